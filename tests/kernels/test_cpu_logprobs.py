"""The CPU logprobs kernel (kernels/cpu/logprobs.c) against torch's log-softmax, top k,
gather and rank: values, ids, ranks, ties, degenerate rows, strides and the contract."""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import cpu


@pytest.fixture(scope="module")
def kernel(built_or_skip):
    return cpu.logprobs.LogprobsKernel(built_or_skip(cpu.logprobs, "the CPU logprobs kernel"))


def reference(logits, k, tokens):
    """(ids, values, ranks) from the float64 log-softmax: the top k by a stable descending
    sort (ties by index), then the token's value; its rank is 1 + the values above it."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    order = lp.sort(dim=-1, descending=True, stable=True)
    chosen = lp.gather(1, tokens[:, None])
    return (order.indices[:, :k], torch.cat([order.values[:, :k], chosen], 1),
            (lp > chosen).sum(1) + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, k", [(1000, 5), (8192, 20), (49_152, 0), (33, 33), (17, 1),
                                      (5000, 64)])
def test_matches_torch(kernel, dtype, vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    rows = 9
    if dtype == torch.float32:  # distinct values, far apart next to float32's rounding
        logits = torch.randperm(rows * vocab, generator=gen).view(rows, vocab) * 1e-3 - 20
    else:  # small integers: many ties, exact in bfloat16
        logits = torch.randint(-40, 40, (rows, vocab), generator=gen).to(dtype)
    tokens = torch.randint(vocab, (rows,), generator=gen)
    tokens[0] = logits[0].float().argmax()  # rank 1
    ids, values, ranks, bad = kernel(logits, k, tokens)
    ref_ids, ref_values, ref_ranks = reference(logits.float(), k, tokens)
    assert not bad.any()
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(values.double(), ref_values, atol=2e-5, rtol=1e-6)
    assert torch.equal(ranks, ref_ranks) and ranks[0] == 1
    # torch's own float32 path (the sampler's fallback) to the same values
    lp = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(values[:, :k], lp.gather(1, ids), atol=2e-6, rtol=0)


def test_ties_come_in_index_order_and_rank_counts_only_larger_values(kernel):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0, 1.0]])
    ids, values, ranks, _ = kernel(logits, 4, torch.tensor([4]))
    assert ids.tolist() == [[1, 3, 4, 2]]  # the three tied 2.0 by index, then the first 1.0
    assert ranks.tolist() == [1]  # nothing is above the sampled 2.0
    _, _, ranks, _ = kernel(logits, 0, torch.tensor([6]))
    assert ranks.tolist() == [4]  # three 2.0 above the sampled 1.0; the tied 1.0 is not
    # many ties across vector lanes: the lowest indices win
    flat = torch.zeros(1, 100)
    ids, _, _, _ = kernel(flat, 10, torch.tensor([50]))
    assert ids.tolist() == [list(range(10))]


def test_masked_tokens_and_rows_without_a_finite_maximum(kernel):
    logits = torch.randn(5, 300)
    logits[0, 100:] = float("-inf")      # a masked tail: zero probability, ranked last
    logits[1, 7] = float("nan")
    logits[2, :] = float("-inf")
    logits[3, 9] = float("inf")
    tokens = torch.tensor([150, 0, 0, 0, 3])
    ids, values, ranks, bad = kernel(logits, 3, tokens)
    assert bad.tolist() == [False, True, True, True, False]
    ref_ids, ref_values, ref_ranks = reference(logits[[0, 4]], 3, tokens[[0, 4]])
    assert torch.equal(ids[[0, 4]], ref_ids) and torch.equal(ranks[[0, 4]], ref_ranks)
    torch.testing.assert_close(values[[0, 4]].double(), ref_values, atol=2e-5, rtol=1e-6)
    assert values[0, 3] == float("-inf") and ranks[0] == 100 + 1


def test_strided_rows_bfloat16_widening_and_the_contract(kernel):
    logits = torch.randn(8, 1000)
    tokens = torch.randint(1000, (4,))
    every_other = logits[::2]
    got = kernel(every_other, 5, tokens)
    want = kernel(every_other.contiguous(), 5, tokens)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    halves = every_other.bfloat16()  # widened exactly: what the float32 copy gives
    assert all(torch.equal(a, b) for a, b in zip(kernel(halves, 5, tokens),
                                                  kernel(halves.float(), 5, tokens)))
    assert not kernel.supports(every_other, kernel.max_k + 1)
    assert not kernel.supports(every_other.half(), 5)
    for args in ((every_other, 5, tokens.int()), (every_other, 5, tokens[:3]),
                 (every_other, 5, torch.tensor([0, 1, 2, 1000])),
                 (every_other, kernel.max_k + 1, tokens)):
        with pytest.raises(ValueError, match="out of contract"):
            kernel(*args)


def test_bfloat16_models_take_logprobs_from_their_own_logits(kernel, llama_dir,
                                                            model_dtype_logits):
    """Requests with logprobs and nothing else to apply keep the LM head's bfloat16 logits
    (no float32 copy), with the same tokens, logprobs and ranks as from the copy."""
    from batchinfer import LLM, SamplingParams
    prompts = ["The quick brown fox", "Batch inference on a CPU", "a b c d e f g"]
    params = [SamplingParams(max_tokens=8, temperature=t, seed=3, logprobs=4, ignore_eos=True)
              for t in (0.0, 0.8, 0.0)]
    llm = LLM(model=str(llama_dir), dtype="bfloat16")
    seen = model_dtype_logits.kept(llm)
    kept = llm.generate(prompts, params)
    assert seen and not any(seen)
    model_dtype_logits.widen()
    widened = llm.generate(prompts, params)
    assert seen[-1]
    for a, b in zip(kept, widened):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
