"""``ovshard compile`` under load and failure: stdout carries the summary only, stderr the progress and a
time/memory report per stage; a full disk (a real, small tmpfs) is a clear error that leaves nothing
behind; a SIGKILLed compile's partial folder is removed by the next compile, a live one's is not.

Every compile here is a real compile of stories260K. The disk-full tests mount tmpfs file systems and
so need root (CI runs as root); they skip, saying why, only where mounting is impossible.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from ovshard.bundle import names, staging
from ovshard.bundle.manifest import read_manifest
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import DiskFullError
from ovshard.passes import WeightFormat
from ovshard.verify.inspect import summary

pytestmark = pytest.mark.slow

OVSHARD = [sys.executable, "-m", "ovshard.cli"]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
SIZE = r"([\d.]+ (?:B|KiB|MiB|GiB))"


def to_bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def partials(output: Path) -> list[Path]:
    return sorted(output.parent.glob(f".{output.name}.*.partial"))


def wait_for(find: Callable[[], Path | None], process: subprocess.Popen, timeout: float = 300) -> Path:
    """Poll ``find`` until it returns a path; fail if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = find()
        if found is not None:
            return found
        if process.poll() is not None:
            pytest.fail(f"the compile exited ({process.returncode}) before it got that far")
        time.sleep(0.05)
    pytest.fail(f"nothing found within {timeout} s")


# ----- one real CLI compile with the default INT4 weights (NNCF runs) serves the stdout and report tests -----


