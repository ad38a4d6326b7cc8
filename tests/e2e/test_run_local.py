"""`ovshard run --local` on a one-stage bundle: in the CLI's process on paged attention, no worker process;
`--workers` still starts one. Both print golden/demo-story.txt (stories260K INT4, f32 hints).

Each command runs under an audit hook that reports every subprocess the CLI started, so "no worker" is
observed, not inferred from timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GOLDEN

pytestmark = pytest.mark.e2e

STORY = (GOLDEN / "demo-story.txt").read_text()
# `ovshard ARGV`, then one JSON line on stderr: the argv of every subprocess the CLI started
WATCHED = [sys.executable, "-c", (
    "import json, sys\n"
    "started = []\n"
    "def hook(event, args):\n"
    "    if event == 'subprocess.Popen':\n"
    "        started.append(args[1] if isinstance(args[1], str) else ' '.join(map(str, args[1])))\n"
    "sys.addaudithook(hook)\n"
    "from ovshard.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(json.dumps({'started': started}), file=sys.stderr)\n"
    "sys.exit(code)\n")]


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K in one stage, the default compile (INT4), as `make demo` compiles two."""
    out = tmp_path_factory.mktemp("run-local") / "one"
    subprocess.run([sys.executable, "-m", "ovshard.cli", "-q", "compile", str(stories), "--stages", "1", "-o",
                    str(out)], capture_output=True, text=True, timeout=600, check=True)
    return out


def run(bundle: Path, *extra: str) -> tuple[str, str, list[str]]:
    """`ovshard run BUNDLE --local --exact` for the demo's 64 tokens: (stdout, log lines, subprocesses started)."""
    done = subprocess.run([*WATCHED, "run", str(bundle), "--local", "--exact", "--max-tokens", "64", *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    *log, started = done.stderr.strip().splitlines()
    return done.stdout, "\n".join(log), json.loads(started)["started"]


@pytest.mark.parametrize("speculative", ["off", "prompt-lookup"])
def test_one_stage_runs_in_this_process_and_tells_the_golden_story(bundle: Path, speculative: str) -> None:
    """A one-stage run starts no `ovshard serve` process, says so, and prints the demo's golden story."""
    out, log, started = run(bundle, "--speculative", speculative)
    assert "one stage: running in this process (paged), no worker" in log
    assert [c for c in started if " serve " in c] == []
    assert out == STORY
    assert "per_hop_network_ms=" in log.splitlines()[-1]


def test_workers_flag_starts_a_worker_process(bundle: Path) -> None:
    """`--workers` runs a one-stage bundle on an `ovshard serve` process over TCP: the same story."""
    out, log, started = run(bundle, "--workers", "--speculative", "off")
    assert "one stage: one worker process per stage over loopback TCP" in log
    assert [c for c in started if " serve " in c and "--stage 0" in c] == started and len(started) == 1
    assert out == STORY


def test_kv_stateful_runs_the_stateful_stage_in_this_process(bundle: Path) -> None:
    """`--kv stateful` keeps the stage in this process on its stateful cache: the same story, no worker."""
    out, log, started = run(bundle, "--kv", "stateful", "--speculative", "off")
    assert "one stage: running in this process (stateful), no worker" in log
    assert "converting" not in log and started == []
    assert out == STORY
