"""``ovshard inspect``: a bundle's stages, pass log and graphs."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a bundle's stages, pass log and graphs",
                       description="Without --stage: stage table, pass log with timings, I/O of each "
                       "stage. With --stage: that stage's graph; with --pass: the dump after that pass.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--stage", type=int, help="stage index")
    p.add_argument("--pass", dest="pass_name", metavar="PASS", help="e.g. InjectBeamIdxGatherPass")
    p.add_argument("--format", default="text", choices=("text", "dot", "svg", "xml"),
                   help="text and dot print the graph; svg and xml print the file's path")
    p.add_argument("--diff", action="store_true", help="unified diff of the graph before/after --pass")
    p.add_argument("--dump-dir", type=Path, help="dump folder if not the one the manifest records")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ovshard.verify.inspect import InspectConfig, inspect_bundle

    print(inspect_bundle(InspectConfig(args.bundle, args.stage, args.pass_name, args.format, args.diff,
                                       args.dump_dir)))
    return 0
