"""Multi-head latent attention's KV trade: a decode step of a DeepSeek-V3-shaped stage against context, cached
expanded (what ovshard compiles), and the attention core in the compressed form it could cache instead.

The stage: the ``deepseek-v3`` preset cut to ``--layers`` layers (its first three are dense, so a 2-layer cut is
attention + an MLP of 18,432 a layer), vocabulary cut to ``--vocab``, one-stage default compile (INT4). Its
cache is filled to each ``--contexts`` length by setting the state tensors (random values: a step's time does
not depend on them; one untimed step after), then one-token decode steps are timed. The first context is the
base: what a step costs without much cache, so that a longer one's excess is what reading the expanded cache
costs (per head keys 128 + 64 and values 128; held as the CPU plugin's default KV precision).

The absorbed core, one layer's attention for one query token against ``ctx`` cached positions in the compressed
form, built as an OpenVINO graph and compiled with the stage's inference precision: the latent [ctx, 512] and
rotary key [ctx, 64] (f32 inputs) shared by all 128 heads; scores of the absorbed query ([1, 128, 512], the heads as
rows: its no-rotary part times kv_b's key half) against latent and rotary key, a softmax, the weighted latent
(times kv_b's value half after). Multiplying the query and the output through kv_b's halves reads kv_b once and
costs its MACs once, as expanding the new token does now, so they are left out of the core: the compressed
step is estimated as the base step plus ``layers`` absorbed cores at the context.

Cases are interleaved in one process (bench/harness.py); medians.

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
import openvino.opset13 as ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.manifest import read_manifest  # noqa: E402
from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.tools.shapes import preset  # noqa: E402
from ovshard.tools.synth import with_layers, write_checkpoint  # noqa: E402

HEADS, NOPE, ROPE, VALUE, LATENT = 128, 128, 64, 128, 512  # DeepSeek-V3's attention


def build(root: Path, layers: int, vocab: int) -> Path:
    config = with_layers(preset("deepseek-v3"), layers)
    config.update(vocab_size=vocab, bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=0)
    checkpoint, bundle = root / "ckpt", root / "bundle"
    if not bundle.exists():
        print("writing the checkpoint and compiling (default, one stage)", file=sys.stderr)
        if not checkpoint.exists():
            write_checkpoint(checkpoint, config, dtype="bfloat16")
        compile_bundle(CompileConfig(checkpoint, bundle, stages=1))
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


def absorbed_core(ctx: int) -> ov.Model:
    # the cache is shared by every head, so the heads are the rows of one matrix product (as in multi-query)
    q_lat = ops.parameter([1, HEADS, LATENT], ov.Type.f32, name="q_latent")
    q_rope = ops.parameter([1, HEADS, ROPE], ov.Type.f32, name="q_rope")
    latent = ops.parameter([1, ctx, LATENT], ov.Type.f32, name="latent")
    rope_key = ops.parameter([1, ctx, ROPE], ov.Type.f32, name="rope_key")
    scores = ops.add(ops.matmul(q_lat, latent, False, True), ops.matmul(q_rope, rope_key, False, True))
    probs = ops.softmax(ops.multiply(scores, ops.constant(np.float32((NOPE + ROPE) ** -0.5))), -1)
    return ov.Model([ops.matmul(probs, latent, False, False)], [q_lat, q_rope, latent, rope_key], "absorbed")


def core_case(core: ov.Core, model: ov.Model, config: dict[str, Any], rng: np.random.Generator):  # noqa: ANN201
    request = core.compile_model(model, "CPU", config).create_infer_request()
    feeds = {p.get_friendly_name(): rng.standard_normal(list(p.get_partial_shape().to_shape())).astype(np.float32)
             for p in model.get_parameters()}
    request.infer(feeds)

    def call() -> list[float]:
        times = []
        for _ in range(8):
            start = time.perf_counter()
            request.infer(feeds)
            times.append(time.perf_counter() - start)
        return times
    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the checkpoint and bundle (reused)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--contexts", default="16,1024,4096", help="the first is the base")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--build-only", action="store_true", help="write and compile the bundle, time nothing")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    bundle = build(args.out, args.layers, args.vocab)
    if args.build_only:
        return 0
    manifest, core, rng = read_manifest(bundle), ov.Core(), np.random.default_rng(0)
    compiled = core.compile_model(str(bundle / manifest.stages[0].model_xml), "CPU")
    config = {"INFERENCE_PRECISION_HINT": compiled.get_property("INFERENCE_PRECISION_HINT")}
    cases = {}
    for ctx in contexts:
        stage = StageAt(compiled, ctx, rng)
        stage.steps(2)  # warm-up
        cases[f"stage {ctx}"] = lambda stage=stage: stage.steps(args.steps)
        cases[f"absorbed {ctx}"] = core_case(core, absorbed_core(ctx), config, rng)
    got = interleaved(cases, args.rounds, label="s a call", timed=False,
                      show=lambda times: f"{1000 * statistics.median(times):.2f} ms")
    ms = {case: 1000 * statistics.median(t for sample in got.samples[case] for t in sample) for case in cases}
    base = ms[f"stage {contexts[0]}"]
    rows = [{"context": ctx, "expanded_step_ms": round(ms[f"stage {ctx}"], 3),
             "expanded_over_base_ms": round(ms[f"stage {ctx}"] - base, 3),
             "absorbed_core_ms": round(ms[f"absorbed {ctx}"], 3),
             "compressed_step_est_ms": round(base + args.layers * ms[f"absorbed {ctx}"], 3)} for ctx in contexts]
    precision = str(compiled.get_property("KV_CACHE_PRECISION"))
    print(write_results("mla_step", rows, {"layers": args.layers, "vocab": args.vocab, "steps": args.steps,
                                           "kv_cache_precision": precision,
                                           "inference_precision": str(config["INFERENCE_PRECISION_HINT"]),
                                           "expanded_bytes_token_layer_f16": HEADS * (NOPE + ROPE + VALUE) * 2,
                                           "latent_bytes_token_layer_f16": (LATENT + ROPE) * 2},
                        title="a DeepSeek-V3-shaped stage's decode step, cached expanded, against context"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
