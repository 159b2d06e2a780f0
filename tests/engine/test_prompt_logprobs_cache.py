"""Requests asking prompt logprobs read the prefix cache where its blocks keep the prompt
logprobs of their positions (kept by an earlier request with the same k): the same
results as computing the whole prompt, with the shared part not computed again."""
from __future__ import annotations

import pytest

from batchinfer import LLM, SamplingParams

SHARED = list(range(5, 105))  # a 100-token shared prefix: 6 full blocks of 16
PROMPTS = [SHARED + [200 + i, 300 + i, 7, 8 + i] for i in range(3)]


@pytest.fixture(scope="module")
def engines(llama_dir):
    kwargs = dict(model=str(llama_dir), dtype="float32", block_size=16, seed=0)
    return LLM(**kwargs), LLM(**kwargs, enable_prefix_caching=False)


# two paths (cached and not) compute the same logits with other kernel shapes: values
# within float error, and tokens that tie within it may come in either order
EPS = 1e-5


def assert_same_prompt_logprobs(got, want, k: int):
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for x, y in zip(got[1:], want[1:]):
        token = next(iter(x))  # the prompt token comes first
        assert next(iter(y)) == token
        assert x[token].logprob == pytest.approx(y[token].logprob, abs=EPS)
        assert x[token].decoded_token == y[token].decoded_token
        # its rank counts the tokens scoring above it: a token within float error of it
        # may fall on either side (seen on AVX2 CPUs: 137 against 138, 5e-7 apart)
        assert abs(x[token].rank - y[token].rank) <= 1
        top_x, top_y = _top(x, k), _top(y, k)
        assert len(top_x) == len(top_y) == k
        assert [v for v, _ in top_x] == pytest.approx([v for v, _ in top_y], abs=EPS)
        values_y = dict((t, v) for v, t in top_y)
        for (v, t), (_, other) in zip(top_x, top_y):
            if t != other:  # a tie: the same value elsewhere in the list, or at its end
                assert (abs(values_y.get(t, top_y[-1][0]) - v) < EPS), (t, other, top_x, top_y)


def _top(logprobs: dict, k: int) -> list[tuple[float, int]]:
    """The top k (value, token), highest first (the prompt token is among them when its
    rank is k or better)."""
    return sorted(((lp.logprob, t) for t, lp in logprobs.items() if lp.rank <= k),
                  key=lambda e: -e[0])[:k]


def test_scoring_requests_skip_the_prefix_an_earlier_one_scored(engines):
    cached, uncached = engines
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    before = cached.stats()["num_prompt_tokens_computed"]
    first = cached.generate(PROMPTS[:1], params)[0]
    later = cached.generate(PROMPTS[1:], params)
    computed = cached.stats()["num_prompt_tokens_computed"] - before
    # the shared blocks but the last are read: that one's last position scores the next token
    assert first.num_cached_tokens == 0 and [o.num_cached_tokens for o in later] == [80, 80]
    assert computed == sum(map(len, PROMPTS)) - 2 * 80
    for out, ref in zip([first, *later], uncached.generate(PROMPTS, params)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert_same_prompt_logprobs(out.prompt_logprobs, ref.prompt_logprobs, 2)


def test_another_k_computes_its_whole_prompt(engines):
    cached, uncached = engines
    cached.generate(PROMPTS[:1], SamplingParams(max_tokens=1, prompt_logprobs=1))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    out = cached.generate(PROMPTS[1:2], params)[0]
    assert out.num_cached_tokens == 0
    assert_same_prompt_logprobs(out.prompt_logprobs,
                                uncached.generate(PROMPTS[1:2], params)[0].prompt_logprobs, 3)


def test_a_preempted_request_keeps_to_its_own_prompt_positions(llama_dir):
    # B is X and the first 40 tokens X generates: scoring B leaves blocks keeping prompt
    # logprobs past X's prompt, which X, preempted while generating, hits when it resumes
    kwargs = dict(model=str(llama_dir), dtype="float32", block_size=16, seed=0)
    x = list(range(5, 25))
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    ref = LLM(**kwargs, enable_prefix_caching=False).generate([x], greedy)[0]
    b = x + ref.outputs[0].token_ids[:40]
    llm = LLM(**kwargs, num_kv_blocks=11, max_num_seqs=2)
    llm.generate([b], SamplingParams(max_tokens=1, prompt_logprobs=1))
    plain = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    out = llm.generate([b, x], [plain, greedy])[1]
    assert llm.stats()["num_preemptions"] > 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_same_prompt_logprobs(out.prompt_logprobs, ref.prompt_logprobs, 1)
