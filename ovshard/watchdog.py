"""A compile that never forks itself, cannot hang in numpy's BLAS, and says where it is when it makes no progress.

A default (calibrated) compile was once seen to stop for good: its main thread spun in OpenBLAS's
``exec_blas`` (a matmul of NNCF's scale estimation) waiting for a BLAS worker thread that slept in a futex and
never took the job. The cause: OpenVINO's converter and NNCF report each use to their telemetry, which sends
every event from a thread of its pool through a forked child of the process (``openvino_telemetry``'s GA4
backend: ``multiprocessing.Process`` on Linux), and OpenBLAS shuts its thread pool down in a ``pthread_atfork``
handler (``blas_thread_shutdown_``) whatever another thread is doing in it. A fork from one thread while
another multiplies in numpy's BLAS hangs: shown in a few seconds by a thread forking in a loop beside one
calling ``a @ a`` (gdb: the forking thread in ``blas_thread_shutdown_`` joining a BLAS worker that waits for
work, the matmul never returning). Each fork also copies the page tables of a compiler holding gigabytes:
the telemetry made a data-free compile of four 1B-shaped layers take 30 s instead of 17.

So a compile declines the telemetry for its own process (:func:`no_telemetry`; the user's own setting, the
consent file of ``opt_in_out``, is never touched), and runs numpy's BLAS on one thread (``threadpoolctl``):
its hand-off to a thread pool is then never taken, whatever else forks. One BLAS thread costs nothing
measurable: the default compile of SmolLM2-135M took 51.3 s with one and 53.5 s with two on 2 cores, with
byte-identical weights (the heavy work is OpenVINO's and torch's, on their own threads).

And whatever else might stop a compile, it is not silent: the compile beats a heartbeat at every piece it
finishes (:func:`beat`), and a watchdog thread that hears none for ``stall_s`` seconds logs what the last beat
said and the Python stack of every thread (``faulthandler``) to stderr, then again every ``stall_s`` while the
silence lasts. It never kills the compile: a layer may be slow, not stuck.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

STALL_S = 600.0  # no piece for this long: report (a calibrated 128-expert layer took 49 s on 2 cores)

class _Heart:
    """When the last beat came (time.monotonic()) and what it said."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at, self.what = time.monotonic(), "the compile started"


_heart = _Heart()


def beat(what: str) -> None:
    """The compile made progress: ``what`` is done."""
    with _heart.lock:
        _heart.at, _heart.what = time.monotonic(), what


def _silence() -> tuple[float, str]:
    with _heart.lock:
        return time.monotonic() - _heart.at, _heart.what


def due(quiet: float, reported: float, stall_s: float) -> bool:
    """Whether a silence of ``quiet`` seconds, last reported at ``reported`` seconds into it (0: not yet), is to
    be reported now: once it reaches ``stall_s``, then every ``stall_s`` more."""
    return quiet >= stall_s and quiet - reported >= stall_s


def _watch(stop: threading.Event, stall_s: float) -> None:
    reported = 0.0
    while not stop.wait(min(stall_s / 4, 30.0)):
        quiet, what = _silence()
        if quiet < stall_s:
            reported = 0.0
        elif due(quiet, reported, stall_s):
            reported = quiet
            log.warning("no progress for %.0f s since: %s; every thread's Python stack follows (the compile goes "
                        "on; report this with the stacks if it never ends)", quiet, what)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy's BLAS on one thread (threadpoolctl: a compile dependency)."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

    with threadpool_limits(limits=1, user_api="blas"):
        yield


@contextmanager
def no_telemetry() -> Iterator[None]:
    """OpenVINO's and NNCF's telemetry declined inside: their shared ``openvino_telemetry.Telemetry`` finds no
    consent whenever a tool (re)initialises it, and an instance made before has its consent taken away, so no
    event is sent and nothing forks. Afterwards the check is the library's own again."""
    try:
        from openvino_telemetry import Telemetry
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # no telemetry package: nothing to decline
        yield
        return
    check = OptInChecker.check
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
    made = getattr(Telemetry, "_SingletonMetaClass__single_instance", None)
    if made is not None:
        made.consent = False
    try:
        yield
    finally:
        OptInChecker.check = check


@contextmanager
def guarded(stall_s: float = STALL_S) -> Iterator[None]:
    """Run a compile with no telemetry, numpy's BLAS on one thread and a watchdog on its heartbeat."""
    beat("the compile started")
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(stop, stall_s), name="ovshard-watchdog", daemon=True)
    with no_telemetry(), one_blas_thread():
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
