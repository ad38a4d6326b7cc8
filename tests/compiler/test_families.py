"""Every model family of the architecture table compiles to 1, 2 and 3 stages that match Hugging Face.

One row of ``FAMILIES`` is one family variant: a tiny transformers config with the shapes that catch
mistakes (head_dim != hidden / heads, GQA, tied and untied heads, sliding windows shorter than the run,
mixed sliding/full layers, partial rotary). The checkpoint is written by transformers itself
(``save_pretrained`` of a seeded random model), so tensor names and config keys are the library's.
The three bundles of a row are compiled in two worker processes while the HF reference is computed
(compiles are mostly single-threaded Python; this halves the wall time on a 2-core machine).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compile_fp32
from families import FAMILIES, Family, phi3, write_random_checkpoint
from transformers import (
    AutoModelForCausalLM,
    DbrxConfig,
    DeepseekV2Config,
    GPTNeoXConfig,
    JambaConfig,
    Phi3Config,
    PretrainedConfig,
)

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import ConfigError, UnsupportedArchitectureError
from ovshard.frontend.arch import UNSUPPORTED_MOE, arch_for
from ovshard.frontend.description import describe
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.verify.fusion import check_cpu_fusion

pytestmark = pytest.mark.slow

PROMPT = [2, 17, 42, 99, 5, 123, 77]  # 2 is Gemma's bos; every id is below each row's vocabulary
NEW_TOKENS = 32
PREFILL_CHUNK = 10  # teacher forcing feeds the continuation as one 10-token step, then token by token
MAX_LOGIT_DIFF = 1e-4
MIN_TOP2_GAP = 1e-3  # HF's greedy path must be clear of near-ties, or token equality proves nothing
STAGE_COUNTS = (1, 2, 3)
@dataclass(frozen=True)
class Reference:
    """Hugging Face on the row's checkpoint: greedy tokens and teacher-forced logits over prompt + tokens."""

    tokens: list[int]  # NEW_TOKENS greedy tokens after PROMPT
    logits: np.ndarray  # [len(PROMPT) + NEW_TOKENS, vocab]: one forward over PROMPT + tokens


def hf_reference(checkpoint: Path) -> Reference:
    """HF ``generate`` (eager attention, so Gemma 2's softcap applies) and one forward over its output."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
        tokens = out[0, len(PROMPT):].tolist()
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].numpy()
    chosen = logits[len(PROMPT) - 1:-1]  # [NEW_TOKENS, vocab]: the rows each new token was picked from
    # min_new_tokens masks eos: were eos the argmax somewhere, generate's tokens would not be plain greedy
    assert chosen.argmax(-1).tolist() == tokens, (
        "HF generate differs from its forward's argmax (min_new_tokens masks eos); pick another seed")
    top2 = np.sort(chosen, axis=-1)[:, -2:]
    gap = float((top2[:, 1] - top2[:, 0]).min())
    assert gap > MIN_TOP2_GAP, f"HF's greedy path has a near-tie (top-2 gap {gap:.1e}); pick another seed"
    return Reference(tokens, logits)


@dataclass
class Built:
    """One row's checkpoint, its HF reference and its bundles (compiled in the background)."""

    family: Family
    checkpoint: Path
    reference: Reference
    compiles: dict[int, Future[Path]]

    def bundle(self, stages: int) -> Path:
        return self.compiles[stages].result()  # re-raises the compile's error in the test that needs it


def _without_telemetry() -> None:
    """Worker start: no OpenVINO conversion telemetry, which openvino-telemetry skips under CI=true.

    It sends each ``convert_model`` event from a forked copy of the process (see bench/memprobe.py): on this
    2-core machine the three compiles of one row took 33 s instead of 6 s, and each worker's exit ~30 s.
    """
    os.environ["CI"] = "true"


