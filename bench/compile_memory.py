#!/usr/bin/env python
"""Peak memory and per-pass time of ``ovshard compile`` on a random-weight Llama-3.2-1B-shaped checkpoint.

What it shows: a compile holds one stage at a time (``compile_stage`` frees each stage before the
next), so peak RSS should follow the largest stage's float32 weights, not the whole model's.

Steps:

1. write a random-weight checkpoint of ``--shape`` (bfloat16 by default, like real Llama releases)
   into ``--work``, or reuse the one already there;
2. for each ``--stages`` value (plus 1 with ``--monolithic``) run ``ovshard compile`` as a fresh
   subprocess, under ``/usr/bin/time -v`` when present (kernel ``ru_maxrss`` of the compiler), while
   a sampler polls the RSS of the child's process tree every ``--interval`` seconds and timestamps
   every log line the compiler prints on stderr; the samples are cut into phases (startup, per
   stage: trace, each pass, save) so each phase gets its own peak;
3. read the bundle's manifest.json (pass_log, plan) and stage file sizes, then delete the bundle;
4. write ``bench/results/compile_memory.json`` and print a table.

Reproduce (from the repository root)::

    .venv/bin/python bench/compile_memory.py                      # 2 and 4 stages
    .venv/bin/python bench/compile_memory.py --stages 2,4 --monolithic   # also --stages 1
    .venv/bin/python bench/compile_memory.py --sweep    # anon memory vs layers per stage (compile_memory_sweep.py)

Needs psutil (in the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from ovshard.bundle import schema
from ovshard.bundle.manifest import read_manifest

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = ROOT / "bench" / "results" / "compile_memory.json"
TIME_BIN = Path("/usr/bin/time")
MiB = 1 << 20
GB = 10**9

# log lines printed by ovshard.compile / ovshard.ir.instruments (format "ovshard: %(message)s")
RE_PLAN = re.compile(r"partition plan")
RE_TRACE = re.compile(r"stage (\d+) \(\d+ of \d+\): tracing layers \[(\d+), (\d+)\)")
RE_PASS = re.compile(r"stage (\d+) \(\d+ of \d+\): (\w+)\s+(changed the graph|no change) in ([\d.]+) s")
RE_DONE = re.compile(r"stage (\d+): compiled in ([\d.]+) s")


# ----------------------------------------------------------------------------------------- checkpoint


def ensure_checkpoint(path: Path, shape: str, dtype: str) -> dict[str, Any]:
    """Write the random-weight checkpoint at ``path`` unless a valid one of this shape is there already."""
    from ovshard.errors import OvshardError
    from ovshard.frontend.checkpoint import open_checkpoint
    from ovshard.tools.synth import preset, write_checkpoint

    config = preset(shape)
    reused = False
    if path.exists() and any(path.iterdir()):
        try:
            ckpt = open_checkpoint(path)
            ckpt.validate_tensors()
        except OvshardError as e:
            sys.exit(f"{path} exists but is not a usable checkpoint ({e}); remove it or pass another --work")
        found = {k: ckpt.config.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size", "dtype")}
        wanted = {k: config.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")} | {"dtype": dtype}
        if found != wanted:
            sys.exit(f"{path} holds another checkpoint ({found}, wanted {wanted}); remove it or pass another --work")
        reused = True
        print(f"reusing checkpoint {path}", file=sys.stderr)
    else:
        print(f"writing {shape} checkpoint ({dtype}) to {path} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        write_checkpoint(path, config, dtype=dtype)
        print(f"  written in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return checkpoint_facts(path, shape, dtype, reused)


def checkpoint_facts(path: Path, shape: str, dtype: str, reused: bool) -> dict[str, Any]:
    from ovshard.frontend.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    numel = {n: math.prod(ckpt.tensor_info(n)[1]) for n in ckpt.tensor_names()}
    disk = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return {
        "path": str(path),
        "shape": shape,
        "dtype": dtype,
        "reused": reused,
        "tensors": len(numel),
        "parameters": sum(numel.values()),
        "size_on_disk_bytes": disk,
        "stored_tensor_bytes": sum(ckpt.nbytes(n) for n in numel),
        "f32_tensor_bytes": 4 * sum(numel.values()),
        "tie_word_embeddings": bool(ckpt.config.get("tie_word_embeddings")),
    }


def stage_f32_bytes(ckpt_path: Path, start: int, end: int, first: bool, last: bool) -> int:
    """Bytes of the float32 tensors ``trace_stage`` loads for layers [start, end) (see ovshard.frontend.trace)."""
    from ovshard.frontend.checkpoint import open_checkpoint
    from ovshard.frontend.tensors import layer_tensors

    ckpt = open_checkpoint(ckpt_path)
    spec, dims = ckpt.spec, ckpt.dims
    shapes: list[tuple[int, ...]] = []
    for i in range(start, end):
        shapes += layer_tensors(spec, dims, i).values()
    embed = (dims.vocab_size, dims.hidden_size)
    if first:
        shapes.append(embed)
    if last:
        shapes.append((dims.hidden_size,))  # final norm
        if not (first and dims.tie_word_embeddings):  # a tied lm_head in stage 0 is the same tensor
            shapes.append(embed)  # lm_head, or the embedding loaded a second time when tied
    return 4 * sum(math.prod(s) for s in shapes)


# ----------------------------------------------------------------------------------------- one compile


@dataclass
class Trace:
    """What one compile subprocess did, with times relative to its start."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rss, shared) of the tree
    lines: list[tuple[float, str]] = field(default_factory=list)  # (t, stderr line)
    forks: int = 0  # child processes of the compiler seen by the sampler


