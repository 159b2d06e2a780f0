"""SamplingParams through the whole engine on a tiny random-weight Llama: seeds, filters,
stop conditions, n > 1, logprobs against transformers, penalties, and that no KV block is
left held after generate() returns."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.random_checkpoint import build_random_checkpoint

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return Path(request.getfixturevalue("llama_dir"))
    except pytest.FixtureLookupError:
        return build_random_checkpoint(tmp_path_factory.mktemp("sampling-llama"), "test-llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", seed=0, block_size=BLOCK_SIZE,
               num_kv_blocks=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path, llm: LLM):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.to(llm.llm_engine.device).eval()


def random_prompt(rng: random.Random, length: int, vocab: int = 1000) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(length)]


def greedy(llm: LLM, prompt, max_tokens: int = 24, **kw) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def assert_no_blocks_held(llm: LLM) -> None:
    engine = llm.llm_engine
    pool = engine.kv.pool
    assert [b.block_id for b in pool.blocks if b.ref_cnt != 0] == []
    assert pool.num_free_blocks == pool.num_blocks
    assert engine.kv.req_blocks == {}
    assert not engine.scheduler.has_unfinished()
    assert engine.scheduler.requests == {} and engine.output_processor.parents == {}


@torch.inference_mode()
def hf_log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of token_ids."""
    device = next(hf_model.parameters()).device
    logits = hf_model(torch.tensor([token_ids], device=device)).logits[0]
    return logits.float().log_softmax(-1).cpu()


# ---- seeds --------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm: LLM):
    rng = random.Random(0)
    prompt = random_prompt(rng, 21)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    again = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert alone == again
    others = [random_prompt(rng, rng.randrange(5, 60)) for _ in range(5)]
    other_params = [SamplingParams(temperature=1.0, max_tokens=rng.randrange(4, 20),
                                   seed=None if i % 2 else 77 + i) for i in range(5)]
    outs = llm.generate(others[:2] + [prompt] + others[2:],
                        other_params[:2] + [params] + other_params[2:])
    assert outs[2].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], params.clone(seed=4321))[0].outputs[0].token_ids
    assert other_seed != alone


def test_filters_that_leave_one_token_are_greedy(llm: LLM):
    prompt = random_prompt(random.Random(1), 17)
    want = greedy(llm, prompt, max_tokens=12)
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=3, **kw)
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == want, kw


