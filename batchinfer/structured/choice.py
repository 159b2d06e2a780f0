"""Completions that are exactly one of a list of choices: the choices' token ids as a trie."""
from __future__ import annotations

import numpy as np

from batchinfer.structured.grammar import set_tokens


class ChoiceTrie:
    """The token sequences a structured-output choice allows, as a trie: which tokens may
    follow what was generated so far (the end-of-sequence tokens once a choice is
    complete). Kept beside llguidance because it is faster for a few labels and holds
    each choice to the one encoding that decodes to exactly its text."""

    error = None  # a trie is built whole: nothing can fail later

    def __init__(self, choices: list[list[int]]):
        self.root: dict = {}
        for ids in choices:
            node = self.root
            for t in ids:
                node = node.setdefault(t, {})
            node[None] = True  # a choice ends here

    def next_tokens(self, generated: list[int], eos_token_ids: frozenset[int]) -> list[int]:
        node = self.root
        for t in generated:
            node = node.get(t)
            if node is None:  # off the trie (cannot happen: every token came from it)
                return sorted(eos_token_ids)
        allowed = [t for t in node if t is not None]
        if None in node:
            allowed += sorted(eos_token_ids)
        return allowed

    def fill(self, generated: list[int], eos_token_ids: frozenset[int],
             row: np.ndarray) -> bool:
        """Writes the allowed tokens into a bitmask row (batchinfer.structured.grammar)."""
        set_tokens(row, self.next_tokens(generated, eos_token_ids))
        return True

    deferred = fill  # (nothing to compute later: grammar.GrammarMatcher.deferred)
