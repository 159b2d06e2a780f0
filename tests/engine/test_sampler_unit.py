"""The Sampler on fixed logits: support and frequencies of the sampling filters,
per-request generators, blocked tokens, penalties and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from batchinfer.engine.sampler import Sampler, SamplingBatch, greedy_argmax, logprobs
from batchinfer.kernels import cpu

N = 20_000  # samples per statistical check: 4 sigma of a frequency is below 0.015
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
LOGITS = PROBS.log() + 3.0  # any shift: softmax(LOGITS) == PROBS


@pytest.fixture(autouse=True, params=["cpu kernel", "torch"])
def sampling_path(request, monkeypatch):
    """Every test twice: with the C sampling and logprobs kernels (what CPUs run) and with
    torch's ops (what GPUs run, and CPUs without a compiler)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu.sample, "available", lambda: False)
        monkeypatch.setattr(cpu.logprobs, "available", lambda: False)
    elif not (cpu.sample.available() and cpu.logprobs.available()):
        pytest.skip("the C sampling kernels cannot be built here")
    return request.param


def test_the_cpu_kernel_draws_when_built(sampling_path, monkeypatch):
    calls = []
    sample = cpu.sample.sample
    monkeypatch.setattr(cpu.sample, "sample", lambda *args: calls.append(args) or sample(*args))
    sampler()(LOGITS.expand(10, -1).clone(), batch(10, top_p=0.9))
    assert bool(calls) == (sampling_path == "cpu kernel")


def sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def batch(n: int, temperature: float = 1.0, top_k: int | None = None,
          top_p: float | None = None, min_p: float | None = None, **kw) -> SamplingBatch:
    def full(value, dtype):
        return None if value is None else torch.full((n,), value, dtype=dtype)
    return SamplingBatch(all_greedy=False, temperature=full(temperature, torch.float32),
                         top_k=full(top_k, torch.long), top_p=full(top_p, torch.float32),
                         min_p=full(min_p, torch.float32), **kw)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def sample_many(b: SamplingBatch, logits: torch.Tensor = LOGITS, seed: int = 0) -> torch.Tensor:
    return sampler(seed)(logits.expand(N, -1).clone(), b).token_ids


def expected(keep: list[int], probs: torch.Tensor = PROBS) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    out = sampler()(logits, SamplingBatch(all_greedy=True))
    assert out.token_ids.tolist() == [1, 0]


def test_temperature_one_matches_softmax():
    freq = frequencies(sample_many(batch(N)), 6)
    torch.testing.assert_close(freq, PROBS, atol=0.015, rtol=0)


def test_temperature_sharpens_and_flattens():
    for t in (0.5, 2.0):
        freq = frequencies(sample_many(batch(N, temperature=t)), 6)
        torch.testing.assert_close(freq, (LOGITS / t).softmax(-1), atol=0.015, rtol=0)


def test_top_k_keeps_exactly_the_k_most_likely():
    tokens = sample_many(batch(N, top_k=3))
    assert set(tokens.tolist()) == {0, 1, 2}
    torch.testing.assert_close(frequencies(tokens, 6), expected([0, 1, 2]), atol=0.015, rtol=0)


@pytest.mark.parametrize("top_p, keep", [(0.3, [0]), (0.6, [0, 1]), (0.7, [0, 1, 2]),
                                         (0.93, [0, 1, 2, 3, 4])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, keep: list[int]):
    tokens = sample_many(batch(N, top_p=top_p))
    assert set(tokens.tolist()) == set(keep)
    torch.testing.assert_close(frequencies(tokens, 6), expected(keep), atol=0.015, rtol=0)


@pytest.mark.parametrize("min_p, keep", [(0.5, [0, 1]), (0.2, [0, 1, 2, 3]), (1.0, [0])])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p: float, keep: list[int]):
    tokens = sample_many(batch(N, min_p=min_p))
    assert set(tokens.tolist()) == set(keep)
    torch.testing.assert_close(frequencies(tokens, 6), expected(keep), atol=0.015, rtol=0)


