"""The scheduler driven directly, with fake requests and no model: schedule() is called,
then update_from_output() with a fake sampled token for each request that reaches its
end."""
from __future__ import annotations

import random

import pytest

from batchinfer.engine.kv_cache_manager import KVCacheManager
from batchinfer.engine.request import Request, RequestStatus
from batchinfer.engine.scheduler import Scheduler, SchedulerOutput
from batchinfer.sampling_params import SamplingParams


class Sim:
    """A scheduler plus the engine's side of a step, without a model."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, caching: bool = True):
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.finished: list[str] = []

    def add(self, request_id: str, prompt: list[int] | int, max_tokens: int = 4) -> Request:
        tokens = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
        req = Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), frozenset(),
                      max_model_len=4096)
        self.requests[request_id] = req
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        return self.apply(self.schedule())

    def schedule(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_invariants(out)
        return out

    def apply(self, out: SchedulerOutput) -> SchedulerOutput:
        """What the model's step gives the scheduler: a sampled token for each request
        whose computed tokens reach its end; one at its max_tokens finishes."""
        # schedule() counted the scheduled tokens computed already
        sampled = [req_id for req_id in out.num_scheduled_tokens
                   if self.requests[req_id].num_computed_tokens
                   == self.requests[req_id].num_tokens]
        tokens = [1000 + self.requests[req_id].num_output_tokens for req_id in sampled]
        for req in self.sched.update_from_output(out, sampled, tokens):
            if req.num_output_tokens >= req.max_tokens:
                self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                self.finished.append(req.request_id)
        return out

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        plans = []
        while self.sched.has_unfinished():
            plans.append(self.step())
            assert len(plans) < max_steps, "the scheduler made no progress"
        return plans

    def check_invariants(self, out: SchedulerOutput) -> None:
        sched, pool = self.sched, self.kv.pool
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert set(out.num_scheduled_tokens) <= {r.request_id for r in sched.running}
        # the model runner reads the cached requests' rows off the front of this order
        assert list(out.num_scheduled_tokens) == out.cached_requests.req_ids + [
            new.req_id for new in out.new_requests]
        held: dict[int, int] = {}
        for req_id, blocks in self.kv.req_blocks.items():
            req = self.requests[req_id]
            assert req.status == RequestStatus.RUNNING
            needed = req.num_computed_tokens  # the scheduled tokens included
            assert len(blocks) >= -(-needed // self.block_size)
            if self.kv.enable_caching:  # every full block of scheduled tokens is registered
                assert self.kv.num_cached_blocks.get(req_id, 0) == needed // self.block_size
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0)
        assert {b.block_id for b in pool.free_queue} == {
            b.block_id for b in pool.blocks if b.ref_cnt == 0}
        for req in sched.waiting:
            assert req.request_id not in self.kv.req_blocks


def test_token_budget_and_max_num_seqs():
    sim = Sim(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=25)
    for i in range(5):
        sim.add(f"r{i}", [i] * 10)
    first = sim.step()
    assert first.num_scheduled_tokens == {"r0": 10, "r1": 10, "r2": 5}
    assert first.total_num_scheduled_tokens == 25
    second = sim.step()
    # running first (two decodes, the rest of r2's prompt), then no room for a 4th sequence
    assert second.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 5}
    assert [r.request_id for r in sim.sched.waiting] == ["r3", "r4"]
    sim.run()
    assert sorted(sim.finished) == [f"r{i}" for i in range(5)]


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    sim = Sim(num_blocks=64, max_num_batched_tokens=16)
    req = sim.add("long", 50, max_tokens=3)
    plans = [sim.step() for _ in range(6)]
    assert [p.num_scheduled_tokens["long"] for p in plans] == [16, 16, 16, 2, 1, 1]
    assert [len(p.new_requests) for p in plans] == [1, 0, 0, 0, 0, 0]
    assert [n for p in plans[1:] for n in p.cached_requests.num_computed_tokens] == [
        16, 32, 48, 50, 51]
    # a token is sampled only once the whole prompt is computed
    assert req.num_output_tokens == 3
    assert sim.finished == ["long"]


def test_running_requests_are_scheduled_before_waiting_ones():
    sim = Sim(num_blocks=64, max_num_batched_tokens=16)
    sim.add("old", 40, max_tokens=4)
    sim.step()
    sim.add("new", [500 + i for i in range(8)])
    plan = sim.step()
    # the running prefill takes the whole budget; the newcomer waits
    assert plan.num_scheduled_tokens == {"old": 16}
    assert [r.request_id for r in sim.sched.waiting] == ["new"]
    plan = sim.step()
    assert list(plan.num_scheduled_tokens) == ["old", "new"]
    assert plan.num_scheduled_tokens == {"old": 8, "new": 8}
    plan = sim.step()
    assert plan.num_scheduled_tokens == {"old": 1, "new": 1}
    assert plan.cached_requests.req_ids == ["old", "new"]


def test_plan_carries_new_block_ids():
    sim = Sim(num_blocks=16, block_size=4)
    a = sim.add("a", 6, max_tokens=8)
    plan = sim.schedule()
    (new,) = plan.new_requests
    assert new.req_id == "a" and new.num_computed_tokens == 0
    assert new.block_ids == sim.kv.block_ids("a") == [0, 1]
    assert new.token_ids == list(range(6)) and new.num_prompt_tokens == 6
    sim.apply(plan)
    deltas = []
    for _ in range(4):
        plan = sim.step()
        assert plan.cached_requests.req_ids == ["a"]
        deltas.append(plan.cached_requests.new_block_ids[0])
    # computed tokens 7, 8, 9, 10: the 9th token opens block 2
    assert deltas == [[], [], [2], []]
    assert sim.kv.block_ids("a") == [0, 1, 2]
    assert a.num_output_tokens == 5


def test_finished_requests_are_announced_in_the_next_plan():
    sim = Sim(num_blocks=16)
    sim.add("a", 3, max_tokens=1)
    sim.add("b", 3, max_tokens=2)
    first = sim.step()
    assert first.finished_req_ids == set()
    assert sim.finished == ["a"]
    assert "a" not in sim.kv.req_blocks
    second = sim.step()
    assert second.finished_req_ids == {"a"}
    assert sim.step().finished_req_ids == {"b"}


def test_preemption_picks_the_most_recently_admitted_and_frees_its_blocks():
    """Four 5-token prompts in a 9-block pool of 4-token blocks hold 8 blocks after the
    first step; the pool runs out when the sequences pass 8 tokens."""
    sim = Sim(num_blocks=9, block_size=4, caching=False)
    for i in range(4):
        sim.add(f"r{i}", [10 * i + j for j in range(5)], max_tokens=8)
    sim.step()
    late = sim.add("late", [100 + j for j in range(12)], max_tokens=2)  # needs 3 blocks
    assert sim.kv.num_free_blocks == 1
    for _ in range(3):
        assert not sim.step().preempted_req_ids
    assert list(sim.sched.waiting) == [late]
    plan = sim.step()
    # r0 took the last free block, r1 needed one more: r3 (admitted last) is preempted,
    # and r2 gets the second block it freed
    assert plan.preempted_req_ids == {"r3"}
    assert set(plan.num_scheduled_tokens) == {"r0", "r1", "r2"}
    r3 = sim.requests["r3"]
    assert r3.status == RequestStatus.PREEMPTED
    assert r3.num_computed_tokens == 0
    assert r3.metrics.num_preemptions == 1
    assert sim.sched.num_preemptions == 1
    assert "r3" not in sim.kv.req_blocks
    assert list(sim.sched.waiting) == [r3, late]
    assert [r.request_id for r in sim.sched.running] == ["r0", "r1", "r2"]
    sim.run()
    assert sorted(sim.finished) == ["late", "r0", "r1", "r2", "r3"]
    assert all(sim.requests[f"r{i}"].num_output_tokens == 8 for i in range(4))
    assert sim.kv.num_free_blocks == 9


def test_the_last_running_request_preempts_itself_when_it_cannot_grow():
    sim = Sim(num_blocks=4, block_size=4, caching=False)
    sim.add("r0", 7, max_tokens=8)
    sim.add("r1", 8, max_tokens=8)
    sim.step()  # r0: 2 blocks, r1: 2 blocks, pool full
    plan = sim.step()
    # r0 (8 tokens) still fits its blocks; r1 (9 tokens) needs a third and is last
    assert plan.preempted_req_ids == {"r1"}
    assert plan.num_scheduled_tokens == {"r0": 1}
    assert sim.kv.block_ids("r0") == [0, 1]


def test_no_admissions_in_a_step_that_preempted():
    """After r1 is preempted there is room for a 3-token chunk of it, but it is not
    readmitted until the next step."""
    sim = Sim(num_blocks=5, block_size=4, max_num_batched_tokens=4, caching=False)
    sim.add("r0", 4, max_tokens=10)
    sim.step()
    sim.add("r1", 12, max_tokens=4)
    for _ in range(4):
        assert not sim.step().preempted_req_ids
    assert sim.kv.num_free_blocks == 0
    plan = sim.step()
    assert plan.preempted_req_ids == {"r1"}
    assert plan.num_scheduled_tokens == {"r0": 1}
    assert plan.new_requests == []
    assert sim.kv.num_free_blocks == 2
    plan = sim.schedule()
    assert plan.num_scheduled_tokens == {"r0": 1, "r1": 3}
    (resumed,) = plan.new_requests
    assert resumed.req_id == "r1"
    assert resumed.token_ids == list(range(12)) + [1000]
    assert resumed.num_computed_tokens == 0


def test_preempted_request_resumes_from_its_cached_prefix():
    """r2 is preempted when the pool runs out; r1 reuses r2's tail block, so r2 comes
    back with its first block still cached and recomputes only the rest."""
    sim = Sim(num_blocks=7, block_size=4, caching=True)
    for i in range(3):
        sim.add(f"r{i}", [10 * i + j for j in range(8)], max_tokens=2 if i < 2 else 8)
    sim.step()
    held = sim.kv.block_ids("r2")
    plan = sim.schedule()
    assert plan.preempted_req_ids == {"r2"}
    assert sim.kv.block_ids("r1")[-1] == held[1]
    sim.apply(plan)
    assert sorted(sim.finished) == ["r0", "r1"]
    r2 = sim.requests["r2"]
    hits_before = sim.kv.hit_tokens
    plan = sim.schedule()
    (resumed,) = plan.new_requests
    assert resumed.req_id == "r2"
    assert resumed.num_computed_tokens == 4
    assert resumed.block_ids[0] == held[0]
    assert plan.num_scheduled_tokens["r2"] == r2.num_tokens - 4 == 5
    assert sim.kv.hit_tokens - hits_before == 4
    sim.apply(plan)
    sim.run()
    assert r2.num_output_tokens == 8


def test_prefix_cache_stats_count_each_admission_once():
    """A request that waits for blocks is queried every step, but its tokens count as
    queried (and its hits as hits) only when it is admitted."""
    sim = Sim(num_blocks=4, block_size=4, caching=True)
    sim.add("a", list(range(12)), max_tokens=4)      # 3 blocks; 4 once it has 13 tokens
    sim.step()
    late = sim.add("b", list(range(8)) + [99] * 6, max_tokens=1)  # shares a's first 8
    for _ in range(3):
        sim.step()
        assert late.status == RequestStatus.WAITING
    assert (sim.kv.queried_tokens, sim.kv.hit_tokens) == (12, 0)
    sim.run()
    assert late.num_cached_tokens == 8
    assert (sim.kv.queried_tokens, sim.kv.hit_tokens) == (12 + 14, 8)


def test_finish_removes_waiting_and_running_requests():
    sim = Sim(num_blocks=16, max_num_seqs=1)
    a = sim.add("a", 5)
    b = sim.add("b", 5)
    sim.step()
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    sim.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert list(sim.sched.waiting) == []
    sim.sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert sim.sched.running == []
    assert not sim.sched.has_unfinished()
    assert sim.kv.num_free_blocks == 16
    assert sim.sched.schedule().finished_req_ids == {"a", "b"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_every_invariant_and_frees_everything(seed: int):
    """Shared prefixes, chunked prefill and preemption together; check_invariants runs
    after every schedule()."""
    rng = random.Random(seed)
    sim = Sim(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=20)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    lengths = {}
    for i in range(14):
        prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(1, 20))]
        lengths[f"q{i}"] = rng.randrange(1, 15)
        sim.add(f"q{i}", prompt, max_tokens=lengths[f"q{i}"])
    sim.run()
    assert sorted(sim.finished) == sorted(lengths)
    assert all(sim.requests[r].num_output_tokens == n for r, n in lengths.items())
    assert sim.sched.num_preemptions > 0
    assert sim.kv.hit_tokens > 0
    assert sim.kv.num_free_blocks == 24
    assert all(b.ref_cnt == 0 for b in sim.kv.pool.blocks)
    assert sim.kv.req_blocks == {}


class OneByOneScheduler(Scheduler):
    """Allocation at block boundaries request by request, as when the free blocks do not
    cover a step's boundary requests together."""

    def _schedule_running(self, out: SchedulerOutput) -> tuple[int, int]:
        budget, prompt_computed, _ = self._plan_running(out, batched=False)
        return budget, prompt_computed