# ---- stop conditions ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def clean_greedy(llm: LLM) -> tuple[str, list[int], str]:
    """A text prompt whose 24-token greedy continuation decodes to printable ASCII."""
    tok = llm.get_tokenizer()
    rng = random.Random(5)
    prompts = [tok.decode(random_prompt(rng, 12), skip_special_tokens=True) for _ in range(16)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        text = tok.decode(ids, skip_special_tokens=True)
        if text.isascii() and text.isprintable() and len(text) > 20:
            return prompt, ids, text
    pytest.fail("no prompt with a printable greedy continuation")


def expected_stop(tok, ids: list[int], stop: str, min_tokens: int = 0) -> tuple[int, str]:
    """Reference: the first k >= min_tokens at which stop ends inside the text the k-th
    token added, and the text cut before it; (len(ids), the whole text) if none."""
    def decode(part: list[int]) -> str:
        return tok.decode(part, skip_special_tokens=True)

    for k in range(max(min_tokens, 1), len(ids) + 1):
        text, prev = decode(ids[:k]), decode(ids[:k - 1])
        pos = text.find(stop, max(len(prev) - len(stop) + 1, 0))
        if pos >= 0:
            return k, text[:pos]
    return len(ids), decode(ids)


def test_stop_string_cuts_the_text_before_it(llm: LLM, clean_greedy):
    tok = llm.get_tokenizer()
    prompt, ids, text = clean_greedy
    mid = len(tok.decode(ids[:len(ids) // 2]))
    stop = text[mid - 2:mid + 3]  # spans a token boundary
    n, cut = expected_stop(tok, ids, stop)
    assert cut == text[:text.find(stop)]
    base = SamplingParams(temperature=0.0, max_tokens=len(ids), stop=[stop, "\x00never"])
    out = llm.generate([prompt], base)[0].outputs[0]
    assert out.text == cut
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ids[:n]
    kept = llm.generate([prompt], base.clone(include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut + stop
    assert kept.token_ids == ids[:n]
    assert_no_blocks_held(llm)


def test_stop_string_that_never_appears_keeps_the_full_text(llm: LLM, clean_greedy):
    prompt, ids, text = clean_greedy
    params = SamplingParams(temperature=0.0, max_tokens=len(ids), stop="\x00never")
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.text == text and out.token_ids == ids
    assert out.finish_reason == "length" and out.stop_reason is None


def test_stop_strings_wait_for_min_tokens(llm: LLM, clean_greedy):
    """A stop string completed before min_tokens neither stops the request nor cuts its
    text; the first one completed from min_tokens on does."""
    tok = llm.get_tokenizer()
    prompt, ids, text = clean_greedy
    word = tok.decode(ids[:1])  # complete after the first token
    min_tokens = 4
    n, cut = expected_stop(tok, ids, word, min_tokens)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(ids),
                                                stop=word, min_tokens=min_tokens))
    out = out[0].outputs[0]
    assert out.token_ids == ids[:n]
    assert out.text == cut
    assert out.finish_reason == ("stop" if n < len(ids) else "length")


def test_stop_token_ids(llm: LLM, clean_greedy):
    tok = llm.get_tokenizer()
    prompt, ids, text = clean_greedy
    stop_token = ids[len(ids) // 2]
    n = ids.index(stop_token) + 1
    base = SamplingParams(temperature=0.0, max_tokens=len(ids), stop_token_ids=[stop_token])
    out = llm.generate([prompt], base)[0].outputs[0]
    assert out.token_ids == ids[:n]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    # as in vLLM, the stop token is in token_ids but its text is not in the output ...
    assert out.text == tok.decode(ids[:n - 1])
    # ... unless asked for, and the same holds when the request also has stop strings
    variants = [base.clone(include_stop_str_in_output=True),
                base.clone(stop=["\x00never"]),
                base.clone(stop=["\x00never"], include_stop_str_in_output=True)]
    outs = llm.generate([prompt] * 3, variants)
    assert [o.outputs[0].text for o in outs] == [tok.decode(ids[:n]), tok.decode(ids[:n - 1]),
                                                 tok.decode(ids[:n])]
    assert all(o.outputs[0].token_ids == ids[:n] for o in outs)


def test_max_tokens_finishes_with_length(llm: LLM):
    prompt = random_prompt(random.Random(3), 9)
    for max_tokens in (1, 7):
        out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=0,
                                                    max_tokens=max_tokens))[0].outputs[0]
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length" and out.stop_reason is None


@pytest.fixture(scope="module")
def eos_setup(model_dir: Path, llm: LLM, tmp_path_factory: pytest.TempPathFactory):
    """The same checkpoint with an extra EOS id: a token its greedy continuation of a
    prompt produces, so EOS handling can be seen on a random model."""
    prompt = random_prompt(random.Random(4), 15)
    ids = greedy(llm, prompt)
    eos = ids[len(ids) // 2]
    copy = tmp_path_factory.mktemp("eos-llama")
    shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    gen_path = copy / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    old = gen["eos_token_id"]
    gen["eos_token_id"] = (old if isinstance(old, list) else [old]) + [eos]
    gen_path.write_text(json.dumps(gen))
    eos_llm = LLM(model=str(copy), dtype="float32", seed=0, block_size=BLOCK_SIZE,
                  num_kv_blocks=64)
    assert eos in eos_llm.llm_engine.eos_token_ids
    return eos_llm, prompt, ids, eos


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(eos_setup):
    eos_llm, prompt, ids, eos = eos_setup
    n = ids.index(eos) + 1
    out = eos_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(ids)))
    out = out[0].outputs[0]
    assert out.token_ids == ids[:n]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = eos_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=len(ids),
                                                        ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == ids
    assert ignored.finish_reason == "length"


def test_min_tokens_blocks_eos_and_stop_tokens(eos_setup):
    eos_llm, prompt, ids, eos = eos_setup
    first = ids.index(eos)
    min_tokens = first + 2
    out = eos_llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=len(ids), min_tokens=min_tokens))[0].outputs[0]
    assert out.token_ids[:first] == ids[:first]
    assert eos not in out.token_ids[:min_tokens]
    assert len(out.token_ids) > min_tokens
    # sampling never picks a blocked token before min_tokens: with half the vocabulary
    # as stop tokens, 12 unblocked samples would almost surely hit one
    vocab = eos_llm.llm_engine.model_config.vocab_size
    stops = [t for t in range(0, vocab, 2)]
    for seed in range(3):
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=20, min_tokens=12,
                                stop_token_ids=stops)
        sampled = eos_llm.generate([prompt], params)[0].outputs[0]
        assert len(sampled.token_ids) > 12
        assert all(t % 2 for t in sampled.token_ids[:12]) and eos not in sampled.token_ids[:12]
        assert sampled.finish_reason == "stop" and sampled.stop_reason == sampled.token_ids[-1]