def test_ties_top_k_keeps_them_and_top_p_cuts_them_in_index_order():
    """Both paths alike: top_k keeps every token tied with the k-th (as transformers and
    vLLM do); top_p takes tied tokens in index order."""
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    tokens = sample_many(batch(N, top_k=2), probs.log())
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    tokens = sample_many(batch(N, top_p=0.5), probs.log())
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(frequencies(tokens, 4), torch.tensor([2 / 3, 1 / 3, 0, 0]),
                               atol=0.015, rtol=0)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    """After top_k=3 the probabilities are 0.5, 0.3125, 0.1875; top_p=0.7 then keeps two
    (on the unfiltered distribution it would have kept three)."""
    tokens = sample_many(batch(N, top_k=3, top_p=0.7))
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(frequencies(tokens, 6), expected([0, 1]), atol=0.015, rtol=0)


def test_filters_apply_after_temperature():
    """At temperature 2 the distribution is flatter, so min_p=0.5 keeps more tokens."""
    flat = (LOGITS / 2).softmax(-1)
    keep = [i for i in range(6) if flat[i] >= 0.5 * flat.max()]
    assert len(keep) > 2
    tokens = sample_many(batch(N, temperature=2.0, min_p=0.5))
    assert set(tokens.tolist()) == set(keep)
    torch.testing.assert_close(frequencies(tokens, 6), expected(keep, flat), atol=0.015, rtol=0)


def test_each_row_uses_its_own_settings():
    """Probabilities 0.042, 0.309, 0.280, 0.253, 0.069, 0.046; four groups of rows:
    greedy, top_k=2, min_p=0.8, top_p=0.85."""
    m = 2000
    b = SamplingBatch(
        all_greedy=False,
        temperature=torch.tensor([0.0] * m + [1.0] * 3 * m),
        top_k=torch.tensor([0] * m + [2] * m + [0] * 2 * m),
        min_p=torch.tensor([0.0] * 2 * m + [0.8] * m + [0.0] * m),
        top_p=torch.tensor([1.0] * 3 * m + [0.85] * m))
    logits = torch.tensor([0.0, 2.0, 1.9, 1.8, 0.5, 0.1]).expand(4 * m, -1).clone()
    tokens = sampler()(logits, b).token_ids
    groups = [set(tokens[i * m:(i + 1) * m].tolist()) for i in range(4)]
    assert groups == [{1}, {1, 2}, {1, 2, 3}, {1, 2, 3, 4}]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))

    def run(batch_rows: list[int], seeded_row: int, other_seed: int) -> list[int]:
        s = sampler(other_seed)
        gen = torch.Generator().manual_seed(123)
        out = []
        for _ in range(30):
            b = batch(len(batch_rows), generators={seeded_row: gen})
            out.append(s(logits[batch_rows], b).token_ids[seeded_row].item())
        return out

    alone = run([3], 0, other_seed=0)
    in_batch = run([5, 0, 3, 7, 1], 2, other_seed=99)
    assert alone == in_batch
    assert len(set(alone)) > 1
    other_seed = []
    gen = torch.Generator().manual_seed(124)
    s = sampler()
    for _ in range(30):
        other_seed.append(s(logits[[3]], batch(1, generators={0: gen})).token_ids[0].item())
    assert other_seed != alone


def test_unseeded_rows_follow_the_engine_generator():
    logits = torch.zeros(1000, 50)
    first = sampler(5)(logits, batch(1000)).token_ids
    again = sampler(5)(logits, batch(1000)).token_ids
    other = sampler(6)(logits, batch(1000)).token_ids
    assert torch.equal(first, again)
    assert (first != other).float().mean() > 0.9


def test_blocked_tokens_are_never_sampled():
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0], [0.0, 5.0, 4.0, 0.0]])
    greedy = sampler()(logits, SamplingBatch(all_greedy=True, blocked=([0], [1])))
    assert greedy.token_ids.tolist() == [2, 1]
    many = logits[:1].expand(N, -1).clone()
    rows = list(range(N))
    tokens = sampler()(many, batch(N, blocked=(rows + rows, [1] * N + [2] * N))).token_ids
    assert set(tokens.tolist()) == {0, 3}


