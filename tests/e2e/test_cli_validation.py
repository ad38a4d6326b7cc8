"""Bad command-line values are refused up front, and `ovshard run --local` takes its workers with it.

Every refusal runs the real CLI in a subprocess and checks exit code 2, an error on stderr that names the
option, and no traceback. One stories260K bundle of two stages (fp32), compiled once, serves the runtime
tests; the compile refusals come before any work, so they need no bundle.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import compile_fp32

from ovshard.bundle.manifest import read_manifest
from ovshard.bundle.weights import WeightFormat
from ovshard.errors import ConfigError, OvshardError
from ovshard.plan.costs import bytes_per_weight
from ovshard.runtime.client.launch import LocalWorkers, WorkerProcess, serve_command
from ovshard.runtime.client.text import Text, encode_prompts

pytestmark = pytest.mark.e2e


OVSHARD = [sys.executable, "-m", "ovshard.cli"]
NOWHERE = "127.0.0.1:1,127.0.0.1:2"  # generate refuses its prompt before it connects to any stage
EXIT_S = 30.0  # how long workers may take to go once their launcher is killed


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("validation") / "b2", stages=2)


@pytest.fixture(scope="module")
def bundle_without_tokenizer(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same bundle with its manifest's tokenizer entry removed: prompts are token ids."""
    copy = tmp_path_factory.mktemp("no-tokenizer") / "b2"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"] = None
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def ovshard(*argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*OVSHARD, *map(str, argv)], capture_output=True, text=True, timeout=timeout)


def assert_refused(done: subprocess.CompletedProcess[str], *expected: str) -> None:
    """Exit 2, each of ``expected`` on stderr, and no traceback."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for text in expected:
        assert text in done.stderr, done.stderr


def test_prompt_ids_that_are_not_numbers_are_refused(bundle: Path) -> None:
    """`--prompt-ids a,b` names the option and shows what token ids look like."""
    done = ovshard("generate", bundle, "--stages", NOWHERE, "--prompt-ids", "a,b")
    assert_refused(done, "--prompt-ids 'a,b': expected comma-separated token ids, e.g. 1,403,407")


def test_prompt_ids_beyond_the_vocabulary_are_refused(bundle: Path) -> None:
    """An id at or above the manifest's vocab_size (512 for stories260K) is refused with the valid range."""
    done = ovshard("generate", bundle, "--stages", NOWHERE, "--prompt-ids", "1,99999")
    assert_refused(done, "--prompt-ids '1,99999'", "token id 99999", "[0, 512)")


def test_negative_prompt_ids_are_refused(bundle: Path) -> None:
    """A negative id is refused with the valid range, not sent to the stages."""
    done = ovshard("generate", bundle, "--stages", NOWHERE, "--prompt-ids", "1,-5")
    assert_refused(done, "--prompt-ids '1,-5'", "token id -5", "[0, 512)")


def test_empty_prompt_ids_are_refused(bundle: Path) -> None:
    """`--prompt-ids ''` is an error, not a silent fall back to --prompt."""
    done = ovshard("generate", bundle, "--stages", NOWHERE, "--prompt-ids=")
    assert_refused(done, "--prompt-ids '': expected comma-separated token ids")


def test_a_prompts_file_that_is_not_utf8_is_refused(bundle: Path, tmp_path: Path) -> None:
    """A --prompts-file with a non-UTF-8 byte names the file, the byte and its offset."""
    prompts = tmp_path / "latin1.txt"
    prompts.write_bytes("Once upon a time\nun caf\u00e9\n".encode("latin-1"))
    done = ovshard("generate", bundle, "--stages", NOWHERE, "--prompts-file", prompts)
    assert_refused(done, f"--prompts-file {prompts}: not UTF-8 text (byte 0xe9 at offset 23); save it as UTF-8")


def test_run_refuses_a_prompts_file_that_is_not_utf8(bundle: Path, tmp_path: Path) -> None:
    """`ovshard run --local` refuses the same file the same way (after starting its workers, which it stops)."""
    prompts = tmp_path / "binary.txt"
    prompts.write_bytes(b"\xff\xfe1,2\n")
    done = ovshard("run", "--local", bundle, "--prompts-file", prompts)
    assert_refused(done, f"--prompts-file {prompts}: not UTF-8 text (byte 0xff at offset 0)")


def test_token_ids_in_a_prompts_file_are_checked_against_the_vocabulary(bundle_without_tokenizer: Path,
                                                                        tmp_path: Path) -> None:
    """Without a tokenizer, a --prompts-file line with an id beyond vocab_size is refused, naming file and prompt."""
    prompts = tmp_path / "ids.txt"
    prompts.write_text("1,403\n1,99999\n")
    done = ovshard("generate", bundle_without_tokenizer, "--stages", NOWHERE, "--prompts-file", prompts)
    assert_refused(done, f"--prompts-file {prompts}, prompt 2 '1,99999': token id 99999", "[0, 512)")


