"""The layer cache: compiled pieces of stages, stored by content, reused across splits and after a crash.

A streamed compile (``ovshard.layerwise``) compiles each piece of a stage (a decoder layer, the embedding,
the lm_head) on its own; the cache keeps each finished piece as OpenVINO IR under a key made of
everything that decides its bytes: the sha256 of its tensors as stored, the model's dimensions, the
weight format the piece gets, the layer-scoped passes, the source of the modules that build and
compress pieces, and the OpenVINO and NNCF versions. Recompiling the same checkpoint with another split
reuses every piece whose role did not change, and a compile killed halfway resumes from the pieces it
finished.

Layout: ``<root>/pieces/<key[:2]>/<key>/{piece.xml, piece.bin, entry.json}``. An entry appears by an
atomic rename of a finished folder, its files' sha256 are checked on every use (a corrupt entry is
removed and rebuilt), and a piece is built under an exclusive file lock on ``<root>/locks/<key>.lock``,
so two concurrent compiles build it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import openvino as ov

from ovshard.bundle import staging
from ovshard.bundle.manifest import sha256_file
from ovshard.bundle.places import cache_root
from ovshard.bundle.plan import format_bytes
from ovshard.errors import OvshardError

log = logging.getLogger(__name__)

ENTRY_FILE = "entry.json"
PIECE_XML = "piece.xml"
PIECE_BIN = "piece.bin"
# the modules whose code decides a piece's bytes: their source is part of every key
_KEY_MODULES = ("ovshard/frontend/stage_module.py", "ovshard/frontend/pieces.py", "ovshard/frontend/trace.py",
                "ovshard/ir/splice.py", "passes/compress_weights.py", "passes/fuse_projections.py",
                "passes/split_zero_points.py",
                "ovshard/frontend/int4_fit.py", "ovshard/frontend/calibration.py")
# the modules whose code decides a converted tokenizer's files and chat record (manifest.py: its schema)
_TOKENIZER_MODULES = ("ovshard/frontend/tokenizer.py", "ovshard/frontend/chat.py", "ovshard/bundle/manifest.py")


def default_cache_dir() -> Path:
    """The layer cache's folder: the one cache root (ovshard/bundle/places.py)."""
    return cache_root()


def _code_version(modules: tuple[str, ...] = _KEY_MODULES) -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for rel in modules:
        path = root / rel
        if not path.is_file():  # an installed (non-editable) tree: passes/ lives inside ovshard/
            path = Path(__file__).resolve().parent / rel.removeprefix("ovshard/")
        digest.update(path.read_bytes() if path.is_file() else rel.encode())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def piece_key(facts: dict) -> str:
    """The cache key of a piece: sha256 over its facts plus the code and library versions."""
    everything = {**facts, "code": _code_version(), "openvino": ov.get_version(), "nncf": _version("nncf")}
    return hashlib.sha256(json.dumps(everything, sort_keys=True).encode()).hexdigest()


def tokenizer_key(source_digest: str) -> str:
    """The cache key of a converted tokenizer: its source files' digest, the converter's versions and code."""
    facts = {"source": source_digest, "openvino_tokenizers": _version("openvino-tokenizers"),
             "transformers": _version("transformers"), "openvino": ov.get_version(),
             "code": _code_version(_TOKENIZER_MODULES)}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Cached:
    """A piece read from the cache: the model (weights memory-mapped) and the layer passes' records."""

    model: ov.Model
    records: list[dict]


