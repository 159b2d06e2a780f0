"""The KV cache manager with fake requests: prefix hits on chained block hashes,
query-then-commit allocation, reference counts and the order blocks are given back."""
from __future__ import annotations

from batchinfer.engine.kv_cache_manager import KEPT_PROMPT_LOGPROBS, KVCacheManager
from batchinfer.engine.request import Request
from batchinfer.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=8), frozenset(), 1024)


def commit(kv: KVCacheManager, req: Request):
    """What the scheduler does to admit a waiting request: query, then allocate."""
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hits, num_hit, new


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return ([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks], dict(pool.cached),
            {k: list(v) for k, v in kv.req_blocks.items()}, dict(kv.num_cached_blocks))


def test_first_request_misses_and_caches_its_full_blocks():
    kv = KVCacheManager(10, BS, enable_caching=True)
    req = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    hits, num_hit, new = commit(kv, req)
    assert hits == [] and num_hit == 0
    assert [b.block_id for b in new] == [0, 1, 2]
    assert kv.block_ids("a") == [0, 1, 2]
    assert len(kv.pool.cached) == 2
    assert [b.block_hash is not None for b in new] == [True, True, False]
    assert kv.num_free_blocks == 7


def test_shared_prefix_hits_and_reference_counts():
    kv = KVCacheManager(10, BS, enable_caching=True)
    a = make_request("a", list(range(10)))
    commit(kv, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit, new = commit(kv, b)
    assert [h.block_id for h in hits] == [0, 1]
    assert num_hit == 8
    assert [blk.block_id for blk in new] == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.num_free_blocks == 10
    assert kv.queried_tokens == 10 + 11
    assert kv.hit_tokens == 8


def test_get_computed_blocks_changes_no_block_state():
    kv = KVCacheManager(6, BS, enable_caching=True)
    a = make_request("a", list(range(9)))
    commit(kv, a)
    kv.free(a)
    before = snapshot(kv)
    hits, num_hit = kv.get_computed_blocks(make_request("b", list(range(9))))
    assert num_hit == 8 and len(hits) == 2
    assert snapshot(kv) == before


def test_last_prompt_token_is_always_computed():
    kv = KVCacheManager(10, BS, enable_caching=True)
    commit(kv, make_request("a", list(range(12))))
    # Exactly three full blocks, all cached: the third is recomputed for the last token.
    hits, num_hit = kv.get_computed_blocks(make_request("b", list(range(12))))
    assert num_hit == 8 and len(hits) == 2
    # One token past three cached blocks: only that token is computed.
    c = make_request("c", list(range(12)) + [99])
    hits, num_hit, new = commit(kv, c)
    assert num_hit == 12 and c.num_tokens - num_hit == 1
    assert len(new) == 1


def test_hashes_are_chained_on_the_parent():
    """The same block of tokens after a different prefix is a different block."""
    kv = KVCacheManager(10, BS, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    commit(kv, a)
    hits, num_hit, _ = commit(kv, b)
    assert num_hit == 0
    assert a.block_hashes[1] != b.block_hashes[1]
    # Both second blocks are registered: had the hash ignored the parent, b's would
    # have collided with a's and stayed private.
    assert len(kv.pool.cached) == 4
    # A request that shares only the first block hits only the first block.
    c = make_request("c", [1, 2, 3, 4, 9, 9, 9, 9, 0])
    hits, num_hit, _ = commit(kv, c)
    assert [h.block_id for h in hits] == kv.block_ids("a")[:1]


def test_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    kv = KVCacheManager(6, BS, enable_caching=True)
    a = make_request("a", list(range(9)))
    commit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    b = make_request("b", list(range(8)) + [77])
    hits, num_hit, new = commit(kv, b)
    assert [h.block_id for h in hits] == [0, 1]
    assert all(h.ref_cnt == 1 for h in hits)
    free = [blk.block_id for blk in kv.pool.free_queue]
    assert 0 not in free and 1 not in free
    assert kv.num_free_blocks == 6 - 3
    # the one new block comes from the head of the queue: the never-used block 3
    assert [blk.block_id for blk in new] == [3]


def test_freed_request_gives_its_tail_blocks_back_first():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_request("a", list(range(16)))
    commit(kv, a)
    kv.free(a)
    assert [blk.block_id for blk in kv.pool.free_queue] == [3, 2, 1, 0]
    # A newcomer that needs one block evicts a's last block; a's prefix stays cached.
    b = make_request("b", [100, 101, 102])
    commit(kv, b)
    assert kv.block_ids("b") == [3]
    assert a.block_hashes[3] not in kv.pool.cached
    assert all(kv.pool.cached[h].block_id == i for i, h in enumerate(a.block_hashes[:3]))


def test_least_recently_freed_request_is_evicted_first():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(50, 58)))
    commit(kv, a)
    commit(kv, b)
    kv.free(a)
    kv.free(b)
    c = make_request("c", list(range(200, 207)))  # needs two blocks: a's
    commit(kv, c)
    assert sorted(kv.block_ids("c")) == sorted([0, 1])
    assert kv.get_computed_blocks(make_request("x", list(range(8)) + [0]))[1] == 0
    assert kv.get_computed_blocks(make_request("y", list(range(50, 58)) + [0]))[1] == 8