def _compiler(proc: psutil.Process, wrapped: bool) -> psutil.Process | None:
    """The compiler's own process: the Popen child, or its child when wrapped in /usr/bin/time."""
    if not wrapped:
        return proc
    try:
        kids = proc.children()
    except psutil.Error:
        return None
    return kids[0] if kids else None


def run_compile(cmd: list[str], wrapped: bool, interval: float, echo: bool,
                extra_env: dict[str, str] | None = None) -> tuple[int, float, Trace]:
    """Run ``cmd``; sample the compiler process's RSS and timestamp its output lines.

    Only the compiler process itself is sampled, not its descendants: openvino_telemetry forks the
    whole compiler (multiprocessing, fork start method) for every telemetry event it sends, and a
    fresh fork reports the parent's RSS although it shares those pages, so summing the tree would
    double-count. The forks are counted in ``Trace.forks``.
    """
    trace = Trace()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    ps = psutil.Process(proc.pid)

    def read(stream, tag: str) -> None:
        for line in stream:
            line = line.rstrip("\n")
            trace.lines.append((time.perf_counter() - start, f"{tag}{line}"))
            if echo:
                print(f"    {line}", file=sys.stderr, flush=True)

    readers = [threading.Thread(target=read, args=(proc.stderr, ""), daemon=True),
               threading.Thread(target=read, args=(proc.stdout, "stdout: "), daemon=True)]
    for r in readers:
        r.start()
    compiler, forks = None, set()
    while proc.poll() is None:
        compiler = compiler or _compiler(ps, wrapped)
        if compiler is not None:
            try:
                info = compiler.memory_info()
                trace.samples.append((time.perf_counter() - start, info.rss, getattr(info, "shared", 0)))
                forks.update(c.pid for c in compiler.children())
            except psutil.Error:
                pass
        time.sleep(interval)
    wall = time.perf_counter() - start
    for r in readers:
        r.join()
    trace.forks = len(forks)
    return proc.returncode, wall, trace


