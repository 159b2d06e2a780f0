"""Keeping Python's cyclic garbage collector off the objects that exist before a run.

A loaded engine holds a few hundred thousand objects the collector tracks (torch,
transformers and the tokenizer bring most of them), and a run that allocates many small
ones (requests, outputs, their per-token bookkeeping; logprobs too, before they were kept
flat: see outputs.FlatLogprobs) sets off full collections that walk all of them, again and
again. Frozen for the run (gc.freeze()), they are left out of every collection; unfrozen
at its end, so an engine shut down later is collected as before. Both calls take constant
time. (vLLM freezes its startup heap the same way.)
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Within the block, the collector leaves alone every object that existed before it.
    A heap the application froze itself is left as it is, frozen, on the way out too."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
