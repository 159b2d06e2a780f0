"""The regular expressions structured outputs take: a subset of Python's `re` syntax
(literals, escapes, classes, `.`, groups, alternation and the greedy or lazy quantifiers
`* + ? {m} {m,} {m,n}`), parsed into a tree. The whole completion must match, so a leading
`^` and a trailing `$` change nothing. Other constructs (backreferences, lookarounds,
anchors inside, flags, `\\b`) are refused with a ValueError naming them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

_MAX_REPEAT = 1000
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
    return _Parser(pattern).parse()


@functools.lru_cache(maxsize=256)
def check_pattern(pattern: str) -> None:
    """Raise ValueError naming what in the pattern is not supported (parsing only: the
    automaton is built once per pattern, by the engine)."""
    parse(pattern)
