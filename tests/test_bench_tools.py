"""The bench tools stay runnable: every bench/ module imports, every script shows --help, every script
is in a suite or named as a helper, and the harness writes its results (a real run of tiny cases)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402  (bench/ is not a package)
import suites  # noqa: E402

# the top-level tools and helpers, and each suite folder's scripts as "<folder>/<name>" (device/ runs apart)
MODULES = sorted(str(p.relative_to(BENCH).with_suffix("")) for p in [*BENCH.glob("*.py"), *BENCH.glob("*/*.py")]
                 if p.parent.name != "device")
SCRIPTS = [m for m in MODULES if 'if __name__ == "__main__"' in (BENCH / f"{m}.py").read_text()]


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    # OVSHARD_CACHE_DIR set: scripts that import tests/conftest.py make no cache folder of their own
    return subprocess.run([sys.executable, *args], cwd=BENCH, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CI": "true", "OVSHARD_CACHE_DIR": str(cache)}, check=False)


def test_every_module_imports_and_every_script_shows_help(tmp_path: Path) -> None:
    loose = [m for m in MODULES if m not in SCRIPTS]
    assert all("/" not in m for m in loose), f"a suite folder holds scripts only, found modules {loose}"
    calls = [["-c", f"import {m}"] for m in loose]
    calls += [[f"{m}.py", "--help"] for m in SCRIPTS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = list(pool.map(lambda call: _run(call, tmp_path), calls))
    failed = [f"{' '.join(c)}: rc {r.returncode}: {r.stderr[-800:]}" for c, r in zip(calls, done, strict=True)
              if r.returncode != 0 or (c[-1] == "--help" and "usage:" not in r.stdout)]
    assert not failed, "\n".join(failed)


def test_every_script_is_in_a_suite_or_named_apart() -> None:
    in_suites = {step.script for suite in suites.SUITES.values() for step in suite.steps}
    scenarios = {m for m in MODULES if m.startswith("scenarios_")}
    loose = set(MODULES) - in_suites - scenarios - set(suites.HELPERS) - set(suites.OWN_LINES)
    assert not loose, f"bench modules in no suite: {sorted(loose)}; add each to bench/suites.py (a Step) or HELPERS"
    missing = in_suites - set(MODULES)
    assert not missing, f"bench/suites.py names scripts that are not in bench/: {sorted(missing)}"


def test_unknown_suite_is_refused_with_the_names() -> None:
    with pytest.raises(SystemExit, match="expected names from"):
        suites.steps(["nope"])


def test_interleaved_rotates_and_write_results_names_the_machine(tmp_path: Path) -> None:
    order: list[str] = []
    got = harness.interleaved({"a": lambda: order.append("a") or 2.0, "b": lambda: order.append("b") or 1.0},
                              rounds=3, timed=False)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert got.median("a") == 2.0 and got.ratio("a", "b") == 2.0
    timed = harness.interleaved({"x": lambda: None}, rounds=2)
    assert all(isinstance(s, float) and s >= 0 for s in timed.samples["x"])

    rows = [{"case": c, "value": got.median(c), "samples": got.samples[c]} for c in got.cases]
    table = harness.write_results("t", rows, {"rounds": 3}, out=tmp_path, command="cmd",
                                  plot={"group_by": "case", "label": "{case}", "value": "value"})
    assert "| case | value |" in table  # lists stay in the JSON only
    doc = json.loads((tmp_path / "t.json").read_text())
    facts = harness.machine()
    assert doc["machine"]["cpu"] == facts["cpu"] and doc["machine"]["isa"] == facts["isa"]
    assert doc["rows"][0]["samples"] == [2.0, 2.0, 2.0] and doc["command"] == "cmd"
    md = (tmp_path / "t.md").read_text()
    assert harness.describe(facts) in md and table in md


def test_interleaved_refuses_no_rounds() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        harness.interleaved({"a": lambda: None}, rounds=0)
