#!/usr/bin/env python
"""Peak anonymous memory of ``ovshard compile`` against layers per stage, streamed vs ``--whole-stage``.

The goal it checks: a streamed compile's peak memory is one layer's working set plus a constant, flat in
the number of layers a stage holds. The gate is anonymous memory (RssAnon summed over the compiler's
process tree, sampled every ``--interval`` s by ``bench/memprobe.py``); weights read back through mmap
are file-backed and reclaimable, so plain RSS is reported beside it but gates nothing.

Cases (``--cases``, comma-separated sets):

* ``1b``: the llama-3.2-1b shape, all 16 layers in 1, 2, 4 and 8 stages, and cut to 2, 4 and 6 layers
  (``ovshard synth --layers``: full-size embedding and lm_head) in 1 stage for the flatness check;
* ``70b``: the llama-3.1-70b shape cut to 1, 2 and 4 layers, 1 stage each, plus 2 stages for the 2- and
  4-layer cuts; ``--whole-stage`` for the 1-layer cut only (more layers would not fit in 24 GB);
* ``8b``: the full llama-3.1-8b shape in 4 and 2 stages streamed, 4 stages whole (for a big machine);
* ``70b-big``: ``--whole-stage`` for the 70B 2- and 4-layer cuts (for a big machine).
* ``30b-a3b``: the qwen3-30b-a3b shape (a mixture of 128 experts, 8 routed) cut to 1, 2 and 4 layers, 1 stage,
  streamed: a layer now holds 128 experts, and the memory must stay one layer's worth.
* ``glm-air``: the glm-4.5-air shape cut to 2, 3 and 5 layers (its dense layer 0, then 1, 2 and 4 layers of 128
  experts and a shared one), 1 stage, streamed: one sparse layer's worth, flat in layers (~40 GB of checkpoints
  in --work; a machine with >= 64 GB).
* ``moe-new``: the glm-4.5-air, llama-4-scout and deepseek-v3 shapes with fewer experts a layer (``FEWER``: 32 of
  128, 4 of 16, 16 of 256; DeepSeek's dense layers cut to its first), at 1, 2 and 3 sparse layers, 1 stage,
  streamed (Scout with ``--max-positions 131072``, its rope's scaled range, not its config's 10M positions): flatness does not depend on how many experts a layer holds, and these fit a 24 GB machine beside
  other work (~40 GB of checkpoints written in turn; ``--drop-checkpoints`` deletes each after its run).

Every case runs streamed and (where listed) ``--whole-stage``, one fresh subprocess each, with
``CI=true`` (openvino_telemetry off: it forks the compiler, and a fork would count the parent's pages
again), ``--no-cache`` (a layer cache hit would skip the work being measured), under ``/usr/bin/time
-v`` when present (kernel peak RSS). A run is killed when MemAvailable falls below ``--guard`` and
recorded as not fitting. Seconds per layer are wall / layers of the checkpoint (startup, embedding and
lm_head included), the median of the streamed compile's own per-layer log lines, and the slope of wall
time over the cuts of one shape (the marginal cost of one more layer).

Reproduce (from the repository root)::

    .venv/bin/python bench/compile_memory.py --sweep                 # 1b and 70b sets, ~1.5 h on 2 cores
    .venv/bin/python bench/compile_memory.py --sweep --cases 8b      # on a machine with >= 64 GB
    .venv/bin/python bench/compile_memory.py --sweep --cases 30b-a3b # ~15 GB of checkpoints in --work
    .venv/bin/python bench/compile_memory.py --sweep --cases glm-air # ~40 GB of checkpoints, >= 64 GB of RAM
    .venv/bin/python bench/compile_memory.py --sweep --report-only --merge OTHER.json   # table + plot

Writes ``bench/results/compile_memory_sweep.json`` (after every run), prints a table and draws
``bench/results/compile_memory_sweep.png`` (matplotlib, in the dev extra; skipped where missing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memprobe import Peak, available_bytes  # noqa: E402  (bench/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "compile_memory_sweep.json"
TIME_BIN = Path("/usr/bin/time")
GB = 10**9
TARGETS = {"llama-3.1-8b": 3.5 * GB, "llama-3.1-70b": 12 * GB}  # peak anon, streamed, any stage count

RE_STAGE = re.compile(r"stage (\d+) \(\d+ of \d+\): layers \[(\d+), (\d+)\), (streamed|traced whole)")
# "stage 0: layer 3 done (4 of 8 layers) in 2.1 s" or, for small layers grouped into one piece, "layers [0, 2) done"
RE_LAYER = re.compile(r"stage (\d+): layers? \[?(\d+)(?:, (\d+)\))? done \(\d+ of \d+(?: layers)?\) in ([\d.]+) s")
RE_SELF = re.compile(r"stage \d+: peak memory")  # ovshard.report.stage_done: the compiler's own sampler
RE_MAXRSS = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


@dataclass(frozen=True)
class Case:
    shape: str  # ovshard.tools.synth preset
    layers: int | None  # `ovshard synth --layers` cut; None: the shape's own layer count
    stages: int
    whole: bool  # --whole-stage
    series: str  # one line of the plot: shape and what varies
    flags: tuple[str, ...] = ()  # more `ovshard compile` flags

    @property
    def key(self) -> str:
        cut = f"L{self.layers}" if self.layers else "full"
        return f"{self.shape}/{cut}/{self.stages}st/{'whole' if self.whole else 'streamed'}"


def _both(shape: str, layers: int | None, stages: int, series: str) -> list[Case]:
    return [Case(shape, layers, stages, False, series), Case(shape, layers, stages, True, series)]


CASE_SETS: dict[str, list[Case]] = {
    "1b": [c for n in (1, 2, 4, 8) for c in _both("llama-3.2-1b", None, n, "1B, 16 layers in 1/2/4/8 stages")]
    + [c for n in (2, 4, 6) for c in _both("llama-3.2-1b", n, 1, "1B cut to 2/4/6 layers, 1 stage")],
    "70b": [Case("llama-3.1-70b", 1, 1, False, "70B cut to 1/2/4 layers, 1 stage"),
            Case("llama-3.1-70b", 1, 1, True, "70B cut to 1/2/4 layers, 1 stage"),
            Case("llama-3.1-70b", 2, 1, False, "70B cut to 1/2/4 layers, 1 stage"),
            Case("llama-3.1-70b", 4, 1, False, "70B cut to 1/2/4 layers, 1 stage"),
            Case("llama-3.1-70b", 2, 2, False, "70B cut to 2/4 layers, 2 stages"),
            Case("llama-3.1-70b", 4, 2, False, "70B cut to 2/4 layers, 2 stages")],
    # --whole-stage for the cuts that do not fit in 24 GB: for a machine with >= 64 GB
    "70b-big": [Case("llama-3.1-70b", 2, 1, True, "70B cut to 1/2/4 layers, 1 stage"),
                Case("llama-3.1-70b", 4, 1, True, "70B cut to 1/2/4 layers, 1 stage")],
    "8b": [Case("llama-3.1-8b", None, 4, False, "8B, 32 layers in 2/4 stages"),
           Case("llama-3.1-8b", None, 2, False, "8B, 32 layers in 2/4 stages"),
           Case("llama-3.1-8b", None, 4, True, "8B, 32 layers in 2/4 stages")],
    # a mixture of experts: a layer holds 128 experts (604M parameters, ~2.4 GB in f32), the router and attention
    "30b-a3b": [Case("qwen3-30b-a3b", n, 1, False, "Qwen3-30B-A3B cut to 1/2/4 layers, 1 stage") for n in (1, 2, 4)],
    # GLM-4.5-Air: layer 0 dense, then 128 experts + 1 shared a layer (2.34B parameters, ~9.4 GB in f32); the cuts hold
    # 1, 2 and 4 sparse layers after the dense one
    "glm-air": [Case("glm-4.5-air", n, 1, False, "GLM-4.5-Air cut to 2/3/5 layers, 1 stage") for n in (2, 3, 5)],
    "moe-new": [Case("glm-4.5-air-32e", n, 1, False, "GLM-4.5-Air, 32 experts, cut to 2/3/4 layers, 1 stage")
                for n in (2, 3, 4)]
    # Scout's 10,485,760 positions would make the rotary tables (2 x 10.5M x 128 f32) 10.7 GB whatever the layers
    + [Case("llama-4-scout-4e", n, 1, False, "Llama-4-Scout, 4 experts, cut to 1/2/3 layers, 1 stage",
            ("--max-positions", "131072")) for n in (1, 2, 3)]
    + [Case("deepseek-v3-16e", n, 1, False, "DeepSeek-V3, 16 experts, cut to 2/3/4 layers, 1 stage") for n in (2, 3, 4)],
}
# shapes of ovshard.tools.shapes presets with fewer experts a layer: name -> (preset, config keys replaced)
FEWER: dict[str, tuple[str, dict[str, Any]]] = {
    "glm-4.5-air-32e": ("glm-4.5-air", {"n_routed_experts": 32}),
    "llama-4-scout-4e": ("llama-4-scout", {"num_local_experts": 4}),
    "deepseek-v3-16e": ("deepseek-v3", {"n_routed_experts": 16, "first_k_dense_replace": 1}),
}


def tree_digest() -> str:
    """sha256 (first 12 hex) of the compiler's sources as they are now: others edit the tree during a sweep."""
    h = hashlib.sha256()
    for path in sorted([*ROOT.glob("ovshard/**/*.py"), *ROOT.glob("passes/*.py")]):
        h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def ovshard_cmd() -> list[str]:
    return [sys.executable, "-m", "ovshard.cli"]


