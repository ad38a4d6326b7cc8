"""Stage workers as local processes: one ``ovshard serve`` per stage on loopback, each on a port it picks.

A worker started with ``--listen HOST:0`` binds a free port, then writes one JSON line on stdout,
``{"event": "listening", "stage": S, "address": "HOST:PORT"}`` (:func:`listening_line`). The launcher
reads that line to learn the address, so no port is chosen before it is bound and no other process
can take it in between. ``ovshard run --local``, the demo and the benchmarks start workers this way.

Each worker's stdin is a pipe only the launcher holds. Started with ``--exit-with-parent``, the worker
watches it (:func:`exit_with_parent`): when the launcher dies, even by SIGKILL, the kernel closes the
pipe, the worker reads end-of-file and stops, so no worker outlives the launcher.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO

from ovshard.bundle.manifest import read_manifest
from ovshard.errors import OvshardError

log = logging.getLogger(__name__)

LISTENING = "listening"
STOP_WAIT_S = 30.0  # how long a terminated worker may take to exit before it is killed
EXIT_GRACE_S = 5.0  # how long a worker whose launcher died may take to stop before it exits at once


def listening_line(stage: int, address: str) -> str:
    """The line a worker writes on stdout once it listens (one JSON object)."""
    return json.dumps({"event": LISTENING, "stage": stage, "address": address})


def read_listening(line: str, stage: int) -> str | None:
    """The address in stage ``stage``'s listening line; None for any other line."""
    try:
        report = json.loads(line)
    except ValueError:
        return None
    if type(report) is not dict or report.get("event") != LISTENING or report.get("stage") != stage:
        return None
    address = report.get("address")
    return address if isinstance(address, str) else None


def serve_command(bundle: Path, stage: int, listen: str = "127.0.0.1:0", options: Sequence[str] = (),
                  exit_with_parent: bool = False) -> list[str]:
    """``ovshard -q serve BUNDLE --stage S --listen ADDRESS [options]`` with this interpreter.

    ``exit_with_parent`` adds ``--exit-with-parent``: only for a :class:`WorkerProcess`, whose stdin pipe
    the worker then watches (with an inherited stdin it would stop as soon as that reads end-of-file).
    """
    return [sys.executable, "-m", "ovshard.cli", "-q", "serve", str(bundle), "--stage", str(stage),
            "--listen", listen, *options, *(["--exit-with-parent"] if exit_with_parent else [])]


def exit_with_parent(stop: Callable[[], None], grace_s: float = EXIT_GRACE_S) -> None:
    """In a worker: call ``stop`` once stdin reaches end-of-file, i.e. the launcher closed it or died.

    A daemon thread reads stdin (its file descriptor) to its end; then ``stop()``, and if the process is still alive
    ``grace_s`` seconds later (``stop`` could not end its main loop), ``os._exit(0)``.
    """
    threading.Thread(target=_watch_stdin, args=(stop, grace_s), name="exit-with-parent", daemon=True).start()


def _watch_stdin(stop: Callable[[], None], grace_s: float) -> None:
    """The body of :func:`exit_with_parent`'s thread."""
    # the file descriptor, not sys.stdin.buffer: a thread blocked in a buffered read holds the buffer's lock,
    # and the interpreter, flushing sys.stdin at exit, aborts on it ("could not acquire lock ... <stdin>")
    try:
        fd = sys.stdin.fileno() if sys.stdin is not None else -1  # None: fd 0 was closed before we started
        while fd >= 0 and os.read(fd, 4096):
            pass  # the launcher never writes; anything it did is ignored
    except (OSError, ValueError):
        pass  # a broken or closed stdin means the same: nobody holds our end any more
    log.warning("parent process gone; stopping stage worker")
    try:
        stop()
    except Exception as e:  # exiting is what matters now; say why the clean way failed
        log.warning("stopping the stage worker failed (%s); exiting", e)
        os._exit(1)
    time.sleep(grace_s)
    log.warning("the stage worker did not stop within %.0f s of its parent going; exiting", grace_s)
    os._exit(0)


