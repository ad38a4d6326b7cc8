"""Peak memory of this process over a stretch of work: anonymous memory (the heap) and resident set.

Anonymous memory (``RssAnon`` in ``/proc/self/status``) is what a compile really holds: weights read
memory-mapped from safetensors or from saved pieces are file-backed, count in the resident set
(``VmRSS``) and can be dropped by the kernel at any time. The kernel keeps no peak of ``RssAnon``, and
its peak of the resident set (``VmHWM``) never resets, so a light thread samples both every
``interval`` seconds. When the stretch set a new all-time ``VmHWM``, that exact figure replaces the
sampled resident peak. Standard library only (the benchmarks import it too); off Linux the resident
peak falls back to ``getrusage`` (the process's peak so far) and the anonymous peak is unknown.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

STATUS = Path("/proc/self/status")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 8 << 20  # the free space a heap keeps at its top before it gives it back (glibc's default 128 KiB)
_FIELDS = {"RssAnon:": "anon", "VmRSS:": "rss", "VmHWM:": "hwm"}


@dataclass(frozen=True)
class MemoryPeak:
    """The largest figures seen; ``None`` where this platform does not tell."""

    anon_bytes: int | None  # anonymous resident memory (heap, numpy/torch/OpenVINO buffers)
    rss_bytes: int | None  # whole resident set, file-backed mappings included


def available_bytes() -> int | None:
    """Memory available to new work: MemAvailable from ``/proc/meminfo``; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def read_status(path: Path = STATUS) -> dict[str, int]:
    """``anon``, ``rss`` and ``hwm`` in bytes from ``/proc/self/status``; empty where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key = _FIELDS.get(line.split(maxsplit=1)[0] if line else "")
        if key is not None:
            found[key] = int(line.split()[1]) * 1024  # the kernel writes "VmRSS:   1234 kB"
    return found


def return_freed_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc serve every allocation of ``threshold`` bytes or more by its own ``mmap`` (given back to the
    kernel when freed) for the rest of this process; False where the C library is not glibc.

    glibc starts at 128 KiB and raises the threshold to the size of each mapped block freed (up to 32 MiB), so
    a compile's layer-sized buffers soon come from the heap, whose freed space stays with the process and
    whose reuse depends on timing. Measured on ``tests/compiler/test_compile_memory.py``'s calibrated compiles (3 runs
    each): peak anon 477-555 MiB at 2 layers and 535-580 at 6 with glibc's default, 424-429 and 432-440 with
    a fixed 1 MiB threshold. Setting it turns glibc's adjustment off, and with it that of the trim threshold, left
    at 128 KiB: the INT4 scale fit's tiles (512 KiB temporaries, freed and allocated again a few hundred times a
    weight) then gave their pages back and faulted them in anew (~50,000 page faults a 1B-shaped gate weight, the fit
    1.5x slower on 2 cores: page faults of one process's threads queue on its memory map), so the heap keeps
    ``TRIM_THRESHOLD`` (8 MiB; 2 MiB still faulted) free at its top."""
    global _fixed
    if _mallopt(M_MMAP_THRESHOLD, threshold) and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        _fixed = threshold
        return True
    return False


_fixed: int | None = None  # the mmap threshold return_freed_blocks fixed, once it has


@contextmanager
def heap_below(size: int) -> Iterator[None]:
    """Inside, blocks under ``size`` bytes come from the heap even where :func:`return_freed_blocks` fixed a lower
    threshold: for work that frees and allocates such blocks many times (the scale fit's tiles), which a mapping
    each would fault in and zero anew; then the fixed threshold again. Nothing where none was fixed (glibc's own
    threshold follows the blocks freed)."""
    fixed = _fixed
    if fixed is None or size <= fixed or not _mallopt(M_MMAP_THRESHOLD, size):
        yield
        return
    try:
        yield
    finally:
        _mallopt(M_MMAP_THRESHOLD, fixed)


def _mallopt(parameter: int, value: int) -> bool:
    """glibc's ``mallopt``; False where the C library is not glibc."""
    mallopt = _libc_mallopt()
    return mallopt is not None and bool(mallopt(parameter, value))


@functools.cache
def _libc_mallopt() -> Callable[[int, int], int] | None:
    """``mallopt`` from the C library the process already has loaded (``CDLL(None)``: no search). Not
    ``ctypes.util.find_library``, which runs ``ldconfig -p`` in a child process at every call: the scale fit sets
    the threshold twice a weight, and each child, until it execs, counts a copy of the compile's memory."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return None


@contextmanager
def libraries_spared_from_gc(*modules: str) -> Iterator[None]:
    """Import ``modules``, then keep every object alive now out of the garbage collector's passes until the block
    ends (``gc.freeze``; ``gc.unfreeze`` after).

    A full ``gc.collect()`` walks every tracked object: with torch, transformers and NNCF imported that is ~400K
    objects and ~0.2 s, and a compile collects after every piece (its freed layers, NNCF's cyclic garbage): a
    quarter of a small model's compile. What was alive before the block is not the block's garbage.
    """
    for module in modules:
        importlib.import_module(module)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _peak_rusage() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


class PeakSampler:
    """``with PeakSampler() as s: work()``; then ``s.peak`` and ``s.seconds`` describe ``work``."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.seconds = 0.0
        self._anon: int | None = None
        self._rss: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ovshard-memory", daemon=True)
        self._hwm: tuple[int | None, int | None] = (None, None)  # VmHWM on entry, on exit
        self._start = 0.0

    def __enter__(self) -> PeakSampler:
        self._hwm = (read_status().get("hwm"), None)
        self._sample()
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.seconds = time.perf_counter() - self._start
        self._hwm = (self._hwm[0], read_status().get("hwm"))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        status = read_status()
        if "anon" in status:
            self._anon = max(self._anon or 0, status["anon"])
        if "rss" in status:
            self._rss = max(self._rss or 0, status["rss"])

    @property
    def peak(self) -> MemoryPeak:
        rss, (before, after) = self._rss, self._hwm
        if before is not None and after is not None and after > before:
            rss = max(rss or 0, after)  # a new all-time peak was set in this stretch: the kernel's figure is exact
        if rss is None:
            rss = _peak_rusage()
        return MemoryPeak(self._anon, rss)