# ---- n > 1 --------------------------------------------------------------------------------

def test_n_completions_share_the_prompt_blocks(llm: LLM):
    prompt = random_prompt(random.Random(6), 3 * BLOCK_SIZE + 5)
    before = llm.stats()
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10))
    after = llm.stats()
    (req,) = out
    assert [c.index for c in req.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in req.outputs]
    assert len(set(seqs)) == 3
    assert all(len(s) == 10 for s in seqs)
    assert after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"] == 3 * len(prompt)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 2 * 3 * BLOCK_SIZE
    # each sample is sample 0 of its own seed (seed + index), as if asked alone
    for i, seq in enumerate(seqs):
        single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i,
                                                       max_tokens=10))[0].outputs[0]
        assert tuple(single.token_ids) == seq
    assert_no_blocks_held(llm)


# ---- logprobs -----------------------------------------------------------------------------

def test_greedy_logprobs_match_transformers(llm: LLM, hf_model):
    prompt = random_prompt(random.Random(7), 23)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                logprobs=3))[0].outputs[0]
    ref = hf_log_softmax(hf_model, prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 8
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        top = row.topk(3)
        assert token == top.indices[0].item()
        assert list(entry) == top.indices.tolist()  # the sampled token is the first of them
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[tid].rank == rank
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_sampled_logprobs_include_the_sampled_token_with_its_rank(llm: LLM, hf_model):
    prompt = random_prompt(random.Random(8), 14)
    out = llm.generate([prompt], SamplingParams(temperature=1.5, seed=2, max_tokens=8,
                                                logprobs=2))[0].outputs[0]
    ref = hf_log_softmax(hf_model, prompt + out.token_ids)
    ranks = []
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        top2 = row.topk(2).indices.tolist()
        assert set(entry) == set(top2) | {token}
        assert next(iter(entry)) == token  # the sampled token first, as vLLM orders them
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        ranks.append(entry[token].rank)
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert max(ranks) > 2  # at this temperature some samples are outside the top 2


# ---- penalties ----------------------------------------------------------------------------

@torch.inference_mode()
def hf_penalised_greedy(hf_model, prompt: list[int], steps: int, rep: float, pres: float,
                        freq: float) -> list[int]:
    """Greedy decoding on transformers' logits with vLLM's penalty definitions."""
    device = next(hf_model.parameters()).device
    out: list[int] = []
    for _ in range(steps):
        logits = hf_model(torch.tensor([prompt + out], device=device)).logits[0, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt + out] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long, device=device),
                                minlength=logits.numel()).float()
        logits = logits - freq * counts - pres * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("rep, pres, freq", [(1.5, 0.0, 0.0), (1.0, 0.8, 0.0),
                                             (1.0, 0.0, 0.7), (1.2, 0.3, 0.4)])
