"""``ovshard bundle merge``: join part bundles compiled on separate nodes."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bundle", help="work on bundles: merge stage parts compiled on separate nodes")
    verbs = p.add_subparsers(dest="bundle_command", required=True)
    merge = verbs.add_parser("merge", help="join part bundles (compile --only-stage K) into one bundle",
                             description="Check that the parts come from one checkpoint and one plan, that every "
                             "stage is there exactly once and every file matches its sha256, then write one "
                             "bundle.")
    merge.add_argument("parts", type=Path, nargs="+", help="part bundle folders")
    merge.add_argument("-o", "--output", type=Path, required=True, help="the merged bundle folder")
    merge.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from ovshard.merge import merge_bundles
    from ovshard.verify.inspect import summary

    manifest = merge_bundles(args.parts, args.output)
    print(summary(args.output, manifest))
    return 0
