"""A compile forks nothing (no telemetry), runs numpy's BLAS on one thread, ends under a load of other numpy threads,
and reports a stall."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
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


# Run as a user would (no CI variable, a home of its own where OpenVINO's telemetry was never declined): once
# `import openvino` has sent its own event, count every fork of the process while it compiles.
_COUNT_FORKS = """
import os, sys, time
import openvino  # its import sends one telemetry event, from the sender's thread pool
from openvino_telemetry import Telemetry
sender = Telemetry().sender
while sender.queue_size:  # that event sent before the count starts
    time.sleep(0.05)
forks, spawns = [], []
os.register_at_fork(before=lambda: forks.append(1))
from ovshard.cli import main
import transformers  # one of its imports runs ldconfig once (ctypes.util.find_library) as it loads
spawning = {"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.exec"}  # children Python's fork hooks miss
sys.addaudithook(lambda event, args: spawns.append(args[0]) if event in spawning else None)
code = main(["-q", "compile", sys.argv[1], "-o", sys.argv[2], "--no-cache", "--stages", "2"])
print(spawns, file=sys.stderr)
print(code, len(forks), len(spawns))
"""


def test_a_compile_forks_nothing_though_telemetry_is_on(stories: Path, tmp_path: Path) -> None:
    """OpenVINO's converter and NNCF send each event from a forked child (a fork beside a numpy matmul hangs
    OpenBLAS, and copies a large compiler's page tables): stories260K's default compile, telemetry on for the
    user, forks no process and starts none (``ctypes.util.find_library`` ran ``ldconfig`` twice a fitted weight)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NNCF_CI", "NNCF_DEV")} | {"HOME": str(home)}
    done = subprocess.run([sys.executable, "-c", _COUNT_FORKS, str(stories), str(tmp_path / "bundle")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (home / "intel" / "openvino_ga_cid").is_file(), "the telemetry was never on: the test shows nothing"
    assert done.stdout.split()[-3:] == ["0", "0", "0"], (done.stdout, done.stderr[-3000:])
    assert read_manifest(tmp_path / "bundle").weights.methods  # the default compile: calibrated
