"""paper.py's phases that choose a node's CPU settings and say where its step goes: kernels, settings, profile.

kernels   bench/cpu_kernels/fc_kernels.py at the shapes' widths and the thread counts measured (its JSON kept in paper.json);
settings  each candidate set of CPU plugin properties compiled beside the others in this process on a one-stage
          bundle, decode steps interleaved in rounds (the order rotating), per thread count; the fastest at the
          table's node threads becomes this CPU class's hints in every bundle of the run;
profile   bench/op_profile.py on each one-stage bundle (decode; the largest shape's 512-token prompt too).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
WIDTHS = {"llama-3.2-1b": "2048x8192", "llama-3.1-8b": "4096x14336", "llama-3.1-70b": "8192x28672"}
CANDIDATES = {  # label -> CPU plugin properties over the bundle's general hints
    "plugin precision (bf16 here)": {},
    "f32 + dynamic quantization 32": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "32"},
    "f32 + dynamic quantization 128": {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
}


def log(message: str) -> None:
    print(f"[paper {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def kernels(work: Path, shapes: list[str], threads: list[int]) -> dict[str, Any]:
    widths = ",".join(WIDTHS[s] for s in shapes if s in WIDTHS)
    out = work / "kernels"
    subprocess.run([sys.executable, str(BENCH / "fc_kernels.py"), "--shapes", widths, "--threads",
                    ",".join(map(str, threads)), "--formats", "i4:128,i4:-1,u4:128,u8:-1", "--settings",
                    "bf16,f32dq32,f32dq128", "--mb", "384", "--repeats", "6", "--out", str(out)], check=True)
    return json.loads((out / "fc_kernels.json").read_text())


def _decode_ms(stage: Any, vocab: int, steps: int) -> float:
    import numpy as np

    from ovshard.runtime.engine.paged import PagedRows

    blocks = list(range(8))
    stage.run([PagedRows(np.arange(16, dtype=np.int64) % vocab, 0, blocks, 1)])
    start = time.perf_counter()
    for i in range(steps):
        stage.run([PagedRows(np.array([7], np.int64), 16 + i, blocks, 1)])
    return 1e3 * (time.perf_counter() - start) / steps


def settings(bundle: Path, threads: list[int], rounds: int, steps: int) -> list[dict[str, Any]]:
    """ms a decode step of each candidate at each thread count, A/B interleaved in one process."""
    import openvino as ov

    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.engine.paged import compile_paged

    manifest = read_manifest(bundle)
    core, rows = ov.Core(), []
    for t in threads:
        stages = {label: compile_paged(core, bundle, manifest, 0, config={**props, "INFERENCE_NUM_THREADS": str(t)},
                                       num_blocks=8, slice_logits=True) for label, props in CANDIDATES.items()}
        samples: dict[str, list[float]] = {label: [] for label in stages}
        labels = list(stages)
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                samples[label].append(_decode_ms(stages[label], manifest.architecture.vocab_size, steps))
        base = samples[labels[0]]
        for label, values in samples.items():
            rows.append({"bundle": bundle.name, "threads": t, "setting": label, "ms a step": round(
                statistics.median(values), 3), "vs plugin precision": round(statistics.median(
                    b / v for b, v in zip(base, values, strict=True)), 3), "properties": CANDIDATES[label]})
            log(f"settings: {bundle.name} {t} threads {label}: {rows[-1]['ms a step']} ms")
        del stages
    return rows


def choose(rows: list[dict[str, Any]], threads: int) -> tuple[str, dict[str, str]]:
    """The candidate fastest at ``threads`` over every bundle measured (the sum of their medians)."""
    totals: dict[str, float] = {}
    for row in rows:
        if row["threads"] == threads:
            totals[row["setting"]] = totals.get(row["setting"], 0.0) + row["ms a step"]
    best = min(totals, key=totals.__getitem__)
    return best, CANDIDATES[best]


def write_hints(bundles: list[Path], properties: dict[str, str], measured: str) -> str:
    """This CPU's class gets ``properties`` in every bundle's hints; returns the class."""
    from ovshard.bundle.manifest import read_manifest
    from ovshard.runtime.engine.cpu import isa_class

    isa = isa_class()
    for bundle in bundles:
        m = read_manifest(bundle)
        hints = dataclasses.replace(m.runtime_hints,
                                    cpu_plugin_by_isa={**m.runtime_hints.cpu_plugin_by_isa, isa: dict(properties)},
                                    cpu_plugin_by_isa_measured={**m.runtime_hints.cpu_plugin_by_isa_measured,
                                                                isa: measured})
        (bundle / "manifest.json").write_text(dataclasses.replace(m, runtime_hints=hints).to_json())
    return isa


def profile(work: Path, bundle: Path, threads: int, prefill: int = 0) -> dict[str, Any]:
    name = f"profile-{bundle.name}-t{threads}" + (f"-prefill{prefill}" if prefill else "")
    command = [sys.executable, str(BENCH / "op_profile.py"), str(bundle), "--threads", str(threads), "--out",
               str(work / "profiles"), "--name", name, "--context", "64" if not prefill else "0"]
    if prefill:
        command += ["--prefill", str(prefill)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((work / "profiles" / f"{name}.json").read_text())
