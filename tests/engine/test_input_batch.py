"""The input batch on its own: rows kept and reused, a step's inputs gathered from them."""
import numpy as np
import pytest

from batchinfer.engine.input_batch import InputBatch
from batchinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def add(batch, req_id, tokens, computed=0, blocks=(), params=GREEDY):
    return batch.add(req_id, list(tokens), len(tokens), computed, list(blocks), params,
                     needs_sampler=False, structured=False)


def test_a_request_keeps_its_row_and_a_freed_row_is_reused():
    batch = InputBatch(4, 64, 8, 4)
    a, b = add(batch, "a", [1, 2]), add(batch, "b", [3])
    assert a != b and batch.row_of == {"a": a, "b": b} and batch.req_ids[a] == "a"
    batch.remove("a")
    batch.remove("a")  # a request without a row: nothing
    assert add(batch, "c", [4]) == a and batch.row_of["b"] == b
    assert batch.tokens(a) == [4] and len(batch) == 2


def test_decodes_come_first_shortest_context_first_then_prefills_in_plan_order():
    batch = InputBatch(4, 64, 8, 4)
    add(batch, "long", range(10, 19), computed=8, blocks=[5, 6, 7])
    add(batch, "prefill", range(20, 26), computed=0, blocks=[1, 2])
    add(batch, "short", range(30, 33), computed=2, blocks=[3])
    rows = batch.rows(["long", "prefill", "short"])
    step = batch.prepare(rows, np.array([1, 6, 1]))
    assert step.order.tolist() == [2, 0, 1] and step.num_decodes == 2
    assert step.starts.tolist() == [2, 8, 0] and step.num_new.tolist() == [1, 1, 6]
    assert step.query_start_loc.tolist() == [0, 1, 2, 8]
    assert step.positions.tolist() == [2, 8, 0, 1, 2, 3, 4, 5]
    assert step.input_ids.tolist() == [32, 18, 20, 21, 22, 23, 24, 25]
    # 9 tokens need 3 blocks of 4: every row's table is cut there, padded with zeros
    assert step.block_tables.tolist() == [[3, 0, 0], [5, 6, 7], [1, 2, 0]]
    assert step.sampling.tolist() == [0, 1, 2]


def test_a_prompt_chunk_that_stops_short_of_its_end_does_not_sample():
    batch = InputBatch(2, 64, 8, 4)
    add(batch, "a", range(10), blocks=[0, 1, 2])
    step = batch.prepare(batch.rows(["a"]), np.array([4]))
    assert step.sampling.tolist() == [] and step.input_ids.tolist() == [0, 1, 2, 3]


def test_sampled_tokens_and_new_blocks_extend_their_rows():
    batch = InputBatch(2, 64, 8, 4)
    a, b = add(batch, "a", [1, 2, 3, 4], blocks=[9]), add(batch, "b", [5], blocks=[8])
    batch.append_tokens(np.array([b, a]), np.array([60, 70]))
    batch.append_blocks(a, [4])
    assert batch.tokens(a) == [1, 2, 3, 4, 70] and batch.output_tokens(a) == [70]
    assert batch.tokens(b) == [5, 60]
    assert batch.block_table[a, :2].tolist() == [9, 4] and batch.num_blocks[a] == 2


def test_token_columns_grow_to_max_model_len_and_no_further(monkeypatch):
    monkeypatch.setattr("batchinfer.engine.input_batch.INITIAL_TOKEN_COLUMNS", 4)
    batch = InputBatch(2, 10, 3, 4)
    row = add(batch, "a", [1, 2, 3])
    assert batch.token_ids.shape[1] == 4
    for t in range(4, 11):
        batch.append_tokens(np.array([row]), np.array([t]))
    assert batch.tokens(row) == list(range(1, 11)) and batch.token_ids.shape[1] == 10
    with pytest.raises(ValueError, match="max_model_len"):
        add(batch, "b", range(11))


def test_sampling_settings_are_kept_per_row_and_counted():
    batch = InputBatch(2, 16, 4, 4)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)
    row = batch.add("a", [1], 1, 0, [], params, needs_sampler=True, structured=True)
    assert (batch.temperature[row], batch.top_k[row]) == (np.float32(0.7), 5)
    assert (batch.top_p[row], batch.min_p[row]) == (np.float32(0.9), np.float32(0.1))
    assert batch.num_needing_sampler == batch.num_structured == 1
    batch.remove("a")
    assert batch.num_needing_sampler == batch.num_structured == 0