def test_penalised_greedy_matches_the_reference(llm: LLM, hf_model, rep, pres, freq):
    base = random_prompt(random.Random(9), 13)
    # the prompt ends with what the model goes on repeating, so the repetition penalty
    # has prompt tokens to act on
    prompt = base + greedy(llm, base, max_tokens=4)
    plain = greedy(llm, prompt, max_tokens=12)
    assert set(plain) & set(prompt)
    got = greedy(llm, prompt, max_tokens=12, repetition_penalty=rep, presence_penalty=pres,
                 frequency_penalty=freq)
    assert got == hf_penalised_greedy(hf_model, prompt, 12, rep, pres, freq)
    assert got != plain  # the tiny model repeats itself; the penalty must change that


# ---- no leaks -----------------------------------------------------------------------------

def test_no_block_is_held_after_preemptions_n_stop_strings_and_aborts(model_dir: Path, llm: LLM):
    small = LLM(model=str(model_dir), dtype="float32", seed=0, block_size=BLOCK_SIZE,
                num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    rng = random.Random(10)
    shared = random_prompt(rng, 20)
    prompts = [shared + random_prompt(rng, rng.randrange(3, 30)) for _ in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.0, max_tokens=40, stop=["e"]),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=30),
              SamplingParams(temperature=1.0, seed=6, max_tokens=35, stop=["a", "x"]),
              SamplingParams(temperature=0.0, max_tokens=25, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=40)]
    outs = small.generate(prompts, params)
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert {o.outputs[0].finish_reason for o in outs[1:4:2]} == {"stop"}
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 12
    assert_no_blocks_held(small)
    # preemption and recomputation do not change what is generated
    reference = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in reference]
    assert sum(o.metrics.num_preemptions for o in outs) == stats["num_preemptions"]

    engine = small.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(n=1 + i % 2, temperature=0.0,
                                                                max_tokens=40))
    for _ in range(6):
        assert engine.step() == []
    assert engine.scheduler.running
    engine.abort_request([f"abort-{i}" for i in range(0, 6, 2)])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step()]
    assert sorted(finished) == [f"abort-{i}" for i in range(1, 6, 2)]
    assert_no_blocks_held(small)


# ---- logit bias, allowed tokens, structured-output choices ----------------------------

def _first_step_logprobs(llm, prompt: str) -> dict[int, float]:
    """Every token's raw logprob at the first generated position."""
    vocab = llm.llm_engine.model_config.vocab_size
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab))[0]
    return {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}


def test_allowed_token_ids_and_logit_bias_steer_greedy(llm):
    raw = _first_step_logprobs(llm, "The weather today")
    ranked = sorted(raw, key=raw.get, reverse=True)
    allowed = [ranked[9], ranked[4], ranked[30]]
    out = llm.generate(["The weather today"], SamplingParams(
        max_tokens=3, temperature=0.0, allowed_token_ids=allowed))[0].outputs[0]
    assert out.token_ids[0] == ranked[4]  # the best of the allowed ones
    assert set(out.token_ids) <= set(allowed)
    # a -100 bias on the best token makes the second the greedy choice; +100 on the
    # 50th makes it the choice
    first = lambda **kw: llm.generate(["The weather today"], SamplingParams(
        max_tokens=1, temperature=0.0, **kw))[0].outputs[0].token_ids[0]
    assert first(logit_bias={ranked[0]: -100}) == ranked[1]
    assert first(logit_bias={str(ranked[50]): 100.0}) == ranked[50]  # JSON-style keys too
    # logprobs stay those of the model (vLLM's raw logprobs)
    biased = llm.generate(["The weather today"], SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=1, logit_bias={ranked[50]: 100}))[0]
    assert biased.outputs[0].logprobs[0][ranked[50]].logprob == pytest.approx(raw[ranked[50]], abs=1e-4)


