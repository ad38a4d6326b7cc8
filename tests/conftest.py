"""Shared fixtures: the real stories260K model, random checkpoints, the Hugging Face reference."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

# No OpenVINO/NNCF telemetry: it forks the process on every convert_model event, which made compiles
# several times slower here. Set before any test module loads openvino; subprocesses inherit it.
os.environ.setdefault("CI", "true")

# CLI compiles in tests use a layer cache of their own, never the user's ~/.cache/ovshard
os.environ.setdefault("OVSHARD_CACHE_DIR", tempfile.mkdtemp(prefix="ovshard-test-cache-"))

STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


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
