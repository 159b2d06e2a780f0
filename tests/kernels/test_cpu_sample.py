"""The CPU sampling kernel (kernels/cpu/sample.c) against the exact distribution its filters
define, computed by sorting in float64: temperature, min_p, top_k, top_p and their
combinations, masked tokens, degenerate rows, and per-row seeds."""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import cpu

N = 40_000  # rows per distribution check


@pytest.fixture(scope="module")
def sample(built_or_skip):
    return cpu.sample.SampleKernel(built_or_skip(cpu.sample, "the CPU sampler"))


def exact(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
          min_p: float) -> torch.Tensor:
    """The distribution the sampler's filters define (as the torch sampler applies them:
    min_p on the tempered distribution, then top_k, then top_p on what is left)."""
    probs = (logits.double() / temperature).softmax(-1)
    keep = probs >= min_p * probs.max() if min_p > 0 else probs > 0
    if 0 < top_k < keep.sum():
        kth = probs[keep].sort(descending=True).values[top_k - 1]
        keep &= probs >= kth
    if top_p < 1:  # tokens by probability, ties by index: keep while those before < top_p
        kept = torch.where(keep, probs, 0.0)
        index = torch.arange(len(kept))
        ahead = torch.stack([kept[(kept > p) | ((kept == p) & (index < i))].sum()
                             for i, p in enumerate(kept)])
        keep &= ahead < top_p * kept.sum()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def draw(sample, logits, n=N, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed0=0):
    rows = logits.expand(n, -1)
    def full(value, dtype):
        return torch.full((n,), value, dtype=dtype)
    return sample(rows, full(temperature, torch.float32), full(top_k, torch.int64),
                  full(top_p, torch.float32), full(min_p, torch.float32),
                  torch.arange(seed0, seed0 + n, dtype=torch.int64))


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.7, 0, 1.0, 0.0),
    (1.0, 7, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.8, 0, 0.95, 0.0), (1.0, 0, 1.0, 0.05),
    (0.8, 20, 0.9, 0.0), (1.2, 30, 0.7, 0.02), (1.0, 1, 1.0, 0.0), (1.0, 0, 0.01, 0.0),
])
def test_draws_follow_the_filtered_distribution(sample, temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(300, generator=gen) * 2.5
    want = exact(logits, temperature, top_k, top_p, min_p)
    tokens = draw(sample, logits, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p)
    freq = torch.bincount(tokens, minlength=300).double() / N
    assert set(tokens.tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert (freq - want).abs().sum() / 2 < 0.03  # total variation
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / N).sqrt() + 1e-4).all()


def test_masked_tokens_are_never_drawn_and_degenerate_rows_defer(sample):
    logits = torch.zeros(4, 64)
    logits[0, ::2] = float("-inf")                 # half masked
    logits[1] = float("-inf")                      # nothing left
    logits[2, 5] = float("nan")
    logits[3, 9] = float("inf")
    n = 4
    tokens = sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                    torch.zeros(n), torch.arange(n))
    assert tokens[0] % 2 == 1 and tokens[1:].tolist() == [-1, -1, -1]
    greedy = torch.tensor([0.0, 1.0, -1.0, 0.5])  # temperature <= 0: left to argmax
    assert sample(logits, greedy, torch.zeros(n, dtype=torch.int64), torch.ones(n),
                  torch.zeros(n), torch.arange(n)).tolist()[::2] == [-1, -1]
    odd = draw(sample, logits[0], n=5000)
    assert (odd % 2 == 1).all() and len(set(odd.tolist())) > 25
    far = torch.full((40,), -200.0)
    far[3] = 0.0  # exp of the rest underflows: only token 3
    assert (draw(sample, far, n=200, temperature=2.0) == 3).all()


