"""A regular expression as an automaton over UTF-8 bytes: a Thompson NFA (a non-ASCII
character is its UTF-8 bytes; `.` and negated classes also take any multi-byte character),
and its DFA, built lazily, one state at a time, as matching reaches it.

Every NFA state can reach the accepting one, so a DFA state that is not empty can still
complete a match.
"""
from __future__ import annotations

from batchinfer.engine.regex_syntax import UTF8_MULTIBYTE, CharSet, parse


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

    def char_set(self, cs: CharSet) -> tuple[int, int]:
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
        for ranges in UTF8_MULTIBYTE:
            at = start
            for j, (lo, hi) in enumerate(ranges):
                nxt = end if j == len(ranges) - 1 else self.state()
                self.edges[at].append((((1 << (hi + 1)) - 1) & ~((1 << lo) - 1), nxt))
                at = nxt


class RegexAutomaton:
    """The pattern's DFA over bytes, built lazily. State 0 is the start; -1 is dead."""

    def __init__(self, pattern: str):
        tree = parse(pattern)
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
