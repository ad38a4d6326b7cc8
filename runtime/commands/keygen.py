"""``ovshard keygen``: a cluster CA and a certificate per node (mutual TLS)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ovshard.runtime.tools.keygen import CA_KEY_FILE, _names, keygen


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", help="make a cluster CA and a certificate per node (mutual TLS)",
                       description="Write a cluster CA (ca.pem, ca.key: keep it offline) and one folder per "
                       "node (ca.pem, cert.pem, key.pem) to pass to that node as --credentials. Needs the "
                       "cryptography package (ovshard[secure]); serving nodes do not.")
    p.add_argument("-o", "--output", type=Path, required=True, help="a new or empty folder")
    p.add_argument("--stages", required=True, metavar="NAME[,NAME...]", help="stage node names, e.g. s0,s1")
    p.add_argument("--heads", default="head", metavar="NAME[,NAME...]", help="head node names (default head)")
    p.add_argument("--days", type=int, default=825, help="certificate validity in days (default 825)")
    p.add_argument("--force", action="store_true", help="replace an earlier keygen folder (its CA too)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``ovshard keygen``: write the folder, print what was written (stdout) and how to deploy it (stderr)."""
    written = keygen(args.output, _names(args.stages), _names(args.heads), args.days, args.force)
    roles = {**{n: "stage" for n in _names(args.stages)}, **{n: "head" for n in _names(args.heads)}}
    width = max(len("node"), *(len(p.name) for p in written))
    print(f"{'node':<{width}}  role   folder")
    for path in written:
        print(f"{path.name:<{width}}  {roles[path.name]:<5}  {path}")
    print(f"copy {args.output}/<name>/ to that machine and pass --credentials <that folder>; "
          f"keep {args.output / CA_KEY_FILE} offline", file=sys.stderr)
    return 0