def test_top_k_keeps_ties_at_its_boundary(sample):
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    tokens = draw(sample, logits, n=20_000, top_k=2)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_top_p_takes_ties_in_index_order(sample):
    """Probabilities 0.4, 0.2, 0.2, 0.2 (a tie of three, one of them first): top_p 0.5
    keeps 0 and 1, exactly as a stable sort's cumulative sum does; the logits' last 16
    elements (past the vector loop) tie with the first ones too."""
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    tokens = draw(sample, probs.log(), n=30_000, top_p=0.5)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(torch.bincount(tokens).double() / 30_000,
                               torch.tensor([2 / 3, 1 / 3], dtype=torch.float64),
                               atol=0.015, rtol=0)
    logits = torch.zeros(37)  # 32 in vector loops, 5 in the tail: all tied
    logits[36] = 0.5
    tokens = draw(sample, logits, n=30_000, top_k=2)
    assert set(tokens.tolist()) == set(range(37))
    tokens = draw(sample, logits, n=30_000, top_p=0.05)  # 36 holds 0.044: then 0, first
    assert set(tokens.tolist()) == {0, 36}                # of the tie, and no other


@pytest.mark.parametrize("top_k", [1, 37, 250])
def test_top_k_on_a_nearly_flat_row_keeps_exactly_k(sample, top_k):
    """Weights all within a few percent of each other (many per value bin of the k-th
    search): exactly the k largest, each drawn."""
    logits = torch.linspace(0.0, 0.3, 500)
    tokens = draw(sample, logits, n=60_000, top_k=top_k)
    assert set(tokens.tolist()) == set(range(500 - top_k, 500))


def test_a_rows_draw_depends_on_its_seed_alone(sample):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 500, generator=gen)
    temperature = torch.rand(16, generator=gen) + 0.5
    top_k = torch.tensor([0, 5, 50, 0] * 4)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99] * 4)
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.01] * 4)
    seeds = torch.randint(2 ** 62, (16,), generator=gen)
    batch = sample(logits, temperature, top_k, top_p, min_p, seeds)
    assert torch.equal(batch, sample(logits, temperature, top_k, top_p, min_p, seeds))
    for r in (0, 7, 13):
        one = slice(r, r + 1)
        assert sample(logits[one], temperature[one], top_k[one], top_p[one], min_p[one],
                      seeds[one]).item() == batch[r].item()
    other = sample(logits, temperature, top_k, top_p, min_p, seeds + 1)
    assert not torch.equal(batch, other)


def test_strided_rows_and_the_contract(sample):
    logits = torch.randn(6, 200)
    ones, zeros = torch.ones(3), torch.zeros(3)
    k = torch.zeros(3, dtype=torch.int64)
    seeds = torch.arange(3)
    every_other = logits[::2]
    assert torch.equal(sample(every_other, ones, k, ones, zeros, seeds),
                       sample(every_other.contiguous(), ones, k, ones, zeros, seeds))
    halves = every_other.bfloat16()  # widened exactly: the same draws as from float32
    assert torch.equal(sample(halves, ones, k, ones, zeros, seeds),
                       sample(halves.float(), ones, k, ones, zeros, seeds))
    for bad in (dict(logits=every_other.half()), dict(temperature=zeros.double()),
                dict(top_k=k.int()), dict(seeds=seeds[:2])):
        args = dict(logits=every_other, temperature=ones, top_k=k, top_p=ones, min_p=zeros,
                    seeds=seeds) | bad
        with pytest.raises(ValueError, match="out of contract"):
            sample(**args)


def test_bfloat16_models_draw_from_their_own_logits(sample, llama_dir, model_dtype_logits):
    """A sampled batch with nothing else to apply keeps the LM head's bfloat16 logits (no
    float32 copy); seeded draws are the same as from the float32 copy."""
    from batchinfer import LLM, SamplingParams
    prompts = ["The quick brown fox", "Batch inference on a CPU", "a b c d e f g"]
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=s,
                             ignore_eos=True) for s in range(3)]
    llm = LLM(model=str(llama_dir), dtype="bfloat16")
    seen = model_dtype_logits.kept(llm)
    kept = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert seen and not any(seen)
    model_dtype_logits.widen()
    widened = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert seen[-1] and kept == widened
