"""Reasoning outputs on a real (random-weight) model: the split into reasoning_content and
the answer, and structured outputs that start after </think>."""
import json
import re
import shutil
from pathlib import Path

import pytest

from batchinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def think_llm(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """The llama checkpoint with a tokenizer whose last two ids are <think> and </think>
    (as single added tokens, as in DeepSeek-R1's and Qwen3's tokenizers)."""
    tok_dir = tmp_path_factory.mktemp("think-tokenizer")
    for f in Path(llama_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, tok_dir / f.name)
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in data["model"]["merges"]]
    used = {t for m in merges for t in (*m, "".join(m))}
    spare = sorted(i for t, i in vocab.items() if t not in used)[-2:]  # no merge needs them
    by_id = {i: t for t, i in vocab.items()}
    for tag, tid in zip(("<think>", "</think>"), spare):
        del vocab[by_id[tid]]
        vocab[tag] = tid
        data["added_tokens"].append({"id": tid, "content": tag, "single_word": False,
                                     "lstrip": False, "rstrip": False, "normalized": False,
                                     "special": False})
    (tok_dir / "tokenizer.json").write_text(json.dumps(data))
    return LLM(model=str(llama_dir), tokenizer=str(tok_dir), dtype="float32", seed=0,
               num_kv_blocks=128, max_num_seqs=8)


def test_tags_are_single_tokens(think_llm):
    parser = think_llm.llm_engine.get_reasoning_parser("deepseek_r1")
    assert parser.by_token and parser.end_token_id > parser.start_token_id


def test_choice_applies_after_the_reasoning(think_llm):
    end = think_llm.llm_engine.get_reasoning_parser("qwen3").end_token_id
    choices = ["positive", "negative"]
    free = SamplingParams(max_tokens=8, temperature=0.0)
    constrained = SamplingParams(max_tokens=8, temperature=0.0,
                                 structured_outputs={"choice": choices})
    open_prompt = "Review: great film.<think>\n"
    [plain] = think_llm.generate([open_prompt], free)
    assert end not in plain.outputs[0].token_ids  # (the test needs it not to end)
    outs = think_llm.generate(
        [open_prompt,  # reasoning never ends: all of it is free, the answer is empty
         open_prompt,  # </think> comes first (biased to): the answer is a choice
         "Review: great film.<think>\nhm</think>\n"],  # the prompt closed it
        [constrained, constrained.clone(logit_bias={end: 100}), constrained],
        reasoning_parser="qwen3")
    still, ended, closed = (o.outputs[0] for o in outs)
    assert still.token_ids == plain.outputs[0].token_ids
    assert still.reasoning_content == plain.outputs[0].text
    assert still.text == "" and still.finish_reason == "length"
    assert ended.token_ids[0] == end and ended.reasoning_content == ""
    assert ended.text in choices and ended.finish_reason == "stop"
    assert closed.reasoning_content is None
    assert closed.text in choices and closed.finish_reason == "stop"


def test_a_grammar_applies_after_the_reasoning(think_llm):
    """A regex and a JSON schema (llguidance's matchers) start at </think> as a choice does."""
    end = think_llm.llm_engine.get_reasoning_parser("qwen3").end_token_id
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for constraint, check in (({"regex": "[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}", t)),
                              ({"json": schema}, lambda t: json.loads(t)["ok"] in (True, False))):
        constrained = SamplingParams(max_tokens=12, temperature=0.0,
                                     structured_outputs=constraint)
        outs = think_llm.generate(
            ["Review: great film.<think>\n", "Review: great film.<think>\nhm</think>\n"],
            [constrained.clone(logit_bias={end: 100}), constrained], reasoning_parser="qwen3")
        ended, closed = (o.outputs[0] for o in outs)
        assert ended.token_ids[0] == end and ended.finish_reason == "stop", ended.text
        assert check(ended.text) and check(closed.text), (ended.text, closed.text)


def test_chat_and_unknown_parser(think_llm):
    out = think_llm.generate(["Say yes.<think>\n"], SamplingParams(
        max_tokens=6, temperature=0.0), reasoning_parser="deepseek_r1")[0].outputs[0]
    assert out.text == "" and out.reasoning_content  # no </think>: all reasoning
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        think_llm.generate(["x"], reasoning_parser="r1")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        think_llm.chat([{"role": "user", "content": "x"}], reasoning_parser="r1")
