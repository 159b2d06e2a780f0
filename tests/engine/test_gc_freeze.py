"""Runs keep the cyclic collector off the objects that existed before them
(engine/gc_freeze.py), and give them back to it afterwards, errors included."""
from __future__ import annotations

import gc

import pytest

from batchinfer.engine.gc_freeze import startup_heap_frozen


def test_the_heap_is_frozen_within_the_block_and_given_back_after_an_error():
    before = gc.get_freeze_count()
    with pytest.raises(RuntimeError):
        with startup_heap_frozen():
            assert gc.get_freeze_count() > before
            raise RuntimeError("a failed run")
    assert gc.get_freeze_count() == 0


def test_a_heap_the_application_froze_stays_frozen():
    # (the count can only fall meanwhile, as frozen objects are freed: never to 0 here,
    # where these lists hold some of them)
    held = [[] for _ in range(100)]
    gc.freeze()
    try:
        with startup_heap_frozen():
            assert gc.get_freeze_count() >= len(held)
        assert gc.get_freeze_count() >= len(held)
    finally:
        gc.unfreeze()


def test_generate_steps_with_the_startup_heap_frozen(llama_dir, monkeypatch):
    from batchinfer import LLM, SamplingParams
    llm = LLM(model=str(llama_dir))
    engine = llm.llm_engine
    step = engine.step
    frozen = []
    monkeypatch.setattr(engine, "step", lambda: frozen.append(gc.get_freeze_count()) or step())
    out = llm.generate(["a b c"], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2))
    assert len(out[0].outputs[0].logprobs) == 3
    assert frozen and min(frozen) > 0
    assert gc.get_freeze_count() == 0