def test_allocate_slots_returns_none_and_changes_nothing_when_out_of_blocks():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_request("a", list(range(9)))
    commit(kv, a)
    kv.free(a)
    b = make_request("b", [7] * 6)
    commit(kv, b)  # takes blocks 3 and 2; a's cached blocks 1 and 0 stay free
    # c hits a's two cached free blocks and needs three more: 2 reclaimed + 3 > 2 free
    c = make_request("c", list(range(8)) + list(range(100, 109)))
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8
    before = snapshot(kv)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, hits, num_hit) is None
    assert snapshot(kv) == before
    assert "c" not in kv.req_blocks
    # A running request that cannot grow keeps what it has.
    d = make_request("d", list(range(300, 305)))
    assert commit(kv, d)[2] is not None
    d.append_token(1)
    d.append_token(2)
    d.append_token(3)
    d.num_computed_tokens = 8
    d.append_token(4)
    before = snapshot(kv)
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots(d, 1) is None
    assert snapshot(kv) == before


def running_pair(kv: KVCacheManager) -> tuple[Request, Request]:
    """Two running requests at a block boundary in a pool of 5 blocks, where a freed
    request's cached blocks 1 and 0 are the last free ones: "a" fills a block equal to
    cached block 0, and "b" has a 12-token chunk to add that takes blocks 4, 1 and 0."""
    old = make_request("old", list(range(8)))
    commit(kv, old)
    kv.free(old)
    a = make_request("a", [0, 1, 2])
    assert kv.allocate_slots(a, 3) is not None  # no prefix-cache query: block 2
    a.num_computed_tokens = 3
    a.append_token(3)
    b = make_request("b", list(range(100, 116)))
    assert kv.allocate_slots(b, 4) is not None  # its first chunk: block 3
    b.num_computed_tokens = 4
    return a, b


def block_ids_snapshot(kv: KVCacheManager) -> tuple:
    """snapshot() with blocks by id, to compare two managers."""
    free, refs, hashes, cached, req_blocks, num_cached = snapshot(kv)
    return (free, refs, hashes, {h: b.block_id for h, b in cached.items()},
            {r: [b.block_id for b in blocks] for r, blocks in req_blocks.items()}, num_cached)


def test_allocate_slots_running_matches_allocate_slots_one_by_one():
    together, one_by_one = (KVCacheManager(5, BS, enable_caching=True) for _ in range(2))
    a, b = running_pair(together)
    new = together.allocate_slots_running([a, b], [1, 12])
    c, d = running_pair(one_by_one)
    assert new == [[b.block_id for b in one_by_one.allocate_slots(r, n)]
                   for r, n in ((c, 1), (d, 12))]
    assert new == [[], [4, 1, 0]]
    assert block_ids_snapshot(together) == block_ids_snapshot(one_by_one)
    assert (a.kv_room, b.kv_room) == (c.kv_room, d.kv_room)
    # a's block stayed private (block 0 held its hash when a registered it), and b's
    # allocation evicted block 0: that hash is no longer cached
    assert together.pool.blocks[2].block_hash is None
    assert a.block_hashes[0] not in together.pool.cached


def test_allocate_slots_running_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(5, BS, enable_caching=True)
    a, b = running_pair(kv)
    before = snapshot(kv), a.kv_room, b.kv_room
    assert kv.allocate_slots_running([a, b], [1, 16]) is None  # 4 blocks, 3 free
    assert (snapshot(kv), a.kv_room, b.kv_room) == before


def test_decode_allocates_a_block_only_when_crossing_a_boundary_and_caches_it():
    kv = KVCacheManager(8, BS, enable_caching=True)
    req = make_request("a", [1, 2, 3])
    commit(kv, req)
    assert kv.block_ids("a") == [0]
    grown = []
    for token in [10, 11, 12, 13, 14]:
        req.append_token(token)
        new = kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        grown.append([b.block_id for b in new])
    # tokens 4..8: the 5th token (index 4) starts a second block
    assert grown == [[], [1], [], [], []]
    # once 8 tokens are computed, both blocks are full and cached with the chained hash
    assert kv.num_cached_blocks["a"] == 2
    assert kv.pool.blocks[1].block_hash == req.block_hashes[1]
    follower = make_request("b", [1, 2, 3, 10, 11, 12, 13, 14, 15])
    assert kv.get_computed_blocks(follower)[1] == 8


def test_prefix_caching_disabled_never_hits_or_hashes():
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    commit(kv, a)
    kv.free(a)
    hits, num_hit, new = commit(kv, make_request("b", list(range(9))))
    assert hits == [] and num_hit == 0
    assert len(new) == 3
    assert kv.pool.cached == {}
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.queried_tokens == 0


def test_usage_reports_the_fraction_of_blocks_held():
    kv = KVCacheManager(8, BS, enable_caching=True)
    assert kv.usage == 0.0
    a = make_request("a", list(range(8)))
    commit(kv, a)
    assert kv.usage == 2 / 8
    kv.free(a)
    assert kv.usage == 0.0


