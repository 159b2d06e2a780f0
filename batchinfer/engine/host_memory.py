"""How glibc's allocator treats the large, short-lived buffers of CPU inference.

By default glibc hands large freed buffers back to the OS and page-faults them in again
on the next step; on CPU that costs as much as the copies themselves, so an engine keeps
freed memory in its heap. A benchmark that builds several engines in one process releases
that memory between them, so that each one starts from the same state.
"""
from __future__ import annotations

import ctypes
import functools

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


def keep_freed_memory() -> None:
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def release_freed_memory() -> None:
    """Return the heap's free memory to the OS now."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
