"""Multi-head latent attention's KV trade, built both ways: a decode step and a prefill of a DeepSeek-V3-shaped
stage cached as the latent (what ovshard compiles: one shared head of keys [latent 512; rotary key 64] and values
the latent 512, kv_b absorbed into the query and the output) and expanded (every head's key 128 + 64 and value
128: ``mla_cache="expanded"``), against context.

The stage: the ``deepseek-v3`` preset cut to ``--layers`` layers (its first three are dense, so a 2-layer cut is
attention + an MLP of 18,432 a layer), vocabulary cut to ``--vocab``, one-stage default compile (INT4), once per
form from one checkpoint. Each form's cache is filled to each ``--contexts`` length by setting the state tensors
(random values: a step's time does not depend on them; one untimed step after), then one-token decode steps are
timed, on the stateful stage and on the stage converted to paged attention (as a worker runs it: one
sequence, ``ctx`` positions in its blocks); a ``--prefill``-token prompt into an empty stateful cache is timed as
one call. The caches are held as the CPU
plugin's default KV precision (``KV_CACHE_PRECISION``).

Cases are interleaved in one process (bench/harness.py); medians, and the median of the rounds' ratios.

    .venv/bin/python bench/mla_step.py --out /tmp/mla-bench [--layers 2] [--contexts 16,1024,4096] [--rounds 5]

Writes bench/results/mla_step.{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, progress, write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.manifest import read_manifest  # noqa: E402
from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.runtime.engine.paged import BLOCK_SIZE, PagedRows, PagedStage, blocks_for, compile_paged  # noqa: E402
from ovshard.tools.shapes import preset  # noqa: E402
from ovshard.tools.synth import with_layers, write_checkpoint  # noqa: E402

FORMS = ("latent", "expanded")  # CompileConfig.mla_cache


def build(root: Path, layers: int, vocab: int, form: str) -> Path:
    config = with_layers(preset("deepseek-v3"), layers)
    config.update(vocab_size=vocab, bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=0)
    checkpoint, bundle = root / "ckpt", root / f"bundle-{form}"
    if not checkpoint.exists():
        progress("writing the checkpoint")
        write_checkpoint(checkpoint, config, dtype="bfloat16")
    if not (bundle / "manifest.json").exists():
        progress(f"compiling the {form} form (default, one stage)")
        compile_bundle(CompileConfig(checkpoint, bundle, stages=1, mla_cache=form))
    return bundle


class StageAt:
    """The stage's infer request with its cache filled to ``ctx`` positions."""

    def __init__(self, compiled: ov.CompiledModel, ctx: int, rng: np.random.Generator) -> None:
        self.request, self.ctx = compiled.create_infer_request(), ctx
        self.filled = {}
        for state in self.request.query_state():
            shape = list(state.state.shape)
            shape[0], shape[2] = 1, ctx
            self.filled[state.name] = rng.standard_normal(shape).astype(np.float32)

    def inputs(self, n: int) -> dict[str, np.ndarray]:
        position = self.ctx + n
        return {"input_ids": np.array([[5 + n]], dtype=np.int64), "attention_mask": np.ones((1, position + 1),
                dtype=np.int64), "position_ids": np.array([[position]], dtype=np.int64),
                "beam_idx": np.zeros(1, dtype=np.int32)}

    def prefill(self, length: int) -> float:
        """One call of a ``length``-token prompt into an empty cache: its seconds."""
        self.request.reset_state()
        inputs = {"input_ids": np.arange(5, 5 + length, dtype=np.int64)[None], "attention_mask": np.ones(
                  (1, length), dtype=np.int64), "position_ids": np.arange(length, dtype=np.int64)[None],
                  "beam_idx": np.zeros(1, dtype=np.int32)}
        start = time.perf_counter()
        self.request.infer(inputs)
        return time.perf_counter() - start

    def steps(self, count: int) -> list[float]:
        for state in self.request.query_state():
            state.state = ov.Tensor(self.filled[state.name])
        self.request.infer(self.inputs(0))  # untimed: the first step after setting the state converts it
        times = []
        for n in range(1, count + 1):
            inputs = self.inputs(n)
            start = time.perf_counter()
            self.request.infer(inputs)
            times.append(time.perf_counter() - start)
        return times


