"""Writing files so that a kill or a full disk never leaves a half-written one behind.

A file rewritten in place (``path.write_text``) is first truncated, then filled: a kill in between
leaves it empty, and whatever reads it next (``--resume`` reading ``summary.json``) fails. Here the
new content goes to a temp file in the same directory, is flushed to disk (fsync) and then renamed
over the old one (``os.replace`` is atomic on POSIX): a reader sees the old file or the new one.

A write that fails for lack of space or an I/O error is reported as one `OxrlError` naming the path,
the free space and what is still intact (`write_error`), never as the library's own traceback (torch
reports a full disk as "unexpected pos ...", safetensors as "IoError(StorageFull)").
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from oxrl_core.errors import OxrlError

#: how the libraries that write checkpoints word a full disk when they do not raise OSError(ENOSPC)
_DISK_FULL_WORDS = ("no space left", "storagefull", "unexpected pos", "file write failed", "disk quota")


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (the directory entry itself is data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` all at once: readers see the old content or the new, never an empty file."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from None


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, or a library's own words for it (torch's zip writer and safetensors hide the errno)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(word in str(exc).lower() for word in _DISK_FULL_WORDS)


def free_mb(path: Path) -> float:
    """Free space (MB) on the file system holding `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return float("nan")


def write_error(
    path: Path, exc: BaseException, needed_bytes: int | None = None, intact: str = "", resume_dir: Path | None = None
) -> OxrlError:
    """One message for a failed write: disk full (with MB needed/free) or another I/O error, naming `path`.

    `intact` says what survived (e.g. "the last complete checkpoint X is intact"); `resume_dir` adds the
    command that continues the run once the cause is fixed.
    """
    after = f"; {intact}" if intact else ""
    resume = f" and resume with: oxrl run --resume -o {resume_dir}" if resume_dir is not None else ""
    if is_disk_full(exc):
        needed = f"{needed_bytes / 2**20:.0f} MB needed, " if needed_bytes else ""
        return OxrlError(
            f"disk full at {path}: {needed}{free_mb(path):.0f} MB free{after}; free space{resume or ' and try again'}"
        )
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return OxrlError(
        f"cannot write {path}: {reason}{after}; check the disk and its permissions{resume or ' and try again'}"
    )
