"""NNCF's other 4-bit formats (NF4, the CB4 codebook, MXFP4) on a real model, beside ovshard's INT4: perplexity.

ovshard's compile stores int4_sym / int4_asym only. This asks whether NNCF's other 4-bit formats would be worth
adding: each is applied by ``nncf.compress_weights`` to the stage IRs of the model's fp32 bundle (every decoder
weight 4-bit, data-free, NNCF's own backup precision for the embedding and the last MatMul; groups of 64 where the
format takes a group size, ADJUST where a row is not divisible), and the result is scored with the frontier's
perplexity (``bench/int4_frontier.py``: same text, context and fp32 reference). A format NNCF refuses on these
IRs is reported with its error.

    CI=true .venv/bin/python bench/compile/nncf_formats.py [--model smollm2-135m] [--formats nf4,cb4,mxfp4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import int4_frontier as frontier  # noqa: E402  (bench/int4_frontier.py: its models, texts and perplexity)
import nncf  # noqa: E402
import openvino as ov  # noqa: E402
from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode  # noqa: E402

from ovshard.bundle.manifest import read_manifest
from ovshard.runtime.client.inprocess import LocalPipeline
from ovshard.verify import perplexity

GROUPS = {"nf4": 64, "cb4": 64, "mxfp4": 32}  # MXFP4's group is fixed at 32


def compress_stage(xml: Path, mode: str) -> None:
    """One stage IR compressed in place by NNCF in ``mode``."""
    model = ov.Core().read_model(xml)
    seen: dict[str, int] = {}
    for op in model.get_ordered_ops():  # NNCF needs unique names; a streamed compile repeats its pieces' names
        name = op.get_friendly_name()
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            op.set_friendly_name(f"{name}__{seen[name]}")
    rows = [op.get_friendly_name() for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"
            and op.input_value(1).get_partial_shape().rank.get_length() != 2]  # the lm_head's row chunks
    extra = {} if mode == "mxfp4" else {"advanced_parameters": AdvancedCompressionParameters(
        group_size_fallback_mode=GroupSizeFallbackMode.ADJUST)}
    model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode(mode), group_size=GROUPS[mode], ratio=1.0,
                                  ignored_scope=nncf.IgnoredScope(names=rows) if rows else None, **extra)
    ov.save_model(model, xml.with_suffix(".new.xml"), compress_to_fp16=False)
    xml.with_suffix(".new.xml").replace(xml)
    xml.with_suffix(".new.bin").replace(xml.with_suffix(".bin"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=list(frontier.models()))
    parser.add_argument("--formats", default="nf4,cb4,mxfp4")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    model = frontier.models()[args.model]()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nncf-formats-") as tmp:
        ref = Path(tmp) / "fp32"
        frontier.compile_row(model, frontier.ROWS["fp32"], ref)
        encode = frontier.tokenizer(ref)
        chunks = perplexity.chunks(encode(perplexity.read_text(model.text)), model.context,
                                   read_manifest(ref).generation.bos_token_id)

        def score(bundle: Path) -> float:
            pipe = LocalPipeline(bundle, verify=False)  # the stage files changed after the manifest was written

            def logits_of(chunk: list[int]):  # noqa: ANN202
                pipe.reset()
                return pipe.forward(chunk)[0]

            return perplexity.score(logits_of, chunks).perplexity

        base = score(ref)
        for mode in args.formats.split(","):
            out = Path(tmp) / mode
            shutil.copytree(ref, out)
            try:
                for xml in sorted(out.glob("stage_*.xml")):
                    compress_stage(xml, mode)
            except Exception as e:  # NNCF's refusal is the finding
                rows.append({"model": model.name, "format": mode, "error": f"{type(e).__name__}: {e}"[:300]})
            else:
                found = score(out)
                rows.append({"model": model.name, "format": f"{mode} g{GROUPS[mode]}",
                             "bundle_mb": round(sum(p.stat().st_size for p in out.glob("*.bin")) / 1e6, 1),
                             "perplexity": round(found, 4), "ppl_vs_fp32": round(found / base - 1, 4)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nncf_formats.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
