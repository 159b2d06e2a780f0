"""What ranks of different nodes send each other, in an encoding that runs no code when
read: node 0's step plans to the other nodes, and the sampling rank's RunnerOutput to
every rank under pipeline parallelism. JSON text of the plain-data dataclasses, moved as
a uint8 tensor after its length; a message that does not decode to the expected shape is
a ValueError (the sender is broken or not one of the job's ranks).

torch.distributed's *_object_list collectives unpickle what they receive, so a rank that
reaches the group could make every other rank run code: batchinfer never uses them.
"""
from __future__ import annotations

import json
from dataclasses import fields

import torch
import torch.distributed as dist

from batchinfer.engine.scheduler import (CachedRequestData, NewRequestData, RunnerOutput,
                                         SchedulerOutput)
from batchinfer.sampling_params import SamplingParams

MAX_MESSAGE = 1 << 31  # bytes; a longer length announced is refused unread

# SamplingParams' fields set by the sampling rank alone (a compiled grammar holds the
# vocabulary's bytes and the automaton built so far)
_LOCAL_PARAMS = {"compiled_grammar"}


def broadcast_bytes(data: bytes | None, src: int, group=None) -> bytes:
    """`data` from rank `src` to every rank of the group (a gloo group: CPU tensors)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if not 0 <= n < MAX_MESSAGE:
        raise ValueError(f"rank {src} announced a message of {n} bytes")
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None and n
              else torch.empty(n, dtype=torch.uint8))
    dist.broadcast(buffer, src=src, group=group)
    return data if data is not None else buffer.numpy().tobytes()


def _params(p: SamplingParams) -> dict:
    out = {f.name: getattr(p, f.name) for f in fields(p) if f.name not in _LOCAL_PARAMS}
    so = p.structured_outputs
    if so is not None:
        out["structured_outputs"] = {f.name: getattr(so, f.name) for f in fields(so)}
    return out


def encode_plan(plan: SchedulerOutput, sampled: tuple[list[str], list[int]]) -> bytes:
    cached = plan.cached_requests
    return json.dumps({
        "new": [[n.req_id, n.token_ids, n.num_prompt_tokens, _params(n.params), n.block_ids,
                 n.num_computed_tokens] for n in plan.new_requests],
        "cached": [cached.req_ids, cached.new_block_ids, cached.num_computed_tokens],
        "scheduled": plan.num_scheduled_tokens,
        "total": plan.total_num_scheduled_tokens,
        "finished": sorted(plan.finished_req_ids),
        "preempted": sorted(plan.preempted_req_ids),
        "sampled": [list(sampled[0]), list(sampled[1])],
    }, separators=(",", ":")).encode()


def decode_plan(data: bytes) -> tuple[SchedulerOutput, tuple[list[str], list[int]]]:
    try:
        m = json.loads(data)
        new = []
        for req_id, token_ids, num_prompt, params, block_ids, computed in m["new"]:
            new.append(NewRequestData(_str(req_id), _ints(token_ids), int(num_prompt),
                                      SamplingParams(**params),
                                      _ints(block_ids), int(computed)))
        req_ids, new_blocks, computed = m["cached"]
        plan = SchedulerOutput(
            new, CachedRequestData([_str(r) for r in req_ids], [_ints(b) for b in new_blocks],
                                   _ints(computed)),
            {_str(k): int(v) for k, v in m["scheduled"].items()}, int(m["total"]),
            {_str(r) for r in m["finished"]}, {_str(r) for r in m["preempted"]})
        ids, tokens = m["sampled"]
        return plan, ([_str(r) for r in ids], _ints(tokens))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"a step plan that does not decode: {e}") from None


def encode_output(out: RunnerOutput) -> bytes:
    return json.dumps([out.req_ids, out.token_ids, out.logprobs, out.prompt_logprobs,
                       out.errors], separators=(",", ":")).encode()


def decode_output(data: bytes) -> RunnerOutput:
    try:
        req_ids, tokens, logprobs, prompt_logprobs, errors = json.loads(data)
        out = RunnerOutput([_str(r) for r in req_ids], _ints(tokens))
        if logprobs is not None:
            out.logprobs = [_logprob(entry) for entry in logprobs]
        if prompt_logprobs is not None:
            out.prompt_logprobs = {_str(r): (int(first), [_logprob(e) for e in rows])
                                   for r, (first, rows) in prompt_logprobs.items()}
        if errors is not None:
            out.errors = {_str(r): _str(why) for r, why in errors.items()}
        return out
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"a step output that does not decode: {e}") from None


def _logprob(entry) -> tuple[list[int], list[float], int]:
    ids, values, rank = entry
    return _ints(ids), [float(v) for v in values], int(rank)


def _ints(values) -> list[int]:
    if not isinstance(values, list):
        raise TypeError(f"expected a list of integers, got {type(values).__name__}")
    return [int(v) for v in values]


def _str(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value
