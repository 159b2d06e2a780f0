"""FlatLogprobs: logprobs kept in flat lists and read as vLLM's list of {token_id: Logprob}
dicts; and a generate() with logprobs and prompt logprobs making no Logprob per entry."""
from __future__ import annotations

import gc
import pickle

import pytest

from batchinfer import LLM, Logprob, SamplingParams
from batchinfer.outputs import FlatLogprobs


def _text(token: int) -> str:
    return f"<{token}>"


def _dicts(token, top_ids, values, rank, k):
    """The position as a dict, built the plain way: the sampled token, then the top k."""
    record = {token: Logprob(values[-1], rank, _text(token))}
    for r in range(k):
        if top_ids[r] not in record:
            record[top_ids[r]] = Logprob(values[r], r + 1, _text(top_ids[r]))
    return record


# (sampled token, top ids, values (the top ones', then the token's), the token's rank, k);
# top ids may run past k (the batch's largest k)
POSITIONS = [
    (5, [5, 9, 2], [-0.1, -2.0, -3.0, -0.1], 1, 3),     # the top one
    (2, [5, 9, 2], [-0.1, -2.0, -3.0, -3.0], 3, 3),     # the last of the top k
    (9, [5, 9, 2], [-0.1, -2.0, -3.0, -2.0], 2, 3),     # in the middle
    (7, [5, 9, 2], [-0.1, -2.0, -3.0, -4.5], 6, 3),     # not among them
    (2, [5, 9, 2, 4], [-0.1, -2.0, -3.0, -3.2, -3.0], 3, 2),  # past k: not among its k
    (5, [5, 9], [-0.1, -2.0, -0.1], 1, 0),              # k = 0: the token alone
]


def test_positions_read_as_the_dicts_built_the_plain_way():
    flat = FlatLogprobs()
    for p in POSITIONS:
        flat.add(*p, _text)
    expected = [_dicts(*p) for p in POSITIONS]
    assert len(flat) == len(expected)
    for got, want in zip(flat, expected):
        assert list(got) == list(want)  # the sampled token first, then by rank
        assert got == want
    assert flat == expected and expected == flat
    assert flat[-1] == expected[-1] and flat[1:3] == expected[1:3]
    assert flat.starts == [0, 3, 6, 9, 13, 16, 17]
    with pytest.raises(IndexError):
        flat[len(expected)]
    assert flat != expected[:-1]
    assert pickle.loads(pickle.dumps(flat)) == expected  # outputs cross process boundaries


def test_a_position_with_no_entries_reads_as_none():
    flat = FlatLogprobs()
    flat.add_none()
    flat.add(*POSITIONS[0], _text)
    flat.add_none()
    assert list(flat) == [None, _dicts(*POSITIONS[0]), None]
    assert flat[0] is None and flat[-1] is None


def test_a_section_keeps_positions_compactly_and_extends_another_as_they_were():
    flat = FlatLogprobs()
    flat.add_none()
    for p in POSITIONS:
        flat.add(*p, _text)
    kept = flat.section(0, 4)  # None and three positions, in arrays
    assert list(kept) == list(flat[:4]) and kept.starts[0] == 0
    assert pickle.loads(pickle.dumps(kept)) == flat[:4]
    rebuilt = FlatLogprobs()
    rebuilt.extend(kept, 0, 2)
    rebuilt.extend(kept, 2)
    rebuilt.extend(flat.section(4, len(flat)))
    assert rebuilt == flat and rebuilt.starts == flat.starts
    assert all(type(x) is list for x in (rebuilt.token_ids, rebuilt.logprobs, rebuilt.ranks))


def test_generate_keeps_no_logprob_object_per_entry(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", seed=0)
    outs = llm.generate(["a b c", "d e"], SamplingParams(max_tokens=6, ignore_eos=True,
                                                         temperature=0.0, logprobs=5,
                                                         prompt_logprobs=2))
    gc.collect()
    assert not any(type(o) is Logprob for o in gc.get_objects())
    for out in outs:
        steps = out.outputs[0].logprobs
        assert isinstance(steps, FlatLogprobs) and len(steps) == 6
        assert list(steps.starts) == sorted(steps.starts)
        for token, step in zip(out.outputs[0].token_ids, steps):
            assert next(iter(step)) == token and 5 <= len(step) <= 6
            assert step[token].decoded_token == llm.get_tokenizer().decode([token])
        prompt = out.prompt_logprobs
        assert isinstance(prompt, FlatLogprobs) and len(prompt) == len(out.prompt_token_ids)
        assert prompt[0] is None
        for token, step in zip(out.prompt_token_ids[1:], prompt[1:]):
            assert next(iter(step)) == token and 2 <= len(step) <= 3
        assert out.outputs[0].cumulative_logprob == pytest.approx(
            sum(step[t].logprob for t, step in zip(out.outputs[0].token_ids, steps)), abs=1e-5)
