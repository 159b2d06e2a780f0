"""Host memory for CPU inference: how glibc's allocator treats the large, short-lived
buffers of a step, and when the KV cache's pages get backed.

By default glibc hands large freed buffers back to the OS and page-faults them in again
on the next step; on CPU that costs as much as the copies themselves, so an engine keeps
freed memory in its heap. A benchmark that builds several engines in one process releases
that memory between them, so that each one starts from the same state.

The KV cache is allocated whole but backed by memory only as blocks come into use. Left to
page faults, that happens 4 KB at a time inside attention's parallel loops, where each
fault also holds up the loop's other threads; KVPagePopulator instead backs blocks ahead
of use, in one call per layer for many blocks (see its numbers).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later


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


def populate(address: int, length: int) -> bool:
    """Back [address, address + length), widened to whole pages, with memory now, as writes
    would but without writing (contents are kept); False where the OS cannot."""
    libc = _libc()
    if libc is None or length <= 0:
        return False
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    end = -(-(address + length) // mmap.PAGESIZE) * mmap.PAGESIZE
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                        _MADV_POPULATE_WRITE) == 0


class KVPagePopulator:
    """Backs a CPU KV cache's blocks with memory before a step writes to them: blocks
    [0, populated) are backed, and a step that uses a block past them extends that to its
    highest block id plus AHEAD_BYTES of blocks more, one call per layer's K and V. The
    block pool hands out never-used blocks in id order, so the backed part grows only as
    the pool's use does.

    On the 2-core Zen 4 VM, faulting SmolLM2's KV pages in one at a time took about 6 us a
    page inside the steps of the bench's shared-prefix run (0.7 s of a 20 s run, in the
    rotary/KV-write kernel that writes first), against about 1.3 us a page populated
    this way."""

    AHEAD_BYTES = 64 << 20

    def __init__(self, regions: list[int], block_bytes: int, num_blocks: int):
        """regions: the address of each per-layer K or V tensor of num_blocks blocks of
        block_bytes each."""
        self.regions, self.block_bytes, self.num_blocks = regions, block_bytes, num_blocks
        self.ahead_blocks = max(1, self.AHEAD_BYTES // (block_bytes * len(regions)))
        self.populated = 0

    def cover(self, max_block_id: int) -> None:
        """Back blocks up to max_block_id (and those ahead of it) if they are not yet."""
        if max_block_id < self.populated:
            return
        end = min(self.num_blocks, max_block_id + 1 + self.ahead_blocks)
        offset, length = self.populated * self.block_bytes, (end - self.populated) * self.block_bytes
        for address in self.regions:
            if not populate(address + offset, length):
                log.debug("the OS cannot populate pages ahead (MADV_POPULATE_WRITE); KV "
                          "pages are faulted in as they are written")
                end = self.num_blocks  # stop trying
                break
        self.populated = end
