"""A set of input row indices kept as sorted, disjoint half-open ranges."""
from __future__ import annotations

import bisect
from collections.abc import Iterable


class RangeSet:
    """Row indices committed so far. Rows finish roughly in input order, so a job of
    millions of rows needs only as many ranges as rows are in flight at once."""

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in sorted(ranges):
            self.add_range(start, end)

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def __contains__(self, index: int) -> bool:
        i = bisect.bisect_right(self._starts, index) - 1
        return i >= 0 and index < self._ends[i]

    def covers(self, start: int, end: int) -> bool:
        """Whether every index in [start, end) is in the set."""
        if start >= end:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and end <= self._ends[i]

    def add(self, index: int) -> None:
        self.add_range(index, index + 1)

    def add_range(self, start: int, end: int) -> None:
        if start >= end:
            return
        lo = bisect.bisect_left(self._ends, start)       # first range that may touch
        hi = bisect.bisect_right(self._starts, end)      # ranges before hi may touch
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def update(self, indices: Iterable[int]) -> None:
        run_start = run_end = None
        for index in sorted(indices):
            if run_end is not None and index <= run_end:
                run_end = max(run_end, index + 1)
                continue
            if run_start is not None:
                self.add_range(run_start, run_end)
            run_start, run_end = index, index + 1
        if run_start is not None:
            self.add_range(run_start, run_end)

    def ranges(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends)]

    def copy(self) -> "RangeSet":
        out = RangeSet()
        out._starts, out._ends = self._starts.copy(), self._ends.copy()
        return out

    def remove_range(self, start: int, end: int) -> None:
        if start >= end:
            return
        lo = bisect.bisect_right(self._ends, start)      # first range ending after start
        hi = bisect.bisect_left(self._starts, end)       # ranges before hi start before end
        if lo >= hi:
            return
        kept_starts, kept_ends = [], []
        if self._starts[lo] < start:
            kept_starts.append(self._starts[lo])
            kept_ends.append(start)
        if self._ends[hi - 1] > end:
            kept_starts.append(end)
            kept_ends.append(self._ends[hi - 1])
        self._starts[lo:hi] = kept_starts
        self._ends[lo:hi] = kept_ends