def test_choice_completions_are_one_of_the_choices(llm):
    from batchinfer import StructuredOutputsParams
    choices = ["positive", "negative", "a neutral opinion"]
    tok = llm.get_tokenizer()
    prompts = ["I loved this film", "Terrible service", "It was fine", "hello"]
    params = SamplingParams(max_tokens=32, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert c.text in choices and c.finish_reason == "stop"
        # greedy: the first token is the best first token of any choice
        raw = _first_step_logprobs(llm, prompt)
        firsts = {tok.encode(ch, add_special_tokens=False)[0] for ch in choices}
        assert c.token_ids[0] == max(firsts, key=raw.get)
    sampled = llm.generate(prompts[:1], SamplingParams(
        n=6, temperature=1.5, seed=3, max_tokens=32,
        structured_outputs={"choice": choices}))[0]  # a dict, as JSON gives it
    assert {c.text for c in sampled.outputs} <= set(choices)


def test_constraint_mistakes_are_named():
    from batchinfer import StructuredOutputsParams
    with pytest.raises(ValueError, match="logit_bias values must be numbers in"):
        SamplingParams(logit_bias={1: 500})
    with pytest.raises(ValueError, match="logit_bias: token ids must be integers"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="grammar refused: .*unknown name"):
        StructuredOutputsParams(grammar="start: nowhere")
    with pytest.raises(ValueError, match="json schema refused: Unimplemented keys"):
        StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    with pytest.raises(ValueError, match="choice must be non-empty strings"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="ignore_eos and min_tokens cannot"):
        SamplingParams(ignore_eos=True, structured_outputs={"choice": ["a"]})
    with pytest.raises(ValueError, match="structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"choices": ["a"]})


def test_impossible_constraints_fail_their_request_alone(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    eos = min(llm.llm_engine.eos_token_ids)
    eos_text = llm.get_tokenizer().decode([eos])
    bad = [SamplingParams(max_tokens=2, allowed_token_ids=[vocab]),
           SamplingParams(max_tokens=4, allowed_token_ids=[eos], min_tokens=2),
           SamplingParams(max_tokens=4, structured_outputs={"choice": [f"A{eos_text}B"]})]
    outs = llm.generate(["a", "b", "c", "d"],
                        [*bad, SamplingParams(max_tokens=2, temperature=0.0)])
    assert "allowed_token_ids must name token ids" in outs[0].error
    assert "only stop tokens, which min_tokens forbids" in outs[1].error
    assert "holds an end-of-sequence or stop token" in outs[2].error
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(allowed_token_ids=[1], structured_outputs={"choice": ["a"]})


def test_choices_decode_to_exactly_their_text(tmp_path, model_dir):
    # a byte-level tokenizer that adds a leading space on its own: "no" encodes as " no"
    import json as json_
    model = tmp_path / "prefix-space"
    shutil.copytree(model_dir, model)
    tok = json_.loads((model / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["add_prefix_space"] = True
    (model / "tokenizer.json").write_text(json_.dumps(tok))
    llm = LLM(model=str(model), dtype="float32")
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode(
        "no", add_special_tokens=False)) == " no"
    outs = llm.generate(["I think", "Maybe"], SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs={"choice": ["yes", "no"]}))
    assert all(o.outputs[0].text in ("yes", "no") for o in outs)


def test_prompt_logprobs_with_n_samples_score_the_prompt_once(llm):
    prompt = list(range(5, 200))
    llm.llm_engine.scheduler.num_prompt_tokens_computed = 0
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=2, prompt_logprobs=0,
                                                temperature=1.0, seed=1))[0]
    assert len(out.prompt_logprobs) == len(prompt) and len(out.outputs) == 4
    # the first sample computes the whole prompt; the rest read its cached blocks
    assert llm.stats()["num_prompt_tokens_computed"] < 2 * len(prompt)


# ---- prompt logprobs ------------------------------------------------------------------

def test_prompt_logprobs_match_transformers(model_dir):
    from transformers import AutoModelForCausalLM
    # a 64-token budget prefills the prompts in chunks; the second prompt shares the first's
    # prefix and reads it from the cache, with the prompt logprobs the first one's blocks
    # kept (the blocks the plain request cached first keep none)
    llm = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=64)
    prompts = [list(range(5, 150)), list(range(5, 120)) + [7, 8, 9]]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    llm.generate(prompts[:1], SamplingParams(max_tokens=1))  # fills the prefix cache
    outs = llm.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for p in range(1, len(prompt)):
            entry = got[p]
            assert entry[prompt[p]].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
            # the rank counts the tokens above it: those within the logprob tolerance may
            # fall either side of it
            x, row = ref[p - 1, prompt[p]], ref[p - 1]
            assert int((row > x + 1e-4).sum()) + 1 <= entry[prompt[p]].rank \
                <= int((row > x - 1e-4).sum()) + 1
            best = int(ref[p - 1].argmax())
            assert best in entry and entry[best].rank == 1
            assert len(entry) <= 3  # the prompt token, then the top 2
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=1))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


