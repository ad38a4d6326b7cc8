"""Stage files pulled by a node that lacks them (runtime/cluster/distribute.py): only the stage's files, every one
verified by sha256, a cut-short pull resumed from the bytes already there, nothing outside the manifest served."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import compile_fp32

from ovshard.bundle.manifest import read_manifest, sha256_file
from ovshard.errors import BundleError
from ovshard.runtime.cluster.distribute import CHUNK_BYTES, BundleSource, files_of, pull


@pytest.fixture(scope="module")
def bundle(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_fp32(stories, tmp_path_factory.mktemp("distribute") / "b3", stages=3)


class Counting:
    """A reader over a BundleSource that counts the bytes it hands out."""

    def __init__(self, source: BundleSource) -> None:
        self.source, self.bytes = source, 0

    def __call__(self, name: str, offset: int, size: int) -> bytes:
        chunk = self.source.read(name, offset, size)
        self.bytes += len(chunk)
        return chunk


def test_a_node_receives_only_its_stage_and_verifies_it(bundle: Path, tmp_path: Path) -> None:
    """Pulling stage 1 writes exactly stage 1's files, each matching the manifest's sha256."""
    manifest = read_manifest(bundle)
    files = files_of(manifest, [1], shared=False)
    reader = Counting(BundleSource(str(bundle)))
    pulled = pull(reader, files, tmp_path / "node")
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == sorted(files)
    assert all(sha256_file(tmp_path / "node" / n) == d for n, d in files.items())
    assert pulled == reader.bytes == sum((bundle / n).stat().st_size for n in files)
    assert pull(reader, files, tmp_path / "node") == 0  # present and verified: nothing pulled again


def test_a_pull_cut_short_resumes_from_the_bytes_already_there(bundle: Path, tmp_path: Path) -> None:
    """A .part file holding the first half of a stage's weights is continued, not started over."""
    manifest = read_manifest(bundle)
    name = manifest.stages[2].model_bin
    size = (bundle / name).stat().st_size
    (tmp_path / f"{name}.part").write_bytes((bundle / name).read_bytes()[: size // 2])
    reader = Counting(BundleSource(str(bundle)))
    pull(reader, {name: manifest.stages[2].sha256[name]}, tmp_path)
    assert reader.bytes == size - size // 2
    assert sha256_file(tmp_path / name) == manifest.stages[2].sha256[name]
    assert size < CHUNK_BYTES or reader.bytes < size


def test_a_damaged_partial_file_is_pulled_again_and_verified(bundle: Path, tmp_path: Path) -> None:
    """A .part file with wrong bytes fails the sha256 check and is replaced by a whole, verified pull."""
    manifest = read_manifest(bundle)
    name = manifest.stages[0].model_xml
    (tmp_path / f"{name}.part").write_bytes(b"not the stage's graph")
    pull(BundleSource(str(bundle)).read, {name: manifest.stages[0].sha256[name]}, tmp_path)
    assert sha256_file(tmp_path / name) == manifest.stages[0].sha256[name]
    assert not (tmp_path / f"{name}.part").exists()


def test_a_source_whose_file_does_not_match_fails_naming_the_file(bundle: Path, tmp_path: Path) -> None:
    """When the source's bytes never match the manifest, the pull stops with an error naming the file."""
    manifest = read_manifest(bundle)
    name = manifest.stages[0].model_xml
    with pytest.raises(BundleError, match=f"{name}: the pulled copy does not match"):
        pull(lambda n, offset, size: b"" if offset else b"garbage", {name: manifest.stages[0].sha256[name]}, tmp_path)
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("name", ["../secret", "/etc/passwd", "stage_0.xml.part"])
def test_the_source_serves_only_the_manifests_files(bundle: Path, name: str) -> None:
    """A name outside the manifest (a path out of the bundle, a stray file) is refused."""
    with pytest.raises(BundleError, match="only the manifest's files are served"):
        BundleSource(str(bundle)).read(name, 0, 10)
