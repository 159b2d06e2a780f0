"""RangeSet against a plain set of the same indices."""
from __future__ import annotations

import random

from batchinfer.job.rangeset import RangeSet


def test_rangeset_removes_like_a_set():
    rng = random.Random(0)
    for _ in range(200):
        members = set(rng.sample(range(60), rng.randint(0, 40)))
        ranges = RangeSet()
        ranges.update(members)
        a, b = sorted(rng.sample(range(-5, 70), 2))
        cut = ranges.copy()
        cut.remove_range(a, b)
        assert [i for i in range(-5, 70) if i in cut] == sorted(members - set(range(a, b)))
        assert [i for i in range(60) if i in ranges] == sorted(members)  # the copy's own