def test_prompt_logprobs_survive_preemption(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=24, max_num_seqs=4)
    prompts = [list(range(10 + i, 110 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0
    # each computed alone, none of it read from a cache
    fresh = LLM(model=str(model_dir), dtype="float32", enable_prefix_caching=False)
    alone = [fresh.generate([p], params)[0] for p in prompts]
    for a, b in zip(outs, alone):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert all(x is None for x in (a.prompt_logprobs[0], b.prompt_logprobs[0]))
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and len(x) == 1
            (tid, lx), = x.items()
            assert lx.logprob == pytest.approx(y[tid].logprob, abs=1e-5)


def test_a_one_token_prompt_chunk_scores_its_position(model_dir):
    # A's 15 tokens leave one token of the 16-token budget: B's first chunk is one token,
    # and a one-token chunk runs among the decodes
    llm = LLM(model=str(model_dir), dtype="float32", block_size=16, max_num_batched_tokens=16)
    a, b = list(range(5, 20)), list(range(100, 130))
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1)
    got = llm.generate([a, b], [SamplingParams(max_tokens=3), scoring])[1].prompt_logprobs
    want = LLM(model=str(model_dir), dtype="float32").generate([b], scoring)[0].prompt_logprobs
    assert got[0] is None and all(entry is not None for entry in got[1:])
    for x, y in zip(got[1:], want[1:]):
        assert list(x) == list(y)
        assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)


# ---- prompt truncation ----------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_tokens(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=64)
    prompt = list(range(5, 105))  # 100 tokens: longer than max_model_len
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    too_long = llm.generate([prompt], greedy)[0]
    assert too_long.outputs[0].finish_reason == "error" and "max_model_len" in too_long.error
    cut = llm.generate([prompt], greedy.clone(truncate_prompt_tokens=20))[0]
    tail = llm.generate([prompt[-20:]], greedy)[0]
    assert cut.prompt_token_ids == prompt[-20:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # -1: as many as leave room for max_tokens
    fit = llm.generate([prompt], greedy.clone(truncate_prompt_tokens=-1))[0]
    assert fit.prompt_token_ids == prompt[-60:]
    assert fit.outputs[0].finish_reason == "length" and len(fit.outputs[0].token_ids) == 4
    no_room = llm.generate([prompt[:10]], greedy.clone(truncate_prompt_tokens=64))[0]
    assert no_room.outputs[0].finish_reason == "error"
    assert "truncate_prompt_tokens 64" in no_room.error
    short = llm.generate([prompt[:10]], greedy.clone(truncate_prompt_tokens=20))[0]
    assert short.prompt_token_ids == prompt[:10]  # shorter prompts are left as they are
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=-2)
