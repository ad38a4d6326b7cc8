"""``ovshard verify``: the KV-cache fusions fired and the numbers match."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove the KV-cache fusions fired and the numbers match",
                       description="Check file checksums; compile each stage on --device and read the "
                       "runtime graph (one KV-fused SDPA per layer, no attention MatMul/Softmax, weights in "
                       "the manifest's precision); with --predict, check the fusion preconditions statically "
                       "(no device needed); with --reference, compare against the Hugging Face model. "
                       "Exit 0 only if every check passes.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--device", help="OpenVINO device for the runtime-graph check (default CPU, or none "
                   "when only --predict is given)")
    p.add_argument("--predict", metavar="GPU,CPU", help="static fusion prediction for these devices")
    p.add_argument("--reference", type=Path, metavar="HF_CHECKPOINT", help="compare against this checkpoint")
    p.add_argument("--prompt", default="Once upon a time", help="prompt for --reference")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with --reference")
    p.add_argument("--perplexity", type=Path, metavar="TEXT", help="with --reference: score this UTF-8 text "
                   "as llama.cpp's llama-perplexity does (chunks of --perplexity-context tokens, the second half "
                   "of each scored) with the bundle and the reference; report both perplexities and the top-1 "
                   "agreement along it, judged by the weight format's thresholds")
    p.add_argument("--perplexity-context", type=int, metavar="N",
                   help="chunk length for --perplexity (default 512, or the bundle's positions when fewer)")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ovshard.verify.checks import VerifyConfig, format_report, report_json, verify_bundle

    predict = tuple(d.strip().upper() for d in args.predict.split(",") if d.strip()) if args.predict else ()
    device = args.device or (None if predict else "CPU")
    if device and device.lower() == "none":
        device = None
    rows = verify_bundle(VerifyConfig(args.bundle, device, predict, args.reference, args.prompt, args.tokens,
                                      args.perplexity, args.perplexity_context))
    print(report_json(rows) if args.json else format_report(rows))
    return 0 if all(r.verdict != "FAIL" for r in rows) else 1
