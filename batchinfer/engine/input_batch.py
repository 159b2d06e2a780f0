"""The model runner's requests as rows of preallocated arrays (as vLLM V1's InputBatch):
token ids, tokens computed, block table rows and sampling settings.

A request holds one row from when the runner first sees it (or sees it again after a
preemption) until it finishes or is preempted; freed rows are reused. Rows change only by
what a plan or a sample changes (new blocks, computed counts, one sampled token), each with
an array operation, so a step gathers its inputs (prepare) with a few vectorised operations
and no loop over its requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchinfer.sampling_params import SamplingParams

# token-id columns a row starts with; they grow (doubling) up to max_model_len as
# requests do, so a long max_model_len costs memory only once a request is that long
INITIAL_TOKEN_COLUMNS = 2048


@dataclass
class StepInputs:
    """One step's requests as the model sees them: decodes first, shortest context first
    (the attention backends group by length), then the others in plan order."""
    order: np.ndarray         # [S] index into the plan's requests of each sequence
    rows: np.ndarray          # [S] their batch rows
    starts: np.ndarray        # [S] int64 tokens computed before this step
    num_new: np.ndarray       # [S] int64 tokens computed in it
    num_decodes: int          # sequences [0, num_decodes) compute one token
    query_start_loc: np.ndarray  # [S + 1] int64
    positions: np.ndarray     # [T] int64 position of every new token
    input_ids: np.ndarray     # [T] int64
    block_tables: np.ndarray  # [S, blocks the longest context needs] int32
    sampling: np.ndarray      # indices into [0, S) of the sequences whose tokens reach their end


def query_positions(starts: np.ndarray, num_new: np.ndarray,
                    all_decode: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(query_start_loc, position of every new token) for sequences that compute num_new
    tokens from position starts (all_decode: every num_new is 1)."""
    if all_decode:
        return np.arange(len(num_new) + 1, dtype=np.int64), starts
    qsl = np.zeros(len(num_new) + 1, dtype=np.int64)
    np.cumsum(num_new, out=qsl[1:])
    positions = np.arange(qsl[-1], dtype=np.int64) + np.repeat(starts - qsl[:-1], num_new)
    return qsl, positions


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_seq: int,
                 block_size: int):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.token_ids = np.zeros((max_num_reqs, min(max_model_len, INITIAL_TOKEN_COLUMNS)),
                                  dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # int32, as the attention backends take it: a step's slice needs no conversion
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        # rows whose request needs more of the sampler than an argmax
        self.needs_sampler = np.zeros(max_num_reqs, dtype=bool)
        self.num_needing_sampler = 0
        self.structured = np.zeros(max_num_reqs, dtype=bool)  # a structured output's rows
        self.num_structured = 0
        # how many requests each row has held: a deferred step's tokens go only to rows
        # still held by the requests that sampled them
        self.row_epoch = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    # ---- rows coming and going ---------------------------------------------------------
    def add(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
            num_computed_tokens: int, block_ids: list[int], params: SamplingParams, *,
            needs_sampler: bool, structured: bool) -> int:
        """Give a request a row holding its tokens so far and its blocks; returns the row."""
        row = self._free_rows.pop()
        self.row_epoch[row] += 1
        n = len(token_ids)
        self._reserve(n)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.needs_sampler[row] = needs_sampler
        self.num_needing_sampler += needs_sampler
        self.structured[row] = structured
        self.num_structured += structured
        self.req_ids[row] = req_id
        self.row_of[req_id] = row
        return row

    def remove(self, req_id: str) -> None:
        """Free a request's row (nothing for a request without one)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.num_needing_sampler -= bool(self.needs_sampler[row])
        self.num_structured -= bool(self.structured[row])
        self.needs_sampler[row] = self.structured[row] = False
        self.req_ids[row] = None
        self._free_rows.append(row)

    def _reserve(self, num_tokens: int) -> None:
        cols = self.token_ids.shape[1]
        if num_tokens <= cols:
            return
        if num_tokens > self.max_model_len:
            raise ValueError(f"a request of {num_tokens} tokens exceeds max_model_len "
                             f"({self.max_model_len})")
        grown = np.zeros((self.token_ids.shape[0], min(self.max_model_len,
                                                       max(num_tokens, 2 * cols))),
                         dtype=np.int32)
        grown[:, :cols] = self.token_ids
        self.token_ids = grown

    # ---- rows changing ---------------------------------------------------------------
    def rows(self, req_ids) -> np.ndarray:
        """The rows of req_ids (an iterable of ids with rows), as an int64 array."""
        return np.fromiter(map(self.row_of.__getitem__, req_ids), dtype=np.int64)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One token more in each row of rows (distinct rows)."""
        if len(rows) == 0:
            return
        ends = self.num_tokens[rows]
        self._reserve(int(ends.max()) + 1)
        self.token_ids[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1

    def tokens(self, row: int, start: int = 0, end: int | None = None) -> list[int]:
        """A row's token ids [start, end) (to its last token by default), as a list."""
        end = int(self.num_tokens[row]) if end is None else end
        return self.token_ids[row, start:end].tolist()

    def output_tokens(self, row: int) -> list[int]:
        return self.tokens(row, int(self.num_prompt_tokens[row]))

    # ---- a step ----------------------------------------------------------------------
    def prepare(self, rows: np.ndarray, num_new: np.ndarray) -> StepInputs:
        """The inputs of a step that computes num_new tokens of each of rows (the plan's
        requests, in its order) from their computed tokens."""
        starts = self.num_computed_tokens[rows]
        decode = num_new == 1
        num_decodes = int(decode.sum())
        if num_decodes == len(rows):
            order = np.argsort(starts, kind="stable")
        else:
            decodes, others = np.flatnonzero(decode), np.flatnonzero(~decode)
            order = np.concatenate([decodes[np.argsort(starts[decodes], kind="stable")],
                                    others])
        rows, starts, num_new = rows[order], starts[order], num_new[order]
        all_decode = num_decodes == len(rows)
        qsl, positions = query_positions(starts, num_new, all_decode)
        token_rows = rows if all_decode else np.repeat(rows, num_new)
        input_ids = self.token_ids[token_rows, positions].astype(np.int64)
        ends = starts + num_new
        max_blocks = -(-int(ends.max()) // self.block_size)
        return StepInputs(order, rows, starts, num_new, num_decodes, qsl, positions, input_ids,
                          self.block_table[rows, :max_blocks],
                          np.flatnonzero(ends == self.num_tokens[rows]))
