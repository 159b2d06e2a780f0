"""Fixtures of the job tests: the tiny model, a reference LLM, an in-process CLI runner."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

sys.path.insert(0, str(Path(__file__).parent))  # jobtools and fake_engine

from jobtools import ENGINE_FLAGS, ENGINE_KWARGS  # noqa: E402


@pytest.fixture(scope="session")
def job_model_dir(llama_dir: Path) -> Path:
    return llama_dir


@pytest.fixture(scope="session")
def reference_llm(job_model_dir: Path):
    from batchinfer import LLM
    return LLM(str(job_model_dir), **ENGINE_KWARGS)


@pytest.fixture
def run_cli(job_model_dir: Path):
    """Invoke `batchinfer run` in-process with the tiny model and no progress bar."""
    from batchinfer.job.cli import run

    def invoke(*args, model: bool = True) -> Result:
        argv = ["--model", str(job_model_dir), *ENGINE_FLAGS] if model else []
        argv += [str(a) for a in args]  # later flags win: a test can override the defaults
        return CliRunner().invoke(run, [*argv, "--no-progress"], catch_exceptions=False)
    return invoke
