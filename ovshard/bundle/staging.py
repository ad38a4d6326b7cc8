"""Writing a bundle atomically: a locked partial folder beside the destination, renamed into place.

A compile writes into ``.<name>.XXXXXXXX.partial`` beside ``<name>`` (the same file system, so the final
rename is atomic) and holds an exclusive ``flock`` on the ``.lock`` file inside for as long as it runs.
A compile killed by SIGKILL cannot remove its folder, but the kernel drops its lock, so the next compile
to the same ``<name>`` removes every sibling partial whose lock it can take and leaves locked ones (a
compile running now) alone. The lock file is made under another name, locked, then renamed to ``.lock``:
a ``.lock`` that can be taken always means a dead owner. A partial without ``.lock`` is being created or
published this instant (or was left by an older ovshard); it is removed once ``GRACE_SECONDS`` old.

Every file a compile writes goes through one writer here: :func:`save_model` (an OpenVINO model, its .xml
and .bin), :func:`write_bytes` / :func:`write_text` and :func:`copy_file`. Each writes under a temporary
name beside its target and renames it into place, so a target is whole or absent. A full disk looks
different by writer: Python raises OSError ENOSPC, while OpenVINO's ``save_model`` raises a RuntimeError
saying only ``basic_ios::clear: iostream error``; the writer removes what it wrote and raises
:class:`DiskFullError` naming the file, the bytes it needed and the bytes free (a RuntimeError counts as a
full disk when, with the partial files removed, less than that is free). :func:`disk_full` turns such an
error (or a raw one from elsewhere) into the compile's own: where the bundle goes, how much space it
needs, and how much there was.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ovshard.bundle import names
from ovshard.bundle.plan import PartitionPlan, format_bytes
from ovshard.errors import BundleError, DiskFullError

if TYPE_CHECKING:
    import openvino as ov

try:
    import fcntl
except ImportError:  # Windows: no flock; partials are not locked, and stale ones are not cleaned
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
GRACE_SECONDS = 600.0  # a partial without a lock file is left alone until this old
FULL_SLACK = 1 << 20  # under this much free space after a failed write, the write failed for lack of space
XML_BYTES_PER_LAYER = 128 << 10  # one decoder layer's graph text (about 100 KiB), in its piece and its stage
XML_BYTES_PER_OP = 512  # an operation's text in a saved .xml (about 440 bytes in a stage graph)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_locks: dict[Path, int] = {}  # partial folder -> descriptor of its locked .lock, while this process writes it
_free_at_start: dict[Path, int] = {}  # partial folder -> bytes free beside it when it was made


def space_needed(plan: PartitionPlan, head_dim: int, max_positions: int) -> int:
    """About the most a compile's partial bundle holds at once: every stage's weights, rotary tables and
    graph XML, plus the streamed pieces of the largest stage while it is built (its weights and XML again)."""
    rotary = 2 * max_positions * head_dim * 4  # the cos and sin tables, f32 [max_positions, head_dim]
    stages = [s.weight_bytes + rotary + XML_BYTES_PER_LAYER * len(s.stage.layers) for s in plan.stages]
    return sum(stages) + max(stages)


def check_output(output: Path) -> None:
    """Refuse an ``-o`` that is a file, or a folder of other things than a bundle (which would be replaced)."""
    if output.exists() and not output.is_dir():
        raise BundleError(f"{output} exists and is a file, not a folder; choose another -o")
    if output.exists() and not (output / names.MANIFEST_FILE).is_file() and any(output.iterdir()):
        raise BundleError(f"{output} exists and is not an ovshard bundle; choose another -o or empty it")


def create(output: Path, needed: int) -> Path:
    """A fresh partial folder beside ``output``, locked by this process; dead compiles' partials go first."""
    check_output(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(output)
    free = _free(output.parent)
    try:
        path = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    except OSError as e:
        if e.errno in _FULL_ERRNOS:
            raise _disk_full_error(output.parent, output, needed, free) from e
        raise
    _free_at_start[path] = free
    try:
        _locks[path] = _lock(path)
    except BaseException as e:
        shutil.rmtree(path, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            raise _disk_full_error(output.parent, output, needed, free) from e
        raise
    if free < needed:
        log.warning("%s has %s free, and this compile needs about %s there: it may run out of space",
                    output.parent, format_bytes(free), format_bytes(needed))
    return path


def publish(workdir: Path, output: Path) -> None:
    """Move the finished bundle into place (replacing a bundle there) and drop the lock."""
    output = output.resolve()
    workdir.chmod(0o755)  # mkdtemp made it private
    (workdir / LOCK_FILE).unlink(missing_ok=True)  # the bundle carries no lock file; the lock stays held
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{time.time_ns()}")
        output.rename(old)
    workdir.rename(output)
    _release(workdir)
    _free_at_start.pop(workdir, None)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(workdir: Path) -> None:
    """Remove a partial bundle, then drop its lock (in that order: nobody else removes it meanwhile)."""
    shutil.rmtree(workdir, ignore_errors=True)
    _release(workdir)
    _free_at_start.pop(workdir, None)


def remove_stale(output: Path) -> list[Path]:
    """Remove the partial folders of ``output`` that no live compile holds, and old bundles a killed
    publish left beside it; return what was removed."""
    if fcntl is None or not output.parent.is_dir():
        return []
    partial = re.compile(rf"\.{re.escape(output.name)}\.[a-z0-9_]{{8}}\.partial")
    old = re.compile(rf"\.{re.escape(output.name)}\.old-\d+")
    removed = []
    for entry in sorted(output.parent.iterdir()):
        if partial.fullmatch(entry.name) and entry.is_dir() and _remove_if_dead(entry):
            log.info("removed %s, the partial bundle of a compile that is no longer running", entry)
            removed.append(entry)
        elif old.fullmatch(entry.name) and entry.is_dir() and output.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            log.info("removed %s, a replaced bundle that a killed compile left", entry)
            removed.append(entry)
    return removed


def save_model(model: ov.Model, xml: Path, compress_to_fp16: bool = False) -> None:
    """``ov.save_model`` to ``xml`` and its .bin, atomically (see the module docstring); DiskFullError on a full disk."""
    import openvino as ov

    tmp_xml = xml.with_name(f".{xml.stem}.{os.getpid()}.tmp.xml")
    pairs = [(tmp_xml.with_suffix(".bin"), xml.with_suffix(".bin")), (tmp_xml, xml)]  # the .xml appears last
    with _replacing(pairs, lambda: model_bytes(model)):
        ov.save_model(model, tmp_xml, compress_to_fp16=compress_to_fp16)


def model_bytes(model: ov.Model) -> int:
    """About what ``save_model`` writes for ``model``: its constants' bytes and its graph's text."""
    ops = model.get_ordered_ops()
    return sum(op.get_byte_size() for op in ops if op.get_type_name() == "Constant") + XML_BYTES_PER_OP * len(ops)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; DiskFullError on a full disk."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _replacing([(tmp, path)], lambda: len(data)):
        tmp.write_bytes(data)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8, no newline translation) to ``path`` atomically; DiskFullError on a full disk."""
    write_bytes(path, text.encode("utf-8"))


def copy_file(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` atomically; DiskFullError on a full disk."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with _replacing([(tmp, target)], lambda: source.stat().st_size):
        shutil.copyfile(source, tmp)


def link_or_copy(source: Path, target: Path) -> bool:
    """Hard-link ``source`` as ``target``, or copy it where linking fails (another file system); True if linked."""
    try:
        os.link(source, target)
        return True
    except OSError:
        shutil.copyfile(source, target)
        return False


def place(source: Path, target: Path) -> bool:
    """``source`` as ``target``, atomically: hard-linked under a temporary name and renamed, or copied where
    linking fails (DiskFullError on a full disk); True if linked. A target that already is ``source`` stays."""
    if target.exists() and os.path.samefile(source, target):
        return True
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        copy_file(source, target)
        return False
    try:
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return True


@contextmanager
def _replacing(pairs: list[tuple[Path, Path]], needed: Callable[[], int]) -> Iterator[None]:
    """Run the body, which writes each pair's temporary file, then rename each onto its target in order.

    On any failure the temporary files are removed; a full disk (ENOSPC, or a RuntimeError with less than
    ``needed()`` bytes free once they are gone) becomes a DiskFullError naming the target."""
    try:
        yield
        for tmp, target in pairs:
            os.replace(tmp, target)
    except BaseException as e:
        for tmp, _ in pairs:
            tmp.unlink(missing_ok=True)
        full = _write_failed(e, pairs[-1][1], needed)
        if full is not None:
            raise full from e
        raise


def _write_failed(error: BaseException, target: Path, needed: Callable[[], int]) -> DiskFullError | None:
    """The DiskFullError ``error`` means for a write of ``target``, or None when it is another failure."""
    if isinstance(error, DiskFullError):
        return None  # already said (a nested writer)
    full_errno = isinstance(error, OSError) and error.errno in _FULL_ERRNOS
    if not full_errno and not isinstance(error, RuntimeError):
        return None
    try:
        size = needed()
    except Exception:  # a model in a broken state: judge by the errno alone
        size = 0
    free = _free(target.parent)
    if not full_errno and free >= max(size, 1):
        return None
    return DiskFullError(
        f"no space left on the device while writing {target}: it needs about {format_bytes(size)} there, and "
        f"{format_bytes(free)} is free; nothing of it was left behind. Free some space, or write to a larger file "
        "system", path=target)


def disk_full(error: BaseException, workdir: Path, output: Path, needed: int) -> DiskFullError | None:
    """The error to raise instead of ``error`` if it (or an error it came from) means a file system filled
    up; call it before removing ``workdir``, whose removal frees the space again."""
    where = None
    for e in _chain(error):
        if isinstance(e, DiskFullError):  # from one of the writers above
            if e.path is not None and _device(e.path) != _device(output.parent):
                return DiskFullError(str(e), e.path)  # another file system (a layer cache elsewhere): it says all
            where = e.path or workdir
            break
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            where = Path(os.fsdecode(e.filename)) if isinstance(e.filename, str | bytes) else workdir
            break
    if where is None and any(isinstance(e, RuntimeError) for e in _chain(error)) and _free(workdir) < FULL_SLACK:
        where = workdir  # a save_model outside the writers above (graph dumps): an iostream error, nothing free
    if where is None:
        return None
    return _disk_full_error(where, output, needed, _free_at_start.get(workdir, _free(workdir)))


def _disk_full_error(where: Path, output: Path, needed: int, free: int) -> DiskFullError:
    output = output.resolve()
    if _device(where) == _device(output.parent):
        return DiskFullError(
            f"no space left on the device while writing the bundle {output}: it needs about "
            f"{format_bytes(needed)} in {output.parent}, and {format_bytes(free)} was free there at the start; "
            "nothing was left behind. Free some space or choose an -o on a larger file system")
    return DiskFullError(f"no space left on the device while writing {where} ({format_bytes(_free(where))} free "
                         f"there) for the bundle {output}; nothing was left behind. Free some space there")


def _lock(folder: Path) -> int:
    """Lock a new ``.lock`` in ``folder``; it appears under its name only once locked."""
    if fcntl is None:
        return -1
    new = folder / f"{LOCK_FILE}.new"
    fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(new, folder / LOCK_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _release(workdir: Path) -> None:
    fd = _locks.pop(workdir, -1)
    if fd >= 0:
        os.close(fd)


def _remove_if_dead(folder: Path) -> bool:
    """Remove ``folder`` unless a live compile holds its lock (or it is too young to judge)."""
    assert fcntl is not None
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        try:
            young = time.time() - folder.stat().st_mtime < GRACE_SECONDS
        except FileNotFoundError:
            return False  # its owner published or removed it meanwhile
        if young:
            return False  # being created or published right now
        shutil.rmtree(folder, ignore_errors=True)
        return not folder.exists()
    except OSError as e:
        log.warning("leaving %s: cannot open its lock file (%s)", folder, e.strerror)
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("leaving %s: a compile running now holds it", folder)
            return False
        shutil.rmtree(folder, ignore_errors=True)  # removed while locked: no other cleaner races this one
        return not folder.exists()
    finally:
        os.close(fd)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def _device(path: Path) -> int:
    return _existing(path).stat().st_dev
