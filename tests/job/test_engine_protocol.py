"""The job's stand-in engine and LLMEngine both keep to the job's view of an engine
(runner.Engine), so the job tests cannot drift from the engine they stand in for."""
from __future__ import annotations

import inspect

import pytest

from batchinfer.engine.engine import LLMEngine
from batchinfer.job.runner import Engine
from fake_engine import FakeEngine

METHODS = [name for name, value in vars(Engine).items()
           if callable(value) and not name.startswith("_")]


def test_the_protocol_names_what_the_job_calls():
    assert set(METHODS) == {"check_params", "render_chat_text", "encode_prompts",
                            "add_request", "step", "stats", "shutdown", "get_reasoning_parser"}


@pytest.mark.parametrize("engine", [LLMEngine, FakeEngine], ids=["LLMEngine", "FakeEngine"])
@pytest.mark.parametrize("name", METHODS)
def test_each_engine_takes_the_protocols_arguments(engine, name):
    """Every parameter of the protocol's method is there, of the same kind and in the same
    place; what an engine adds after them has a default."""
    wanted = list(inspect.signature(getattr(Engine, name)).parameters.values())
    have = list(inspect.signature(getattr(engine, name)).parameters.values())
    by_name = {p.name: p for p in have}
    for i, p in enumerate(wanted):
        assert p.name in by_name, f"{engine.__name__}.{name} lacks {p.name}"
        q = by_name[p.name]
        assert q.kind == p.kind, f"{engine.__name__}.{name}: {p.name} is {q.kind}"
        if p.kind is not p.KEYWORD_ONLY:
            assert have[i].name == p.name, f"{engine.__name__}.{name}: {p.name} moved"
        assert (p.default is p.empty) == (q.default is q.empty), (engine, name, p.name)
    extra = [q for q in have if q.name not in {p.name for p in wanted}
             and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)]
    assert all(q.default is not q.empty for q in extra), (engine, name, extra)