@dataclass(frozen=True)
class CliCompile:
    output: Path
    process: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def cli_compile(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> CliCompile:
    """``ovshard compile stories260K --stages 2`` in a subprocess; no layer cache, so every piece meets NNCF."""
    output = tmp_path_factory.mktemp("cli") / "out"
    process = subprocess.run([*OVSHARD, "compile", str(stories), "--stages", "2", "--no-cache", "-o", str(output)],
                             capture_output=True, text=True, timeout=600, check=False)
    assert process.returncode == 0, process.stderr
    return CliCompile(output, process)


def test_stdout_holds_only_the_summary(cli_compile: CliCompile) -> None:
    """stdout is exactly the bundle summary; NNCF's progress bars (which it does print) went to stderr."""
    out, err = cli_compile.process.stdout, cli_compile.process.stderr
    assert out == summary(cli_compile.output, read_manifest(cli_compile.output)) + "\n"
    assert "Applying Weight Compression" in err  # NNCF ran and printed its bars, and not on stdout
    assert not re.search(r"[\r\x1b━]|Applying|ovshard:", out)


def test_report_shows_seconds_and_peak_memory_per_stage(cli_compile: CliCompile) -> None:
    """stderr ends the compile with a table: each stage's layers, seconds, peak anonymous and peak RSS."""
    err = cli_compile.process.stderr
    assert "ovshard: compile report:\n" in err, err
    table = err.split("ovshard: compile report:\n", 1)[1].splitlines()
    assert table[0].split() == ["stage", "layers", "seconds", "peak", "anon", "peak", "RSS"]
    rows = [re.fullmatch(rf"(\d+|total)\s+\[(\d+), (\d+)\)\s+([\d.]+)\s+{SIZE}\s+{SIZE}", line) for line in table[1:4]]
    assert all(rows), table
    assert [(r[1], r[2], r[3]) for r in rows if r] == [("0", "0", "3"), ("1", "3", "5"), ("total", "0", "5")]
    for r in rows:
        assert r is not None
        anon, rss = to_bytes(r[5]), to_bytes(r[6])
        assert 64 * UNITS["MiB"] < anon <= rss  # the interpreter with torch and OpenVINO holds hundreds of MiB
        assert float(r[4]) > 0


def test_progress_shows_each_layer_and_the_time_left(cli_compile: CliCompile) -> None:
    """stderr counts the layers done of the whole compile's, with seconds a layer, the time left and the peak
    memory so far, and after stage 0 tells the compile's time left."""
    err = cli_compile.process.stderr
    for stage, layer in ((0, 0), (0, 2), (1, 3), (1, 4)):
        assert re.search(rf"stage {stage}: layer {layer} done in [\d.]+ s; {layer + 1} of 5 layers, [\d.]+ s a layer, "
                         rf"about \d+ s left, peak {SIZE} resident so far\n", err), err
    assert re.search(rf"stage 0: peak memory {SIZE} anonymous, {SIZE} resident; about \d+ s left for 1 more "
                     r"stage \(2 layers\)\n", err), err


# ----- stale partial folders -----


def test_a_killed_compile_leaves_a_partial_that_the_next_compile_removes(
        stories: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 mid-compile leaves .out.*.partial; the next compile to out removes it, saying so, and publishes."""
    output = tmp_path / "out"
    process = subprocess.Popen([*OVSHARD, "compile", str(stories), "--weights", "fp32", "--no-cache", "-o",
                                str(output)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        piece = wait_for(lambda: next(tmp_path.glob(".out.*.partial/.pieces/stage0/*"), None), process)
    finally:
        process.kill()
        process.wait(timeout=60)
    stale = piece.parents[2]
    assert partials(output) == [stale] and (stale / staging.LOCK_FILE).is_file()
    with caplog.at_level(logging.INFO, logger="ovshard"):
        compile_bundle(CompileConfig(stories, output, weights=WeightFormat("fp32")))
    assert not stale.exists()
    assert f"removed {stale}" in caplog.text
    assert partials(output) == [] and (output / names.MANIFEST_FILE).is_file()
    assert not (output / staging.LOCK_FILE).exists()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from ovshard.bundle import staging
print(staging.create(Path(sys.argv[1]), 0), flush=True)
time.sleep(600)
"""


def test_a_running_compiles_partial_is_left_alone(stories: Path, tmp_path: Path) -> None:
    """A partial whose lock another live process holds survives a compile to the same name; once that
    process is dead, the next clean-up removes it."""
    output = (tmp_path / "out").resolve()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(output)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        live = Path(holder.stdout.readline().strip())
        assert partials(output) == [live]
        compile_bundle(CompileConfig(stories, output, weights=WeightFormat("fp32")))
        assert (output / names.MANIFEST_FILE).is_file()
        assert partials(output) == [live] and (live / staging.LOCK_FILE).is_file()
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert staging.remove_stale(output) == [live] and partials(output) == []


# ----- a full disk, for real: small tmpfs file systems -----


def assert_disk_full_message(message: str, output: Path, disk: Path) -> None:
    """The message names the bundle and its folder, the space needed and the space there was."""
    found = re.search(rf"while writing the bundle {re.escape(str(output))}: it needs about {SIZE} in "
                      rf"{re.escape(str(disk))}, and {SIZE} was free there at the start", message)
    assert found, message
    assert to_bytes(found[1]) > to_bytes(found[2])


# free space that runs out (with stories260K's pieces as they are today) at the first streamed weight buffer
# (an OSError from Python), while a piece is saved, and while stage 0 is saved (both RuntimeErrors from OpenVINO)
@pytest.mark.parametrize("size", ["20k", "300k", "900k"], ids=["buffer", "piece", "stage"])
def test_disk_full_mid_compile_is_a_clear_error_that_leaves_nothing(
        stories: Path, small_disk: Callable[[str], Path], size: str) -> None:
    """Compiling onto a tmpfs too small raises DiskFullError with path and sizes; no bundle or partial remains."""
    disk = small_disk(size)
    output = disk / "out"
    with pytest.raises(DiskFullError) as raised:
        compile_bundle(CompileConfig(stories, output, stages=2))
    assert_disk_full_message(str(raised.value), output, disk)
    assert list(disk.iterdir()) == []


def test_cli_disk_full_exits_1_with_one_line_and_no_traceback(
        stories: Path, small_disk: Callable[[str], Path]) -> None:
    """The CLI on a full disk: exit 1, the error as its last stderr line, empty stdout, nothing left."""
    disk = small_disk("20k")
    output = disk / "out"
    process = subprocess.run([*OVSHARD, "compile", str(stories), "--no-cache", "-o", str(output)],
                             capture_output=True, text=True, timeout=600, check=False)
    assert process.returncode == 1, process.stderr
    assert "Traceback" not in process.stderr
    last = process.stderr.splitlines()[-1]
    assert last.startswith("ovshard compile: error: no space left on the device"), process.stderr
    assert_disk_full_message(last, output, disk)
    assert process.stdout == "" and list(disk.iterdir()) == []


def test_openvino_save_model_on_a_full_disk_is_recognised(small_disk: Callable[[str], Path]) -> None:
    """OpenVINO says only RuntimeError('basic_ios::clear: iostream error') on a full disk, without errno
    or path; disk_full still recognises it, by the space left where the bundle is written."""
    disk = small_disk("64k")
    model = ov.Model([ov.opset13.constant(np.ones(1 << 16, dtype=np.float32))], [], "big")  # 256 KiB of weights
    workdir = staging.create(disk / "out", 1 << 20)
    try:
        with pytest.raises(RuntimeError, match="iostream error") as raised:
            ov.save_model(model, workdir / "m.xml", compress_to_fp16=False)
        error = staging.disk_full(raised.value, workdir, disk / "out", 1 << 20)
    finally:
        staging.discard(workdir)
    assert error is not None and "needs about 1.0 MiB" in str(error)
    assert list(disk.iterdir()) == []


def test_a_runtime_error_with_space_free_is_not_called_disk_full(tmp_path: Path) -> None:
    """Any other RuntimeError, where the disk has room, passes through as itself."""
    workdir = staging.create(tmp_path / "out", 0)
    try:
        assert staging.disk_full(RuntimeError("basic_ios::clear: iostream error"), workdir, tmp_path / "out", 0) is None
    finally:
        staging.discard(workdir)
    assert partials(tmp_path / "out") == []
