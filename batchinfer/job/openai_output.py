"""The OpenAI Batch API output file (`--output-format openai`), written from the Parquet parts.

One JSON line per input line, in the order of the parts: `custom_id`, and a `response`
whose body is a `chat.completion` or `text_completion` object (status 200), or an error
body (status 400) for a row that failed.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchinfer.job.manifest import fsync_dir
from batchinfer.job.prompts import COMPLETIONS_URL

_COLUMNS = ("id", "sample_index", "url", "completion", "finish_reason", "prompt_tokens",
            "output_tokens", "error")


def _rows(paths: list[Path]) -> Iterator[list[dict[str, Any]]]:
    """The output rows of each input row together (its samples are consecutive)."""
    group: list[dict[str, Any]] = []
    for path in paths:
        f = pq.ParquetFile(path)
        columns = [c for c in _COLUMNS if c in f.schema_arrow.names]
        for batch in f.iter_batches(batch_size=4096, columns=columns):
            for row in batch.to_pylist():
                if group and row["sample_index"] == 0:
                    yield group
                    group = []
                group.append(row)
    if group:
        yield group


def _hex(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def response_line(group: list[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
    first = group[0]
    custom_id = first["id"]
    request_id = _hex(f"{custom_id}", 32)
    line: dict[str, Any] = {"id": f"batch_req_{request_id[:24]}", "custom_id": custom_id,
                            "error": None}
    if first["finish_reason"] == "error":
        line["response"] = {"status_code": 400, "request_id": request_id, "body": {"error": {
            "message": first["error"], "type": "invalid_request_error", "param": None,
            "code": None}}}
        return line
    is_chat = first.get("url") != COMPLETIONS_URL
    choices = []
    for row in group:
        choice: dict[str, Any] = {"index": row["sample_index"]}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": row["completion"]}
        else:
            choice["text"] = row["completion"]
        choice.update(logprobs=None, finish_reason=row["finish_reason"])
        choices.append(choice)
    prompt_tokens = first["prompt_tokens"] or 0
    completion_tokens = sum(r["output_tokens"] or 0 for r in group)
    body = {"id": f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id[:24]}",
            "object": "chat.completion" if is_chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return line


def write_openai_output(paths: list[Path], dest: Path, model: str) -> int:
    """Write the output JSONL atomically; returns the number of lines."""
    created = int(time.time())
    tmp = dest.with_name(f".{dest.name}.tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for group in _rows(paths):
            f.write(json.dumps(response_line(group, model, created), ensure_ascii=False) + "\n")
            count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    return count