@pytest.fixture(scope="module")
def compiler() -> Iterator[ProcessPoolExecutor]:
    """Two spawned worker processes for compiles (forking a process holding OpenVINO threads is unsafe)."""
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_without_telemetry) as pool:
        yield pool


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request: pytest.FixtureRequest, compiler: ProcessPoolExecutor,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    name = request.param
    family = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    checkpoint = write_random_checkpoint(family, root / "ckpt")
    compiles = {s: compiler.submit(compile_fp32, checkpoint, root / f"b{s}", stages=s,
                                   max_positions=family.max_positions)
                for s in sorted(STAGE_COUNTS, reverse=True)}  # the longest first: the two workers finish together
    yield Built(family, checkpoint, hf_reference(checkpoint), compiles)
    for future in compiles.values():  # a deselected test leaves its compile unneeded: do not queue it
        future.cancel()
    for future in compiles.values():
        if not future.cancelled():
            future.exception()


def teacher_forced_logits(bundle: Path, tokens: list[int]) -> np.ndarray:
    """ovshard's logits [len(PROMPT) + len(tokens), vocab]: PROMPT, then a 10-token step, then one token a step."""
    pipe = LocalPipeline(bundle, config=EXACT_HINTS)
    steps = [PROMPT, tokens[:PREFILL_CHUNK], *([t] for t in tokens[PREFILL_CHUNK:])]
    return np.concatenate([pipe.forward(step)[0] for step in steps])


@pytest.mark.parametrize("stages", STAGE_COUNTS)
def test_bundle_matches_hugging_face(built: Built, stages: int) -> None:
    """Teacher-forced logits over prompt + 32 tokens within 1e-4 of HF, and the same 32 greedy tokens."""
    bundle = built.bundle(stages)
    ref = built.reference
    logits = teacher_forced_logits(bundle, ref.tokens)
    assert logits.shape == ref.logits.shape
    diff = np.abs(logits - ref.logits).max(axis=-1)  # [positions]
    worst = int(diff.argmax())
    assert diff[worst] <= MAX_LOGIT_DIFF, (
        f"max |logit diff| {diff[worst]:.2e} > {MAX_LOGIT_DIFF:.0e} at position {worst} "
        f"(first position over: {int(np.argmax(diff > MAX_LOGIT_DIFF))}; the prompt has {len(PROMPT)})")
    tokens, _ = LocalPipeline(bundle, config=EXACT_HINTS).generate_greedy(PROMPT, NEW_TOKENS)
    first_bad = next((i for i, (a, b) in enumerate(zip(tokens, ref.tokens, strict=True)) if a != b), None)
    assert tokens == ref.tokens, f"greedy tokens diverge from HF at step {first_bad}"


@pytest.mark.parametrize("stages", STAGE_COUNTS)
def test_cpu_fuses_every_stage(built: Built, stages: int) -> None:
    """Every stage's CPU graph fuses the KV cache into one SDPA a layer, or (soft-capped) keeps all explicit."""
    bundle = built.bundle(stages)
    reports = check_cpu_fusion(bundle, read_manifest(bundle))
    assert len(reports) == stages
    found = [(r.stage, r.layers, r.explicit_layers, r.fused_sdpa, r.unfused_attention) for r in reports]
    assert all(r.explicit_layers == (r.layers if built.family.explicit_attention else 0) for r in reports), found
    assert all(r.ok for r in reports), found


GENAI_SCRIPT = """
import json, sys
import numpy as np, openvino as ov, openvino_genai
bundle, prompt, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
pipe = openvino_genai.LLMPipeline(bundle, "CPU", ATTENTION_BACKEND="SDPA", INFERENCE_PRECISION_HINT="f32",
                                  KV_CACHE_PRECISION="f32")
config = openvino_genai.GenerationConfig()
config.max_new_tokens = config.min_new_tokens = new_tokens
config.do_sample = False
result = pipe.generate(ov.Tensor(np.array([prompt], dtype=np.int64)), config)
print(json.dumps([int(t) for t in result.tokens[0]]))
"""


