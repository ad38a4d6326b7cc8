"""Anonymous and resident memory of another process and its descendants, read from /proc (Linux).

The gate for compile memory is *anonymous* memory: ``RssAnon`` of ``/proc/<pid>/status``, the heap and
other private pages a process cannot give back without swap. Weights read back through ``mmap`` (the
checkpoint's safetensors, the streamed compile's saved pieces) count as ``RssFile``: the kernel may drop
and re-read them, so they bound nothing. Plain ``VmRSS`` (= RssAnon + RssFile + RssShmem) is reported
beside it.

A tree's figure is the sum over the process and all its descendants (found by scanning ``/proc/*/stat``
for parent ids; this kernel has no ``/proc/<pid>/task/<tid>/children``). A fresh ``fork`` shares its
parent's pages copy-on-write but reports them again, so a tree with forks of the compiler in it is
counted high: :class:`Peak` counts the descendants it saw, and the benchmark turns openvino_telemetry
(which forks the compiler for each event) off with ``CI=true``.

``ovshard.memory`` samples the compiling process itself (the figures ``ovshard compile`` prints); this
module watches a compiler from outside, its whole process tree, with the same ``/proc`` parsing
(``ovshard.memory.read_status``) and no other dependency. Used by ``bench/compile_memory.py --sweep``
and ``tests/compiler/test_compile_memory.py``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ovshard.memory import read_status  # the compiler's own sampler reads /proc/self/status the same way

PROC = Path("/proc")


@dataclass(frozen=True)
class Usage:
    """Memory of one process, or summed over a tree, in bytes."""

    anon: int = 0  # RssAnon
    rss: int = 0  # VmRSS
    processes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.anon + other.anon, self.rss + other.rss, self.processes + other.processes)


def process_usage(pid: int) -> Usage:
    """RssAnon and VmRSS of ``pid`` (parsed by ovshard.memory); zero once it has exited or is a zombie."""
    found = read_status(PROC / str(pid) / "status")
    if "anon" not in found or "rss" not in found:
        return Usage()
    return Usage(found["anon"], found["rss"], 1)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    out = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, their children ...), not ``pid`` itself."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, stack = [], list(children.get(pid, []))
    while stack:
        p = stack.pop()
        found.append(p)
        stack += children.get(p, [])
    return found


def tree_usage(pid: int) -> tuple[Usage, list[int]]:
    """Memory of ``pid`` plus all its descendants, and the descendants' pids."""
    kids = descendants(pid)
    total = process_usage(pid)
    for k in kids:
        total = total + process_usage(k)
    return total, kids


@dataclass
class Peak:
    """Samples the memory of a process tree on a thread until :meth:`stop`; keeps peaks and a timeline.

    ``peak_anon`` and ``peak_rss`` are maxima of the tree sums, each over its own sample (they need not
    peak at the same moment). ``timeline`` holds (seconds since start, anon, rss) of every sample.
    """

    pid: int
    interval: float = 0.1
    peak_anon: int = 0
    peak_rss: int = 0
    samples: int = 0
    descendants_seen: set[int] = field(default_factory=set)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._start = time.perf_counter()

    def sample(self) -> Usage:
        usage, kids = tree_usage(self.pid)
        self.descendants_seen.update(kids)
        if usage.processes:
            self.samples += 1
            self.peak_anon = max(self.peak_anon, usage.anon)
            self.peak_rss = max(self.peak_rss, usage.rss)
            self.timeline.append((time.perf_counter() - self._start, usage.anon, usage.rss))
        return usage

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> Peak:
        self._thread = threading.Thread(target=self._run, name=f"memprobe-{self.pid}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Peak:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo: what the system can still hand out without swapping."""
    with open(PROC / "meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")
