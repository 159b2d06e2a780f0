"""A regular expression as an automaton over UTF-8 bytes: an NFA with counters (a non-ASCII
character is its UTF-8 bytes; `.` and negated classes also take any multi-byte character),
and its DFA, built lazily, one state at a time, as matching reaches it.

A counted repeat `x{m,n}` is built once, with a counter, instead of n copies of x: the
NFA is read in configurations, (NFA state, the counts of the counted repeats around it),
and a DFA state is a set of them. Of the configurations of one NFA state, a DFA state
keeps those with a count below the repeat's minimum and, of the others, the least (having
done more repeats can only allow less), so `.{0,1000}` gives one configuration a state.

Every NFA state can reach the accepting one, so a DFA state that is not empty can still
complete a match.

Bounds (each a RegexTooLarge naming it): the NFA's size is checked from the tree before
it is built (regex_syntax.MAX_NFA_STATES); a DFA state holds at most
MAX_DFA_STATE_SIZE configurations; and building stops at `deadline` (time.monotonic()),
which the caller sets and clears around its work.
"""
from __future__ import annotations

import contextlib
import time

from batchinfer.structured.regex_syntax import (MAX_NFA_STATES, UTF8_MULTIBYTE, CharSet,
                                                RegexTooLarge, check_size, parse)

# The most configurations one DFA state may hold: as many as the NFA states the size
# check allows, which bounds a state exactly unless counted repeats nest (there the check
# assumes one count per level, as an array of bounded strings has).
MAX_DFA_STATE_SIZE = MAX_NFA_STATES


# ---- NFA over bytes ---------------------------------------------------------------

class _NFA:
    """States 0..n-1; `edges[s]`: (byte mask, target) pairs; `eps[s]`: epsilon targets.
    A counted repeat has a counter: its entry state (in `push`) starts a count of 0, its
    loop state (`loops[s]` = (min, max or None, body start, exit)) starts another repeat
    (count + 1, held at min where there is no max) while count < max, and leaves,
    dropping the count, once count >= min. `mins[s]`: the minimum of each counter around
    state s, innermost last."""

    def __init__(self):
        self.edges: list[list[tuple[int, int]]] = []
        self.eps: list[list[int]] = []
        self.push: set[int] = set()
        self.loops: dict[int, tuple[int, int | None, int, int]] = {}
        self.mins: list[tuple[int, ...]] = []
        self._around: tuple[int, ...] = ()  # the counters around the fragment being built

    def state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        self.mins.append(self._around)
        return len(self.edges) - 1

    def build(self, node) -> tuple[int, int]:
        """(start, end) of a fragment matching node: as many states as
        regex_syntax.measure counts for it, before it weighs counted repeats."""
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
        if high == 0:
            start = self.state()
            return start, start
        if (low, high) in ((0, 1), (0, None), (1, None)):  # ?, *, +
            start, out = self.state(), self.state()
            s, e = self.build(inner)
            self.eps[start].append(s)
            if low == 0:
                self.eps[start].append(out)
            if high is None:
                self.eps[e].append(s)
            self.eps[e].append(out)
            return start, out
        start = self.state()
        self.push.add(start)
        self._around += (low,)
        loop = self.state()
        s, e = self.build(inner)
        self._around = self._around[:-1]
        out = self.state()
        self.eps[start].append(loop)
        self.eps[e].append(loop)
        self.loops[loop] = (low, high, s, out)
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


# a configuration: (NFA state, the counts of the counters around it, innermost last)
_Config = tuple[int, tuple[int, ...]]