def test_openvino_genai_runs_the_one_stage_bundle(built: Built) -> None:
    """openvino_genai.LLMPipeline loads the 1-stage bundle and decodes HF's 32 greedy tokens.

    In a process of its own, as a serving node runs it: no torch beside it.
    """
    done = subprocess.run([sys.executable, "-c", GENAI_SCRIPT, str(built.bundle(1)), json.dumps(PROMPT),
                           str(NEW_TOKENS)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == built.reference.tokens


# refusals: what a fixed graph cannot compute, and families the table does not hold


def test_longrope_past_its_original_context_is_refused(tmp_path: Path) -> None:
    """A longrope bundle longer than original_max_position_embeddings (where the factors switch) is refused."""
    checkpoint = write_random_checkpoint(FAMILIES["phi3_partial_longrope"], tmp_path / "ckpt")
    with pytest.raises(UnsupportedArchitectureError) as e:
        compile_fp32(checkpoint, tmp_path / "b", stages=1, max_positions=65)
    assert "original_max_position_embeddings=64" in str(e.value) and "--max-positions" in str(e.value), str(e.value)
    assert not (tmp_path / "b").exists()


def test_an_eos_outside_the_vocabulary_is_refused(tmp_path: Path) -> None:
    """Phi3Config's default eos (32000) on a 300-token vocabulary is refused before any stage is built.

    openvino_genai masks eos with ``logits[eos] = -inf`` under min_new_tokens: an eos past the vocabulary
    wrote outside its logits buffer (LLMPipeline crashed or decoded zeros, about 1 run in 150).
    """
    family = Family(lambda: Phi3Config(**{**phi3().to_dict(), "eos_token_id": 32000}))
    checkpoint = write_random_checkpoint(family, tmp_path / "ckpt")
    with pytest.raises(ConfigError) as e:
        compile_fp32(checkpoint, tmp_path / "b", stages=1)
    assert "eos_token_id [32000]" in str(e.value) and "300 tokens" in str(e.value), str(e.value)
    assert not (tmp_path / "b").exists()


def _supported_model_types() -> list[str]:
    """The model types this file proves, and llama (tests/compiler/test_parity.py)."""
    return ["llama", *sorted({FAMILIES[n].config().model_type for n in FAMILIES})]


def test_unknown_family_error_lists_the_supported_ones() -> None:
    """A gpt_neox config is refused with a message naming it and every supported model type."""
    with pytest.raises(UnsupportedArchitectureError) as e:
        arch_for(GPTNeoXConfig().to_dict())
    message = str(e.value)
    assert "gpt_neox" in message and "support" in message, message  # "supports: ..." or "supported: ..."
    missing = [t for t in _supported_model_types() if t not in message]
    assert not missing, f"the message does not list {missing}: {message}"


UNSUPPORTED_MOE_CONFIGS = [DeepseekV2Config, JambaConfig, DbrxConfig]


@pytest.mark.parametrize("config", UNSUPPORTED_MOE_CONFIGS, ids=[c.model_type for c in UNSUPPORTED_MOE_CONFIGS])
def test_unsupported_mixture_of_experts_is_refused_by_name(config: type[PretrainedConfig]) -> None:
    """MoE families outside the table are refused naming the type, MoE, and what the family would need."""
    with pytest.raises(UnsupportedArchitectureError) as e:
        arch_for(config().to_dict())
    message = str(e.value)
    assert config.model_type in message and "mixture-of-experts" in message, message
    assert f"would need {UNSUPPORTED_MOE[config.model_type]}" in message, message


def test_a_prequantized_checkpoint_is_refused_naming_its_method() -> None:
    """gpt-oss as released (MXFP4 experts, quantization_config) is refused, saying how to dequantize first."""
    config = {**FAMILIES["gpt_oss"].config().to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(UnsupportedArchitectureError) as e:
        describe(config)
    assert "quant_method='mxfp4'" in str(e.value) and "dequantize" in str(e.value).lower(), str(e.value)
