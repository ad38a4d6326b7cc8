"""``ovshard cache info|clear``: the layer cache of compiled pieces."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="the layer cache of compiled pieces: size report or clear")
    p.add_argument("cache_command", choices=("info", "clear"))
    p.add_argument("--cache-dir", type=Path, help="default: $OVSHARD_CACHE_DIR or ~/.cache/ovshard")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ovshard.cache import clear_cache, default_cache_dir, format_report

    root = args.cache_dir or default_cache_dir()
    print(format_report(root) if args.cache_command == "info" else clear_cache(root))
    return 0
