"""The LLM API around the engine: prompts of every kind, chat, per-request errors,
metrics and progress."""
from __future__ import annotations

import numpy as np
import pytest

from batchinfer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(model=str(llama_dir), max_model_len=512)


def test_text_and_token_prompts_agree(llm):
    tokenizer = llm.get_tokenizer()
    text = "The quick brown fox"
    by_text = llm.generate([text], GREEDY)[0]
    by_ids = llm.generate([tokenizer.encode(text)], GREEDY)[0]
    assert by_text.prompt == text
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == tokenizer.decode(by_text.outputs[0].token_ids,
                                                       skip_special_tokens=True)


def test_text_prompts_are_tokenized_in_one_call(llm, monkeypatch):
    engine, calls = llm.llm_engine, []
    encode = engine.encode_prompts

    def counting(texts, *args, **kwargs):
        calls.append(len(texts))
        return encode(texts, *args, **kwargs)
    monkeypatch.setattr(engine, "encode_prompts", counting)
    texts = ["The quick brown fox", " jumps over", "the lazy dog."]
    outs = llm.generate([texts[0], [1, 2, 3], texts[1], texts[2]], GREEDY)
    assert calls == [3]
    assert [o.prompt for o in outs] == [texts[0], None, texts[1], texts[2]]
    tokenizer = llm.get_tokenizer()
    assert [outs[i].prompt_token_ids for i in (0, 2, 3)] == [tokenizer.encode(t) for t in texts]
    chats = [[{"role": "user", "content": t}] for t in texts]
    assert ([o.prompt_token_ids for o in llm.chat(chats, GREEDY)]
            == [engine.render_chat(c) for c in chats])
    assert calls[1:] == [3] + [1] * 3  # chat's one call; render_chat's one each


def test_single_prompt_and_order(llm):
    prompts = [[1, 5 + i, 9] for i in range(10)]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts
    single = llm.generate(prompts[3], GREEDY)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_chat_uses_the_template(llm):
    conversation = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": "What is a cat?"}]
    chat_out = llm.chat(conversation, GREEDY)[0]
    text = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=True)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert chat_out.prompt_token_ids == ids
    assert chat_out.outputs[0].token_ids == llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], GREEDY)
    # OpenAI's content parts: text parts joined by newlines; other kinds refused
    parts = [{"role": "system", "content": [{"type": "text", "text": "Answer"},
                                            {"type": "text", "text": "briefly."}]},
             {"role": "user", "content": "What is a cat?"}]
    joined = [{"role": "system", "content": "Answer\nbriefly."}, conversation[1]]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == llm.chat(joined, GREEDY)[0].prompt_token_ids
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], GREEDY)


THINKING_TEMPLATE = (
    "{%- for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>"
    "{%- if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{%- endif %}")


