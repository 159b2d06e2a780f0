"""Which KV blocks each request holds. Query-then-commit: get_computed_blocks() finds a
request's cached prefix without side effects; allocate_slots() takes the blocks (or returns
None when the pool cannot hold them) and registers newly full blocks in the prefix cache.

A request asking prompt logprobs needs every prompt position's logits, which cached KV does
not give; so a cached block also keeps its positions' prompt logprobs once a request that
asked them (with the same k) computed them, and such a request reads only blocks that have
them. That is what lets a scoring job with a shared system prompt skip computing it."""
from __future__ import annotations

from batchinfer.engine.block_pool import BlockPool, KVBlock
from batchinfer.engine.request import Request
from batchinfer.outputs import FlatLogprobs


# Blocks keep prompt logprobs for k up to this (vLLM's default max_logprobs): about 32
# bytes an entry, k + 1 entries a position. Requests asking more compute their whole prompt.
KEPT_PROMPT_LOGPROBS = 20


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.shared_logprob_blocks: dict[str, int] = {}  # share_prompt_logprobs' progress
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The request's chained block hashes, extended to cover num_blocks full blocks."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks; the last token is always left to
        compute, since its logits are needed. A request still to score prompt positions
        (prompt logprobs) counts only blocks that keep them for its k, and computes the last
        of those again: the hidden state of its last position scores the next token."""
        if not self.enable_caching:
            return [], 0
        recorded = request.prompt_logprobs
        k = None
        if recorded is not None and len(recorded) < request.num_prompt_tokens:
            k = request.params.prompt_logprobs
            if k > KEPT_PROMPT_LOGPROBS:
                return [], 0  # no block keeps these: the whole prompt is computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in self._hashes(request, max_blocks)[:max_blocks]:
            block = self.pool.get_cached(h)
            if block is None or (k is not None and (block.prompt_logprobs is None
                                                    or block.prompt_logprobs[0] != k)):
                break
            hits.append(block)
        if k is not None:
            hits = hits[:-1]
        return hits, len(hits) * self.block_size

    def cached_prompt_logprobs(self, request: Request, num_computed: int) -> FlatLogprobs | None:
        """The prompt logprobs a request asking them takes from the cache when its first
        num_computed tokens are cache hits (get_computed_blocks): the prompt positions from
        those it has recorded up to num_computed (inclusive: that one is scored by the last
        hit block's last position, which is not computed again), or None when there are
        none to add. Read before allocate_slots, which may evict the block holding the
        last one."""
        recorded = request.prompt_logprobs
        if recorded is None:
            return None
        num_computed = min(num_computed, request.num_prompt_tokens - 1)
        if num_computed < len(recorded):
            return None
        bs = self.block_size
        out = FlatLogprobs()
        position = len(recorded)
        hashes = self._hashes(request, num_computed // bs + 1)
        while position <= num_computed:
            b = position // bs
            _, section = self.pool.get_cached(hashes[b]).prompt_logprobs
            end = min((b + 1) * bs, num_computed + 1)
            out.extend(section, position - b * bs, end - b * bs)
            position = end
        return out

    def share_prompt_logprobs(self, request: Request) -> None:
        """Let the prefix cache's blocks keep the prompt logprobs the request has recorded
        for their positions: each full prompt block once all its positions are recorded and
        it is registered in the cache (whichever comes last calls this)."""
        recorded, k = request.prompt_logprobs, request.params.prompt_logprobs
        if not self.enable_caching or recorded is None or k > KEPT_PROMPT_LOGPROBS:
            return
        bs = self.block_size
        registered = self.num_cached_blocks.get(request.request_id, 0)
        done = min(len(recorded) // bs, request.num_prompt_tokens // bs, registered)
        start = self.shared_logprob_blocks.get(request.request_id, 0)
        if done <= start:
            return
        for b, h in enumerate(self._hashes(request, done)[start:done], start):
            block = self.pool.get_cached(h)
            if block is not None and block.prompt_logprobs is None:
                block.prompt_logprobs = (k, recorded.section(b * bs, (b + 1) * bs))
        self.shared_logprob_blocks[request.request_id] = done

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = (), num_computed_tokens: int = 0
                       ) -> list[KVBlock] | None:
        """Blocks for num_new_tokens more tokens after the request's computed ones (plus
        the cache hits passed in). Returns the newly allocated blocks, or None (and changes
        nothing) when the pool cannot hold them. The prefix-cache counters count a request
        when it is admitted (here), not each time a waiting request is queried."""
        total = request.num_computed_tokens + num_computed_tokens + num_new_tokens
        if not computed_blocks and total <= request.kv_room:
            return []  # the common decode step: room in the last block, nothing to cache
        req_id, bs = request.request_id, self.block_size
        blocks = self.req_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_blocks[req_id] = []
        admitted = not blocks
        num_new = -(-total // bs) - len(blocks) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0) if computed_blocks else 0
        if max(num_new, 0) + reclaimed > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[req_id]
            return None
        if admitted and self.enable_caching:
            self.queried_tokens += request.num_tokens
            self.hit_tokens += num_computed_tokens
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        new = self.pool.allocate(num_new) if num_new > 0 else []
        blocks.extend(new)
        room = len(blocks) * bs
        if self.enable_caching:
            # the block being filled must be registered once it is full
            num_cached = self._cache_full_blocks(request, blocks, total // bs)
            room = min(room, (num_cached + 1) * bs - 1)
        request.kv_room = room
        return new

    def allocate_slots_running(self, requests: list[Request],
                               num_new_tokens: list[int]) -> list[list[int]] | None:
        """allocate_slots(requests[i], num_new_tokens[i]) for running requests (no cache
        hits to add), as one commit: the new block ids of each, or None (and nothing
        changed) when the free blocks do not cover them all. Blocks are taken and full
        blocks registered request by request, in the order given, so the pool and the
        prefix cache end as the calls one by one would leave them."""
        req_blocks, bs = self.req_blocks, self.block_size
        block_lists = [req_blocks[r.request_id] for r in requests]
        needed = 0
        for req, n, blocks in zip(requests, num_new_tokens, block_lists):
            num_new = -(-(req.num_computed_tokens + n) // bs) - len(blocks)
            if num_new > 0:
                needed += num_new
        if needed > self.pool.num_free_blocks:
            return None
        allocate, caching = self.pool.allocate, self.enable_caching
        num_cached_blocks, cache_full_blocks = self.num_cached_blocks, self._cache_full_blocks
        out = []
        for req, n, blocks in zip(requests, num_new_tokens, block_lists):
            total = req.num_computed_tokens + n
            num_new = -(-total // bs) - len(blocks)
            if num_new > 0:
                new = allocate(num_new)
                blocks.extend(new)
                out.append([b.block_id for b in new])
            else:
                out.append([])
            room = len(blocks) * bs
            if caching:
                num_cached = num_cached_blocks.get(req.request_id, 0)
                if total // bs > num_cached:
                    num_cached = cache_full_blocks(req, blocks, total // bs)
                room = min(room, (num_cached + 1) * bs - 1)
            req.kv_room = room
        return out

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> int:
        """Register the request's full blocks up to num_full; returns how many it has
        registered: at most the blocks its known tokens fill (with async scheduling, the
        last may hold a sampled token whose value is still on its way)."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_full, len(request.token_ids) // self.block_size)
        if num_full <= start:
            return start
        hashes = self._hashes(request, num_full)
        cache_block = self.pool.cache_block
        for i in range(start, num_full):
            cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full
        if request.prompt_logprobs is not None:
            self.share_prompt_logprobs(request)
        return num_full

    def free(self, request: Request) -> None:
        request.kv_room = 0
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.shared_logprob_blocks.pop(request.request_id, None)
        self.pool.free(blocks[::-1])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
