"""Incremental detokenization, used only for requests with stop strings (everything else
is decoded once when it finishes)."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Appends the text of each new token, holding back incomplete UTF-8 sequences, and
    finds stop strings in the new text."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool,
                 include_stop_str_in_output: bool):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; returns the stop string if the text now contains one (the text
        is then cut at it). With check_stop False (min_tokens not reached yet) the text
        only grows."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append(full[len(prefix):], check_stop)

    def flush(self, check_stop: bool = True) -> str | None:
        """The request ends: append what is held back (an incomplete UTF-8 sequence, as the
        tokenizer decodes it, so the text is the one a request without stop strings gets)
        and look for a stop string in it once more; returns the stop string if one is found."""
        if self.read_offset == len(self.ids):
            return None
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return self._append(full[len(prefix):], check_stop)

    def _append(self, new_text: str, check_stop: bool) -> str | None:
        search_from = max(len(self.text) - self.max_stop_len + 1, 0)
        self.text += new_text
        if not check_stop:
            return None
        found = [(pos, stop) for stop in self.stop
                 if (pos := self.text.find(stop, search_from)) >= 0]
        if not found:
            return None
        pos, stop = min(found)  # the stop string that appears first
        self.text = self.text[:pos + len(stop)] if self.include_stop else self.text[:pos]
        return stop
