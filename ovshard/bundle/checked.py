"""Files already checked against their sha256, remembered by identity so a restart need not read them again.

A stage's weights are hundreds of MB to GB; reading them all for the sha256 check costs every start (0.44 s
of a warm 2.5 s start on the real Gemma 3 270M). After a file matched its manifest digest, a small record
keeps the file's identity: device, inode, size, modification time and inode change time (``st_ctime_ns``,
which no user call can set back: any write, ``touch`` or ``utime`` moves it). A later check whose file has
the same identity and the same expected digest trusts the record; any change reads the file again. This is
the test ``make`` and ``git status`` trust for "unchanged". It guards against what the check is for (a
corrupt copy, a file of another compile), not against someone who can write the bundle folder and could
rewrite its manifest too.

Records are one small JSON file per checked file under ``folder`` (the node's cache, ``verified/``), named
by a hash of the file's resolved path; written to a temporary name and renamed. A folder that cannot be
written only means every start reads the files again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CHECKED_FOLDER = "verified"  # the records' folder inside a node's compiled-model cache


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class CheckedFiles:
    """``known(path, digest)``: the file matched ``digest`` before and is unchanged since; ``remember`` after
    a match."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @classmethod
    def in_cache(cls, model_cache: Path | None) -> CheckedFiles | None:
        """The records kept in a node's compiled-model cache; None (read every file) without one."""
        return cls(model_cache / CHECKED_FOLDER) if model_cache is not None else None

    def _record(self, resolved: str) -> Path:
        return self.folder / f"{hashlib.sha256(resolved.encode()).hexdigest()[:32]}.json"

    def known(self, path: Path, digest: str) -> bool:
        resolved = str(path.resolve())
        try:
            record = json.loads(self._record(resolved).read_text())
            return bool(record["sha256"] == digest and record["identity"] == _identity(path)
                        and record["path"] == resolved)
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def remember(self, path: Path, digest: str) -> None:
        resolved = str(path.resolve())
        record = self._record(resolved)
        partial = record.with_name(f"{record.name}.{os.getpid()}.partial")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"path": resolved, "sha256": digest, "identity": _identity(path)}))
            partial.replace(record)
        except OSError as e:  # a read-only cache: the next start reads the file again
            log.debug("cannot record the check of %s in %s: %s", path, self.folder, e)
            partial.unlink(missing_ok=True)
