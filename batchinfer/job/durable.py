"""Files written so that a crash leaves the old content or the new, never a part: a
temporary file in the same folder, fsynced, renamed over the old one, the folder fsynced."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NotSynced(OSError):
    """A file was replaced, but syncing its folder failed: the new content is in place
    and seen by readers, but a crash of the machine may still undo it."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: temporary file in the same folder, fsync, rename. Raises
    NotSynced when only the last step (syncing the folder) failed; on any other failure
    `path` is as it was and the temporary file is gone."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    write_durably(tmp, lambda f: f.write(data))
    try:
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    try:
        fsync_dir(path.parent)
    except OSError as e:
        raise NotSynced(e.errno, e.strerror, str(path.parent)) from e


def write_durably(path: Path, write: Any) -> None:
    """Create `path` with what `write(file)` writes, fsynced; removed again on failure."""
    try:
        with open(path, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        remove_quietly(path)
        raise


def remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # left for remove_orphans


def os_error_message(e: OSError) -> str:
    """`path: cause` of an OSError, for a one-line message."""
    where = e.filename if e.filename is not None else ""
    cause = e.strerror or str(e)
    return f"{where}: {cause}" if where else cause