def parse_time_v(path: Path) -> dict[str, Any]:
    """The fields of GNU time -v output we report."""
    if not path.is_file():
        return {}
    text = path.read_text()
    out: dict[str, Any] = {}
    for key, pattern in (("max_rss_bytes", r"Maximum resident set size \(kbytes\): (\d+)"),
                         ("user_s", r"User time \(seconds\): ([\d.]+)"),
                         ("system_s", r"System time \(seconds\): ([\d.]+)"),
                         ("major_faults", r"Major \(requiring I/O\) page faults: (\d+)"),
                         ("minor_faults", r"Minor \(reclaiming a frame\) page faults: (\d+)")):
        m = re.search(pattern, text)
        if m:
            value = float(m.group(1))
            out[key] = int(value * 1024) if key == "max_rss_bytes" else value
    return out


def phases(trace: Trace, wall: float) -> list[dict[str, Any]]:
    """Cut the run into phases by its log lines; each phase gets its duration and peak tree RSS.

    A pass's log line comes when it ends and carries its seconds, so it starts at (line time - seconds);
    the trace of stage i runs from its "tracing" line to the start of its first pass, saving (IR + sha256)
    from its last pass to its "compiled in" line.
    """
    bounds: list[tuple[str, int | None, float, float]] = []  # (name, stage, start, end)
    cursor, stage_open = 0.0, None
    for t, line in trace.lines:
        if RE_PLAN.search(line) and cursor == 0.0:
            bounds.append(("startup (imports, open, plan)", None, 0.0, t))
            cursor = t
        elif m := RE_TRACE.search(line):
            if cursor < t:
                bounds.append(("between stages", None, cursor, t))
            stage_open, cursor = int(m.group(1)), t
        elif m := RE_PASS.search(line):
            begin = max(cursor, t - float(m.group(4)))
            if not any(b[0] == "trace" and b[1] == stage_open for b in bounds):
                bounds.append(("trace", stage_open, cursor, begin))
            bounds.append((m.group(2), int(m.group(1)), begin, t))
            cursor = t
        elif m := RE_DONE.search(line):
            bounds.append(("save IR + sha256", int(m.group(1)), cursor, t))
            cursor, stage_open = t, None
    bounds.append(("finish (manifest, publish, exit)", None, cursor, wall))
    out = []
    for name, stage, a, b in bounds:
        inside = [s for s in trace.samples if a <= s[0] <= b]
        peak = max(inside, key=lambda s: s[1]) if inside else None
        out.append({"phase": name, "stage": stage, "start_s": round(a, 2), "seconds": round(b - a, 2),
                    "peak_rss_bytes": peak[1] if peak else None,
                    "peak_shared_bytes": peak[2] if peak else None,
                    "rss_at_end_bytes": inside[-1][1] if inside else None})
    return out