def test_chat_template_and_its_variables(llm):
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "Hi there"}]

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    out = llm.chat(conversation, GREEDY, chat_template=THINKING_TEMPLATE)[0]
    assert out.prompt_token_ids == ids("<user>Hi there<assistant>")
    out = llm.chat(conversation, GREEDY, chat_template=THINKING_TEMPLATE,
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt_token_ids == ids("<user>Hi there<assistant><no-think>")
    # the tokenizer's own template takes the variables too
    default = llm.chat(conversation, GREEDY)[0].prompt_token_ids
    assert llm.chat(conversation, GREEDY, chat_template_kwargs={"unused": 1})[0] \
        .prompt_token_ids == default
    # continuing the last message: no new turn
    partial = [*conversation, {"role": "assistant", "content": "Once upon"}]
    out = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True,
                   chat_template=THINKING_TEMPLATE)[0]
    assert out.prompt_token_ids == ids("<user>Hi there<assistant>Once upon")
    with pytest.raises(ValueError, match="cannot both be set"):
        llm.chat(partial, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot set add_generation_prompt"):
        llm.chat(conversation, GREEDY, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="must be an object"):
        llm.chat(conversation, GREEDY, chat_template_kwargs=["enable_thinking"])
    with pytest.raises(ValueError, match="the chat template failed: TemplateSyntaxError"):
        llm.chat(conversation, GREEDY, chat_template="{% for %}")


def test_token_ids_of_any_integer_type(llm):
    ids = [1, 5, 9]
    expected = llm.generate(ids, GREEDY)[0].outputs[0].token_ids
    for prompt in (list(np.array(ids)), np.array(ids)):  # numpy ints, a numpy array
        out = llm.generate(prompt, GREEDY)
        assert len(out) == 1 and out[0].error is None
        assert out[0].outputs[0].token_ids == expected
    batch = llm.generate(np.array([ids, ids]), GREEDY)  # a 2-D array: one prompt a row
    assert [o.outputs[0].token_ids for o in batch] == [expected, expected]


def test_token_ids_out_of_range_or_not_integers_fail(llm):
    # plain ints take a fast check; anything else the per-element one
    for bad in ([1, -3], [1, 2 ** 40], [1, True], [1, 2.0], [np.int64(1), -1]):
        out = llm.generate([bad], GREEDY)[0]
        assert out.error is not None and "token ids must be integers" in out.error, bad


def test_a_bad_argument_part_way_through_generate_leaves_nothing_behind(llm):
    with pytest.raises(AttributeError):
        llm.generate([[1, 2, 3], [4, 5, 6]], [GREEDY, {}])  # the second params are no params
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_prompts_fail_alone(llm):
    too_long = [1] + [7] * 600
    outs = llm.generate([[1, 2, 3], too_long, "", [1, 10 ** 9], [1, 4, 5], "bad \ud800 x"],
                        GREEDY)
    good = [outs[0], outs[4]]
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in good)
    assert "max_model_len" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert outs[1].prompt_token_ids == too_long  # its length is known and reported
    assert "empty" in outs[2].error
    assert "token ids" in outs[3].error
    assert "not valid Unicode" in outs[5].error  # a lone surrogate, as JSON's \ud800 gives
    for message in ({"role": "user", "content": "bad \udc80"},
                    {"role": "user", "content": [{"type": "text", "text": "x\ud800"}]},
                    {"role": "user\ud800", "content": "hi"}):
        with pytest.raises(ValueError, match="not valid Unicode"):
            llm.chat([message], GREEDY)
    pool = llm.llm_engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_prompt_that_could_never_fit_the_pool(llama_dir):
    llm = LLM(model=str(llama_dir), num_kv_blocks=4, block_size=16)  # 64 tokens in all
    assert llm.llm_engine.max_model_len == 64
    outs = llm.generate([[1] * 100, [1, 2, 3]], GREEDY)
    assert outs[0].outputs[0].finish_reason == "error" and "max_model_len" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length"