def penalty_batch(n: int, rep: list[float], pres: list[float], freq: list[float],
                  prompts: list[list[int]], outputs: list[list[int]]) -> SamplingBatch:
    return SamplingBatch(
        all_greedy=True, repetition_penalty=torch.tensor(rep),
        presence_penalty=torch.tensor(pres), frequency_penalty=torch.tensor(freq),
        prompt_token_ids=prompts, output_token_ids=outputs)


def test_penalties_follow_vllm_definitions():
    """repetition: seen in prompt or output -> positive logits / r, negative * r;
    frequency: - f * count in output; presence: - p if in output at all."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5, -0.5, 0.7],
                           [2.0, -1.0, 0.5, 1.5, -0.5, 0.7]])
    b = penalty_batch(2, rep=[2.0, 1.0], pres=[0.2, 0.0], freq=[0.3, 0.0],
                      prompts=[[0, 1], [0]], outputs=[[3, 3, 2], [3]])
    got = Sampler._apply_penalties(logits, b)
    want = torch.tensor([
        [2.0 / 2,              # prompt only: repetition only
         -1.0 * 2,             # negative and in the prompt
         0.5 / 2 - 0.3 - 0.2,  # once in the output
         1.5 / 2 - 0.6 - 0.2,  # twice in the output
         -0.5,                 # unseen
         0.7],                 # unseen
        logits[1].tolist()])   # neutral settings leave a row alone
    torch.testing.assert_close(got, want)


def test_presence_and_frequency_ignore_the_prompt():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    b = penalty_batch(1, rep=[1.0], pres=[1.5], freq=[0.5], prompts=[[0, 0, 1]],
                      outputs=[[2, 2]])
    got = Sampler._apply_penalties(logits, b)
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 1.0 - 1.5 - 1.0]]))


def test_penalties_change_what_is_sampled():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = sampler()(logits, SamplingBatch(all_greedy=True)).token_ids.item()
    penalised = sampler()(logits, penalty_batch(1, [1.2], [0.0], [0.0], [[]], [[0]])).token_ids
    assert plain == 0 and penalised.item() == 1
    # under sampling the penalised token's frequency drops as vLLM's formula predicts
    b = batch(N, repetition_penalty=torch.full((N,), 1.0),
              presence_penalty=torch.full((N,), 0.0), frequency_penalty=torch.full((N,), 0.5),
              prompt_token_ids=[[]] * N, output_token_ids=[[0, 0]] * N)
    freq = frequencies(sample_many(b, torch.tensor([1.0, 1.0, 1.0])), 3)
    want = torch.tensor([0.0, 1.0, 1.0]).softmax(-1)
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


def test_logprobs_are_raw_with_the_sampled_token_and_its_rank():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0],
                           [0.0, 0.0, 4.0, 1.0, 2.0]])
    raw = logits.log_softmax(-1)
    # row 0 cannot take its best token (blocked), row 1 is sharpened: logprobs stay raw
    b = batch(2, temperature=0.5, max_num_logprobs=2, blocked=([0], [1]))
    out = sampler()(logits, b)
    for row in range(2):
        order = raw[row].argsort(descending=True)
        assert out.logprob_ids[row].tolist() == order[:2].tolist()
        torch.testing.assert_close(out.logprob_values[row, :2], raw[row, order[:2]])
        token = out.token_ids[row].item()
        torch.testing.assert_close(out.logprob_values[row, 2], raw[row, token])
        assert out.sampled_ranks[row].item() == order.tolist().index(token) + 1
    assert out.token_ids[0].item() != 1


def test_zero_logprobs_returns_only_the_sampled_token():
    logits = torch.tensor([[0.5, 2.0, 1.0]])
    out = sampler()(logits, SamplingBatch(all_greedy=True, max_num_logprobs=0))
    assert out.logprob_ids.shape == (1, 0)
    assert out.logprob_values.shape == (1, 1)
    assert out.logprob_values[0, 0].item() == pytest.approx(
        2.0 - math.log(math.exp(0.5) + math.exp(2.0) + math.exp(1.0)), abs=1e-6)
    assert out.sampled_ranks.tolist() == [1]


@pytest.mark.parametrize("k", [3, 100])  # 100: past the C kernel's largest k, torch's way
def test_logprobs_rows_without_a_finite_maximum_and_large_k_come_from_torch(k):
    from batchinfer.engine.sampler import _torch_logprobs
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(k))
    logits[2, 5] = float("nan")
    logits[3, :] = float("-inf")
    tokens = torch.tensor([0, 1, 2, 3])
    got = logprobs(logits, k, tokens)
    want = _torch_logprobs(logits, k, tokens)
    assert torch.equal(got[0][:2], want[0][:2]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[1], want[1], equal_nan=True, atol=2e-6, rtol=0)
    assert got[1][2].isnan().all()


def test_no_logprobs_unless_asked():
    out = sampler()(torch.randn(2, 5), SamplingBatch(all_greedy=True))
    assert out.logprob_ids is None and out.logprob_values is None and out.sampled_ranks is None


@pytest.mark.parametrize("vocab", [1024, 1030, 8192, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_the_first_maximum(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    # rounded values: many rows hold their maximum more than once
    logits = (torch.randn(64, vocab, generator=gen) * 2).round().to(dtype)
    logits[0, -1] = 50        # the very last column (inside a short last chunk when vocab % 128)
    logits[1, 3] = logits[1, vocab - 2] = 50   # a tie across chunks: the first must win
    logits[2, 130] = logits[2, 131] = 50       # a tie inside one chunk
    expected = logits.argmax(dim=-1)
    assert torch.equal(greedy_argmax(logits), expected)
    assert greedy_argmax(logits)[:3].tolist() == [vocab - 1, 3, 130]


@pytest.mark.parametrize("vocab", [32, 1030, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_argmax_matches_torch_with_nan_and_inf(vocab, dtype):
    if not cpu.ops.available():
        pytest.skip("no C ops here: greedy_argmax takes torch's path")
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(8, vocab + 16, generator=gen) * 2).round().to(dtype)[:, :vocab]
    logits[0, vocab // 2] = float("nan")                 # a NaN is the maximum...
    logits[0, vocab - 1] = float("nan")                  # ...the first one
    logits[1] = float("-inf")                            # nothing above -inf: index 0
    logits[2, :] = 1.0                                   # all equal: index 0
    logits[3, vocab - 1] = 99.0                          # the last column (a tail when vocab % 32)
    logits[4, 1] = logits[4, 2] = 99.0                   # neighbours in different lanes
    logits[5, 5] = float("inf")
    logits[5, 3] = float("inf")
    assert not logits.is_contiguous()                    # rows strided, as a padded head's slice
    assert cpu.ops.supports_argmax(logits)
    assert torch.equal(cpu.ops.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [5, 32, 70])
def test_a_packed_bitmask_leaves_only_its_tokens(vocab):
    """Bit t % 32 of word t // 32 allows token t (llguidance's layout, the sign bit
    included); a row of -1 is unconstrained; the sampled tokens are allowed ones."""
    import numpy as np

    from batchinfer.engine.sampler import unpack_bitmask
    from batchinfer.structured.grammar import set_tokens
    words = -(-vocab // 32)
    allowed = [[0, vocab - 1], [min(31, vocab - 1)], list(range(vocab))]
    mask = np.empty((3, words), dtype=np.int32)
    for row, ids in zip(mask, allowed[:2]):
        set_tokens(row, ids)
    mask[2] = -1
    bits = unpack_bitmask(torch.from_numpy(mask), vocab)
    assert [torch.nonzero(b).flatten().tolist() for b in bits] == allowed
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab))
    greedy = Sampler()(logits, SamplingBatch(all_greedy=True,
                                             bitmask=torch.from_numpy(mask)))
    assert [t in ids for t, ids in zip(greedy.token_ids.tolist(), allowed)] == [True] * 3
    assert greedy.token_ids[2] == logits[2].argmax()
    drawn = Sampler(torch.Generator().manual_seed(0))(logits, SamplingBatch(
        all_greedy=False, temperature=torch.ones(3), bitmask=torch.from_numpy(mask)))
    assert [t in ids for t, ids in zip(drawn.token_ids.tolist(), allowed)] == [True] * 3