class WorkerProcess:
    """One ``ovshard serve`` child process, and the address it reports once it listens.

    Its stdout is read to the end by a thread of its own (the listening line, then nothing); its
    stderr goes where ``stderr`` says (default: this process's stderr). Its stdin is a pipe nobody
    writes to and only this process holds: a worker started with ``--exit-with-parent`` stops when it
    closes, which :meth:`stop` does, and which the kernel does when this process dies.
    """

    def __init__(self, command: Sequence[str], stage: int, stderr: IO[str] | int | None = None) -> None:
        self.stage = stage
        self.process = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=stderr, text=True)
        self.address: str | None = None
        self._reported = threading.Event()  # set on the listening line or at the end of stdout
        self._terminated = False
        stdout = self.process.stdout
        if stdout is not None:  # always: stdout is a pipe
            threading.Thread(target=self._watch, args=(stdout,), name=f"stage-{stage}-stdout", daemon=True).start()

    def _watch(self, stdout: IO[str]) -> None:
        for line in stdout:
            address = read_listening(line, self.stage)
            if address is not None and self.address is None:
                self.address = address
                self._reported.set()
            else:
                log.debug("stage %d worker: %s", self.stage, line.rstrip())
        self._reported.set()  # stdout closed: the worker exited (or will) without reporting

    def wait_listening(self, timeout: float) -> str:
        """The address the worker listens on; OvshardError if it exits first or says nothing in time."""
        if not self._reported.wait(timeout):
            raise OvshardError(f"the worker for stage {self.stage} (pid {self.process.pid}) did not report a "
                               f"listening address within {timeout:.0f} s; see its log on stderr")
        if self.address is None:
            try:
                code: int | str = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = "none (it closed its stdout)"
            raise OvshardError(f"the worker for stage {self.stage} exited before it listened (exit code {code}); "
                               "its error is on stderr")
        return self.address

    def terminate(self) -> None:
        """Send SIGTERM once. A second one could reach the worker while Python exits, when its handler is
        already reset to the default, and kill it mid-exit (-15 instead of 0)."""
        if not self._terminated and self.process.poll() is None:
            self.process.terminate()
            self._terminated = True

    def stop(self) -> None:
        """Terminate the worker and wait for it; kill it if it does not exit within STOP_WAIT_S. Then close
        its stdin (after the wait: closed first, a worker would log that its parent went away)."""
        self.terminate()
        try:
            self.process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("stage %d worker (pid %d) ignored SIGTERM; killing it", self.stage, self.process.pid)
            self.process.kill()
            self.process.wait()
        finally:
            if self.process.stdin is not None:
                self.process.stdin.close()


class LocalWorkers:
    """One worker process per stage of a bundle on loopback, as a context manager that stops them.

    Inside the ``with``, ``addresses[i]`` is where stage i listens and ``processes[i]`` is its process.
    """

    def __init__(self, bundle: Path, exact: bool = False, timeout: float = 120.0, threads: int | None = None,
                 kv: str = "auto", static_decode: bool = True) -> None:
        self.bundle, self.timeout = Path(bundle), timeout
        self.options = (["--exact"] if exact else []) + (["--threads", str(threads)] if threads else []) + \
            (["--kv", kv] if kv != "auto" else []) + ([] if static_decode else ["--no-static-decode"])
        self.workers: list[WorkerProcess] = []
        self.addresses: list[str] = []

    @property
    def processes(self) -> list[subprocess.Popen[str]]:
        return [worker.process for worker in self.workers]

    def start(self) -> list[str]:
        """Start every stage's worker at once, then wait for each to report its address."""
        stages = read_manifest(self.bundle).num_stages
        try:
            self.workers = [WorkerProcess(serve_command(self.bundle, i, options=self.options, exit_with_parent=True),
                                          i) for i in range(stages)]
            self.addresses = [w.wait_listening(self.timeout) for w in self.workers]  # they start side by side
        except BaseException:
            self.stop()
            raise
        return self.addresses

    def stop(self) -> None:
        for worker in self.workers:  # all at once, then each waited for
            worker.terminate()
        for worker in self.workers:
            worker.stop()

    def __enter__(self) -> LocalWorkers:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


@contextmanager
def local_workers(bundle: Path, exact: bool = False, timeout: float = 120.0,
                  threads: int | None = None, kv: str = "auto", static_decode: bool = True) -> Iterator[list[str]]:
    """One ``ovshard serve`` process per stage on loopback (``static_decode``: as ``serve`` without
    ``--no-static-decode``); yields their addresses; stops them after."""
    with LocalWorkers(bundle, exact, timeout, threads, kv, static_decode) as workers:
        yield workers.addresses
