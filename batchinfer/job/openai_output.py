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

from batchinfer.job.durable import fsync_dir
from batchinfer.job.prompts import COMPLETIONS_URL

_COLUMNS = ("id", "sample_index", "url", "body", "completion", "reasoning", "tool_calls",
            "finish_reason", "prompt_tokens", "output_tokens", "error", "logprobs",
            "prompt_logprobs")


def _rows(parts: list[tuple[Path, bool]]) -> Iterator[tuple[list[dict[str, Any]], bool]]:
    """The output rows of each input row together (its samples are consecutive), with
    whether the part they start in lists logprobs with the sampled token first."""
    group: list[dict[str, Any]] = []
    group_flag = True
    for path, sampled_first in parts:
        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        # `body` (the request, prompt included) only to see how many logprobs a line asked
        # for, and whether its tool_choice named a function
        columns = [c for c in _COLUMNS if c in names and (
            c != "body" or "logprobs" in names or "tool_calls" in names)]
        for batch in f.iter_batches(batch_size=4096, columns=columns):
            for row in batch.to_pylist():
                if group and row["sample_index"] == 0:
                    yield group, group_flag
                    group = []
                if not group:
                    group_flag = sampled_first
                group.append(row)
    if group:
        yield group, group_flag


def _hex(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def _top_k(body: Any, is_chat: bool, default: int | None) -> int:
    """How many top logprobs the line asked for: chat `top_logprobs` (with `logprobs`:
    true), completions `logprobs` (a number); else --logprobs."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            body = None
    if isinstance(body, dict):
        asked = body.get("logprobs")
        if is_chat and asked is True:
            return int(body.get("top_logprobs") or 0)
        if not is_chat and isinstance(asked, int) and not isinstance(asked, bool):
            return asked
    return default or 0


def _named_tool_choice(body: Any) -> bool:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return False
    return isinstance(body, dict) and isinstance(body.get("tool_choice"), dict)


def _finite(logprob: float) -> float:
    """A logprob JSON can hold: -inf becomes -9999.0, as vLLM's server writes it."""
    return max(logprob, -9999.0)


def _logprobs_object(steps: list[list[dict[str, Any]]], k: int, is_chat: bool) -> dict:
    """OpenAI's logprobs object from the logprobs column (per token: the sampled token's
    entry first, then the top entries by rank)."""
    def top(step):
        return sorted((e for e in step if e["rank"] <= k), key=lambda e: e["rank"])

    if is_chat:
        def entry(e):
            # a token that is part of a character decodes to U+FFFD: its own bytes are not
            # in the column, and OpenAI allows null
            token = e["token"]
            return {"token": token, "logprob": _finite(e["logprob"]),
                    "bytes": None if "\ufffd" in token else list(token.encode("utf-8"))}
        return {"content": [{**entry(step[0]), "top_logprobs": [entry(e) for e in top(step)]}
                            for step in steps]}
    offsets, at = [], 0
    for step in steps:
        offsets.append(at)
        at += len(step[0]["token"])
    return {"tokens": [step[0]["token"] for step in steps],
            "token_logprobs": [_finite(step[0]["logprob"]) for step in steps],
            "top_logprobs": [{e["token"]: _finite(e["logprob"]) for e in top(step)}
                             for step in steps],
            "text_offset": offsets}


def _prompt_logprobs_list(steps: list[list[dict[str, Any]] | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token (null for the first), {token id: {logprob,
    rank, decoded_token}} for the prompt token and the top ones there."""
    if steps is None:
        return None
    return [None if step is None else
            {str(e["token_id"]): {"logprob": _finite(e["logprob"]), "rank": e["rank"],
                                  "decoded_token": e["token"]} for e in step}
            for step in steps]


def response_line(group: list[dict[str, Any]], model: str, created: int,
                  default_logprobs: int | None = None,
                  sampled_first: bool = True) -> dict[str, Any]:
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
        if "reasoning" in row:  # --reasoning-parser: as vLLM's server writes it
            if is_chat:
                choice["message"]["content"] = row["completion"] or None
                choice["message"]["reasoning_content"] = row["reasoning"]
            else:
                choice["reasoning_content"] = row["reasoning"]
        finish_reason = row["finish_reason"]
        if is_chat and row.get("tool_calls"):  # as vLLM's server writes them
            choice["message"]["tool_calls"] = row["tool_calls"]
            choice["message"]["content"] = row["completion"] or None
            # a call the line's tool_choice named ends as "stop", as in OpenAI's API
            finish_reason = "stop" if _named_tool_choice(first.get("body")) else "tool_calls"
        steps = row.get("logprobs")
        logprobs = None
        if steps and sampled_first:
            k = _top_k(first.get("body"), is_chat, default_logprobs)
            logprobs = _logprobs_object(steps, k, is_chat)
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if not is_chat:  # vLLM's field, null unless the line asked
            choice["prompt_logprobs"] = _prompt_logprobs_list(row.get("prompt_logprobs"))
        choices.append(choice)
    prompt_tokens = first["prompt_tokens"] or 0
    completion_tokens = sum(r["output_tokens"] or 0 for r in group)
    body = {"id": f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id[:24]}",
            "object": "chat.completion" if is_chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    if is_chat:  # vLLM puts it on the response, null unless the line asked
        body["prompt_logprobs"] = _prompt_logprobs_list(first.get("prompt_logprobs"))
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return line


def write_openai_output(parts: list[tuple[Path, bool]], dest: Path, model: str,
                        default_logprobs: int | None = None) -> int:
    """Write the output JSONL atomically; returns the number of lines. parts: each part
    file and whether its logprobs lists start with the sampled token (OutputDir.
    parts_with_sampled_first; a part without it gets null logprobs). default_logprobs:
    --logprobs, for lines that do not ask themselves."""
    created = int(time.time())
    tmp = dest.with_name(f".{dest.name}.tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for group, sampled_first in _rows(parts):
            line = response_line(group, model, created, default_logprobs, sampled_first)
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
            count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    return count
