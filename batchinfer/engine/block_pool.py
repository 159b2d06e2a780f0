"""The pool of KV blocks: free list, reference counts and the prefix-cache hash map.

A block whose ref count drops to 0 keeps its hash and contents and goes to the tail of the
free queue; allocation takes from the head, so cached blocks are evicted least-recently-freed
first. A cache hit on a free block takes it back out of the queue. All of it O(1).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchinfer.outputs import FlatLogprobs


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prompt_logprobs", "prev_free",
                 "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # a cached block's positions' prompt logprobs, once a request asking them computed
        # them: (k, FlatLogprobs section); kept and evicted with the hash
        self.prompt_logprobs: tuple[int, FlatLogprobs] | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks (head = next to evict)."""

    def __init__(self, blocks: list[KVBlock]):
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free, block.next_free = last, self.tail
        self.tail.prev_free = block
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    def get_cached(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue, evicting their cache entries."""
        if n > self.free_queue.size:
            raise RuntimeError(f"asked for {n} blocks, {self.free_queue.size} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
                block.prompt_logprobs = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks that reach 0 join the free queue's tail in the
        order given (callers pass a request's blocks tail-first, so its last blocks,
        the least likely to be shared, are evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
