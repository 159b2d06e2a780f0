"""The regular expressions structured outputs take: a subset of Python's `re` syntax
(literals, escapes, classes, `.`, groups, alternation and the greedy or lazy quantifiers
`* + ? {m} {m,} {m,n}`), parsed into a tree. The whole completion must match, so a leading
`^` and a trailing `$` change nothing. Other constructs (backreferences, lookarounds,
anchors inside, flags, `\\b`) are refused with a ValueError naming them.

A pattern's automaton is bounded before it is built: `measure` counts its NFA states from
the tree, each state inside a counted repeat as many times as a DFA state can hold it with
different counts, and check_pattern refuses a pattern above MAX_NFA_STATES with
RegexTooLarge (a ValueError naming the limit). A counted repeat is one NFA fragment and a
counter, so `[^"]{0,1000}` costs its body once; it costs once per count only where the
counts read so far are ambiguous: a body that holds a counted repeat and can match empty
or run on into its own next repeat, as in `((a{0,1000}){0,1000}){0,1000}`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

_MAX_REPEAT = 1000
# Groups inside groups: parsing and building recurse once per level (a JSON schema at its
# deepest nesting, 32, makes about 70).
_MAX_NESTING = 100
# A pattern's automaton may have this many NFA states, counted as `measure` does. The NFA
# is built whole, in about 5 us a state, and a DFA state holds at most this many NFA
# states (with their counts), so this bounds the build and one step of the DFA (about
# half a second each at the limit) and their memory. JSON schemas with 100 properties
# take 7,000, an enum of 500 short values 12,500 (2,000 values of 45 characters 91,000),
# an array of up to 1000 strings of up to 1000 characters 170 (`batchinfer bench
# structured`).
MAX_NFA_STATES = 100_000
# A longer pattern is refused before it is parsed (about 2 us a character).
MAX_PATTERN_CHARS = 100_000
_CONT = (0x80, 0xBF)
# the byte ranges of well-formed multi-byte UTF-8 characters (Unicode table 3-7)
UTF8_MULTIBYTE = [((0xC2, 0xDF), _CONT), ((0xE0, 0xE0), (0xA0, 0xBF), _CONT),
                   ((0xE1, 0xEC), _CONT, _CONT), ((0xED, 0xED), (0x80, 0x9F), _CONT),
                   ((0xEE, 0xEF), _CONT, _CONT), ((0xF0, 0xF0), (0x90, 0xBF), _CONT, _CONT),
                   ((0xF1, 0xF3), _CONT, _CONT, _CONT), ((0xF4, 0xF4), (0x80, 0x8F), _CONT, _CONT)]
_DIGITS = frozenset("0123456789")
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_SPACE = frozenset(" \t\n\r\f\v")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


class RegexTooLarge(ValueError):
    """A pattern whose automaton would pass one of the limits set on it."""


@dataclass(frozen=True)
class CharSet:
    """Characters: `chars` listed, or (negated) every character but those; negated sets
    and `.` also match any non-ASCII character (`chars` of a negated set are ASCII)."""
    chars: frozenset
    negated: bool = False


# ---- parsing: pattern -> tree of ("set", CharSet) | ("cat", [..]) | ("alt", [..])
#      | ("rep", node, min, max or None)

class _Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0
        self.depth = 0

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
            self.depth += 1
            if self.depth > _MAX_NESTING:
                raise self.fail(f"groups nested more than {_MAX_NESTING} deep are not "
                                "supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("missing )")
            self.i += 1
            self.depth -= 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", CharSet(frozenset("\n"), negated=True))
        if c == "\\":
            return ("set", self.escape())
        if c in "*+?":
            raise self.fail(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.fail(f"{c!r} inside the pattern is not supported (the whole "
                            "completion is matched)")
        if c == ")":
            raise self.fail("unbalanced )")
        return ("set", CharSet(frozenset(c)))

    def escape(self) -> CharSet:
        if self.peek() is None:
            raise self.fail("pattern ends with a backslash")
        c = self.take()
        classes = {"d": _DIGITS, "w": _WORD, "s": _SPACE}
        if c in classes:
            return CharSet(classes[c])
        if c.lower() in classes:
            return CharSet(classes[c.lower()], negated=True)
        if c == "0":  # \0, \0o, \0oo: octal, as in Python
            digits = "0"
            while len(digits) < 3 and self.peek() is not None and self.peek() in "01234567":
                digits += self.take()
            return CharSet(frozenset(chr(int(digits, 8))))
        if c in _ESCAPES:
            return CharSet(frozenset(_ESCAPES[c]))
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"bad \\{c} escape")
            self.i += width
            return CharSet(frozenset(chr(int(digits, 16))))
        if c.isalnum():
            raise self.fail(f"\\{c} is not supported")
        return CharSet(frozenset(c))

    def char_class(self) -> CharSet:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        chars: set[str] = set()
        negated_parts: list[frozenset] = []
        first = True
        spanned = 0  # characters its ranges list, overlaps counted again
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
                spanned += ord(high) - ord(low) + 1
                if spanned > MAX_NFA_STATES:  # (each character past ASCII is a state or more)
                    raise RegexTooLarge(f"regex too large: a class lists more than "
                                        f"{MAX_NFA_STATES} characters (limit {MAX_NFA_STATES})")
                chars |= {chr(o) for o in range(ord(low), ord(high) + 1)}
            else:
                chars.add(low)
        if negated_parts:  # [\D], [^\s] ...: only in a set of their own
            if chars or len(negated_parts) > 1 or negated:
                raise self.fail("\\D, \\W or \\S mixed with other members of a class is not "
                                "supported")
            return CharSet(negated_parts[0], negated=True)
        if negated and any(ord(ch) > 127 for ch in chars):
            raise self.fail("non-ASCII characters in a negated class are not supported")
        if not chars and not negated:
            raise self.fail("empty class")
        return CharSet(frozenset(chars), negated)


def parse(pattern: str):
    """The pattern's tree (ValueError naming what is not supported)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"regex must be a non-empty string, got {pattern!r}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RegexTooLarge(f"regex too large: is {len(pattern)} characters long (limit "
                            f"{MAX_PATTERN_CHARS})")
    return _Parser(pattern).parse()


