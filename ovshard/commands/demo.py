"""``ovshard demo``: compile the built-in default model and print a report."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="compile the built-in default model and print a report",
                       description="Compile ../shared/models/stories260K (or a small random Llama when it "
                       "is absent) into stages, check the KV-cache fusion, and generate a sample.")
    p.add_argument("-o", "--output", type=Path, default=Path("out/demo"))
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--checkpoint", type=Path, help="compile this checkpoint instead of the default")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ovshard.tools.demo import DemoConfig, run_demo

    return 0 if run_demo(DemoConfig(args.output, args.stages, args.checkpoint)) else 1
