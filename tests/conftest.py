"""Shared fixtures: the real stories260K model, random checkpoints, the Hugging Face reference."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest

# No OpenVINO/NNCF telemetry: it forks the process on every convert_model event, which made compiles
# several times slower here. Set before any test module loads openvino; subprocesses inherit it.
os.environ.setdefault("CI", "true")

# CLI compiles in tests use a layer cache of their own, never the user's ~/.cache/ovshard
os.environ.setdefault("OVSHARD_CACHE_DIR", tempfile.mkdtemp(prefix="ovshard-test-cache-"))

# The Ctrl-C tests send SIGINT to ovshard processes as a terminal would. A background job of a
# non-interactive shell starts with SIGINT ignored, and an ignored signal stays ignored in every child:
# restore the default (KeyboardInterrupt) so the processes the tests start see SIGINT as at a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
# stories260K as a chat model (tests/test_chat.py explains): a ChatML template, and two tokens renamed and marked
# special so that it has <|im_start|> and <|im_end|>; the model writes " Lily" in nearly every story
CHATML = ("{{ bos_token }}{% for message in messages %}"
          "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
RENAMED = {"<0x00>": "<|im_start|>", "▁Lily": "<|im_end|>"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite golden/ from the current output")


@pytest.fixture(scope="session")
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def stories() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.fail(f"{STORIES} is missing: the tests read the real stories260K model from ../shared")
    return STORIES


def hf_greedy(checkpoint: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """Hugging Face greedy decoding without early stop: (new tokens, logits [new_tokens, vocab])."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([row[0] for row in out.logits]).numpy()
    return tokens, logits


def compile_fp32(checkpoint: Path, output: Path, **kwargs) -> Path:
    """Compile with exact fp32 weights; kwargs go to CompileConfig (stages=, layers=, ...)."""
    from ovshard.compile import CompileConfig, compile_bundle
    from ovshard.passes import WeightFormat

    compile_bundle(CompileConfig(checkpoint, output, weights=WeightFormat("fp32"), **kwargs))
    return output


def run_greedy(bundle: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """ovshard's stage-by-stage greedy run with f32 hints: (new tokens, logits [new_tokens, vocab])."""
    from ovshard.runtime.local import LocalPipeline
    from ovshard.runtime.stage import EXACT_HINTS

    tokens, rows = LocalPipeline(bundle, config=EXACT_HINTS).generate_greedy(prompt, new_tokens)
    return tokens, np.stack(rows)


def chatml_checkpoint(source: Path, out: Path, template: object = CHATML) -> Path:
    """stories260K (weights and configs linked, not copied) with ChatML tokens and ``template``."""
    out.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (out / name).symlink_to(source / name)
    tok = json.loads((source / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for old, new in RENAMED.items():
        vocab[new] = vocab.pop(old)
    tok["model"]["merges"] = [m for m in tok["model"]["merges"] if "".join(m) not in RENAMED and not set(m) & set(RENAMED)]
    tok["added_tokens"] += [{"id": vocab[new], "content": new, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for new in RENAMED.values()]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((source / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return out