def measure(n: int, args: argparse.Namespace, ckpt: dict[str, Any]) -> dict[str, Any]:
    bundle = args.work / f"bundle-{n}st"
    if bundle.exists():
        shutil.rmtree(bundle)
    ovshard = Path(sys.executable).with_name("ovshard")
    base = [str(ovshard)] if ovshard.exists() else [sys.executable, "-m", "ovshard.cli"]
    cmd = [*base, "compile", ckpt["path"], "--stages", str(n), "-o", str(bundle)]
    time_file = args.work / f"time-{n}st.txt"
    time_file.unlink(missing_ok=True)
    wrapped = TIME_BIN.exists() and not args.no_time
    full = [str(TIME_BIN), "-v", "-o", str(time_file), *cmd] if wrapped else cmd
    print(f"\n$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    extra_env = {"CI": "true"} if args.no_telemetry else {}
    rc, wall, trace = run_compile(full, wrapped, args.interval, args.echo, extra_env)
    timev = parse_time_v(time_file)
    sampled_peak = max((s[1] for s in trace.samples), default=0)
    result: dict[str, Any] = {
        "stages": n,
        "command": cmd,
        "extra_env": extra_env,
        "returncode": rc,
        "wall_s": round(wall, 2),
        "peak_rss_bytes": timev.get("max_rss_bytes", sampled_peak),
        "peak_rss_source": "/usr/bin/time -v (ru_maxrss)" if "max_rss_bytes" in timev else "psutil samples",
        "sampled_peak_rss_bytes": sampled_peak,
        "time_v": timev,
        "forks_seen": trace.forks,
        "phases": phases(trace, wall),
        "log": [f"{t:8.2f}  {line}" for t, line in trace.lines],
        "rss_timeline": [[round(t, 2), rss // MiB] for t, rss, _ in trace.samples],  # seconds, MiB
    }
    print(f"  exit {rc}, {wall:.0f} s, peak RSS {result['peak_rss_bytes'] / GB:.2f} GB", file=sys.stderr)
    if rc != 0:
        result["stderr_tail"] = [line for _, line in trace.lines[-30:]]
        shutil.rmtree(bundle, ignore_errors=True)
        return result
    manifest = read_manifest(bundle)
    stage_rows = []
    for plan_stage, entry in zip(manifest.plan.stages, manifest.stages, strict=True):
        i, (a, b) = entry.index, entry.layers
        passes = {r.name: r.seconds for r in manifest.pass_log if r.stage == i}
        ph = {p["phase"]: p for p in result["phases"] if p["stage"] == i}
        stage_rows.append({
            "index": i,
            "layers": [a, b],
            "f32_weight_bytes": stage_f32_bytes(Path(ckpt["path"]), a, b, i == 0, i == n - 1),
            "planned_weight_bytes": plan_stage.weight_bytes,  # after int4_asym, the planner's estimate
            "xml_bytes": (bundle / entry.model_xml).stat().st_size,
            "bin_bytes": (bundle / entry.model_bin).stat().st_size,
            "trace_s": ph.get("trace", {}).get("seconds"),
            "pass_s": passes,
            "save_s": ph.get("save IR + sha256", {}).get("seconds"),
            "peak_rss_bytes": max((p["peak_rss_bytes"] or 0 for p in ph.values()), default=None),
            "rss_after_bytes": ph.get("save IR + sha256", {}).get("rss_at_end_bytes"),  # once the stage is freed
        })
    result["stage_table"] = stage_rows
    result["weights"] = schema.encode(manifest.weights)
    result["bundle_bytes"] = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    if args.keep_bundles:
        result["bundle"] = str(bundle)
    else:
        shutil.rmtree(bundle)
    return result


# ----------------------------------------------------------------------------------------- report


def gb(n: int | float | None) -> str:
    return "-" if n is None else f"{n / GB:.2f} GB"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(x.rjust(w) if c else x.ljust(w) for c, (x, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def report(results: dict[str, Any]) -> str:
    ck = results["checkpoint"]
    whole = ck["f32_tensor_bytes"]
    out = [f"checkpoint: {ck['path']} ({ck['shape']}, {ck['dtype']}, {ck['parameters'] / 1e9:.3f} B parameters)",
           f"  on disk {gb(ck['size_on_disk_bytes'])}; tensors as stored {gb(ck['stored_tensor_bytes'])}, "
           f"as float32 {gb(whole)}", ""]
    rows = [["stages", "wall", "user", "sys", "peak RSS", "peak/largest stage f32", "largest stage f32",
             "whole model f32", "peak/whole", "forks"]]
    for r in results["runs"]:
        if r["returncode"] != 0:
            rows.append([str(r["stages"]), f"{r['wall_s']:.0f} s", "-", "-", gb(r["peak_rss_bytes"]),
                         f"FAILED rc={r['returncode']}", "-", gb(whole), "-", "-"])
            continue
        largest = max(s["f32_weight_bytes"] for s in r["stage_table"])
        tv = r["time_v"]
        rows.append([str(r["stages"]), f"{r['wall_s']:.0f} s", f"{tv.get('user_s', 0):.0f} s",
                     f"{tv.get('system_s', 0):.0f} s", gb(r["peak_rss_bytes"]),
                     f"{r['peak_rss_bytes'] / largest:.2f}x", gb(largest), gb(whole),
                     f"{r['peak_rss_bytes'] / whole:.2f}x", str(r["forks_seen"])])
    out.append(table(rows))
    for r in results["runs"]:
        if r["returncode"] != 0:
            continue
        names = list(dict.fromkeys(p for s in r["stage_table"] for p in s["pass_s"]))
        out += ["", f"{r['stages']} stage(s): per stage, seconds (manifest pass_log; trace/save from log times)"]
        rows = [["stage", "layers", "f32 weights", ".bin", "peak RSS", "RSS after", "trace",
                 *(p.removesuffix("Pass") for p in names), "save", "total"]]
        for s in r["stage_table"]:
            secs = [s["trace_s"] or 0.0, *(s["pass_s"].get(p, 0.0) for p in names), s["save_s"] or 0.0]
            rows.append([str(s["index"]), f"[{s['layers'][0]}, {s['layers'][1]})", gb(s["f32_weight_bytes"]),
                         gb(s["bin_bytes"]), gb(s["peak_rss_bytes"]), gb(s["rss_after_bytes"]),
                         *(f"{x:.1f}" for x in secs),
                         f"{sum(secs):.1f}"])
        out.append(table(rows))
        startup = next((p for p in r["phases"] if p["phase"].startswith("startup")), None)
        if startup:
            out.append(f"  startup (imports, open, plan): {startup['seconds']:.1f} s, "
                       f"peak {gb(startup['peak_rss_bytes'])}")
    return "\n".join(out)


def versions() -> dict[str, str]:
    found = {}
    for dist in ("openvino", "nncf", "torch", "transformers", "safetensors", "numpy"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    if "--sweep" in sys.argv[1:]:  # the layers-per-stage sweep of anonymous memory: its own options
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from compile_memory_sweep import main as sweep

        sys.exit(sweep([a for a in sys.argv[1:] if a != "--sweep"]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ovshard-bench"),
                        help="checkpoint and bundles go here (default /tmp/ovshard-bench)")
    parser.add_argument("--stages", default="2,4", help="comma-separated stage counts (default 2,4)")
    parser.add_argument("--monolithic", action="store_true", help="also compile with --stages 1 for comparison")
    parser.add_argument("--shape", default="llama-3.2-1b", help="ovshard.tools.synth.SHAPES preset")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--interval", type=float, default=0.1, help="RSS sampling period in seconds")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--keep-bundles", action="store_true", help="do not delete the bundles after measuring")
    parser.add_argument("--no-time", action="store_true", help="do not wrap in /usr/bin/time -v")
    parser.add_argument("--no-telemetry", action="store_true",
                        help="run the compiler with CI=true, which turns off openvino_telemetry in OVC and NNCF "
                        "(it forks the compiler once per event); default: the environment as it is")
    parser.add_argument("--echo", action="store_true", help="echo the compiler's log lines as they come")
    args = parser.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)

    counts = [int(s) for s in args.stages.split(",") if s.strip()]
    if args.monolithic and 1 not in counts:
        counts.append(1)
    ckpt = ensure_checkpoint(args.work / f"ckpt-{args.shape}-{args.dtype}", args.shape, args.dtype)
    results: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
                    "platform": platform.platform(), "python": platform.python_version(), "versions": versions()},
        "checkpoint": ckpt,
        "no_telemetry": args.no_telemetry,
        "runs": [],
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    for n in counts:
        results["runs"].append(measure(n, args, ckpt))
        args.results.write_text(json.dumps(results, indent=1) + "\n")  # keep partial results
    text = report(results)
    results["report"] = text.splitlines()
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    print(f"\nresults: {args.results}")


if __name__ == "__main__":
    main()