# ---- prompt logprobs kept on cached blocks ----------------------------------------------

def scoring_request(request_id: str, tokens: list[int], k: int = 1) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=1, prompt_logprobs=k),
                   frozenset(), 1024)


def record(req: Request, upto: int) -> None:
    """Record the request's prompt positions up to upto (exclusive) as the engine would: the
    prompt token's logprob depends only on it and its position, so requests sharing a
    prefix record the same entries there."""
    recorded = req.prompt_logprobs
    for p in range(len(recorded), upto):
        token = req.token_ids[p]
        recorded.add(token, [token, 1000 + p], [-0.5 - p, -1.5 - p, -0.5 - p], 1, 1, str)


def scored(kv: KVCacheManager, request_id: str, n: int, k: int = 1) -> Request:
    """A scoring request of tokens 0 .. n - 1, computed, its prompt recorded and shared."""
    req = scoring_request(request_id, list(range(n)), k)
    commit(kv, req)
    record(req, n)
    kv.share_prompt_logprobs(req)
    return req


def test_blocks_keep_the_prompt_logprobs_of_their_positions_once_all_are_recorded():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = scoring_request("a", list(range(11)))  # 2 full blocks + 3 tokens
    commit(kv, a)
    record(a, 7)
    kv.share_prompt_logprobs(a)
    first, second = kv.req_blocks["a"][:2]
    assert first.prompt_logprobs[0] == 1 and list(first.prompt_logprobs[1]) == a.prompt_logprobs[:4]
    assert second.prompt_logprobs is None  # positions 4..7: 7 not recorded yet
    record(a, 11)
    kv.share_prompt_logprobs(a)
    assert list(second.prompt_logprobs[1]) == a.prompt_logprobs[4:8]
    assert kv.req_blocks["a"][2].prompt_logprobs is None  # not full, not cached


def test_a_scoring_request_reads_blocks_with_its_k_and_computes_the_last_again():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = scored(kv, "a", 13)
    b = scoring_request("b", list(range(12)) + [99, 98])  # 3 full blocks shared
    hits, num_hit = kv.get_computed_blocks(b)
    # the third block's last position scores b's position 12: it is computed again
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2] and num_hit == 8
    cached = kv.cached_prompt_logprobs(b, num_hit)
    assert list(cached) == a.prompt_logprobs[1:9]  # b has position 0 (None) already
    # another k, or no prompt logprobs at all
    assert kv.get_computed_blocks(scoring_request("c", b.token_ids, k=2)) == ([], 0)
    assert kv.get_computed_blocks(make_request("d", b.token_ids))[1] == 12


def test_blocks_a_plain_request_cached_keep_no_prompt_logprobs():
    kv = KVCacheManager(16, BS, enable_caching=True)
    commit(kv, make_request("plain", list(range(13))))
    assert kv.get_computed_blocks(scoring_request("b", list(range(13)))) == ([], 0)


def test_an_evicted_block_drops_its_prompt_logprobs():
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = scored(kv, "a", 9)
    blocks = kv.req_blocks["a"]
    assert all(b.prompt_logprobs is not None for b in blocks[:2])
    kv.free(a)
    kv.pool.allocate(4)  # every block, the cached ones evicted
    assert all(b.prompt_logprobs is None and b.block_hash is None for b in blocks)


def test_a_block_recorded_before_it_is_registered_keeps_them_once_it_is():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = scoring_request("a", list(range(11)))
    kv.allocate_slots(a, 7)  # a 7-token chunk: one full block registered
    a.num_computed_tokens = 7
    record(a, 8)  # the chunk's last position scores position 7: block 1 is all recorded
    kv.share_prompt_logprobs(a)
    blocks = kv.req_blocks["a"]
    assert blocks[0].prompt_logprobs is not None and blocks[1].block_hash is None
    kv.allocate_slots(a, 4)  # the rest: block 1 registered, and it keeps them then
    assert list(blocks[1].prompt_logprobs[1]) == a.prompt_logprobs[4:8]


def test_a_request_with_its_prompt_scored_reads_the_cache_as_any_other():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = scoring_request("a", list(range(13)))
    commit(kv, a)
    record(a, 13)
    for token in (50, 51, 52, 53):  # generated after its prompt
        a.append_token(token)
    kv.free(a)  # preempted
    hits, num_hit = kv.get_computed_blocks(a)
    # all three blocks it computed, though none keeps prompt logprobs: it needs no more
    assert num_hit == 12
    assert kv.cached_prompt_logprobs(a, num_hit) is None


def test_a_k_past_the_kept_limit_reads_and_keeps_nothing():
    kv = KVCacheManager(16, BS, enable_caching=True)
    k = KEPT_PROMPT_LOGPROBS + 1
    scored(kv, "a", 13, k)
    assert all(b.prompt_logprobs is None for b in kv.req_blocks["a"])
    assert kv.get_computed_blocks(scoring_request("b", list(range(14)), k=k)) == ([], 0)
