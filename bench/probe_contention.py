"""Does a node's probe see a shared core? ``probe_layer`` on one core, idle and beside a busy loop.

The probe runs in a child at niceness 15 (Ray's workers' own) pinned to the last core; the busy loop is
pinned to the same core at niceness 10, as in tests/runtime/cluster/test_cluster.py's unequal pair. Rounds alternate idle
and busy; written (bench/results/probe_contention.{json,md}) and printed: the medians and busy/idle.

    .venv/bin/python bench/probe_contention.py BUNDLE [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, write_results  # noqa: E402  (bench/ is not a package)


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

    def side(busy: bool) -> float:
        loop = None
        if busy:
            loop = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(10)\nwhile True: pass"],
                                    preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        try:
            return probe(args.bundle, core)
        finally:
            if loop is not None:
                loop.kill()
                loop.wait()

    got = interleaved({"idle": lambda: side(False), "busy": lambda: side(True)}, args.rounds,
                      label="s a layer step", timed=False)
    rows = [{"core": name, "us_a_layer_step": round(got.median(name) * 1e6, 1),
             "x_idle": round(got.median(name) / got.median("idle"), 2)} for name in got.cases]
    print(write_results("probe_contention", rows, {"bundle": str(args.bundle), "core": core, "rounds": args.rounds},
                        title="a node's probe on an idle and a busy core"))
    print(f"busy / idle: {rows[1]['x_idle']:.2f}x")

if __name__ == "__main__":
    main()