class PieceCache:
    """Compiled pieces under ``root``; every method is safe with other processes using the same root."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.core = ov.Core()

    def _entry(self, key: str) -> Path:
        return self.root / "pieces" / key[:2] / key

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def files(self, key: str, into: Path, build: Callable[[Path], list[str]]) -> list[str]:
        """Files kept under ``key`` (a converted tokenizer), copied into ``into``; ``build(into)`` makes them on
        a miss, and they are kept for the next compile. Returns the file names."""
        entry = self.root / "files" / key[:2] / key
        with self._locked(f"files-{key}"):
            if (entry / ENTRY_FILE).is_file():
                names = json.loads((entry / ENTRY_FILE).read_text())["files"]
                if all((entry / n).is_file() for n in names):
                    for n in names:
                        staging.copy_file(entry / n, into / n)
                    log.info("cache: %d files from %s", len(names), entry)
                    return names
            names = build(into)
            if names:  # else nothing was made (the builder warned why): nothing to keep
                self._keep_files(entry, into, names)
            return names

    @staticmethod
    def _keep_files(entry: Path, into: Path, names: list[str]) -> None:
        """Copy ``names`` from ``into`` to a partial entry, renamed to ``entry`` when whole; removed on a failure."""
        partial = entry.with_name(entry.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir(parents=True)
            for n in names:
                staging.copy_file(into / n, partial / n)
            staging.write_text(partial / ENTRY_FILE, json.dumps({"files": names}))
            shutil.rmtree(entry, ignore_errors=True)
            partial.rename(entry)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def get(self, key: str) -> Cached | None:
        """The entry under ``key``, or None; a damaged entry is removed (and so rebuilt by the caller)."""
        entry = self._entry(key)
        meta = entry / ENTRY_FILE
        if not meta.is_file():
            return None
        try:
            info = json.loads(meta.read_text())
            for name, digest in info["sha256"].items():
                if sha256_file(entry / name) != digest:
                    raise ValueError(f"{name} does not match its sha256")
            model = self.core.read_model(entry / PIECE_XML)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            log.warning("layer cache: entry %s is damaged (%s); rebuilding it", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        return Cached(model, info.get("records", []))

    def get_or_build(self, key: str, build: Callable[[], tuple[ov.Model, list[dict]]], what: str) -> Cached:
        """The cached piece, or ``build()``'s, stored first; built once however many compiles ask at once."""
        found = self.get(key)
        if found is not None:
            log.info("layer cache: %s from %s", what, self._entry(key))
            return found
        with self._locked(key):
            found = self.get(key)  # another compile may have built it while we waited
            if found is not None:
                return found
            model, records = build()
            self._put(key, model, records, what)
        stored = self.get(key)
        if stored is None:
            raise OvshardError(f"layer cache: {what} was written to {self._entry(key)} but cannot be read back; "
                               "check the disk, or compile with --no-cache")
        return stored

    def _put(self, key: str, model: ov.Model, records: list[dict], what: str) -> None:
        final = self._entry(key)
        tmp = self.root / "tmp" / f"{key}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            staging.save_model(model, tmp / PIECE_XML)
            info = {"what": what, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "records": records,
                    "sha256": {n: sha256_file(tmp / n) for n in (PIECE_XML, PIECE_BIN)}}
            staging.write_text(tmp / ENTRY_FILE, json.dumps(info, indent=1))
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _entries(root: Path) -> list[tuple[Path, dict]]:
    found = []
    for meta in sorted((root / "pieces").glob(f"*/*/{ENTRY_FILE}")):
        try:
            found.append((meta.parent, json.loads(meta.read_text())))
        except (OSError, ValueError):
            found.append((meta.parent, {"what": "damaged entry"}))
    return found


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def format_report(root: Path) -> str:
    """What the cache at ``root`` holds: entries by kind, their size, and the total."""
    entries = _entries(root)
    if not entries:
        return f"layer cache {root}: empty"
    kinds: dict[str, list[int]] = {}
    for path, info in entries:
        kind = str(info.get("what", "?")).split(" ")[0]
        kinds.setdefault(kind, []).append(_size(path))
    lines = [f"layer cache {root}: {len(entries)} pieces, {format_bytes(sum(map(sum, kinds.values())))}"]
    lines += [f"  {kind:10s} {len(sizes):5d} pieces  {format_bytes(sum(sizes))}" for kind, sizes in sorted(kinds.items())]
    return "\n".join(lines)


def clear_cache(root: Path) -> str:
    """Remove every entry under ``root``; say how much was freed."""
    if not root.exists():
        return f"layer cache {root}: nothing to clear"
    size, count = _size(root), len(_entries(root))
    for sub in ("pieces", "tmp", "locks"):
        shutil.rmtree(root / sub, ignore_errors=True)
    return f"layer cache {root}: removed {count} pieces, {format_bytes(size)}"
