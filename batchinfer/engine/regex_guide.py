"""Completions that match a regular expression: the regex as an automaton over UTF-8 bytes,
and per automaton state the token ids whose bytes keep a match possible.

The pattern is parsed here (a subset of Python's `re` syntax: literals, escapes, classes,
`.`, groups, alternation and the greedy or lazy quantifiers `* + ? {m} {m,} {m,n}`; the
whole completion must match, so a leading `^` and a trailing `$` change nothing). Other
constructs (backreferences, lookarounds, anchors inside, flags, `\\b`) are refused with a
ValueError naming them. The pattern becomes a Thompson NFA over bytes (a non-ASCII
character is its UTF-8 bytes; `.` and negated classes also take any multi-byte character),
and its DFA is built lazily, one state at a time, as generation reaches it.

Every NFA state can reach the accepting one, so a DFA state that is not empty can still
complete a match: a token is allowed when walking its bytes from the current state never
empties it. The end-of-sequence tokens are allowed where the state accepts. All tokens are
walked together, a column of their bytes at a time (numpy, over the DFA's moves as an
array), and each state's allowed set is kept.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np
import torch

_MAX_REPEAT = 1000
_CONT = (0x80, 0xBF)
# the byte ranges of well-formed multi-byte UTF-8 characters (Unicode table 3-7)
_UTF8_MULTIBYTE = [((0xC2, 0xDF), _CONT), ((0xE0, 0xE0), (0xA0, 0xBF), _CONT),
                   ((0xE1, 0xEC), _CONT, _CONT), ((0xED, 0xED), (0x80, 0x9F), _CONT),
                   ((0xEE, 0xEF), _CONT, _CONT), ((0xF0, 0xF0), (0x90, 0xBF), _CONT, _CONT),
                   ((0xF1, 0xF3), _CONT, _CONT, _CONT), ((0xF4, 0xF4), (0x80, 0x8F), _CONT, _CONT)]
_ALL_BYTES = (1 << 256) - 1
_DIGITS = frozenset("0123456789")
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_SPACE = frozenset(" \t\n\r\f\v")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


@dataclass(frozen=True)
class _CharSet:
    """Characters: `chars` listed, or (negated) every character but those; negated sets
    and `.` also match any non-ASCII character (`chars` of a negated set are ASCII)."""
    chars: frozenset
    negated: bool = False


# ---- parsing: pattern -> tree of ("set", _CharSet) | ("cat", [..]) | ("alt", [..])
#      | ("rep", node, min, max or None)

class _Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"regex {self.p!r}: {what} (at position {self.i})")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.peek() == "$" and self.i == len(self.p) - 1:
            self.i += 1
        if self.i != len(self.p):
            raise self.fail(f"unexpected {self.peek()!r}")
        return node

    def alternation(self):
        branches = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concatenation())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concatenation(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            if self.peek() == "$" and self.i == len(self.p) - 1:
                break
            items.append(self.repetition())
        return ("cat", items)

    def repetition(self):
        node = self.atom()
        while self.peek() is not None and self.peek() in "*+?{":
            c = self.peek()
            if c == "{":
                bounds = self.braces()
                if bounds is None:
                    break  # a literal "{", as in Python
                low, high = bounds
            else:
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() == "?":  # lazy: the same set of matches
                self.i += 1
            elif self.peek() == "+":
                raise self.fail("possessive quantifiers are not supported")
            node = ("rep", node, low, high)
            if self.peek() is not None and self.peek() in "*+?" or (
                    self.peek() == "{" and self.braces_ahead()):
                raise self.fail("multiple repeat")
        return node

    def braces_ahead(self) -> bool:
        """Whether a {m,n} quantifier starts here (else "{" is a literal)."""
        saved = self.i
        try:
            return self.braces() is not None
        finally:
            self.i = saved

    def braces(self) -> tuple[int, int | None] | None:
        end = self.p.find("}", self.i)
        body = self.p[self.i + 1:end] if end > 0 else ""
        low, comma, high = body.partition(",")
        if comma and low == "" and high.isdigit():
            low = "0"  # {,n}, as Python reads it
        if end < 0 or not low.isdigit() or not (high.isdigit() or high == ""):
            return None
        self.i = end + 1
        lo, hi = int(low), (int(high) if high else (None if comma else int(low)))
        if hi is not None and hi < lo:
            raise self.fail(f"bad repeat {{{body}}}")
        if max(lo, hi or 0) > _MAX_REPEAT:
            raise self.fail(f"repeats above {_MAX_REPEAT} are not supported")
        return lo, hi

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.p.startswith("?:", self.i):
                    self.i += 2
                elif self.p.startswith("?P<", self.i):
                    self.i = self.p.index(">", self.i) + 1
                else:
                    raise self.fail("lookarounds, flags and other (?...) groups are not "
                                    "supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("missing )")
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", _CharSet(frozenset("\n"), negated=True))
        if c == "\\":
            return ("set", self.escape())
        if c in "*+?":
            raise self.fail(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.fail(f"{c!r} inside the pattern is not supported (the whole "
                            "completion is matched)")
        if c == ")":
            raise self.fail("unbalanced )")
        return ("set", _CharSet(frozenset(c)))

    def escape(self) -> _CharSet:
        if self.peek() is None:
            raise self.fail("pattern ends with a backslash")
        c = self.take()
        classes = {"d": _DIGITS, "w": _WORD, "s": _SPACE}
        if c in classes:
            return _CharSet(classes[c])
        if c.lower() in classes:
            return _CharSet(classes[c.lower()], negated=True)
        if c == "0":  # \0, \0o, \0oo: octal, as in Python
            digits = "0"
            while len(digits) < 3 and self.peek() is not None and self.peek() in "01234567":
                digits += self.take()
            return _CharSet(frozenset(chr(int(digits, 8))))
        if c in _ESCAPES:
            return _CharSet(frozenset(_ESCAPES[c]))
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"bad \\{c} escape")
            self.i += width
            return _CharSet(frozenset(chr(int(digits, 16))))
        if c.isalnum():
            raise self.fail(f"\\{c} is not supported")
        return _CharSet(frozenset(c))

    def char_class(self) -> _CharSet:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        chars: set[str] = set()
        negated_parts: list[frozenset] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.fail("missing ]")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "\\":
                self.i += 1
                part = self.escape()
                if part.negated:
                    negated_parts.append(part.chars)
                    continue
                low = next(iter(part.chars)) if len(part.chars) == 1 else None
                if low is None:
                    chars |= part.chars
                    continue
            else:
                low = self.take()
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                high = self.take()
                if high == "\\":
                    part = self.escape()
                    if len(part.chars) != 1 or part.negated:
                        raise self.fail("bad range in class")
                    high = next(iter(part.chars))
                if ord(high) < ord(low):
                    raise self.fail(f"bad range {low}-{high}")
                if ord(high) - ord(low) > 4096:
                    raise self.fail("class ranges wider than 4096 characters are not supported")
                chars |= {chr(o) for o in range(ord(low), ord(high) + 1)}
            else:
                chars.add(low)
        if negated_parts:  # [\D], [^\s] ...: only in a set of their own
            if chars or len(negated_parts) > 1 or negated:
                raise self.fail("\\D, \\W or \\S mixed with other members of a class is not "
                                "supported")
            return _CharSet(negated_parts[0], negated=True)
        if negated and any(ord(ch) > 127 for ch in chars):
            raise self.fail("non-ASCII characters in a negated class are not supported")
        if not chars and not negated:
            raise self.fail("empty class")
        return _CharSet(frozenset(chars), negated)


# ---- NFA over bytes ---------------------------------------------------------------

class _NFA:
    """States 0..n-1; `edges[s]`: (byte mask, target) pairs; `eps[s]`: epsilon targets."""

    def __init__(self):
        self.edges: list[list[tuple[int, int]]] = []
        self.eps: list[list[int]] = []

    def state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, node) -> tuple[int, int]:
        """(start, end) of a fragment matching node."""
        kind = node[0]
        if kind == "set":
            return self.char_set(node[1])
        if kind == "cat":
            start = end = self.state()
            for item in node[1]:
                s, e = self.build(item)
                self.eps[end].append(s)
                end = e
            return start, end
        if kind == "alt":
            start, end = self.state(), self.state()
            for branch in node[1]:
                s, e = self.build(branch)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        _, inner, low, high = node
        start = end = self.state()
        for _ in range(low):
            s, e = self.build(inner)
            self.eps[end].append(s)
            end = e
        if high is None:  # then any number more
            s, e = self.build(inner)
            self.eps[end].append(s)
            self.eps[e].append(s)
            out = self.state()
            self.eps[end].append(out)
            self.eps[e].append(out)
            return start, out
        out = self.state()
        for _ in range(high - low):
            self.eps[end].append(out)
            s, e = self.build(inner)
            self.eps[end].append(s)
            end = e
        self.eps[end].append(out)
        return start, out

    def char_set(self, cs: _CharSet) -> tuple[int, int]:
        start, end = self.state(), self.state()
        ascii_mask = 0
        for ch in cs.chars:
            if ord(ch) < 128:
                ascii_mask |= 1 << ord(ch)
        if cs.negated:
            ascii_mask = ~ascii_mask & ((1 << 128) - 1)
            self.any_multibyte(start, end)
        else:
            for ch in cs.chars:
                if ord(ch) >= 128:
                    self.path(start, end, ch.encode("utf-8"))
        if ascii_mask:
            self.edges[start].append((ascii_mask, end))
        return start, end

    def path(self, start: int, end: int, data: bytes) -> None:
        at = start
        for j, b in enumerate(data):
            nxt = end if j == len(data) - 1 else self.state()
            self.edges[at].append((1 << b, nxt))
            at = nxt

    def any_multibyte(self, start: int, end: int) -> None:
        """Any well-formed UTF-8 character of two to four bytes (no overlong forms, no
        surrogates, nothing above U+10FFFF)."""
        for ranges in _UTF8_MULTIBYTE:
            at = start
            for j, (lo, hi) in enumerate(ranges):
                nxt = end if j == len(ranges) - 1 else self.state()
                self.edges[at].append((((1 << (hi + 1)) - 1) & ~((1 << lo) - 1), nxt))
                at = nxt


def _parse(pattern: str):
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"regex must be a non-empty string, got {pattern!r}")
    return _Parser(pattern).parse()


@functools.lru_cache(maxsize=256)
def check_pattern(pattern: str) -> None:
    """Raise ValueError naming what in the pattern is not supported (parsing only: the
    automaton is built once per pattern, by the engine)."""
    _parse(pattern)


class RegexAutomaton:
    """The pattern's DFA over bytes, built lazily. State 0 is the start; -1 is dead."""

    def __init__(self, pattern: str):
        tree = _parse(pattern)
        self.nfa = _NFA()
        start, self.accept = self.nfa.build(tree)
        self.sets: list[frozenset[int]] = []
        self.ids: dict[frozenset[int], int] = {}
        self.moves: list[dict[int, int]] = []
        self.accepting: list[bool] = []
        self._intern(self._closure({start}))

    def _closure(self, states) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def _intern(self, states: frozenset[int]) -> int:
        if not states:
            return -1
        sid = self.ids.get(states)
        if sid is None:
            sid = self.ids[states] = len(self.sets)
            self.sets.append(states)
            self.moves.append({})
            self.accepting.append(self.accept in states)
        return sid

    def step(self, state: int, byte: int) -> int:
        if state < 0:
            return -1
        moves = self.moves[state]
        nxt = moves.get(byte)
        if nxt is None:
            bit = 1 << byte
            targets = {t for s in self.sets[state] for mask, t in self.nfa.edges[s]
                       if mask & bit}
            nxt = moves[byte] = self._intern(self._closure(targets)) if targets else -1
        return nxt

    def matches(self, data: bytes) -> bool:
        state = 0
        for b in data:
            state = self.step(state, b)
        return state >= 0 and self.accepting[state]


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
        self._moves = np.full((16, 256), _UNKNOWN, dtype=np.int64)
        # per state and device, the allowed ids (end-of-sequence included where it
        # accepts); states with the same set share one tensor
        self._tensors: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._shared: dict[tuple[bytes, torch.device], torch.Tensor] = {}

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
            pairs = np.unique(states[unknown] * 256 + data[unknown])
            targets = [self.automaton.step(pair // 256, pair % 256) for pair in pairs.tolist()]
            self._cover_states()
            self._moves[pairs // 256, pairs % 256] = targets
            nxt = self._moves[states, data]
        return nxt

    def _cover_states(self) -> None:
        """Grow the moves table to a row for every state the automaton has."""
        count = len(self.automaton.sets)
        if count > len(self._moves):
            grown = np.full((2 * count, 256), _UNKNOWN, dtype=np.int64)
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

    def next_tokens(self, generated: list[int], eos_token_ids: frozenset[int],
                    device: torch.device) -> torch.Tensor:
        """The token ids that may follow `generated` (a tensor on device)."""
        if len(generated) < self.consumed:  # started again (cannot happen: tokens only grow)
            self.state, self.consumed = 0, 0
        for token in generated[self.consumed:]:
            if self.state >= 0:
                self.state = self.guide.advance(self.state, token)
        self.consumed = len(generated)
        # off the pattern (cannot happen: every token came from it): only an end remains
        return self.guide.next_tokens(self.state, eos_token_ids, device)
