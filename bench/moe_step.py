"""A decode step of an MoE stage against a dense stage of the same active parameters.

Both are one-stage INT4 bundles (the default compile) of random checkpoints written by ``ovshard synth``'s
writer. ``--preset qwen3-30b-a3b`` (the default): the MoE one is that preset cut to ``--layers`` layers (128
experts of 768, 8 routed a token); the dense one is the same model with each layer's experts replaced by one
MLP of 8 x 768 = 6144 (Qwen3's block otherwise). ``--preset glm-4.5-air``: every one of the ``--layers`` layers
sparse, as in a middle stage (the preset's dense layer 0 is left out), 8 routed experts of 1408 plus the shared
one; the dense one is GLM-4.5's block with one MLP of 9 x 1408 = 12672 a layer (the same attention: 96 query
heads, 8 key/value heads, biases, half rotary). Either way a token reads the same weights in both but for the
router. ``--experts N`` keeps N of the preset's experts (a decode step reads only the routed ones, so the step
is the same; the compile holds one layer's experts at a time, which for GLM-4.5-Air's 128 is about 9 GB as f32).
The vocabulary is cut to ``--vocab`` so that the embedding and lm_head, the same in both, do not hide the layers.
The steps are measured interleaved in one process (bench/harness.py: each round every bundle once, the first
rotating), one token a step after a prompt, and the ratio
reported is MoE / dense median step time, for each weight variant: ``default`` (the default compile: its INT8
share, chosen by sensitivity within 1.15x the all-INT4 bytes both held and read a step, the MoE's routed experts
counted at top-k of all, so both models read about the same INT8 share a step, though not of the same
projections) and ``all-int4`` (``--budget 1.0``: every decoder weight INT4 g128 in both, the same bytes a step but
for the f32 router).
``--small`` narrows both models (hidden 256, experts of 64) to prove the script runs on a small machine; its
timings mean nothing.

    .venv/bin/python bench/moe_step.py --out /tmp/moe-bench [--preset glm-4.5-air --experts 32] [--layers 4]
        [--rounds 5] [--steps 32] [--small]

Writes bench/results/moe_step.{json,md,png} (moe_step_glm.* for glm-4.5-air) and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, write_results  # noqa: E402  (bench/ is not a package)

from ovshard.bundle.weights import WeightFormat  # noqa: E402
from ovshard.compile import CompileConfig, compile_bundle  # noqa: E402
from ovshard.runtime.client.inprocess import LocalPipeline  # noqa: E402
from ovshard.tools.shapes import family_config, preset  # noqa: E402
from ovshard.tools.synth import with_layers, write_checkpoint  # noqa: E402

PROMPT = list(range(3, 19))  # 16 tokens
VARIANTS = {"default": WeightFormat(), "all-int4": WeightFormat(budget=1.0)}


PRESETS = ("qwen3-30b-a3b", "glm-4.5-air")
DENSE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "bos_token_id",
              "eos_token_id", "tie_word_embeddings", "dtype", "initializer_range")


def configs(name: str, layers: int, vocab: int, small: bool, experts: int | None = None) -> dict[str, dict[str, Any]]:
    """The MoE config (the preset cut) and the dense config of the same active parameters."""
    moe = with_layers(preset(name), layers)
    moe.update(vocab_size=vocab, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096)
    glm = name == "glm-4.5-air"
    expert_key = "n_routed_experts" if glm else "num_experts"
    if experts is not None:
        moe[expert_key] = experts
    if glm:
        moe.update(first_k_dense_replace=0, num_nextn_predict_layers=0, pad_token_id=None)
    if small:
        moe.update(hidden_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64)
    active = moe["num_experts_per_tok"] * moe["moe_intermediate_size"]
    if glm:  # GLM-4.5's block, every layer dense: the routed experts and the shared one as one MLP
        dense = {**moe, "intermediate_size": active + moe["n_shared_experts"] * moe["moe_intermediate_size"],
                 "first_k_dense_replace": layers}
    else:
        dense = family_config("qwen3", **{k: moe[k] for k in DENSE_KEYS}, intermediate_size=active,
                              max_window_layers=layers)
    return {"moe": moe, "dense": dense}


def build(root: Path, name: str, config: dict[str, Any], variant: str) -> Path:
    checkpoint = root / f"{name}-ckpt"
    bundle = root / (f"{name}-bundle" if variant == "default" else f"{name}-{variant}-bundle")
    if not bundle.exists():
        print(f"{name}: writing the checkpoint and compiling ({variant}, one stage)", file=sys.stderr)
        if not checkpoint.exists():
            write_checkpoint(checkpoint, config, dtype=config.get("dtype", "float32"))
        compile_bundle(CompileConfig(checkpoint, bundle, stages=1, weights=VARIANTS[variant]))
    return bundle


def step_times(pipe: LocalPipeline, steps: int) -> list[float]:
    """Seconds of each of ``steps`` one-token decode steps after the prompt (a fresh context)."""
    pipe.reset()
    logits, _ = pipe.forward(PROMPT)
    token, times = int(logits[-1].argmax()), []
    for _ in range(steps):
        start = time.perf_counter()
        logits, _ = pipe.forward([token])
        times.append(time.perf_counter() - start)
        token = int(logits[-1].argmax())
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the checkpoints and bundles (reused)")
    parser.add_argument("--preset", default=PRESETS[0], choices=PRESETS, help="the MoE shape (default %(default)s)")
    parser.add_argument("--experts", type=int, help="keep this many of the preset's experts (default: all)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--small", action="store_true", help="narrow shapes: proves the script runs, times nothing")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"weight variants ({', '.join(VARIANTS)})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown {', '.join(unknown)}; expected some of {', '.join(VARIANTS)}")
    pipes = {(name, variant): LocalPipeline(build(args.out, name, config, variant))
             for variant in variants
             for name, config in configs(args.preset, args.layers, args.vocab, args.small, args.experts).items()}
    for pipe in pipes.values():
        step_times(pipe, 4)  # warm-up
    got = interleaved({f"{name} {variant}": lambda pipe=pipe: step_times(pipe, args.steps)
                       for (name, variant), pipe in pipes.items()}, args.rounds, label="s a step", timed=False,
                      show=lambda times: f"{1000 * statistics.median(times):.2f} ms")
    times = {key: [t for sample in got.samples[f"{key[0]} {key[1]}"] for t in sample] for key in pipes}
    rows = []
    for variant in variants:
        moe, dense = (statistics.median(times[name, variant]) for name in ("moe", "dense"))
        rows.append({"variant": variant, "steps": len(times["moe", variant]), "moe_step_ms": round(1000 * moe, 3),
                     "dense_step_ms": round(1000 * dense, 3), "moe_over_dense": round(moe / dense, 3)})
    glm = args.preset == "glm-4.5-air"
    print(write_results("moe_step_glm" if glm else "moe_step", rows,
                        {"preset": args.preset, "experts": args.experts, "layers": args.layers, "vocab": args.vocab,
                         "small": args.small},
                        title=f"a {args.preset}-shaped stage against a dense stage of its active parameters",
                        plot={"group_by": "variant", "bars": ["moe_step_ms", "dense_step_ms"], "ylabel": "ms a step"}))
    for pipe in pipes.values():
        pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