def paged_steps(stage: PagedStage, ctx: int, count: int) -> list[float]:
    """``count`` one-token decode steps of one sequence with ``ctx`` positions cached (the caches' contents as they
    are: a step's time does not depend on them)."""
    times = []
    for n in range(count):
        rows = PagedRows(np.array([5 + n], np.int64), ctx, list(range(blocks_for(ctx + 1, BLOCK_SIZE))))
        start = time.perf_counter()
        stage.run([rows])
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the checkpoint and bundle (reused)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--contexts", default="16,1024,4096", help="the first is the base")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kv-precision", default=None, help="KV_CACHE_PRECISION for both forms (default: the "
                        "plugin's)")
    parser.add_argument("--stateful-only", action="store_true", help="no paged cases (the CPU plugin's paged "
                        "attention takes u8 or f32 caches only)")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the timed prefill (0: none)")
    parser.add_argument("--build-only", action="store_true", help="write and compile the bundle, time nothing")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    bundles = {form: build(args.out, args.layers, args.vocab, form) for form in FORMS}
    if args.build_only:
        return 0
    core, rng = ov.Core(), np.random.default_rng(0)
    cases: dict[str, Any] = {}
    compiled, dims, paged = {}, {}, {}
    config = {"KV_CACHE_PRECISION": args.kv_precision} if args.kv_precision else {}
    for form, bundle in bundles.items():
        manifest = read_manifest(bundle)
        dims[form] = manifest.architecture
        progress(f"compiling the {form} stage, stateful and paged")
        compiled[form] = core.compile_model(str(bundle / manifest.stages[0].model_xml), "CPU", config)
        if not args.stateful_only:
            paged[form] = compile_paged(core, bundle, manifest, 0, config=config or None, slice_logits=True,
                                        num_blocks=blocks_for(max(contexts) + 1, BLOCK_SIZE))
    for ctx in contexts:
        for form in FORMS:
            stage = StageAt(compiled[form], ctx, rng)
            stage.steps(2)  # warm-up
            cases[f"{form} {ctx}"] = lambda stage=stage: stage.steps(args.steps)
            if paged:
                paged_steps(paged[form], ctx, 2)  # warm-up
                cases[f"{form} paged {ctx}"] = lambda form=form, ctx=ctx: paged_steps(paged[form], ctx, args.steps)
    if args.prefill:
        for form in FORMS:
            stage = StageAt(compiled[form], 0, rng)
            stage.prefill(args.prefill)  # warm-up
            cases[f"{form} prefill"] = lambda stage=stage: [stage.prefill(args.prefill)]
    got = interleaved(cases, args.rounds, label="s a call", timed=False,
                      show=lambda times: f"{1000 * statistics.median(times):.2f} ms")
    ms = {case: 1000 * statistics.median(t for sample in got.samples[case] for t in sample) for case in cases}

    def ratio(a: str, b: str) -> float:  # the median of the rounds' ratios of median call times
        return round(statistics.median(statistics.median(x) / statistics.median(y) for x, y in
                                       zip(got.samples[a], got.samples[b], strict=True)), 3)
    rows = [{"case": f"step at {ctx}", "latent_ms": round(ms[f"latent {ctx}"], 3),
             "expanded_ms": round(ms[f"expanded {ctx}"], 3),
             "expanded_over_latent": ratio(f"expanded {ctx}", f"latent {ctx}")} for ctx in contexts]
    rows += [{"case": f"paged step at {ctx}", "latent_ms": round(ms[f"latent paged {ctx}"], 3),
              "expanded_ms": round(ms[f"expanded paged {ctx}"], 3),
              "expanded_over_latent": ratio(f"expanded paged {ctx}", f"latent paged {ctx}")} for ctx in contexts
             if paged]
    if args.prefill:
        rows.append({"case": f"prefill {args.prefill}", "latent_ms": round(ms["latent prefill"], 3),
                     "expanded_ms": round(ms["expanded prefill"], 3),
                     "expanded_over_latent": ratio("expanded prefill", "latent prefill")})
    one = compiled["latent"]
    meta = {"layers": args.layers, "vocab": args.vocab, "steps": args.steps, "rounds": args.rounds,
            "kv_cache_precision": str(one.get_property("KV_CACHE_PRECISION")),
            "paged_cache_bytes_token_layer": {form: stage.bytes_per_token // args.layers for form, stage in paged.items()},
            "inference_precision": str(one.get_property("INFERENCE_PRECISION_HINT")),
            **{f"{form}_cache_elements_token_layer": dims[form].kv_elements_per_token for form in FORMS}}
    print(write_results("mla_step", rows, meta,
                        title="a DeepSeek-V3-shaped stage's decode step and prefill, latent cache against expanded"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
