"""A structured output that starts once the reasoning has ended."""
from __future__ import annotations

import numpy as np


class AfterReasoning:
    """Wraps a choice trie or grammar matcher: until `end_token_id` (a reasoning parser's
    `</think>`) is generated any token may follow (fill leaves the row and returns False);
    after it the wrapped structure constrains what follows, as if the completion started
    there."""

    def __init__(self, inner, end_token_id: int):
        self.inner = inner
        self.end_token_id = end_token_id
        self.start: int | None = None  # where the structured part of `generated` starts
        self.scanned = 0

    @property
    def error(self) -> str | None:
        return self.inner.error

    def fill(self, generated: list[int], eos_token_ids: frozenset[int],
             row: np.ndarray) -> bool:
        if not self._started(generated):
            return False
        return self.inner.fill(generated[self.start:], eos_token_ids, row)

    def deferred(self, generated: list[int], eos_token_ids: frozenset[int], row: np.ndarray):
        """As the wrapped structure's (grammar.GrammarMatcher.deferred); False before the
        reasoning ends."""
        if not self._started(generated):
            return False
        return self.inner.deferred(generated[self.start:], eos_token_ids, row)

    def _started(self, generated: list[int]) -> bool:
        if self.start is None:
            try:
                self.start = generated.index(self.end_token_id, self.scanned) + 1
            except ValueError:
                self.scanned = len(generated)
                return False
        return True
