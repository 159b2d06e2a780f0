"""Engine flags of `batchinfer run` reach the engine under their EngineConfig names."""
from __future__ import annotations

import json

import pytest


class Loaded(Exception):
    pass


@pytest.mark.parametrize("flags, expected", [
    ([], {}),  # unset options are left to the engine's defaults
    (["--enforce-eager", "--attention-backend", "torch"],
     {"enforce_eager": True, "attention_backend": "torch"}),
    (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}),
])
def test_engine_flags_reach_the_engine(tmp_path, run_cli, monkeypatch, flags, expected):
    seen = {}

    def capture(model, kwargs):
        seen.update(kwargs)
        raise Loaded

    monkeypatch.setattr("batchinfer.job.runner.load_engine", capture)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(Loaded):  # the job stops where the engine would load
        run_cli(path, "-o", tmp_path / "out", *flags)
    assert {k: seen[k] for k in ("enforce_eager", "attention_backend", "kv_cache_dtype")
            if k in seen} == expected
