"""What ranks of different nodes send each other decodes to the same plain data, and a
payload that is not that (a pickle a rogue rank sends) is refused without running it."""
from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest

from batchinfer.engine import wire
from batchinfer.engine.scheduler import (CachedRequestData, NewRequestData, RunnerOutput,
                                         SchedulerOutput)
from batchinfer.sampling_params import SamplingParams

PACKAGE = Path(__file__).resolve().parents[2] / "batchinfer"


def _plan() -> SchedulerOutput:
    params = [
        SamplingParams(max_tokens=5, temperature=0.7, top_k=20, seed=3, stop=["\n"],
                       logit_bias={7: -2.5}, logprobs=2),
        SamplingParams(max_tokens=3, structured_outputs={"choice": ["yes", "no"]},
                       choice_token_ids=[[5, 6], [9]]),
    ]
    new = [NewRequestData(f"r{i}", [1, 2, 3 + i], 3, p, [i, 10 + i], 0)
           for i, p in enumerate(params)]
    return SchedulerOutput(new, CachedRequestData(["c"], [[4]], [17]), {"r0": 3, "r1": 3, "c": 1},
                           7, {"gone"}, {"p1", "p2"})


def test_a_plan_round_trips():
    plan = _plan()
    decoded, sampled = wire.decode_plan(wire.encode_plan(plan, (["c"], [42])))
    assert decoded == plan
    assert sampled == (["c"], [42])
    assert decoded.new_requests[0].params.logit_bias == {7: -2.5}
    assert decoded.new_requests[1].params.structured_outputs.choice == ["yes", "no"]


def test_an_output_round_trips():
    out = RunnerOutput(["a", "b"], [3, 4], logprobs=[([3, 1], [-0.1, -2.5], 1),
                                                      ([4, 2], [-0.2, float("-inf")], 1)],
                       prompt_logprobs={"a": (1, [([9], [-1.25], 3)])},
                       errors={"b": "no allowed token"})
    assert wire.decode_output(wire.encode_output(out)) == out


class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_pickle_from_a_peer_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(RunnerOutput([str(_Payload(str(marker)))], [1]))
    evil = pickle.dumps(_Payload(str(marker)))
    for data in (payload, evil):
        for decode in (wire.decode_output, wire.decode_plan):
            with pytest.raises(ValueError, match="does not decode"):
                decode(data)
    assert not marker.exists()


@pytest.mark.parametrize("data", [b"[]", b'{"new": 3}', b'[["a"], "x", null, null, null]',
                                  b'[[1], [2], null, null, null]'])
def test_a_message_of_another_shape_is_a_value_error(data):
    for decode in (wire.decode_output, wire.decode_plan):
        with pytest.raises(ValueError, match="does not decode"):
            decode(data)


def test_nothing_in_the_package_unpickles_what_a_rank_sends():
    """torch.distributed's object collectives unpickle; batchinfer sends bytes it decodes.
    The one pickle.loads reads the pipe from a node's own process to the workers it
    started."""
    objects = re.compile(r"\b(broadcast_object_list|all_gather_object|gather_object|"
                         r"scatter_object_list|recv_object_list|send_object_list)\b")
    loads = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert not objects.search(text), path
        loads += [(path.name, line.strip()) for line in text.splitlines()
                  if "pickle.loads" in line or "pickle.load(" in line]
    assert loads == [("tensor_parallel.py", "runner.execute(*pickle.loads(data))")]
