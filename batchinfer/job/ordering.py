"""Offline ordering: hand requests to the engine grouped by shared prefix.

An online server must take requests in arrival order; a batch job can read ahead. The
window holds up to `size` requests sorted by prompt (text, or token ids). It gives them out
like an elevator: from the key of the last request handed out, upward, wrapping around at
the end. Requests sharing a prefix leave together, so the prefix's KV blocks are computed
once and hit by the rest while still cached; new rows, read as room frees up, join at
their place and leave on the next sweep. A size of 0 or 1 keeps input order.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class ReorderWindow(Generic[T]):
    def __init__(self, size: int):
        self.size = max(size, 1)
        self._fifo: deque[tuple[object, T]] | None = deque() if size <= 1 else None
        self._keys: list[object] = []
        self._items: list[T] = []
        self._cursor: object | None = None

    def __len__(self) -> int:
        return len(self._fifo) if self._fifo is not None else len(self._items)

    def has_room(self) -> bool:
        return len(self) < self.size

    def push(self, key: object, item: T) -> None:
        if self._fifo is not None:
            self._fifo.append((key, item))
            return
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, item)

    def pop(self) -> T:
        """The next request: the smallest key >= the last one handed out, else the smallest."""
        if self._fifo is not None:
            return self._fifo.popleft()[1]
        if not self._items:
            raise IndexError("pop from an empty window")
        i = 0 if self._cursor is None else bisect.bisect_left(self._keys, self._cursor)
        if i == len(self._keys):
            i = 0
        self._cursor = self._keys.pop(i)
        return self._items.pop(i)