@functools.lru_cache(maxsize=256)
def check_pattern(pattern: str) -> None:
    """Raise ValueError naming what in the pattern is not supported, or RegexTooLarge if
    its automaton would have more than MAX_NFA_STATES states (from the tree alone: no
    automaton is built here, and no tokenizer is needed)."""
    check_size(parse(pattern))


def check_size(tree) -> None:
    states = measure(tree)[1]
    if states > MAX_NFA_STATES:
        raise RegexTooLarge(f"regex too large: expands to {states} automaton states "
                            f"(limit {MAX_NFA_STATES})")


# ---- size: the automaton's states, counted from the tree ------------------------------

_ALL_BYTES = (1 << 256) - 1
_LEAD_BYTES = sum(1 << b for ranges in UTF8_MULTIBYTE for b in range(ranges[0][0],
                                                                     ranges[0][1] + 1))
_ASCII = (1 << 128) - 1
# NFA states beyond a set's two of `.` and negated sets: any multi-byte character
_MULTIBYTE_STATES = sum(len(ranges) - 1 for ranges in UTF8_MULTIBYTE)


@dataclass(frozen=True)
class Shape:
    """What sizing a repeat needs to know of its body's language (byte sets as 256-bit
    masks): whether it holds the empty string, the bytes its strings start with, and
    `cont`, the bytes that can extend one of its strings into a longer one (a superset:
    all bytes where unknown). `literal`: the bytes every string starts with, and whether
    that is the only string. `counted`: whether it holds a counted repeat.

    A non-empty body whose `cont` and `first` are disjoint is read one repeat at a time
    without doubt (where one repeat ends, the next byte either starts another or follows
    the repeat), so the number of repeats read is known."""
    nullable: bool
    first: int
    cont: int
    literal: tuple[bytes, bool]
    counted: bool

    @property
    def decodable(self) -> bool:
        return not self.nullable and not self.cont & self.first


_EMPTY = Shape(True, 0, 0, (b"", True), False)


