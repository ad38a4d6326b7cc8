"""A full disk during any write of a compile is one clear error that names the path, the space needed and
the space free, and leaves nothing half-written: the last stage's save on a real, small tmpfs (sized from a
measured compile), a layer-cache entry on a full cache disk, and each writer of ovshard.bundle.staging.

The tmpfs tests mount file systems and so need root (CI runs as root); they skip, saying why, only where
mounting is impossible.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from ovshard.bundle import names, staging
from ovshard.compile import CompileConfig, compile_bundle
from ovshard.errors import DiskFullError
from ovshard.passes import WeightFormat

OVSHARD = [sys.executable, "-m", "ovshard.cli"]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
SIZE = r"([\d.]+ (?:B|KiB|MiB|GiB))"
COMPILE = ["--stages", "2", "--weights", "fp32"]


def to_bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def used_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` occupy on their file system (whole blocks, as tmpfs counts pages)."""
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file())


@dataclass(frozen=True)
class LastSave:
    """What the partial bundle holds when the last stage is saved, and what that save adds."""

    before: int
    added: int


@pytest.fixture(scope="module")
def last_save(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> LastSave:
    """Compile stories260K (2 stages, fp32, no cache) once to a normal folder, measuring the last stage's save."""
    last = names.stage_xml(1, 2)
    seen: dict[str, LastSave] = {}
    save = staging.save_model

    def measured(model: ov.Model, xml: Path, compress_to_fp16: bool = False) -> None:
        before = used_bytes(xml.parent)
        save(model, xml, compress_to_fp16)
        seen[xml.name] = LastSave(before, used_bytes(xml.parent) - before)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staging, "save_model", measured)
        compile_bundle(CompileConfig(stories, tmp_path_factory.mktemp("measure") / "out", stages=2,
                                     weights=WeightFormat("fp32")))
    assert seen[last].added > 64 << 10, seen  # room to land inside the save
    return seen[last]


def test_cli_full_disk_at_the_last_stage_save_is_a_clear_error_and_leaves_nothing(
        stories: Path, small_disk: Callable[[str], Path], last_save: LastSave) -> None:
    """`ovshard compile` onto a tmpfs that fills during the last stage's save: exit 1, one error line naming the
    bundle's path, the space it needs and the space there was, no traceback, and no bundle or partial left."""
    disk = small_disk(f"{(last_save.before + last_save.added // 2) >> 10}k")
    output = disk / "out"
    process = subprocess.run([*OVSHARD, "compile", str(stories), *COMPILE, "--no-cache", "-o", str(output)],
                             capture_output=True, text=True, timeout=600, check=False)
    assert process.returncode == 1, process.stderr
    assert "Traceback" not in process.stderr and process.stdout == "", process.stderr
    assert "stage 0: compiled in" in process.stderr and "stage 1: compiled in" not in process.stderr, process.stderr
    last = process.stderr.splitlines()[-1]
    found = re.search(rf"^ovshard compile: error: no space left on the device while writing the bundle "
                      rf"{re.escape(str(output))}: it needs about {SIZE} in {re.escape(str(disk))}, and {SIZE} was "
                      r"free there at the start", last)
    assert found, process.stderr
    assert to_bytes(found[1]) > to_bytes(found[2])
    assert list(disk.iterdir()) == []  # no manifest, no stage file, no partial folder


def test_a_full_cache_disk_names_the_cache_and_keeps_no_half_entry(
        stories: Path, small_disk: Callable[[str], Path], tmp_path: Path) -> None:
    """A layer cache on a tmpfs too small for a piece: DiskFullError naming the cache's file, the space needed
    and free; no bundle, no partial bundle, and no half-written cache entry (only the lock files stay)."""
    cache = small_disk("64k")
    output = tmp_path / "out"
    with pytest.raises(DiskFullError) as raised:
        compile_bundle(CompileConfig(stories, output, stages=2, weights=WeightFormat("fp32"), cache_dir=cache))
    message = str(raised.value)
    found = re.search(rf"while writing {re.escape(str(cache))}/\S+: it needs about {SIZE} there, and {SIZE} is free",
                      message)
    assert found, message
    assert to_bytes(found[1]) > to_bytes(found[2])
    assert not output.exists() and list(tmp_path.glob(".out.*")) == []
    left = [p.relative_to(cache) for p in cache.rglob("*") if p.is_file()]
    assert all(p.parts[0] == "locks" for p in left), left


def _big_model() -> ov.Model:
    """A model with 256 KiB of weights."""
    return ov.Model([ov.opset13.constant(np.ones(1 << 16, dtype=np.float32))], [], "big")


@pytest.mark.parametrize("writer", ["save_model", "write_bytes", "copy_file"])
def test_each_writer_on_a_full_disk_raises_disk_full_and_leaves_no_file(
        small_disk: Callable[[str], Path], tmp_path: Path, writer: str) -> None:
    """save_model, write_bytes and copy_file into 64 KiB: DiskFullError naming the target, needed and free
    bytes; neither the target nor a temporary file remains."""
    disk = small_disk("64k")
    source = tmp_path / "source"
    source.write_bytes(os.urandom(256 << 10))
    target = disk / "m.xml"
    with pytest.raises(DiskFullError) as raised:
        if writer == "save_model":
            staging.save_model(_big_model(), target)
        elif writer == "write_bytes":
            staging.write_bytes(target, source.read_bytes())
        else:
            staging.copy_file(source, target)
    found = re.search(rf"while writing {re.escape(str(target))}: it needs about {SIZE} there, and {SIZE} is free",
                      str(raised.value))
    assert found, str(raised.value)
    assert to_bytes(found[1]) >= 256 << 10 and to_bytes(found[2]) < to_bytes(found[1])
    assert raised.value.path == target
    assert list(disk.iterdir()) == []


def test_writers_replace_their_target_whole(tmp_path: Path) -> None:
    """With room, each writer leaves exactly its target (a model: .xml and .bin), readable, and no temporary file."""
    staging.save_model(_big_model(), tmp_path / "m.xml")
    staging.write_text(tmp_path / "t.json", "{}\n")
    staging.copy_file(tmp_path / "t.json", tmp_path / "c.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "m.bin", "m.xml", "t.json"]
    assert ov.Core().read_model(tmp_path / "m.xml").get_ordered_ops()[0].get_byte_size() == 256 << 10
    assert (tmp_path / "c.json").read_text() == "{}\n"


def test_a_runtime_error_with_room_is_not_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails for another reason, with the disk free, raises that error itself; nothing is left."""
    def failing(model: ov.Model, path: Path, compress_to_fp16: bool = False) -> None:
        Path(path).write_bytes(b"partial")
        raise RuntimeError("some other OpenVINO failure")

    monkeypatch.setattr(ov, "save_model", failing)
    with pytest.raises(RuntimeError, match="some other OpenVINO failure"):
        staging.save_model(_big_model(), tmp_path / "m.xml")
    assert list(tmp_path.iterdir()) == []