class RegexAutomaton:
    """The pattern's DFA over bytes, built lazily. State 0 is the start; -1 is dead.
    `forget()` drops every state (the start is built again as 0) and bumps `epoch`;
    `intern(configs)` gives a state's id from its configurations, after it too."""

    def __init__(self, pattern: str):
        tree = parse(pattern)
        check_size(tree)  # before building anything
        self.nfa = _NFA()
        self.start, self.accept = self.nfa.build(tree)
        self.deadline: float | None = None
        self._limit_s = 0.0
        self.epoch = 0
        self._reset()

    def forget(self) -> None:
        self._reset()
        self.epoch += 1

    def _reset(self) -> None:
        start = self._closure({(self.start, ())})  # first: if it raises, nothing changed
        self.sets: list[frozenset[_Config]] = [start]
        self.ids: dict[frozenset[_Config], int] = {start: 0}
        self.moves: list[dict[int, int]] = [{}]
        self.accepting: list[bool] = [(self.accept, ()) in start]

    @contextlib.contextmanager
    def time_limit(self, seconds: float):
        """Building stops with RegexTooLarge once `seconds` have passed (inside another
        time_limit, the outer one holds)."""
        if self.deadline is not None:
            yield
            return
        self.deadline, self._limit_s = time.monotonic() + seconds, seconds
        try:
            yield
        finally:
            self.deadline = None

    def intern(self, configs: frozenset[_Config]) -> int:
        if not configs:
            return -1
        sid = self.ids.get(configs)
        if sid is None:
            self._check_time()
            sid = self.ids[configs] = len(self.sets)
            self.sets.append(configs)
            self.moves.append({})
            self.accepting.append((self.accept, ()) in configs)
        return sid

    def step(self, state: int, byte: int) -> int:
        if state < 0:
            return -1
        moves = self.moves[state]
        nxt = moves.get(byte)
        if nxt is None:
            bit = 1 << byte
            edges = self.nfa.edges
            targets = {(t, counts) for q, counts in self.sets[state] for mask, t in edges[q]
                       if mask & bit}
            nxt = moves[byte] = self.intern(self._closure(targets)) if targets else -1
        return nxt

    def matches(self, data: bytes) -> bool:
        state = 0
        for b in data:
            state = self.step(state, b)
        return state >= 0 and self.accepting[state]

    def _closure(self, configs) -> frozenset[_Config]:
        """configs and every configuration epsilon moves reach from them, less those
        another covers: of one NFA state's configurations with the same counts below the
        minimums, those with other counts at least another's."""
        nfa = self.nfa
        eps, push, loops, mins = nfa.eps, nfa.push, nfa.loops, nfa.mins
        seen: dict[_Config, tuple | None] = {}  # -> its key in fronts, for counted ones
        fronts: dict[tuple, list[tuple[int, ...]]] = {}  # (state, low counts) -> the rest
        todo: list[_Config] = []

        def add(config: _Config) -> None:
            if config in seen:
                return
            q, counts = config
            key = None
            if counts:
                key, rest = _split(q, counts, mins[q])
                front = fronts.get(key)
                if front is None:
                    fronts[key] = [rest]
                elif any(all(a <= b for a, b in zip(f, rest)) for f in front):
                    return  # covered
                else:
                    front[:] = [f for f in front if not all(b <= a for a, b in zip(f, rest))]
                    front.append(rest)
            seen[config] = key
            todo.append(config)
            if len(seen) > MAX_DFA_STATE_SIZE:
                raise RegexTooLarge(
                    f"regex too large: a state of its automaton holds more than "
                    f"{MAX_DFA_STATE_SIZE} NFA states (limit {MAX_DFA_STATE_SIZE})")

        for config in configs:
            add(config)
        popped = 0
        while todo:
            q, counts = todo.pop()
            popped += 1
            if not popped % 1024:
                self._check_time()
            loop = loops.get(q)
            if loop is None:
                after = counts + (0,) if q in push else counts
                for t in eps[q]:
                    add((t, after))
                continue
            low, high, body, out = loop
            n = counts[-1]
            if high is None or n < high:
                add((body, counts[:-1] + (min(n + 1, low) if high is None else n + 1,)))
            if n >= low:
                add((out, counts[:-1]))
        if not fronts:
            return frozenset(seen)
        return frozenset(c for c, key in seen.items()
                         if key is None or _split(c[0], c[1], mins[c[0]])[1] in fronts[key])

    def _check_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise RegexTooLarge(f"regex too slow: building its automaton took more than "
                                f"{self._limit_s:g} s (limit {self._limit_s:g} s)")


def _split(q: int, counts: tuple[int, ...], mins: tuple[int, ...]):
    """((q, the counts below their minimum, -1 for the others), the others)."""
    low = tuple(c if c < m else -1 for c, m in zip(counts, mins))
    return (q, low), tuple(c for c, m in zip(counts, mins) if c >= m)