def test_max_tokens_capped_by_max_model_len(llama_dir):
    llm = LLM(model=str(llama_dir), max_model_len=32)
    out = llm.generate([[1] * 30], SamplingParams(max_tokens=100, ignore_eos=True, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"


def test_metrics_are_ordered(llm):
    outs = llm.generate([[1, 2, 3 + i] for i in range(6)], GREEDY)
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.queue_s >= 0 and m.ttft_s >= 0 and m.e2e_s >= m.ttft_s
        assert m.tpot_s(len(out.outputs[0].token_ids)) >= 0
        assert m.num_preemptions == 0


def test_stats_keys(llm):
    stats = llm.stats()
    for key in ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "num_preemptions",
                "num_free_blocks", "num_total_blocks"):
        assert isinstance(stats[key], int)


def test_progress_bar(llm, capsys):
    llm.generate([[1, 2, 3]] * 3, GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_sampling_params_validation():
    nan = float("nan")
    for bad in (dict(temperature=-1), dict(top_p=0), dict(n=0), dict(max_tokens=0),
                dict(min_tokens=5, max_tokens=2), dict(stop=[""]),
                # wrong types and non-finite numbers, caught here rather than in a step
                dict(temperature=nan), dict(repetition_penalty=nan), dict(top_p=float("inf")),
                dict(top_k=2.5), dict(max_tokens=2.5), dict(n=True), dict(logprobs=2.5),
                dict(seed=2 ** 63), dict(seed=2 ** 63 - 1, n=2), dict(stop_token_ids=["7"]),
                dict(stop_token_ids=[-1]), dict(stop=5), dict(stop_token_ids=7)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    # any integer type is taken, as a Python int, and so are whole floats and collections
    params = SamplingParams(n=np.int64(2), seed=np.int32(5), max_tokens=np.int64(3),
                            stop_token_ids=[np.int64(2)], top_k=-1)
    assert (params.n, params.seed, params.max_tokens, params.stop_token_ids, params.top_k) \
        == (2, 5, 3, [2], 0)
    assert all(type(v) is int for v in (params.n, params.seed, params.max_tokens))
    params = SamplingParams(max_tokens=3.0, stop_token_ids=range(2, 4), stop={"x"})
    assert (params.max_tokens, params.stop_token_ids, params.stop) == (3, [2, 3], ["x"])
    assert SamplingParams(stop_token_ids=np.array([7, 8])).stop_token_ids == [7, 8]


def test_params_beyond_the_vocabulary_fail_alone(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    outs = llm.generate([[1, 2, 3]] * 3, [
        GREEDY, SamplingParams(temperature=0, max_tokens=4, logprobs=vocab + 1),
        SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[vocab])])
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 8
    assert "logprobs" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert "stop_token_ids" in outs[2].error


def test_a_failed_step_leaves_the_llm_usable(llm, monkeypatch):
    prompts = [[1, 2, 3], [1, 4, 5, 6], [1, 7]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    runner = llm.llm_engine.model_runner
    execute, calls = runner.execute, []

    def fails_on_the_third_step(plan):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return execute(plan)
    monkeypatch.setattr(runner, "execute", fails_on_the_third_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompts, GREEDY)
    monkeypatch.undo()
    assert not llm.llm_engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    pool = llm.llm_engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_request_ids_may_not_collide_with_samples(llm):
    # n > 1 samples of "a" run as "a#0", "a#1": neither order may reuse one of those ids
    engine = llm.llm_engine
    two = SamplingParams(n=2, max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], two)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a#1", [4, 5], GREEDY)
    engine.add_request("b#0", [4, 5], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("b", [6, 7], two)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [6, 7], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step())
    assert sorted(done) == ["a", "b#0"]
    assert [len(c.token_ids) for c in done["a"].outputs] == [2, 2]
    assert len(done["b#0"].outputs[0].token_ids) == 8
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_earliest_stop_string_wins():
    from batchinfer.engine.detokenizer import IncrementalDetokenizer

    class OneTokenTokenizer:  # a single token carries both stop strings
        def decode(self, ids, skip_special_tokens=True):
            return "hello world" * len(ids)

    detok = IncrementalDetokenizer(OneTokenTokenizer(), ["world", "lo"], True, False)
    assert detok.add(1) == "lo" and detok.text == "hel"


def test_text_held_back_for_an_incomplete_character_ends_the_request(llm):
    from batchinfer.engine.detokenizer import IncrementalDetokenizer
    tok = llm.get_tokenizer()
    ids = tok.encode("Grüße", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, ["never"], True, False)
    for token in ids[:cut]:
        assert detok.add(token) is None
    assert not detok.text.endswith("\ufffd")  # held back while the character may complete
    assert detok.flush() is None and detok.text == tok.decode(ids[:cut])

    # in the engine: a request cut by max_tokens inside a character has the same text with
    # stop strings (incremental detokenizing) as without (one decode at the end)
    sampled = SamplingParams(max_tokens=30, temperature=1.5, seed=5)
    prompts = [f"Grüße aus Köln — {i}" for i in range(16)]
    checked = 0
    for out in llm.generate(prompts, sampled):
        ids = out.outputs[0].token_ids
        cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
        if cuts:
            params = sampled.clone(max_tokens=cuts[0])
            plain, stopped = llm.generate([out.prompt] * 2, [params, params.clone(stop=["\x00"])])
            assert stopped.outputs[0].token_ids == plain.outputs[0].token_ids
            assert stopped.outputs[0].text == plain.outputs[0].text
            assert plain.outputs[0].text.endswith("\ufffd")
            checked += 1
    assert checked >= 2


def test_the_callers_config_is_not_written_back(llama_dir):
    """The engine resolves max_model_len for itself; the EngineConfig it was given keeps
    what the caller asked for (None: the model's)."""
    from batchinfer.config import EngineConfig
    from batchinfer.engine.engine import LLMEngine
    config = EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64)
    engine = LLMEngine(config)
    assert engine.max_model_len > 0 and config.max_model_len is None
