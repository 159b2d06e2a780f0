"""The logprobs column built straight from FlatLogprobs equals the one Arrow builds from
the same logprobs as Python lists of dicts."""
from __future__ import annotations

import pyarrow as pa

from batchinfer.job.writer import (LOGPROB_FIELDS, PROMPT_LOGPROB_FIELDS, _logprob_lists,
                                   to_table)
from batchinfer.outputs import FlatLogprobs


def _flat(positions) -> FlatLogprobs:
    flat = FlatLogprobs()
    for token, top_ids, values, rank, k in positions:
        flat.add(token, top_ids, values, rank, k, lambda t: f"tok{t}" * (t % 3))
    return flat


A = _flat([(5, [5, 9, 2], [-0.1, -2.0, -3.0, -0.1], 1, 3),
           (7, [5, 9, 2], [-0.1, -2.0, -3.0, -4.5], 6, 3)])
B = _flat([(2, [5, 9, 2, 4], [-0.1, -2.0, -3.0, -3.2, -3.0], 3, 2)])
EMPTY = FlatLogprobs()
PROMPT = FlatLogprobs()  # a prompt's: None first
PROMPT.add_none()
PROMPT.add(3, [3, 1], [-0.5, -1.5, -0.5], 1, 1, str)
PROMPT.add(4, [3, 1], [-0.5, -1.5, -2.5], 4, 1, str)
SCHEMA = pa.schema([pa.field("id", pa.int64()), *LOGPROB_FIELDS, *PROMPT_LOGPROB_FIELDS])


def _rows(values, prompt=None):
    return [{"id": i, "cumulative_logprob": -1.0, "logprobs": v, "prompt_logprobs": prompt}
            for i, v in enumerate(values)]


def test_flat_column_equals_the_column_from_python_lists():
    values = [A, None, B, EMPTY, A]
    got = to_table(_rows(values), SCHEMA)
    want = to_table(_rows([_logprob_lists(v) for v in values]), SCHEMA)
    assert got.equals(want)
    assert got.column("logprobs").to_pylist()[2] == [
        [{"token_id": 2, "token": "tok2tok2", "logprob": -3.0, "rank": 3},
         {"token_id": 5, "token": "tok5tok5", "logprob": -0.10000000149011612, "rank": 1},
         {"token_id": 9, "token": "", "logprob": -2.0, "rank": 2}]]
    assert got.column("logprobs").null_count == 1


def test_a_position_with_no_entries_is_null():
    got = to_table(_rows([A, None], PROMPT), SCHEMA)
    want = to_table(_rows([_logprob_lists(A), None], _logprob_lists(PROMPT)), SCHEMA)
    assert got.equals(want)
    assert got.column("prompt_logprobs").to_pylist()[0][0] is None
    assert len(got.column("prompt_logprobs").to_pylist()[1]) == 3


def test_a_column_mixing_flat_and_list_logprobs_is_built_from_lists():
    got = to_table(_rows([A, _logprob_lists(B), None]), SCHEMA)
    want = to_table(_rows([_logprob_lists(A), _logprob_lists(B), None]), SCHEMA)
    assert got.equals(want)
