"""Stage files to the nodes that lack them: a chunked, resumable pull verified by sha256 against the manifest.

The node that runs ``ovshard up`` holds the bundle; a :class:`BundleSource` there (a Ray actor pinned to that
node) serves byte ranges of the files the manifest names, and nothing else (a name outside the manifest is
refused, so no path reaches beyond the bundle). A stage actor on a node without the files calls
:func:`pull` for exactly its stages' files (and the shared files only where it asks for them): each file is
written to ``<name>.part`` chunk by chunk, so a pull cut short (the actor died, the node rebooted) resumes
from the bytes already there; a finished file is checked against the manifest's sha256 before it is renamed
into place, and a mismatch starts that file over once, then fails naming the file. A file already present
with the right digest is not pulled again: the node-local cache (``$OVSHARD_CACHE_DIR`` or
``~/.cache/ovshard``, under ``bundles/<fingerprint>``) serves every later ``up`` of the same bundle.

Bytes travel as Ray task results (its object store, chunks of :data:`CHUNK_BYTES`), on Ray's own channel.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from ovshard.bundle import names
from ovshard.bundle.manifest import Manifest, bundle_fingerprint, read_manifest, sha256_file, shared_files
from ovshard.errors import BundleError

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
PART_SUFFIX = ".part"

Reader = Callable[[str, int, int], bytes]  # (file name, offset, size) -> bytes; fewer only at the file's end


def files_of(manifest: Manifest, stages: Iterable[int], shared: bool) -> dict[str, str]:
    """The files (name -> sha256) of the given stages, plus the shared ones (tokenizer, configs) if asked."""
    wanted = set(stages)
    files: dict[str, str] = {}
    for entry in manifest.stages:
        if entry.index in wanted:
            files.update(entry.sha256)
    if shared:
        files.update(shared_files(manifest))
    return files


class BundleSource:
    """Byte ranges of one bundle's files, for the nodes that pull them (a Ray actor on the bundle's node)."""

    def __init__(self, bundle: str) -> None:
        self.bundle = Path(bundle)
        manifest = read_manifest(self.bundle)
        self.names = {names.MANIFEST_FILE} | set(files_of(manifest, range(manifest.num_stages), shared=True))

    def read(self, name: str, offset: int, size: int) -> bytes:
        if name not in self.names:
            raise BundleError(f"{name!r} is not a file of bundle {self.bundle}: only the manifest's files are served")
        with open(self.bundle / name, "rb") as f:
            f.seek(offset)
            return f.read(min(size, CHUNK_BYTES))


def pull(read: Reader, files: dict[str, str], dest: Path, progress: Callable[[str, int], None] | None = None) -> int:
    """Make ``dest`` hold every file of ``files`` (name -> sha256), pulling what is missing; bytes pulled."""
    dest.mkdir(parents=True, exist_ok=True)
    pulled = 0
    for name, digest in sorted(files.items()):
        final = dest / name
        if final.is_file() and sha256_file(final) == digest:
            continue
        for attempt in (1, 2):
            pulled += _pull_file(read, name, final, progress)
            if sha256_file(final.with_name(final.name + PART_SUFFIX)) == digest:
                os.replace(final.with_name(final.name + PART_SUFFIX), final)
                log.info("pulled %s (sha256 %s... verified)", name, digest[:12])
                break
            final.with_name(final.name + PART_SUFFIX).unlink()
            if attempt == 2:
                raise BundleError(f"{name}: the pulled copy does not match the manifest's sha256 {digest[:12]}... "
                                  "twice; the source bundle's file is damaged: recompile it on the source node")
            log.warning("%s: pulled copy did not match its sha256; pulling it again from the start", name)
    return pulled


def _pull_file(read: Reader, name: str, final: Path, progress: Callable[[str, int], None] | None) -> int:
    """Append the rest of ``name`` to its ``.part`` file, from the bytes already there; bytes read."""
    part = final.with_name(final.name + PART_SUFFIX)
    offset = part.stat().st_size if part.exists() else 0
    if offset:
        log.info("%s: resuming at %d bytes", name, offset)
    got = 0
    with open(part, "ab") as f:
        while chunk := read(name, offset + got, CHUNK_BYTES):
            f.write(chunk)
            got += len(chunk)
            if progress:
                progress(name, offset + got)
        f.flush()
        os.fsync(f.fileno())
    return got


def local_copy(bundle: Path, fingerprint: str, force: bool) -> Path | None:
    """``bundle`` itself when this node holds that very bundle (same manifest) and ``force`` is off, else None."""
    if force or not (bundle / names.MANIFEST_FILE).is_file():
        return None
    return bundle if bundle_fingerprint(bundle) == fingerprint else None


__all__ = ["CHUNK_BYTES", "BundleSource", "files_of", "local_copy", "pull"]
