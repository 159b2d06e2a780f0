"""The sampling defaults a model's generation_config.json recommends, read as vLLM reads them.

    generation_defaults("models/qwen3", "auto")   # {"temperature": 0.6, "top_k": 20, ...}

"auto" reads the model directory's file, "vllm" reads none (SamplingParams' own defaults),
any other value is a directory holding a generation_config.json. Only the fields below are
taken; `do_sample` is ignored, as vLLM ignores it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchinfer.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json field -> SamplingParams field
DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                  "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | Path | None, generation_config: str = "auto"
                        ) -> dict[str, Any]:
    """SamplingParams values (by field name) that the generation config sets; {} for "vllm",
    or for "auto" when the model has no such file. A malformed file (not JSON, a value of
    the wrong type or out of range) or a PATH without one: ValueError naming the file and
    field."""
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
    values = {}
    for name, field in DEFAULT_FIELDS.items():
        if data.get(name) is None:
            continue
        try:  # each value checked as SamplingParams checks it, and normalised (3.0 -> 3)
            values[field] = getattr(SamplingParams(**{field: data[name]}), field)
        except (ValueError, TypeError) as e:
            why = str(e).replace(f"SamplingParams.{field}", name, 1)
            raise ValueError(f"{path}: {why}") from None
    return values


def describe(defaults: dict[str, Any]) -> str:
    """The defaults as `temperature=0.6, top_k=20`, by generation_config.json's names."""
    names = {field: name for name, field in DEFAULT_FIELDS.items()}
    return ", ".join(f"{names.get(k, k)}={v}" for k, v in defaults.items())
