"""Completions that match a regular expression: per state of the pattern's automaton
(batchinfer/structured/regex_automaton.py), the token ids whose bytes keep a match possible.

A token is allowed when walking its bytes from the current state never empties it. The
end-of-sequence tokens are allowed where the state accepts. All tokens are walked together,
a column of their bytes at a time (numpy, over the DFA's moves as an array), and each
state's allowed set is kept, up to MAX_DFA_STATES states a pattern.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from batchinfer.structured.regex_automaton import RegexAutomaton
from batchinfer.structured.regex_syntax import RegexTooLarge

# The DFA states a guide keeps, with their moves and allowed tokens (about 4 KB a state
# of a JSON schema's: 40 MB in all). Past this they are all forgotten and built again as
# matching reaches them, so a pattern that keeps reaching new states (a counted repeat
# over long completions: a state per count) holds bounded memory over a whole job.
MAX_DFA_STATES = 10_000
# Seconds one completion's step may spend building the automaton (a state of a JSON
# schema's takes well under a millisecond; the allowed tokens of a state about 10 ms).
# Past it the completion ends with an error naming the limit, and the pattern is refused
# to later requests: a pattern whose DFA blows up costs its rows, not the job, and a stop
# signal waits for at most about this long.
BUILD_SECONDS = 5.0


# ---- tokens -------------------------------------------------------------------------

def _byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet (GPT-2's bytes_to_unicode)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each token id's bytes as it adds them to a completion; None for special tokens.
    Byte-level BPE (GPT-2, Llama 3, Qwen) and SentencePiece-style (`▁` for a space,
    `<0xNN>` byte fallback) vocabularies are read exactly."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    byte_level = "ByteLevel" in json.dumps(decoder)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {tid for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(added, "special", False)}
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    table = _byte_decoder() if byte_level else None
    out: list[bytes | None] = []
    for tid, piece in enumerate(pieces):
        if piece is None or tid in special:
            out.append(None)
        elif table is not None and all(ch in table for ch in piece):
            out.append(bytes(table[ch] for ch in piece))
        elif (len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
              and not byte_level):
            out.append(bytes([int(piece[3:5], 16)]))
        elif byte_level:  # an added token outside the alphabet: its text as it is
            out.append(piece.encode("utf-8"))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


class VocabBytes:
    """The vocabulary's byte strings as one padded array, for walking every token through
    an automaton at once: a column of bytes a step. Rows are sorted by first byte, so the
    tokens starting with a byte are one slice (starts[b]:starts[b + 1])."""

    def __init__(self, pieces: list[bytes | None]):
        self.pieces = pieces  # each token id's bytes (None: never allowed)
        ids = sorted((tid for tid, data in enumerate(pieces) if data),
                     key=lambda tid: pieces[tid][0])
        self.ids = np.asarray(ids, dtype=np.int64)
        self.lengths = np.asarray([len(pieces[tid]) for tid in ids], dtype=np.int64)
        width = int(self.lengths.max()) if ids else 0
        self.matrix = np.zeros((len(ids), width), dtype=np.uint8)
        flat = np.frombuffer(b"".join(pieces[tid] for tid in ids), dtype=np.uint8)
        rows = np.repeat(np.arange(len(ids)), self.lengths)
        cols = np.arange(flat.size) - np.repeat(np.cumsum(self.lengths) - self.lengths,
                                                self.lengths)
        self.matrix[rows, cols] = flat
        first = self.matrix[:, 0] if width else np.zeros(0, dtype=np.uint8)
        self.starts = np.searchsorted(first, np.arange(257))


_UNKNOWN = -2  # a transition not yet taken in the automaton


class RegexGuide:
    """Which tokens a completion may take next to keep matching the pattern."""

    def __init__(self, pattern: str, vocab: VocabBytes):
        self.pattern = pattern
        self.automaton = RegexAutomaton(pattern)
        self.vocab = vocab
        self.pieces = vocab.pieces
        # the automaton's moves as an array [states, 256] (-1 dead, _UNKNOWN not yet
        # computed), grown as states appear, for stepping many tokens at once
        self._moves = np.full((16, 256), _UNKNOWN, dtype=np.int32)
        # per state and device, the allowed ids (end-of-sequence included where it
        # accepts); states with the same set share one tensor
        self._tensors: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._shared: dict[tuple[bytes, torch.device], torch.Tensor] = {}
        self.error: str | None = None  # the limit the automaton passed, if it did

    def make_room(self) -> None:
        """Past MAX_DFA_STATES, forget every state (the automaton's epoch changes: a
        RegexMatcher then finds its state again from its configurations)."""
        if len(self.automaton.sets) > MAX_DFA_STATES:
            self.automaton.forget()
            self._moves = np.full((16, 256), _UNKNOWN, dtype=np.int32)
            self._tensors.clear()
            self._shared.clear()

    def advance(self, state: int, token: int) -> int:
        data = self.pieces[token] if 0 <= token < len(self.pieces) else None
        if data is None:
            return -1
        for b in data:
            state = self.automaton.step(state, b)
            if state < 0:
                break
        return state

    def _step_many(self, states: np.ndarray, data: np.ndarray) -> np.ndarray:
        """automaton.step over arrays of live states and bytes; each distinct pair not
        taken before is computed once."""
        self._cover_states()  # advance() may have made states the table has not seen
        nxt = self._moves[states, data]
        unknown = nxt == _UNKNOWN
        if unknown.any():
            pairs = np.unique(states[unknown].astype(np.int64) * 256 + data[unknown])
            targets = [self.automaton.step(pair // 256, pair % 256) for pair in pairs.tolist()]
            self._cover_states()
            self._moves[pairs // 256, pairs % 256] = targets
            nxt = self._moves[states, data]
        return nxt

    def _cover_states(self) -> None:
        """Grow the moves table to a row for every state the automaton has."""
        count = len(self.automaton.sets)
        if count > len(self._moves):
            grown = np.full((2 * count, 256), _UNKNOWN, dtype=np.int32)
            grown[:len(self._moves)] = self._moves
            self._moves = grown

    def allowed(self, state: int) -> np.ndarray:
        """Token ids (not end-of-sequence), sorted, whose bytes keep a match possible from
        state: the tokens starting with a byte the state can take, then all of them stepped
        through the automaton together, a byte column at a time, dropped where they die
        (numpy; the automaton is asked only for moves not taken before)."""
        vocab = self.vocab
        after_first = self._step_many(np.full(256, state, dtype=np.int64),
                                      np.arange(256, dtype=np.uint8))
        live = np.flatnonzero(after_first >= 0)
        if not len(live):
            return vocab.ids[:0]
        counts = vocab.starts[live + 1] - vocab.starts[live]
        rows = np.repeat(vocab.starts[live] - np.cumsum(counts) + counts, counts) \
            + np.arange(int(counts.sum()))
        states = np.repeat(after_first[live], counts)
        kept = []
        for col in range(1, vocab.matrix.shape[1] + 1):
            ended = vocab.lengths[rows] == col
            if ended.any():
                kept.append(rows[ended])
                rows, states = rows[~ended], states[~ended]
            if not len(rows):
                break
            states = self._step_many(states, vocab.matrix[rows, col])
            alive = states >= 0
            rows, states = rows[alive], states[alive]
        return np.sort(vocab.ids[np.concatenate(kept)]) if kept else vocab.ids[:0]

    def next_tokens(self, state: int, eos_token_ids: frozenset[int],
                    device: torch.device) -> torch.Tensor:
        """allowed(state), with the end-of-sequence tokens where the state accepts (or
        where nothing else can follow), as a tensor on device, made once per state."""
        key = (state, device)
        ids = self._tensors.get(key)
        if ids is None:
            allowed = self.allowed(state) if state >= 0 else np.zeros(0, dtype=np.int64)
            if state < 0 or self.automaton.accepting[state] or not len(allowed):
                allowed = np.concatenate([allowed, np.asarray(sorted(eos_token_ids),
                                                              dtype=np.int64)])
            packed = allowed.astype(np.int32).tobytes()
            ids = self._shared.get((packed, device))
            if ids is None:
                ids = self._shared[(packed, device)] = \
                    torch.from_numpy(allowed.astype(np.int64)).to(device)
            self._tensors[key] = ids
        return ids


class RegexMatcher:
    """One completion's place in a RegexGuide, advanced by the tokens it generates."""

    def __init__(self, guide: RegexGuide):
        self.guide = guide
        self.state = 0
        self.consumed = 0
        self.epoch = guide.automaton.epoch
        self.configs = guide.automaton.sets[0]  # the state's, to find it after an epoch
        self.error: str | None = None

    def next_tokens(self, generated: list[int], eos_token_ids: frozenset[int],
                    device: torch.device) -> torch.Tensor:
        """The token ids that may follow `generated` (a tensor on device). Where building
        the automaton passes a limit (BUILD_SECONDS, or the size of a state), only an end
        may follow: `error` names the limit, for the engine to fail the completion, and
        the guide keeps it, to fail its other completions at their next token (each would
        spend the time again) and to refuse the pattern to later requests."""
        guide = self.guide
        if self.error is None and guide.error is not None:
            self.error = guide.error
        if self.error is None:
            try:
                with guide.automaton.time_limit(BUILD_SECONDS):
                    return self._next_tokens(generated, eos_token_ids, device)
            except RegexTooLarge as e:
                self.error = guide.error = str(e)
        return guide.next_tokens(-1, eos_token_ids, device)

    def _next_tokens(self, generated: list[int], eos_token_ids: frozenset[int],
                     device: torch.device) -> torch.Tensor:
        guide, automaton = self.guide, self.guide.automaton
        guide.make_room()
        if self.epoch != automaton.epoch:
            self.epoch = automaton.epoch
            self.state = automaton.intern(self.configs)
        if len(generated) < self.consumed:  # started again (cannot happen: tokens only grow)
            self.state, self.consumed = 0, 0
        for token in generated[self.consumed:]:
            if self.state >= 0:
                self.state = guide.advance(self.state, token)
        self.consumed = len(generated)
        self.configs = automaton.sets[self.state] if self.state >= 0 else frozenset()
        # off the pattern (cannot happen: every token came from it): only an end remains
        return guide.next_tokens(self.state, eos_token_ids, device)
