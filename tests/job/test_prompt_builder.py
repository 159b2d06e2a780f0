"""PromptBuilder tokenizes a batch of rows in one tokenizer call and gives each row the ids
the engine gives that row's prompt alone; a row that cannot be tokenized fails alone."""
from __future__ import annotations

import functools
from types import SimpleNamespace

from transformers import AutoTokenizer

from batchinfer.engine.engine import LLMEngine
from batchinfer.job.prompts import PromptBuilder, PromptSpec
from batchinfer.job.reader import InputRow
from batchinfer.sampling_params import SamplingParams

SYSTEM = "You label sentences. Answer with one word. " * 5
TEXTS = ["The river ran high.", " A leading space.", "bad \ud800 text", "naïve café",
         "Last row."]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation's ids as transformers renders and encodes it alone."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def builder(llama_dir, mode: str, system_prompt: str | None):
    engine = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(llama_dir))
    calls = []

    def encode(texts, add_special_tokens):
        calls.append(len(texts))
        return LLMEngine.encode_prompts(engine, texts, add_special_tokens)
    render = functools.partial(LLMEngine.render_chat_text, engine)
    build = PromptBuilder(PromptSpec(mode, mode if mode != "openai" else "body", None),
                          SamplingParams(), system_prompt, render, encode)
    return build, engine, calls


def test_text_prompts_with_a_system_prompt_are_rendered_then_encoded_together(llama_dir):
    build, engine, calls = builder(llama_dir, "prompt", SYSTEM)
    items = build.build_batch([InputRow(i, {"prompt": t}) for i, t in enumerate(TEXTS)])
    # the bad row fails as it is rendered; the others are encoded in one call
    assert calls == [len(TEXTS) - 1]
    assert [i.error is not None for i in items] == [t == TEXTS[2] for t in TEXTS]
    assert "not valid Unicode" in items[2].error and items[2].prompt is None
    for item, text in zip(items, TEXTS):
        if item.error is None:
            chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
            assert item.prompt.tolist() == chat_ids(engine.tokenizer, chat)


def test_plain_text_and_chat_rows_of_one_batch(llama_dir):
    build, engine, calls = builder(llama_dir, "prompt", None)
    items = build.build_batch([InputRow(i, {"prompt": t}) for i, t in enumerate(TEXTS)])
    # the bad text fails the batch's call; then each row is encoded alone
    assert calls == [len(TEXTS)] + [1] * len(TEXTS)
    assert "not valid Unicode" in items[2].error
    # a text prompt is encoded as the engine encodes text: special tokens (bos) added
    good = [t for t in TEXTS if "\ud800" not in t]
    assert ([i.prompt.tolist() for i in items if i.error is None]
            == [engine.tokenizer.encode(t) for t in good])

    build, engine, calls = builder(llama_dir, "openai", None)
    rows = [{"body": {"messages": [{"role": "user", "content": good[0]}]}},
            {"body": {"prompt": good[1]}},
            {"body": {"prompt": [5, 6, 7]}},
            {"body": {"prompt": [5, True]}},
            {"body": {"messages": [{"role": "user", "content": good[2]}]}}]
    items = build.build_batch([InputRow(i, r) for i, r in enumerate(rows)])
    assert sorted(calls) == [1, 2]  # chats together, completions together
    chat = chat_ids(engine.tokenizer, [{"role": "user", "content": good[0]}])
    assert items[0].prompt.tolist() == chat
    assert items[1].prompt.tolist() == engine.tokenizer.encode(good[1])
    assert items[2].prompt.tolist() == [5, 6, 7]
    assert "token ids must be integers" in items[3].error
    assert items[4].prompt.tolist() == chat_ids(engine.tokenizer,
                                                [{"role": "user", "content": good[2]}])
