"""The harness every bench script shares: the machine described once, cases measured in interleaved
rounds (medians and per-round ratios), and results written as JSON, a markdown table and a plot.

    from harness import RESULTS, interleaved, write_results

    got = interleaved({"plain": run_plain, "tls": run_tls}, rounds=7)   # A, B, B, A, ... (seconds a call)
    rows = [{"case": c, "ms": 1e3 * got.median(c), "x_plain": got.ratio(c, "plain")} for c in got.cases]
    write_results("tls_cost", rows, {"tokens": 64}, plot={"group_by": ..., "label": ..., "value": "ms"})

A case is a callable; its sample for a round is the seconds the call took (``time.perf_counter``), or with
``timed=False`` what it returns (its own timing, tokens/s, a record). Timings here drift +-50% between processes,
so variants are compared within one process, round by round, and a ratio is the median of the rounds' ratios.
Results go under ``bench/results/`` (git-ignored): ``<name>.json`` (meta, machine, rows, samples included),
``<name>.md`` (the table under a line naming the machine and the command) and ``<name>.png`` when a plot
spec is given (see report.py for the spec).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STORIES = ROOT.parent / "shared" / "models" / "stories260K"


def compiler_version() -> str:
    """A digest of the compiler's sources: a kept bundle is ovshard's default compile of the code at hand, never
    of an older default."""
    digest = hashlib.sha256()
    for path in sorted(p for folder in ("ovshard", "passes") for p in (ROOT / folder).rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def current_bundle(folder: Path, name: str) -> Path:
    """Where the compiler at hand keeps its bundle ``name`` in ``folder`` (``name-<compiler_version>``); the
    bundles an older compiler kept there under that name (or the name alone) are removed."""
    out = folder / f"{name}-{compiler_version()}"
    for old in folder.glob(f"{name}*"):
        if old != out:
            shutil.rmtree(old, ignore_errors=True)
    return out


def progress(message: str, tag: str = "bench") -> None:
    """A progress line on stderr (stdout carries results)."""
    print(f"[{tag} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# ------------------------------------------------------------------------------------------- the machine


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    fields = (line.partition(":") for line in out.splitlines())
    return {k.strip(): v.strip() for k, sep, v in fields if sep}


def machine() -> dict[str, Any]:
    """This machine as every result names it: the CPU model (lscpu), cores, the ISA class ovshard's
    runtime picks its hints by, the software versions and the load when the run started."""
    from ovshard.runtime.engine.cpu import cpu_name, isa_class

    cpu = _lscpu()
    cores = cpu.get("Core(s) per socket"), cpu.get("Socket(s)")
    versions = {}
    for dist in ("openvino", "openvino-genai", "openvino-tokenizers", "nncf", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu.get("Model name") or cpu_name(), "cpu_count": os.cpu_count(),
            "cores": int(cores[0]) * int(cores[1]) if all(c and c.isdigit() for c in cores) else os.cpu_count(),
            "isa": isa_class(), "platform": platform.platform(), "python": platform.python_version(),
            "versions": versions, "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def describe(facts: dict[str, Any]) -> str:
    """One line: "AMD EPYC, 2 cores (2 CPUs), ISA avx512, OpenVINO 2025.x"."""
    return (f"{facts['cpu']}, {facts.get('cores', '?')} cores ({facts['cpu_count']} CPUs), ISA {facts.get('isa', '?')}, "
            f"OpenVINO {facts.get('versions', {}).get('openvino', '?')}")


# ------------------------------------------------------------------------------------------- measuring


@dataclass
class Interleaved:
    """Samples of several cases taken in interleaved rounds: ``samples[case][round]``."""

    cases: list[str]
    samples: dict[str, list[Any]] = field(default_factory=dict)

    def values(self, case: str, key: Callable[[Any], float] = float) -> list[float]:
        return [key(s) for s in self.samples[case]]

    def median(self, case: str, key: Callable[[Any], float] = float) -> float:
        return median(self.values(case, key))

    def ratio(self, case: str, baseline: str, key: Callable[[Any], float] = float) -> float:
        """The median over rounds of case / baseline in the same round: the pairs cancel slow drift."""
        pairs = zip(self.values(case, key), self.values(baseline, key), strict=True)
        return median([a / b for a, b in pairs])


def interleaved(cases: dict[str, Callable[[], Any]], rounds: int, warmup: int = 0, label: str = "",
                timed: bool = True, show: Callable[[Any], str] | None = None) -> Interleaved:
    """Each round runs every case once, the first case rotating from round to round, after ``warmup``
    untimed runs of each. A case's sample is its seconds, or with ``timed=False`` what it returns."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: expected at least 1 interleaved round")
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    got = Interleaved(names, {n: [] for n in names})
    every, shown = max(1, rounds // 20), show or _shown  # at most ~20 progress lines
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            sample = cases[name]()
            got.samples[name].append(time.perf_counter() - start if timed else sample)
        if (r + 1) % every == 0 or r + 1 == rounds:
            progress(f"{label + ' ' if label else ''}round {r + 1}/{rounds}: "
                     + ", ".join(f"{n} {shown(got.samples[n][-1])}" for n in names))
    return got


def _shown(sample: Any) -> str:
    return f"{sample:.4g}" if isinstance(sample, float) else type(sample).__name__


# ------------------------------------------------------------------------------------------- results


def command_line(argv: list[str] | None = None, env: str = "CI=true ") -> str:
    """The command that reproduces this run, from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return f"{env}.venv/bin/python {shown} {shlex.join(sys.argv[1:] if argv is None else argv)}".strip()


def write_results(name: str, rows: list[dict[str, Any]], meta: dict[str, Any] | None = None, *,
                  columns: list[str] | None = None, plot: dict[str, Any] | None = None, out: Path = RESULTS,
                  command: str | None = None, title: str = "", facts: dict[str, Any] | None = None) -> str:
    """``<out>/<name>.json`` (meta, machine, command and every row), ``<name>.md`` (``columns`` of the rows,
    default all but lists, under a line naming the machine) and ``<name>.png`` where ``plot`` is given and
    matplotlib is installed. Returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    facts = facts or machine()
    command = command or command_line()
    doc: dict[str, Any] = {"name": name, "title": title, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "command": command, "machine": facts, "meta": meta or {}, "rows": rows}
    if plot and rows and report.plot(name, title or name, rows, plot, out / f"{name}.png"):
        doc["plot_file"] = f"{name}.png"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    columns = columns or [c for c in dict.fromkeys(k for row in rows for k in row)
                          if not any(isinstance(row.get(c), list | dict) for row in rows)]
    table = report.markdown_table([{c: row.get(c, "") for c in columns} for row in rows])
    lines = [f"# {title or name}", "", f"{describe(facts)}; {doc['created']}. Command: `{command}`", "", table, ""]
    lines += [f"- {k}: {v}" for k, v in (meta or {}).items() if not isinstance(v, list | dict)]
    if "plot_file" in doc:
        lines += ["", f"![{name}]({doc['plot_file']})"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return table