def measure(node) -> tuple[Shape, int]:
    """The node's Shape, and the NFA states regex_automaton builds for it, each counted
    once per count a DFA state can hold it with. A DFA state keeps, of the counts an NFA
    state is reached with, only those below the repeat's minimum and the least of the
    others (more repeats done can only allow less), so a counted repeat's states count
    (min + 1) times; where the body holds a counted repeat and is not decodable, its
    states count once per count (max + 1), as if it were copied out."""
    kind = node[0]
    if kind == "set":
        return _set_shape(node[1]), _set_states(node[1])
    if kind == "cat":
        shape, states = _EMPTY, 1
        for item in node[1]:
            item_shape, item_states = measure(item)
            shape, states = _then(shape, item_shape), states + item_states
        return shape, states
    if kind == "alt":
        measured = [measure(branch) for branch in node[1]]
        return _either([m[0] for m in measured]), 2 + sum(m[1] for m in measured)
    _, inner, low, high = node
    body, states = measure(inner)
    if high == 0:
        return _EMPTY, 1
    more = body.first if high is None or high > low else 0
    # one repeat at most, or a body read one repeat at a time: cont is known
    known = body.decodable or (high is not None and high <= 1)
    counter = (low, high) not in ((0, 1), (0, None), (1, None))  # ?, * and + count nothing
    shape = Shape(low == 0 or body.nullable, body.first,
                  body.cont | more if known else _ALL_BYTES,
                  (body.literal[0], False) if low > 0 else (b"", False),
                  body.counted or counter)
    if not counter:
        return shape, 2 + states
    if body.counted and not body.decodable:
        copies = (low if high is None else high) + 1
    else:
        copies = low + 1
    return shape, 2 + (states + 1) * copies


def _set_shape(cs: CharSet) -> Shape:
    if cs.negated:
        first = (~sum(1 << ord(ch) for ch in cs.chars) & _ASCII) | _LEAD_BYTES
        return Shape(False, first, 0, (b"", False), False)
    first = 0
    for ch in cs.chars:
        first |= 1 << ch.encode("utf-8")[0]
    literal = (next(iter(cs.chars)).encode("utf-8"), True) if len(cs.chars) == 1 \
        else (b"", False)
    return Shape(False, first, 0, literal, False)


def _set_states(cs: CharSet) -> int:
    if cs.negated:
        return 2 + _MULTIBYTE_STATES
    return 2 + sum(len(ch.encode("utf-8")) - 1 for ch in cs.chars if ord(ch) >= 128)


def _then(a: Shape, b: Shape) -> Shape:
    """The Shape of a's strings followed by b's. A string of a that extends into a longer
    one of a by a byte b can start with would make the split ambiguous: cont unknown."""
    if a.cont & b.first:
        cont = _ALL_BYTES
    else:
        cont = b.cont | (a.cont if b.nullable else 0)
    prefix, whole = a.literal
    if whole:
        prefix, whole = prefix + b.literal[0], b.literal[1]
    return Shape(a.nullable and b.nullable, a.first | (b.first if a.nullable else 0), cont,
                 (prefix, whole), a.counted or b.counted)


# alternatives compared pair by pair when their first bytes overlap, at most
_MAX_PAIRED_BRANCHES = 64


def _either(branches: list[Shape]) -> Shape:
    """The Shape of the union of the branches' strings. A string of one branch may extend
    into a string of another only where their first bytes overlap and neither their
    literal beginnings differ nor (both being single strings) one is not a prefix of the
    other: each such byte is added to cont."""
    nullable = any(b.nullable for b in branches)
    first = cont = 0
    overlap = False
    for b in branches:
        overlap = overlap or bool(first & b.first)
        first |= b.first
        cont |= b.cont
    if nullable:
        cont |= first
    if overlap:
        cont |= _crossing(branches)
    prefixes = [b.literal[0] for b in branches]
    common = prefixes[0]
    for p in prefixes[1:]:
        common = common[:next((i for i, (x, y) in enumerate(zip(common, p)) if x != y),
                              min(len(common), len(p)))]
    whole = branches[0].literal[1] and all(b.literal == branches[0].literal
                                           for b in branches)
    return Shape(nullable, first, cont, (common, whole), any(b.counted for b in branches))


def _crossing(branches: list[Shape]) -> int:
    """The bytes by which a string of one branch can extend into a string of another."""
    if all(b.literal[1] for b in branches):  # single strings, as an enum: exactly
        strings = sorted({b.literal[0] for b in branches})
        cont = 0
        for i, s in enumerate(strings):  # the strings s begins come right after it
            j = i + 1
            while j < len(strings) and strings[j].startswith(s):
                cont |= 1 << strings[j][len(s)]
                j += 1
        return cont
    if len(branches) > _MAX_PAIRED_BRANCHES:
        return _ALL_BYTES
    for i, a in enumerate(branches):
        for b in branches[i + 1:]:
            pa, pb = a.literal[0], b.literal[0]
            n = min(len(pa), len(pb))
            if a.first & b.first and pa[:n] == pb[:n]:
                return _ALL_BYTES
    return 0
