"""Fixtures of the job tests: a tiny random model, a reference LLM, a CLI runner."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

sys.path.insert(0, str(Path(__file__).parent))  # fake_engine, for tests and subprocesses

# Small KV pool and batch: engine start-up stays fast and the tests exercise preemption-free
# continuous batching with several requests in flight.
ENGINE_KWARGS = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8}
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "8"]


@pytest.fixture(scope="session")
def job_model_dir(tmp_path_factory) -> Path:
    from batchinfer.model.random_checkpoint import build_random_checkpoint
    return build_random_checkpoint(tmp_path_factory.mktemp("job-model"), "test-llama")


@pytest.fixture(scope="session")
def reference_llm(job_model_dir):
    from batchinfer import LLM
    return LLM(str(job_model_dir), **ENGINE_KWARGS)


@pytest.fixture
def run_cli(job_model_dir):
    """Invoke `batchinfer run` in-process with the tiny model and quiet progress."""
    from batchinfer.job.cli import run

    def invoke(*args: str, model: bool = True) -> Result:
        argv = ["--model", str(job_model_dir), *ENGINE_FLAGS] if model else []
        argv += [str(a) for a in args]  # later flags win: a test can override the defaults
        return CliRunner().invoke(run, [*argv, "--no-progress"], catch_exceptions=False)
    return invoke
