"""NNCF's own compression options on the real Gemma 3 270M: what each buys, data-free and data-aware.

The evidence behind ovshard's INT4 default (docs/results/2026-12-int4-accuracy.md). A one-stage fp32 bundle of the
Q4_K_M GGUF (equal to transformers on it) is compressed whole by ``nncf.compress_weights`` with each
option set (NNCF's rules: the embedding and the last MatMul INT8, ``ratio`` chosen by NNCF's data-free
sensitivity within the graph), then run on CPU defaults and scored on a 191-token Eiffel Tower passage
(every position): perplexity and teacher-forced top-1 against fp32. Data-aware options
calibrate on the model's own greedy continuations of four neutral prompts (96 tokens each). This runs
NNCF on the whole graph, not layer by layer: it measures the methods, not the streaming compile.

    CI=true .venv/bin/python bench/compile/nncf_options.py [--options asym128,asym64_awq_se,...] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nncf
import numpy as np
import openvino as ov
from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.runtime.engine.stage import EXACT_HINTS
from ovshard.verify import perplexity

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from int4_frontier import tokenizer  # noqa: E402

TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed "
    "the Iron Lady, it was constructed as the centrepiece of the 1889 World's Fair, and to crown the centennial "
    "anniversary of the French Revolution. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France and one of the most "
    "recognisable structures in the world. The tower received 5,889,000 visitors in 2022. The Eiffel Tower is the "
    "most visited monument with an entrance fee in the world. It is 330 metres tall, about the same height as an "
    "81-storey building, and the tallest structure in Paris."
)
CALIBRATION_PROMPTS = ("Once upon a time", "The history of science", "Here is a recipe:", "In the morning, the city")
M = nncf.CompressWeightsMode
ADJUST = AdvancedCompressionParameters(group_size_fallback_mode=GroupSizeFallbackMode.ADJUST)
DATA = object()  # stands for the calibration dataset in an option set

OPTIONS = {
    "int8": {"mode": M.INT8_ASYM},
    "asym128": {"mode": M.INT4_ASYM, "group_size": 128},
    "asym64": {"mode": M.INT4_ASYM, "group_size": 64},
    "asym32": {"mode": M.INT4_ASYM, "group_size": 32},
    "sym32": {"mode": M.INT4_SYM, "group_size": 32},
    "asym_per_channel": {"mode": M.INT4_ASYM, "group_size": -1},
    "asym128_ratio0.8": {"mode": M.INT4_ASYM, "group_size": 128, "ratio": 0.8},
    "asym64_ratio0.8": {"mode": M.INT4_ASYM, "group_size": 64, "ratio": 0.8},
    "asym32_ratio0.9": {"mode": M.INT4_ASYM, "group_size": 32, "ratio": 0.9},
    "asym128_awq_data_free": {"mode": M.INT4_ASYM, "group_size": 128, "awq": True},
    "asym128_se": {"mode": M.INT4_ASYM, "group_size": 128, "dataset": DATA, "scale_estimation": True},
    "asym128_awq_se": {"mode": M.INT4_ASYM, "group_size": 128, "dataset": DATA, "awq": True,
                       "scale_estimation": True},
    "asym64_awq_se": {"mode": M.INT4_ASYM, "group_size": 64, "dataset": DATA, "awq": True, "scale_estimation": True},
    "asym128_gptq": {"mode": M.INT4_ASYM, "group_size": 128, "dataset": DATA, "gptq": True},
    "asym64_gptq_se": {"mode": M.INT4_ASYM, "group_size": 64, "dataset": DATA, "gptq": True,
                       "scale_estimation": True},
}


def unique_names(model: ov.Model) -> None:
    """A joined (streamed) stage repeats piece-local friendly names; NNCF needs each node's to be unique."""
    seen: set[str] = set()
    for op in model.get_ordered_ops():
        if op.get_friendly_name() in seen:
            op.set_friendly_name(f"{op.get_friendly_name()}__{len(seen)}")
        seen.add(op.get_friendly_name())


def calibration(fp32: Path, encode) -> nncf.Dataset:
    pipe = LocalPipeline(fp32, config=EXACT_HINTS, verify=False)
    samples = []
    for prompt in CALIBRATION_PROMPTS:
        ids = encode(prompt)
        tokens, _ = pipe.generate_greedy(ids, 96)
        seq = np.array([ids + tokens], dtype=np.int64)
        n = seq.shape[1]
        samples.append({"input_ids": seq, "attention_mask": np.ones((1, n), np.int64),
                        "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)})
    return nncf.Dataset(samples)


def whole_text(pipe: LocalPipeline, ids: list[int]) -> perplexity.Scores:
    """Every position of the passage scored (it is one 191-token stretch, shorter than a llama.cpp chunk)."""
    return perplexity.predictions(pipe.forward(ids)[0][:-1], ids[1:])


def run(fp32: Path, name: str, options: dict, ids: list[int], ref: perplexity.Scores, root: Path) -> dict:
    out = root / name
    shutil.copytree(fp32, out, ignore=shutil.ignore_patterns("openvino_model*"))
    began = time.perf_counter()
    for entry in read_manifest(fp32).stages:
        model = ov.Core().read_model(fp32 / entry.model_xml)
        unique_names(model)
        with contextlib.redirect_stdout(sys.stderr):
            model = nncf.compress_weights(model, **options)
        ov.save_model(model, out / entry.model_xml, compress_to_fp16=False)
    seconds = time.perf_counter() - began
    pipe = LocalPipeline(out, verify=False)  # CPU defaults; checksums changed with the weights
    found = whole_text(pipe, ids)
    size = sum(p.stat().st_size for p in out.glob("*.bin"))
    shutil.rmtree(out)
    return {"option": name, "perplexity": round(found.perplexity, 3),
            "ppl_vs_fp32": round(found.perplexity / ref.perplexity - 1, 4),
            "top1_vs_fp32": round(float(np.mean(found.top1 == ref.top1)), 4), "weights_mb": round(size / 1e6, 1),
            "nncf_s": round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    logging.getLogger("nncf").setLevel(logging.WARNING)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from real_gemma import gemma_gguf_path

    rows = []
    with tempfile.TemporaryDirectory(prefix="ovshard-nncf-") as tmp:
        fp32 = Path(tmp) / "fp32"
        compile_bundle(CompileConfig(gemma_gguf_path(), fp32, stages=1, weights=WeightFormat("fp32"), max_positions=512))
        encode = tokenizer(fp32)
        ids = encode(TEXT)
        pipe = LocalPipeline(fp32, config=EXACT_HINTS, verify=False)
        ref = whole_text(pipe, ids)
        dataset = None
        for name in args.options.split(","):
            options = dict(OPTIONS[name])
            if any(v is DATA for v in options.values()):
                dataset = dataset or calibration(fp32, encode)
                options = {k: dataset if v is DATA else v for k, v in options.items()}
            if options["mode"] != M.INT8_ASYM:
                options["advanced_parameters"] = ADJUST
            print(f"nncf: {name}", file=sys.stderr, flush=True)
            rows.append(run(fp32, name, options, ids, ref, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nncf_options.json").write_text(json.dumps({"model": "gemma3-270m Q4_K_M GGUF, 1 stage",
                                                            "text_tokens": len(ids), "rows": rows}, indent=2))
    print("| option | perplexity | vs fp32 | top-1 vs fp32 | weights MB | NNCF s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['option']} | {r['perplexity']} | {r['ppl_vs_fp32']:+.1%} | {r['top1_vs_fp32']:.1%} | "
              f"{r['weights_mb']} | {r['nncf_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
