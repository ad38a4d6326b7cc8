"""Shared fixtures: the real stories260K model, random checkpoints, the Hugging Face reference."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

# No OpenVINO/NNCF telemetry: it forks the process on every convert_model event, which made compiles
# several times slower here. Set before any test module loads openvino; subprocesses inherit it.
os.environ.setdefault("CI", "true")

# CLI compiles in tests use a layer cache of their own, never the user's ~/.cache/ovshard; it goes when
# the session ends
if "OVSHARD_CACHE_DIR" not in os.environ:
    os.environ["OVSHARD_CACHE_DIR"] = tempfile.mkdtemp(prefix="ovshard-test-cache-")
    atexit.register(shutil.rmtree, os.environ["OVSHARD_CACHE_DIR"], ignore_errors=True)

# The Ctrl-C tests send SIGINT to ovshard processes as a terminal would. A background job of a
# non-interactive shell starts with SIGINT ignored, and an ignored signal stays ignored in every child:
# restore the default (KeyboardInterrupt) so the processes the tests start see SIGINT as at a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
GOLDEN = REPO / "golden"
# stories260K as a chat model (tests/runtime/client/test_chat_template.py explains): a ChatML template, and two tokens renamed and marked
# special so that it has <|im_start|> and <|im_end|>; the model writes " Lily" in nearly every story
CHATML = ("{{ bos_token }}{% for message in messages %}"
          "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
RENAMED = {"<0x00>": "<|im_start|>", "▁Lily": "<|im_end|>"}


def free_port_base(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now (for a fixed --port-base): drawn at
    random, so that two test runs on one machine do not reach for the same ports, and below the system's
    ephemeral range, so that no process binding port 0 (Ray's workers and agents start many) is handed one of
    them before the stages bind them."""
    import random
    import socket

    from ovshard.runtime.wire.address import ephemeral_low

    draw = random.Random(os.getpid())
    for _ in range(200):
        base = draw.randrange(20000, max(ephemeral_low(), 20000 + 2 * count) - count)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free loopback ports found")


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


def hf_sampled(checkpoint: Path, prompt: list[int], config: object, max_positions: int = 512) -> list[int]:
    """The tokens the runtime's decode loop draws under ``config`` (a SamplingConfig: its seed, its rng
    sequence) when every step's scores are Hugging Face's full rows of logits: the reference for a sampler
    that is handed less (e.g. the top-K a last stage sends for "topk:K")."""
    import torch
    from transformers import AutoModelForCausalLM

    from ovshard.runtime.decoding.decode import generate
    from ovshard.runtime.engine.scores import Scores

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    class FullLogits:
        vocab_size = model.config.vocab_size

        def __init__(self) -> None:
            self.max_positions, self.ids = max_positions, []

        def step(self, tokens: list[int], position: int, want: str, rewind: int, compact: bool) -> Scores:
            self.ids = self.ids[:position] + list(tokens)
            with torch.no_grad():
                logits = model(torch.tensor([self.ids])).logits[0, -1:].numpy()  # [1, vocab]
            return Scores(logits)

    return list(generate(FullLogits(), prompt, config))  # type: ignore[arg-type]


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


def assert_greedy_like_hf(bundle: Path, checkpoint: Path, prompt: list[int], new_tokens: int = 16,
                          max_logit_diff: float = 1e-4) -> None:
    """``bundle`` greedy-decodes the tokens Hugging Face decodes from ``checkpoint``, every logit within
    ``max_logit_diff``."""
    tokens, rows = run_greedy(bundle, prompt, new_tokens)
    expected, reference = hf_greedy(checkpoint, prompt, new_tokens)
    assert tokens == expected
    assert float(np.abs(rows - reference).max()) <= max_logit_diff


_COMPILED: dict[str, Path] = {}  # one compile per checkpoint and options in a test run; tests get copies
_COMPILED_ROOT = Path(tempfile.mkdtemp(prefix="ovshard-test-bundles-"))
atexit.register(shutil.rmtree, _COMPILED_ROOT, ignore_errors=True)


def compile_fp32(checkpoint: Path, output: Path, **kwargs) -> Path:
    """``checkpoint`` compiled with exact fp32 weights into ``output``; kwargs go to CompileConfig (stages=,
    layers=, ...). The same checkpoint and options compile once per test run: later calls copy that bundle
    (a copy, never links: tests may corrupt their bundle's files)."""
    from ovshard.compile import CompileConfig, compile_bundle
    from ovshard.passes import WeightFormat

    source = Path(checkpoint).resolve()
    files = sorted(source.iterdir()) if source.is_dir() else [source]
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    key = json.dumps([str(source), stamp, sorted((k, repr(v)) for k, v in kwargs.items())])
    if key not in _COMPILED:
        first = _COMPILED_ROOT / str(len(_COMPILED))
        compile_bundle(CompileConfig(checkpoint, first, weights=WeightFormat("fp32"), **kwargs))
        _COMPILED[key] = first
    shutil.copytree(_COMPILED[key], output)
    return output


def run_greedy(bundle: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """ovshard's stage-by-stage greedy run with f32 hints: (new tokens, logits [new_tokens, vocab])."""
    from ovshard.runtime.client.inprocess import LocalPipeline
    from ovshard.runtime.engine.stage import EXACT_HINTS

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


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``small_disk("300k")``: a fresh tmpfs of that size, unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk-{size}"
        where.mkdir()
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a small tmpfs needs root and mount(8); this environment has neither")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def at_once(call: Callable, items: list, timeout: float = 300) -> list:
    """``call(item)`` for each item on a thread of its own, all released together (a barrier); their results."""
    import threading

    results: list = [None] * len(items)
    barrier = threading.Barrier(len(items))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = call(items[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results


def generate_concurrently(head, jobs, speculation=None, timeout: float = 300) -> list:  # noqa: ANN001
    """Each (prompt, max_tokens) job on a thread of its own through ``head``, all started together (a
    barrier); each job's greedy tokens, or the OvshardError it ended with."""
    from ovshard.errors import OvshardError
    from ovshard.runtime.engine.sampler import SamplingConfig

    def job(one: tuple) -> list | OvshardError:
        prompt, n = one
        try:
            return list(head.generate(prompt, SamplingConfig(max_tokens=n), None, speculation))
        except OvshardError as e:
            return e

    return at_once(job, list(jobs), timeout)


def refuse_paged_stage(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """In-process pipelines loaded after this get stage ``index``'s paged form refused (PagedUnsupportedError),
    as the plugin refuses a stage it cannot page; the other stages compile as usual."""
    from ovshard.errors import PagedUnsupportedError
    from ovshard.runtime.client import inprocess

    real = inprocess.compile_paged

    def refuse(*args: object, **kwargs: object) -> object:
        if args[3] == index:
            raise PagedUnsupportedError(f"stage {index}: refused for the test")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(inprocess, "compile_paged", refuse)