# ----------------------------------------------------------------------------------------- checkpoints


def checkpoint(work: Path, shape: str, layers: int | None, dtype: str) -> tuple[Path, dict[str, Any]]:
    """The random checkpoint of ``shape`` cut to ``layers``, written with ``ovshard synth`` unless present."""
    from ovshard.tools.synth import checkpoint_layout, shape_config

    source = shape
    if shape in FEWER:  # a config.json of the preset with fewer experts, which synth cuts to ``layers``
        base, replaced = FEWER[shape]
        source = str(work / f"config-{shape}.json")
        Path(source).write_text(json.dumps({**shape_config(base), **replaced}, indent=1) + "\n")
    config = shape_config(source, layers)
    path = work / f"ckpt-{shape}-{f'L{layers}' if layers else 'full'}-{dtype}"
    facts = {"path": str(path), "shape": shape, "layers": config["num_hidden_layers"], "dtype": dtype,
             "bytes": checkpoint_layout(config, dtype).nbytes}
    if (path / "config.json").is_file():
        found = json.loads((path / "config.json").read_text())
        if (found.get("num_hidden_layers"), found.get("hidden_size"), found.get("dtype")) != (
                config["num_hidden_layers"], config["hidden_size"], dtype):
            sys.exit(f"{path} holds another checkpoint; remove it or pass another --work")
        return path, facts | {"reused": True}
    free = shutil.disk_usage(work).free
    if free < facts["bytes"] + 4 * GB:
        raise RuntimeError(f"{path}: needs {facts['bytes'] / GB:.1f} GB (+4 GB for the bundle), "
                           f"{free / GB:.1f} GB free on {work}")
    cmd = [*ovshard_cmd(), "synth", source, "--dtype", dtype, "-o", str(path)]
    cmd += ["--layers", str(layers)] if layers else []
    print(f"$ {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return path, facts | {"reused": False, "synth_s": round(time.perf_counter() - start, 1)}


# ----------------------------------------------------------------------------------------- one compile


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the compile's own process group (started with start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def compile_once(cmd: list[str], interval: float, guard: int, echo: bool) -> dict[str, Any]:
    """Run ``cmd``, sample its tree's RssAnon/VmRSS, timestamp its stderr lines; kill it if memory runs out."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", CI="true")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    peak = Peak(proc.pid, interval).start()
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            if echo and line.startswith("ovshard:"):
                print(f"    {line.rstrip()}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    aborted = None
    while proc.poll() is None:
        if available_bytes() < guard:
            aborted = (f"killed: MemAvailable fell below {guard / GB:.1f} GB at tree RSS "
                       f"{peak.peak_rss / GB:.2f} GB, anon {peak.peak_anon / GB:.2f} GB")
            _kill_tree(proc)
            proc.wait()
            break
        time.sleep(0.2)
    wall = time.perf_counter() - start
    peak.stop()
    reader.join(timeout=10)
    return {"returncode": proc.returncode, "wall_s": round(wall, 2), "aborted": aborted, "peak": peak,
            "lines": lines}


def _first_after(timeline: list[tuple[float, int, int]], t: float) -> int | None:
    return next((anon for s, anon, _ in timeline if s >= t), None)


def layer_profile(lines: list[tuple[float, str]], timeline: list[tuple[float, int, int]]) -> dict[str, Any]:
    """Per streamed layer: its logged seconds, its peak anon, and anon just after it finished (a leak grows)."""
    layers = []
    previous = None
    for t, line in lines:
        if m := RE_STAGE.search(line):
            previous = t
        elif (m := RE_LAYER.search(line)) and previous is not None:
            inside = [anon for s, anon, _ in timeline if previous <= s <= t]
            a = int(m.group(2))
            z = int(m.group(3)) if m.group(3) else a + 1
            layers.append({"stage": int(m.group(1)), "layers": [a, z], "seconds": float(m.group(4)) / (z - a),
                           "peak_anon": max(inside, default=None), "anon_after": _first_after(timeline, t)})
            previous = t
    return {"layers": layers}  # seconds: per layer (a group's time split evenly)


def peak_context(lines: list[tuple[float, str]], timeline: list[tuple[float, int, int]]) -> dict[str, Any]:
    """When the anon peak happened and the compiler's log lines around it."""
    if not timeline:
        return {}
    t_peak = max(timeline, key=lambda s: s[1])[0]
    logged = [(t, line) for t, line in lines if line.startswith("ovshard:")]
    before = [line for t, line in logged if t <= t_peak]
    after = [line for t, line in logged if t > t_peak]
    return {"at_s": round(t_peak, 1), "after_line": before[-1] if before else None,
            "before_line": after[0] if after else None}


def measure(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    ckpt, facts = checkpoint(args.work, case.shape, case.layers, args.dtype)
    bundle = args.work / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    flags = ["--stages", str(case.stages), "--no-cache", *(["--whole-stage"] if case.whole else []), *case.flags]
    cmd = [*ovshard_cmd(), "compile", str(ckpt), *flags, "-o", str(bundle)]
    time_file = args.work / "time-v.txt"
    time_file.unlink(missing_ok=True)
    wrapped = [str(TIME_BIN), "-v", "-o", str(time_file), *cmd] if TIME_BIN.exists() else cmd
    print(f"\n[{case.key}] $ ovshard {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    sources = tree_digest()
    got = compile_once(wrapped, args.interval, int(args.guard * GB), args.echo)
    peak: Peak = got["peak"]
    timeline = peak.timeline
    m = RE_MAXRSS.search(time_file.read_text()) if time_file.is_file() else None
    run: dict[str, Any] = {
        "case": asdict(case), "key": case.key, "checkpoint": facts, "command": f"ovshard {' '.join(cmd[3:])}",
        "sources": sources, "returncode": got["returncode"], "aborted": got["aborted"], "wall_s": got["wall_s"],
        "peak_anon_bytes": peak.peak_anon, "peak_rss_bytes": peak.peak_rss, "samples": peak.samples,
        "time_v_max_rss_bytes": int(m.group(1)) * 1024 if m else None,
        "descendants_seen": len(peak.descendants_seen) - (1 if wrapped is not cmd else 0),
        "peak": peak_context(got["lines"], timeline),
        "self_reported": [line for _, line in got["lines"] if RE_SELF.search(line)],  # ovshard.memory's figures
        **layer_profile(got["lines"], timeline),
        "timeline": [[round(t, 1), a // (1 << 20), r // (1 << 20)] for t, a, r in timeline[::5]],  # s, MiB, MiB
        "log": [f"{t:7.1f} {line}" for t, line in got["lines"] if line.startswith("ovshard:")],
    }
    if got["returncode"] == 0:
        from ovshard.bundle.manifest import read_manifest

        run["stage_layers"] = [e.stage.end - e.stage.start for e in read_manifest(bundle).stages]
        run["bundle_bytes"] = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    else:
        run["stderr_tail"] = [line for _, line in got["lines"][-25:]]
    shutil.rmtree(bundle, ignore_errors=True)
    if args.drop_checkpoints:
        shutil.rmtree(ckpt, ignore_errors=True)
    print(f"  rc {run['returncode']}, {run['wall_s']:.0f} s, peak anon {peak.peak_anon / GB:.2f} GB, "
          f"RSS {peak.peak_rss / GB:.2f} GB{' (' + run['aborted'] + ')' if run['aborted'] else ''}",
          file=sys.stderr, flush=True)
    return run


# ----------------------------------------------------------------------------------------- report


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / GB:.2f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(x.ljust(w) if c < 2 else x.rjust(w) for c, (x, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def _ok(run: dict[str, Any]) -> bool:
    return run["returncode"] == 0 and not run.get("aborted")


def layers_per_stage(run: dict[str, Any]) -> int:
    """The most layers any stage of the run held (balanced plans need not split evenly)."""
    if run.get("stage_layers"):
        return max(run["stage_layers"])
    return math.ceil(run["checkpoint"]["layers"] / run["case"]["stages"])


def profile(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's per-layer profile; for a run that recorded none, derived again from its log and timeline."""
    if "layers" in run or "log" not in run:
        return run.get("layers", [])
    lines = [(float(x[:7]), x[8:]) for x in run["log"]]
    timeline = [(t, a << 20, r << 20) for t, a, r in run["timeline"]]
    return layer_profile(lines, timeline)["layers"]


def seconds_per_layer(run: dict[str, Any]) -> tuple[float, float | None]:
    """(wall / layers of the checkpoint, median of the streamed compile's per-layer log times)."""
    logged = [x["seconds"] for x in profile(run)]
    return run["wall_s"] / run["checkpoint"]["layers"], statistics.median(logged) if logged else None


def slopes(runs: list[dict[str, Any]]) -> list[tuple[str, str, str, int, float]]:
    """Least-squares slope of wall time over the layer count among 1-stage cuts, per (shape, mode, machine)."""
    groups: dict[tuple[str, bool, str], list[tuple[int, float]]] = {}
    for r in runs:
        c = r["case"]
        if _ok(r) and c["layers"] and c["stages"] == 1:
            groups.setdefault((c["shape"], c["whole"], r.get("machine", "")), []).append(
                (r["checkpoint"]["layers"], r["wall_s"]))
    out = []
    for (shape, whole, machine), points in sorted(groups.items()):
        if len({x for x, _ in points}) < 2:
            continue
        mx, my = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        out.append((shape, "whole" if whole else "streamed", machine, len(points), slope))
    return out


Series = tuple[str, bool, str]  # (plot series, --whole-stage, machine)


def _series(runs: list[dict[str, Any]]) -> dict[Series, list[tuple[int, int]]]:
    """(layers per stage, peak anon) of the successful runs, sorted, per series, mode and machine."""
    found: dict[Series, list[tuple[int, int]]] = {}
    for r in runs:
        if _ok(r):
            key = (r["case"]["series"], r["case"]["whole"], r.get("machine", ""))
            found.setdefault(key, []).append((layers_per_stage(r), r["peak_anon_bytes"]))
    return {k: sorted(v) for k, v in found.items()}


def flatness(runs: list[dict[str, Any]]) -> list[str]:
    """Peak anon at the most vs the fewest layers per stage, within each series, mode and machine."""
    out = []
    for (series, whole, machine), group in sorted(_series(runs).items()):
        if len(group) < 2:
            continue
        (lo_x, lo), (hi_x, hi) = group[0], group[-1]
        spread = max(y for _, y in group) / min(y for _, y in group)
        out.append(f"  {series}, {'whole' if whole else 'streamed'} [{machine}]: {hi_x} vs {lo_x} layers/stage "
                   f"{hi / GB:.2f} / {lo / GB:.2f} GB = {hi / lo:.2f}x (max/min over the series {spread:.2f}x)")
    return out


def targets(runs: list[dict[str, Any]]) -> list[str]:
    out = []
    for shape, limit in TARGETS.items():
        got = [r for r in runs if r["case"]["shape"] == shape and not r["case"]["whole"] and _ok(r)]
        if not got:
            out.append(f"  {shape}: not measured (target <= {limit / GB:.1f} GB anon)")
            continue
        worst = max(got, key=lambda r: r["peak_anon_bytes"])
        verdict = "met" if worst["peak_anon_bytes"] <= limit else "NOT met"
        out.append(f"  {shape}: worst streamed peak anon {worst['peak_anon_bytes'] / GB:.2f} GB ({worst['key']}, "
                   f"{worst.get('machine')}) vs target <= {limit / GB:.1f} GB: {verdict}")
    return out


def report(runs: list[dict[str, Any]]) -> str:
    rows = [["case", "machine", "layers/stage", "wall s", "peak anon GB", "peak RSS GB", "ru_maxrss GB",
             "s/layer (wall)", "s/layer (log)", "anon peak came after"]]
    for r in runs:
        wall_per, logged = seconds_per_layer(r)
        status = "" if _ok(r) else (r.get("aborted") or f"FAILED rc={r['returncode']}")
        after = (r.get("peak", {}).get("after_line") or "").removeprefix("ovshard: ")
        rows.append([r["key"], r.get("machine", "here"), str(layers_per_stage(r)), f"{r['wall_s']:.0f}",
                     _gb(r["peak_anon_bytes"]), _gb(r["peak_rss_bytes"]), _gb(r.get("time_v_max_rss_bytes")),
                     f"{wall_per:.1f}", "-" if logged is None else f"{logged:.1f}",
                     status or after[:70]])
    out = [_table(rows), "", "flatness (peak anon, most vs fewest layers per stage):", *flatness(runs),
           "", "targets:", *targets(runs), "", "marginal seconds per layer (slope of wall over the 1-stage cuts):"]
    out += [f"  {shape} {mode} [{machine}]: {slope:.1f} s/layer ({n} cuts)"
            for shape, mode, machine, n, slope in slopes(runs)]
    return "\n".join(out)


def plot(runs: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    titles = {"llama-3.2-1b": "Llama-3.2-1B shape", "llama-3.1-8b": "Llama-3.1-8B shape",
              "llama-3.1-70b": "Llama-3.1-70B shape, cut to 1-4 layers"}
    shapes = [s for s in titles if any(r["case"]["shape"] == s and _ok(r) for r in runs)]
    if not shapes:
        return None
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.6 * len(shapes), 5.4), squeeze=False)
    series = _series(runs)
    shape_of = {r["case"]["series"]: r["case"]["shape"] for r in runs}
    for ax, shape in zip(axes[0], shapes, strict=True):
        lines = sorted({(name, machine) for name, _, machine in series if shape_of[name] == shape})
        for k, (name, machine) in enumerate(lines):
            for whole in (False, True):
                points = series.get((name, whole, machine))
                if points:
                    xs, ys = [x for x, _ in points], [y / GB for _, y in points]
                    ax.plot(xs, ys, marker="os^D"[k % 4], linestyle="--" if whole else "-", color=f"C{k}",
                            label=f"{name} [{machine}]: {'--whole-stage' if whole else 'streamed'}")
                    ax.annotate(f"{ys[-1]:.2f}", (xs[-1], ys[-1]), textcoords="offset points",
                                xytext=(5, 6 if k % 2 else -11), fontsize=7, color=f"C{k}")
        if shape in TARGETS:
            ax.axhline(TARGETS[shape] / GB, color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(f"target <= {TARGETS[shape] / GB:g} GB (streamed)", (0.98, TARGETS[shape] / GB),
                        xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=8, color="grey")
        ax.set_title(titles[shape], fontsize=10)
        ax.set_xlabel("layers per stage (largest stage of the plan)")
        ax.set_ylabel("peak anonymous memory, GB")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.06)  # room for the value labels
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.margins(x=0.08)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    fig.suptitle("ovshard compile: peak RssAnon of the compiler's process tree vs layers per stage\n"
                 "(default INT4, bf16 random checkpoints; solid: streamed, dashed: --whole-stage)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024  # MemTotal
    found = {}
    for dist in ("openvino", "nncf", "torch", "transformers", "numpy"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"label": f"{os.cpu_count()} cores, {round(total / 2**30)} GiB", "cpus": os.cpu_count(),
            "memory_bytes": total, "platform": platform.platform(), "python": platform.python_version(),
            "versions": found}


_SHAPE_ORDER = {"llama-3.2-1b": 0, "llama-3.1-8b": 1, "llama-3.1-70b": 2}


def _order(run: dict[str, Any]) -> tuple:
    c = run["case"]
    return _SHAPE_ORDER.get(c["shape"], 9), c["series"], c["layers"] or 0, c["stages"], c["whole"]


def _load(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["runs"] if path.is_file() else []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="compile_memory.py --sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1b,70b", help=f"case sets from {', '.join(CASE_SETS)} (default 1b,70b)")
    p.add_argument("--only", help="run only cases whose key contains one of these (comma-separated), e.g. 70b/L1,8b/full/4st")
    p.add_argument("--work", type=Path, default=Path("/tmp/ovshard-sweep"),
                   help="checkpoints and bundles (default /tmp/ovshard-sweep; the 70b set needs ~30 GB free)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--interval", type=float, default=0.1, help="sampling period in seconds (default 0.1)")
    p.add_argument("--guard", type=float, default=1.5, help="kill a compile when MemAvailable < this many GB")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, help="PNG path (default: --results with .png)")
    p.add_argument("--resume", action="store_true", help="skip cases already in --results from this machine")
    p.add_argument("--merge", type=Path, action="append", default=[],
                   help="also report (and keep) the runs of this results file, e.g. a big machine's")
    p.add_argument("--report-only", action="store_true", help="run nothing: table and plot from --results")
    p.add_argument("--echo", action="store_true", help="echo the compiler's log lines")
    p.add_argument("--drop-checkpoints", action="store_true", help="delete each checkpoint after its run (disk)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work = args.work.resolve()
    here = machine()
    runs = _load(args.results)
    for other in args.merge:  # its runs replace those of the same case and machine
        incoming = [r | {"source": str(other)} for r in _load(other)]
        replaced = {(r["key"], r.get("machine")) for r in incoming}
        runs = [r for r in runs if (r["key"], r.get("machine")) not in replaced] + incoming
    if not args.report_only:
        args.work.mkdir(parents=True, exist_ok=True)
        cases = [c for name in args.cases.split(",") if name.strip() for c in CASE_SETS[name.strip()]]
        only = [o.strip() for o in (args.only or "").split(",") if o.strip()]
        cases = list({c.key: c for c in cases if not only or any(o in c.key for o in only)}.values())
        done = {r["key"] for r in runs if r.get("machine") == here["label"] and _ok(r)} if args.resume else set()
        todo = [c for c in cases if c.key not in done]
        again = {c.key for c in todo}
        runs = [r for r in runs if not (r.get("machine") == here["label"] and r["key"] in again)]
        for case in todo:
            try:
                run = measure(case, args) | {"machine": here["label"]}
            except RuntimeError as e:  # no disk for the checkpoint
                print(f"[{case.key}] skipped: {e}", file=sys.stderr)
                run = {"case": asdict(case), "key": case.key, "machine": here["label"], "returncode": None,
                       "aborted": f"skipped: {e}", "wall_s": 0.0, "peak_anon_bytes": 0, "peak_rss_bytes": 0,
                       "checkpoint": {"layers": case.layers or 0}}
            runs.append(run)
            _save(args.results, here, runs)
    runs.sort(key=_order)
    text = report(runs)
    _save(args.results, here, runs, text)
    print(text)
    png = plot(runs, args.plot or args.results.with_suffix(".png"))
    print(f"\nresults: {args.results}" + (f"\nplot: {png}" if png else ""))
    return 0


def _save(path: Path, here: dict[str, Any], runs: list[dict[str, Any]], text: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": here, "gate": "peak RssAnon summed over "
           "the compiler's process tree, sampled by bench/memprobe.py", "runs": runs}
    if text is not None:
        doc["report"] = text.splitlines()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
