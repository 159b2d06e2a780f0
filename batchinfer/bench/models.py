"""What --model names: a checkpoint directory, or a named random-weight shape.

A named shape (batchinfer.random_checkpoint.SHAPES) becomes a config + tokenizer
directory in the cache dir, built once. The engine then initialises random weights itself
(load_format="dummy"), unless the transformers baseline needs the very same weights: then
small shapes get real random safetensors that both systems load.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from batchinfer.paths import cache_root

# Shapes small enough to write real random weights for (a few hundred MB at most).
SMALL_SHAPES = ("tiny", "tiny-moe", "tiny-glm4-moe", "smollm2-135m")


@dataclass(frozen=True)
class ModelSource:
    path: str          # directory handed to the engine and to transformers
    load_format: str   # "auto" (weights on disk) or "dummy" (engine initialises them)
    shape: str | None  # the named shape, when --model was one

    @property
    def has_weights(self) -> bool:
        return self.load_format != "dummy"


def default_cache_dir() -> Path:
    return cache_root() / "bench"


def shape_names() -> list[str]:
    from batchinfer.random_checkpoint import SHAPES
    return list(SHAPES)


def _build_once(target: Path, shape: str, weights: bool, num_hidden_layers: int | None) -> None:
    """Build a checkpoint directory atomically: concurrent runs never see a half-written one."""
    if (target / "config.json").is_file():
        return
    from batchinfer.random_checkpoint import build_random_checkpoint
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build_random_checkpoint(tmp, shape, weights=weights)
        tmp.chmod(0o755)
        if num_hidden_layers is not None:
            config_path = tmp / "config.json"
            config = json.loads(config_path.read_text())
            config["num_hidden_layers"] = num_hidden_layers
            config_path.write_text(json.dumps(config, indent=2))
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(model: str, *, need_weights: bool = False, cache_dir: Path | None = None,
                  num_hidden_layers: int | None = None, load_format: str = "auto") -> ModelSource:
    """Turn --model into a directory; need_weights asks for real random weights on disk
    (only for SMALL_SHAPES; bigger shapes stay dummy and the caller seeds its own weights).
    num_hidden_layers cuts a named shape to fewer layers (used where layers are never run).
    load_format "dummy" leaves a directory's weights unread and a named shape's unwritten."""
    if os.path.isdir(model):
        if num_hidden_layers is not None:
            raise ValueError("a layer-count override only applies to named shapes, "
                             f"not to the directory {model}")
        return ModelSource(os.path.abspath(model), load_format, None)
    if load_format == "dummy":
        need_weights = False
    names = shape_names()
    if model not in names:
        raise ValueError(f"--model {model!r} is neither a directory nor a named shape "
                         f"({', '.join(names)})")
    weights = need_weights and model in SMALL_SHAPES
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"{model}-{'weights' if weights else 'config'}"
    if num_hidden_layers is not None:
        name += f"-{num_hidden_layers}l"
    target = cache_dir / name
    _build_once(target, model, weights, num_hidden_layers)
    return ModelSource(str(target), "auto" if weights else "dummy", model)
