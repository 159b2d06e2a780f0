"""The built-in demo model: a small random-weight Llama, built on first use and cached.

`LLM(model="demo")` and `batchinfer run --model demo` use it so the whole pipeline can be
tried without any model on disk. Its weights are random, so its text is meaningless.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from batchinfer.paths import cache_root

DEMO_MODEL = "demo"  # the model name that selects it
DEMO_NOTICE = ("The built-in demo model has random weights: its output text is meaningless "
               "and only shows that the pipeline works.")
DEMO_NAME = "demo-v1"
DEMO_SHAPE = "tiny"
DEMO_SEED = 0

logger = logging.getLogger(__name__)


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_model(model: str) -> str:
    """The model to load: the demo checkpoint's directory for "demo" (built first if it is
    not cached yet), any other name as given."""
    return str(demo_model_path()) if model == DEMO_MODEL else model


def demo_model_path() -> Path:
    """Path of the demo checkpoint, building it first if it is not cached yet.

    The checkpoint is built in a temporary directory next to its final place and renamed
    into place, so a reader never sees a half-written model; when two processes race, the
    first rename wins and the other discards its copy.
    """
    final = cache_root() / DEMO_NAME
    if _is_complete(final):
        return final
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise RuntimeError(f"{final} exists but holds no complete demo model "
                           f"(no config.json); delete it and try again")
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=final.parent))
    try:
        logger.info("building the demo model in %s", final)
        # transformers' model classes, which building needs, cost a second to import
        from batchinfer.random_checkpoint import build_random_checkpoint
        build_random_checkpoint(staging, DEMO_SHAPE, seed=DEMO_SEED)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache entry is a plain directory
        try:
            os.rename(staging, final)
        except OSError:
            # Another process renamed its copy into place first.
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