def test_prompts_file_id_errors_name_the_file_and_the_prompt(bundle_without_tokenizer: Path) -> None:
    """encode_prompts says which file and which prompt (counting non-empty lines from 1) holds the bad ids."""
    text = Text(bundle_without_tokenizer, read_manifest(bundle_without_tokenizer))
    assert encode_prompts(text, ["1,403", "7"], Path("p.txt")) == [[1, 403], [7]]
    with pytest.raises(OvshardError, match=r"--prompts-file p\.txt, prompt 2 '1,x': expected comma-separated"):
        encode_prompts(text, ["1,403", "1,x"], Path("p.txt"))


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("--group-size", "0", "--group-size 0: expected a positive INT4 group size"),
    ("--stages", "0", "--stages 0: expected a number of stages, at least 1"),
    ("--max-positions", "0", "--max-positions 0: expected the longest context served in tokens, at least 1"),
    ("--context-tokens", "-1", "--context-tokens -1: expected the KV-cache length"),
    ("--jobs", "0", "--jobs 0: expected a number of layers compiled in parallel, at least 1"),
], ids=["group-size", "stages", "max-positions", "context-tokens", "jobs"])
def test_compile_refuses_a_count_out_of_range(stories: Path, tmp_path: Path, option: str, value: str,
                                              expected: str) -> None:
    """A compile count out of range is refused naming the option, before anything is written."""
    done = ovshard("compile", stories, "-o", tmp_path / "out", option, value)
    assert_refused(done, expected)
    assert not (tmp_path / "out").exists()


def test_per_channel_int4_is_accepted_and_costed_at_half_a_byte() -> None:
    """--group-size -1 (one scale per output channel) is valid, and the planner costs it 0.5 bytes a weight."""
    fmt = WeightFormat("int4_sym", group_size=-1)
    assert bytes_per_weight(fmt) == 0.5
    with pytest.raises(ConfigError, match="--group-size -2"):
        WeightFormat("int4_sym", group_size=-2)


def test_a_worker_stops_when_its_stdin_closes(bundle: Path, tmp_path: Path) -> None:
    """`ovshard serve --exit-with-parent` exits 0 once its stdin closes, saying why, without a traceback."""
    with (tmp_path / "stderr").open("w") as log:
        worker = WorkerProcess(serve_command(bundle, 0, exit_with_parent=True), 0, stderr=log)
        try:
            worker.wait_listening(120)
            assert worker.process.stdin is not None
            worker.process.stdin.close()
            assert worker.process.wait(timeout=EXIT_S) == 0
        finally:
            worker.stop()
    err = (tmp_path / "stderr").read_text()
    assert "parent process gone; stopping stage worker" in err and "Traceback" not in err


TGKILL = {"x86_64": 234, "aarch64": 131}  # the syscall that signals one thread of another process


def test_a_worker_stops_on_a_sigterm_the_kernel_hands_to_any_of_its_threads(bundle: Path) -> None:
    """A process's SIGTERM may land on any thread (OpenVINO's, a connection's), where Python only notes it
    for the main thread: the worker still drains and exits 0 rather than waiting, blocked in accept(), for
    a SIGKILL."""
    if platform.machine() not in TGKILL:
        pytest.skip(f"tgkill's number on {platform.machine()} is not known here")
    worker = WorkerProcess(serve_command(bundle, 0, exit_with_parent=True), 0)
    try:
        worker.wait_listening(120)
        pid = worker.process.pid
        threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        assert threads, "the worker runs more than its main thread (stdin watch, OpenVINO)"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(TGKILL[platform.machine()], pid, threads[-1], signal.SIGTERM) == 0, ctypes.get_errno()
        assert worker.process.wait(timeout=EXIT_S) == 0
    finally:
        worker.stop()


def test_stopping_local_workers_terminates_them_and_closes_their_stdin(bundle: Path) -> None:
    """LocalWorkers.stop still terminates every worker and waits for it, and closes each one's stdin."""
    workers = LocalWorkers(bundle)
    workers.start()
    workers.stop()
    # serve sets its SIGTERM handler before it reports its address: each worker drained and exited 0
    assert [w.process.returncode for w in workers.workers] == [0, 0]
    assert all(w.process.stdin is not None and w.process.stdin.closed for w in workers.workers)


def _listening_workers(run: psutil.Process, count: int, timeout: float) -> list[psutil.Process]:
    """The ``count`` child processes of ``run`` once each listens on a TCP port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = run.children()
        try:
            listening = [c for c in children if any(s.status == psutil.CONN_LISTEN for s in c.net_connections())]
        except psutil.NoSuchProcess:
            listening = []
        if len(listening) == count:
            return listening
        time.sleep(0.2)
    raise AssertionError(f"run (pid {run.pid}) did not have {count} listening workers within {timeout:.0f} s")


def test_killing_run_local_takes_its_workers_with_it(bundle: Path, tmp_path: Path) -> None:
    """SIGKILL to `ovshard run --local` (held mid-run, so it cannot finish first) ends its workers too."""
    # The run reads its --prompts-file once its workers listen; a FIFO that nobody opens for writing holds it
    # there for as long as the test needs, however fast or loaded the machine is
    prompts = tmp_path / "prompts"
    os.mkfifo(prompts)
    with (tmp_path / "stderr").open("w") as log:
        run = subprocess.Popen([*OVSHARD, "run", "--local", str(bundle), "--prompts-file", str(prompts),
                                "--speculative", "off"],
                               stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        workers: list[psutil.Process] = []
        try:
            workers = _listening_workers(psutil.Process(run.pid), 2, 600)
            assert run.poll() is None and all(w.is_running() for w in workers)
            os.kill(run.pid, signal.SIGKILL)
            run.wait(timeout=EXIT_S)
            gone, alive = psutil.wait_procs(workers, timeout=EXIT_S)
            assert not alive, f"workers {[w.pid for w in alive]} outlived the killed run"
        finally:
            for w in workers:  # leave nothing behind if the test fails
                if w.is_running():
                    w.kill()
            if run.poll() is None:
                run.kill()
    assert "parent process gone; stopping stage worker" in (tmp_path / "stderr").read_text()
