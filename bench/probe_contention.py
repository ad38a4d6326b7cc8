"""Does a node's probe see a shared core? ``probe_layer`` on one core, idle and beside a busy loop.

The probe runs in a child at niceness 15 (Ray's workers' own) pinned to the last core; the busy loop is
pinned to the same core at niceness 10, as in tests/runtime/cluster/test_cluster.py's unequal pair. Rounds alternate idle
and busy; printed: each probe's step time and the busy/idle ratio of the medians.

    .venv/bin/python bench/probe_contention.py BUNDLE [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def probe(bundle: Path, core: int) -> float:
    """One probe in a fresh child process at niceness 15 on ``core``: its step seconds."""
    code = ("import json, os, sys\nos.nice(15)\nos.sched_setaffinity(0, {int(sys.argv[2])})\n"
            "from pathlib import Path\nfrom ovshard.bundle.manifest import read_manifest\n"
            "from ovshard.runtime.cluster.probe import probe_layer\n"
            "print(json.dumps(probe_layer(read_manifest(Path(sys.argv[1])), threads=1)))\n")
    out = subprocess.run([sys.executable, "-c", code, str(bundle), str(core)], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.splitlines()[-1])["step_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    core = sorted(os.sched_getaffinity(0))[-1]
    found: dict[str, list[float]] = {"idle": [], "busy": []}
    for _ in range(args.rounds):
        for side in ("idle", "busy"):
            loop = None
            if side == "busy":
                loop = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(10)\nwhile True: pass"],
                                        preexec_fn=lambda: os.sched_setaffinity(0, {core}))
            try:
                found[side].append(probe(args.bundle, core))
            finally:
                if loop is not None:
                    loop.kill()
                    loop.wait()
            print(f"{side}: {found[side][-1] * 1e6:.1f} us a layer step", flush=True)
    ratio = statistics.median(found["busy"]) / statistics.median(found["idle"])
    print(f"busy / idle: {ratio:.2f}x")


if __name__ == "__main__":
    main()
