"""Job files: TOML holding any option of `batchinfer run` (flags given too override it).

Keys are option names with dashes or underscores (`max-tokens = 64`); tables such as
`[sampling]` or `[engine]` may group them and are flattened. A `[messages]` table (role ->
template) or `[[messages]]` list ({role, content}) is the --messages-template;
`sampling-columns` is true (every known name) or a list of names. Relative paths (input,
output, metrics textfile, `@file` values such as system prompts, schemas and tools, a model
or tokenizer directory) are resolved against the folder of the job file, so a job file
runs the same from any working directory.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from batchinfer.job.errors import JobError

_PATH_KEYS = ("input", "output", "metrics_textfile", "chat_template")
# the options whose TOML value is a table of their own (the flags take it as JSON)
_TABLE_VALUED = ("chat_template_kwargs", "json_schema")
_LIST_VALUED = ("tools",)  # an array of tables, taken as JSON too
# earlier names of options, still read
_ALIASES = {"prefix_caching": "enable_prefix_caching"}


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The options of a job file, keyed by option name (underscores), paths resolved."""
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise JobError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"--config {path}: cannot read it: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise JobError(f"--config {path}: invalid TOML: {e}") from None
    values: dict[str, Any] = {}
    if "messages" in data:
        values["messages_template"] = _messages(data.pop("messages"), path)
    for key, value in data.items():
        if key.replace("-", "_") in _TABLE_VALUED and isinstance(value, dict):
            value = json.dumps(value)  # a TOML table of values, not a section
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for name, v in items:
            name = name.replace("-", "_")
            name = _ALIASES.get(name, name)
            if (name in _TABLE_VALUED and isinstance(v, dict)) or (
                    name in _LIST_VALUED and isinstance(v, list)):
                v = json.dumps(v)
            if name in values:
                raise JobError(f"--config {path}: {name!r} is given twice")
            if name == "sampling_columns" and (v is True or isinstance(v, list)):
                v = "all" if v is True else ",".join(map(str, v))
            values[name] = v
    return _resolve_paths(values, path.parent)


def _messages(value: Any, path: Path) -> str:
    """The `messages` of a job file as the JSON text --messages-template takes."""
    if isinstance(value, dict):  # role -> template, in order
        value = [{"role": role, "content": content} for role, content in value.items()]
    if not isinstance(value, list):
        raise JobError(f"--config {path}: messages must be a table (role -> template) or a "
                       "list of {role, content} tables")
    return json.dumps(value)


def _resolve_paths(values: dict[str, Any], base: Path) -> dict[str, Any]:
    def resolve(text: str) -> str:
        p = Path(text).expanduser()
        return str(p if p.is_absolute() else base / p)

    for key in _PATH_KEYS:
        value = values.get(key)
        if isinstance(value, str) and not (key == "input" and value.startswith("hf:")):
            values[key] = resolve(value)
    for key in ("system_prompt", "prompt_template", "messages_template", "json_schema",
                "grammar", "tools"):
        text = values.get(key)
        if isinstance(text, str) and text.startswith("@"):
            values[key] = "@" + resolve(text[1:])
    for key in ("model", "tokenizer"):  # a directory beside the job file, else as given
        name = values.get(key)
        if isinstance(name, str) and name != "demo" and (base / name).is_dir():
            values[key] = str(base / name)
    return values
