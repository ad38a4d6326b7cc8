"""A compile runs numpy's BLAS on one thread, ends under a load of other numpy threads, and reports a stall."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from ovshard import watchdog
from ovshard.bundle.manifest import read_manifest
from ovshard.compile import CompileConfig, compile_bundle


def _blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_a_compile_runs_blas_on_one_thread_and_gives_the_threads_back() -> None:
    """Inside the guard numpy's BLAS has one thread (its hand-off to a thread pool, where a compile once spun
    forever, is never taken); after it, what it had before."""
    before = _blas_threads()
    with watchdog.guarded():
        assert _blas_threads() and set(_blas_threads()) == {1}
    assert _blas_threads() == before


def test_a_silent_compile_says_where_it_is(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture) -> None:
    """No beat for longer than the stall time: a warning names the last piece done, and every thread's Python
    stack goes to stderr; the compile itself goes on."""
    with caplog.at_level(logging.WARNING, logger="ovshard.watchdog"), watchdog.guarded(stall_s=0.4):
        watchdog.beat("stage 0: layer 3 compiled")
        deadline = time.monotonic() + 60  # the watchdog wakes every 0.1 s; a loaded machine may be slow to run it
        while not any("no progress for" in m for m in caplog.messages) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert any("no progress for" in m and "stage 0: layer 3 compiled" in m for m in caplog.messages), caplog.messages
    err = capfd.readouterr().err
    assert "test_a_silent_compile_says_where_it_is" in err and "Thread" in err, err[-2000:]


def test_a_silence_is_reported_when_it_reaches_the_stall_time_then_every_stall_time() -> None:
    """Shorter silences are never reported; a long one at the stall time, then once per stall time more."""
    assert not watchdog.due(quiet=9.9, reported=0.0, stall_s=10.0)
    assert watchdog.due(quiet=10.0, reported=0.0, stall_s=10.0)
    assert not watchdog.due(quiet=19.0, reported=10.0, stall_s=10.0)
    assert watchdog.due(quiet=20.5, reported=10.0, stall_s=10.0)


def test_the_default_compile_ends_under_a_load_of_numpy_threads(stories: Path, tmp_path: Path) -> None:
    """stories260K's default compile (calibrated: the scale fit in torch) finishes while two other
    threads of the process multiply matrices in numpy without pause (bounded time; no assertion on speed)."""
    stop, errors = threading.Event(), []

    def load() -> None:
        a = np.random.default_rng(0).standard_normal((256, 256))
        while not stop.is_set():
            a = np.tanh(a @ a)

    def compile_it() -> None:
        try:
            compile_bundle(CompileConfig(stories, tmp_path / "bundle", stages=2, cache_dir=None))
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(e)

    loaders = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    worker = threading.Thread(target=compile_it, daemon=True)
    for t in [*loaders, worker]:
        t.start()
    worker.join(timeout=900)
    stop.set()
    assert not worker.is_alive(), "the compile did not end within 15 minutes under load"
    assert not errors, errors
    assert read_manifest(tmp_path / "bundle").weights.methods  # it calibrated, as the default does
