"""``ovshard demo`` / ``make demo``: compile a built-in default and print a readable report."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ovshard.compile import CompileConfig, DumpOptions, compile_bundle
from ovshard.fusion import check_cpu_fusion
from ovshard.inspect import summary
from ovshard.manifest import Manifest

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SHARED_MODEL = REPO.parent / "shared" / "models" / "stories260K"
PROMPT = "Once upon a time"


@dataclass(frozen=True)
class DemoConfig:
    output: Path
    stages: int = 2
    checkpoint: Path | None = None


def default_checkpoint(scratch: Path) -> Path:
    """stories260K from ../shared when present, else a small random Llama written on the fly."""
    chosen = os.environ.get("OVSHARD_DEMO_CHECKPOINT")
    if chosen:
        return Path(chosen)
    if SHARED_MODEL.is_dir():
        return SHARED_MODEL
    from ovshard.synth import SHAPES, write_checkpoint

    target = scratch / "random-tiny-llama"
    if not (target / "config.json").is_file():
        log.warning("%s not found; writing a random-weight tiny Llama to %s", SHARED_MODEL, target)
        write_checkpoint(target, SHAPES["tiny"])
    return target


def _sample(bundle: Path, m: Manifest, max_new_tokens: int = 48) -> str:
    """Greedy text from the compiled stages, run one after another in this process."""
    from ovshard.runtime.local import LocalPipeline

    pipe = LocalPipeline(bundle)
    eos = tuple(m.generation.get("eos_token_ids") or ())
    if m.tokenizer:
        import openvino as ov
        import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

        core = ov.Core()
        tok = core.compile_model(str(bundle / m.tokenizer["tokenizer"]), "CPU")
        detok = core.compile_model(str(bundle / m.tokenizer["detokenizer"]), "CPU")
        prompt = [int(t) for t in tok([PROMPT])["input_ids"][0]]
    else:
        prompt = [m.generation.get("bos_token_id") or 1]
    start = time.perf_counter()
    tokens, _ = pipe.generate_greedy(prompt, max_new_tokens, eos)
    seconds = time.perf_counter() - start
    text = str(detok(np.array([prompt + tokens]))["string_output"][0]) if m.tokenizer else str(prompt + tokens)
    return f"{text}\n({len(tokens)} tokens in {seconds:.2f} s, {len(tokens) / seconds:.1f} tok/s, in-process)"


def run_demo(config: DemoConfig) -> bool:
    """Compile, report stages/pass log/fusion, generate a sample. True if every fusion check passed."""
    checkpoint = config.checkpoint or default_checkpoint(config.output.parent)
    manifest = compile_bundle(CompileConfig(checkpoint, config.output, stages=config.stages,
                                            dumps=DumpOptions()))
    print(f"== compiled {checkpoint} into {config.output}\n")
    print(summary(config.output, manifest))
    print("\n== KV-cache fusion on CPU (compiled runtime graph)")
    reports = check_cpu_fusion(config.output, manifest)
    for r in reports:
        verdict = "OK" if r.ok else "NOT FUSED"
        print(f"stage {r.stage}: {r.fused_sdpa}/{r.layers} ScaledDotProductAttention fed by beam_idx + 2 "
              f"MemoryInput, {r.unfused_attention} MatMul/Softmax left: {verdict}")
    print(f"\n== greedy sample, prompt {PROMPT!r}")
    print(_sample(config.output, manifest))
    return all(r.ok for r in reports)
