"""The sampling defaults a model's generation_config.json recommends, read as vLLM reads them.

    generation_defaults("models/qwen3", "auto")   # {"temperature": 0.6, "top_k": 20, ...}

"auto" reads the model directory's file, "vllm" reads none (SamplingParams' own defaults),
any other value is a directory holding a generation_config.json. Only the fields below are
taken; `do_sample` is ignored, as vLLM ignores it. A value no user could mean (a negative
temperature, top_p outside (0, 1], max_new_tokens beyond the model's context, a value of the
wrong type) is ignored too, with a warning naming it, as vLLM ignores what it cannot use.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from batchinfer.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json field -> SamplingParams field
DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                  "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | Path | None, generation_config: str = "auto",
                        max_context: int | None = None) -> dict[str, Any]:
    """SamplingParams values (by field name) that the generation config sets; {} for "vllm",
    or for "auto" when the model has no such file. A file that is not a JSON object, or a
    PATH without one: ValueError naming the file. A field out of range or of the wrong
    type, or a max_new_tokens above max_context (default: the model directory's
    max_position_embeddings), is left out with a warning naming it."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        if model_dir is None:
            return {}
        path = Path(model_dir) / FILE_NAME
        if not path.is_file():
            return {}
    else:
        path = Path(generation_config).expanduser() / FILE_NAME
        if not path.is_file():
            raise ValueError(f"generation_config {generation_config}: no {FILE_NAME} in that "
                             "directory (give auto, vllm or a directory holding one)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    if max_context is None and model_dir is not None:
        max_context = _context(Path(model_dir))
    values = {}
    for name, field in DEFAULT_FIELDS.items():
        if data.get(name) is None:
            continue
        try:  # each value checked as SamplingParams checks it, and normalised (3.0 -> 3)
            value = getattr(SamplingParams(**{field: data[name]}), field)
        except (ValueError, TypeError) as e:
            why = str(e).replace(f"SamplingParams.{field}", name, 1)
            _warn(f"{path}: {why}; ignored")
            continue
        if name == "max_new_tokens" and max_context is not None and value > max_context:
            _warn(f"{path}: max_new_tokens {value} exceeds the model's context "
                  f"({max_context} tokens); ignored")
            continue
        values[field] = value
    return values


def _context(model_dir: Path) -> int | None:
    """The model directory's max_position_embeddings (its text decoder's), if it says."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    for source in (config, config.get("text_config")):
        value = source.get("max_position_embeddings") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


_warned: set[str] = set()


def _warn(message: str) -> None:
    """One line on stderr, once per process (the job and its engine both read the file)."""
    if message not in _warned:
        _warned.add(message)
        print(f"batchinfer: warning: {message}", file=sys.stderr, flush=True)


def describe(defaults: dict[str, Any]) -> str:
    """The defaults as `temperature=0.6, top_k=20`, by generation_config.json's names."""
    names = {field: name for name, field in DEFAULT_FIELDS.items()}
    return ", ".join(f"{names.get(k, k)}={v}" for k, v in defaults.items())