def block_state(sim: Sim) -> tuple:
    kv, pool = sim.kv, sim.kv.pool
    return ([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            {h: b.block_id for h, b in pool.cached.items()},
            {r: [b.block_id for b in blocks] for r, blocks in kv.req_blocks.items()},
            dict(kv.num_cached_blocks), {r: q.kv_room for r, q in sim.requests.items()})


def plan_state(plan: SchedulerOutput) -> tuple:
    return (plan.num_scheduled_tokens, plan.cached_requests, plan.preempted_req_ids,
            [(n.req_id, n.block_ids, n.num_computed_tokens) for n in plan.new_requests])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_batched_boundary_allocation_matches_one_by_one(seed: int, caching: bool):
    """The same workload through both paths gives the same plans, block tables and prefix
    cache at every step, with steps where the free blocks cover every boundary request
    (one commit) and steps where they do not (the one-by-one fallback, preempting)."""
    rng = random.Random(seed)
    batched, one_by_one = (Sim(num_blocks=28, block_size=4, max_num_seqs=8,
                               max_num_batched_tokens=24, caching=caching) for _ in range(2))
    one_by_one.sched = OneByOneScheduler(one_by_one.kv, 8, 24)
    commits = []
    allocate = batched.kv.allocate_slots_running

    def counted(requests, counts):
        result = allocate(requests, counts)
        commits.append(result is not None)
        return result

    batched.kv.allocate_slots_running = counted
    # shared prefixes and the Sim's sampled tokens (1000 + output index, the same for
    # every request) give equal block hashes across requests: private duplicates, and
    # freed cached blocks evicted while an equal block is registered
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(3, 10))] for _ in range(3)]
    workload = {}  # arrival step -> requests
    for i in range(20):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        workload.setdefault(rng.randrange(30), []).append((f"q{i}", prompt, rng.randrange(1, 24)))
    step = 0
    while step < 30 or batched.sched.has_unfinished():
        for req_id, prompt, max_tokens in workload.get(step, ()):
            for sim in (batched, one_by_one):
                sim.add(req_id, prompt, max_tokens)
        if batched.sched.has_unfinished():
            assert plan_state(batched.step()) == plan_state(one_by_one.step())
            assert block_state(batched) == block_state(one_by_one)
        step += 1
        assert step < 1000, "the scheduler made no progress"
    assert not one_by_one.sched.has_unfinished()
    assert sorted(batched.finished) == sorted(r for reqs in workload.values() for r, _, _ in reqs)
    assert True in commits and False in commits  # both paths taken
    assert batched.sched.num_preemptions == one_by_one.sched.num_preemptions > 0
