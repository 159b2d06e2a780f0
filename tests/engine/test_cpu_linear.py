"""Linear weights packed for oneDNN on CPU (batchinfer/model/cpu_linear.py): bfloat16 used
only where it gives F.linear's exact bits (and then the engine's output does not change),
float32 only where each row's result does not depend on the rows computed with it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import checkpoints
from batchinfer import LLM, SamplingParams
from batchinfer.bench.roofline import ModelShape, weight_bytes_read_per_step
from batchinfer.model import cpu_linear


@pytest.fixture
def fresh_probe():
    cpu_linear.available.cache_clear()
    yield
    cpu_linear.available.cache_clear()


def test_float32_packed_products_keep_rows_independent(fresh_probe):
    if not cpu_linear.available(torch.float32):
        pytest.skip("oneDNN's float32 products depend on the row count on this machine")
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(300, 96, generator=gen)
    packed = cpu_linear.pack(weight, 64)
    full = cpu_linear.linear(x, packed, bias)
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    for start, rows in ((0, 1), (2, 3), (10, 64), (0, 256), (299, 1)):
        assert torch.equal(cpu_linear.linear(x[start:start + rows], packed, bias),
                           full[start:start + rows])


@pytest.mark.parametrize("fake", ["row_count_dependent", "wrong"])
def test_float32_probe_refuses(fresh_probe, monkeypatch, fake):
    """A product whose rows change with the row count, or that is not F.linear within
    rounding, is not used."""
    def linear(x, weight, bias=None):
        out = F.linear(x, weight, bias)
        return out + x.shape[0] * 1e-3 if fake == "row_count_dependent" else out * 1.01
    monkeypatch.setattr(cpu_linear, "pack", lambda weight, hint: weight)
    monkeypatch.setattr(cpu_linear, "linear", linear)
    assert not cpu_linear.available(torch.float32)


def test_switched_off_by_the_environment(fresh_probe, monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    assert not cpu_linear.available(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_product_is_bit_identical(fresh_probe, rows):
    if not cpu_linear.available(torch.bfloat16):
        pytest.skip("oneDNN packing of bfloat16 is not available on this machine")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(160, 96, generator=gen).bfloat16()
    bias = torch.randn(160, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    packed = cpu_linear.pack(weight, 64)
    assert torch.equal(cpu_linear.linear(x, packed, bias), F.linear(x, weight, bias))
    assert torch.equal(cpu_linear.linear(x, packed), F.linear(x, weight))


def _greedy(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[set[int]]]]:
    """(tokens, each step's top 5) per prompt."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    return [(o.outputs[0].token_ids, [set(step) for step in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params)]


def _packed_then_plain(model_dir: str, dtype: torch.dtype, monkeypatch):
    """(packed model, plain model): one engine with packing as this machine decides, one
    with it switched off, each generating the same prompts; their outputs compared."""
    prompts = ["The quick brown fox", "Batch inference on a CPU", "a b c d e f g"]
    models, outs = [], []
    for switched_off in (False, True):
        if switched_off:
            monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
            cpu_linear.available.cache_clear()
        llm = LLM(model=model_dir, dtype=str(dtype).removeprefix("torch."), device="cpu")
        models.append(llm.llm_engine.model_runner.model)
        outs.append(_greedy(llm, prompts))
    _assert_same_greedy(*outs, dtype)
    return models


def _assert_same_greedy(packed_out, plain_out, dtype: torch.dtype) -> None:
    """bfloat16: the same tokens; float32: the same up to compare_greedy's near-ties."""
    if dtype == torch.bfloat16:
        assert plain_out == packed_out
        return
    result = checkpoints.compare_greedy(
        [t for t, _ in packed_out], [t for t, _ in plain_out],
        [top for _, top in packed_out], [top for _, top in plain_out])
    assert result.ok, result.failures


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])  # tied / untied embeddings
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_output_unchanged_by_packing(fixture, dtype, request, fresh_probe, monkeypatch):
    """bfloat16: the same tokens. float32: the same up to a near-tie that rounding may flip
    (compare_greedy's rule), as the packed product adds in another order."""
    if not cpu_linear.available(dtype):
        pytest.skip(f"oneDNN packing of {dtype} is not used on this machine")
    model, plain = _packed_then_plain(str(request.getfixturevalue(fixture)), dtype,
                                      monkeypatch)
    layer = model.model.layers[0]
    # every product packed; only the embedding table keeps a plain copy
    assert layer.self_attn.qkv_proj.packed is not None and layer.self_attn.qkv_proj.weight is None
    assert layer.self_attn.o_proj.weight is None and layer.mlp.packed_halves is not None
    assert layer.mlp.gate_up_proj.weight is None
    assert model.lm_head.packed is not None
    assert (model.lm_head.weight is not None) == model.tie_word_embeddings
    assert plain.model.layers[0].mlp.packed_halves is None
    # the bench's bytes-per-step count sees the packed weights as the same bytes
    shape = ModelShape.from_config(plain.config)
    assert weight_bytes_read_per_step(model, shape, model.tie_word_embeddings).dense == \
        weight_bytes_read_per_step(plain, shape, plain.tie_word_embeddings).dense > 0


@pytest.mark.parametrize("fixture", ["qwen3_moe_dir", "mixtral_dir", "glm4_moe_dir"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_experts_packed_output_unchanged(fixture, dtype, request, fresh_probe,
                                             monkeypatch):
    """Every expert's two products run on packed weights (only those are kept); the tokens
    as with F.linear (bfloat16 exactly, float32 up to compare_greedy's near-ties), and the
    bench's byte count sees the same expert bytes."""
    if not cpu_linear.available(dtype):
        pytest.skip(f"oneDNN packing of {dtype} is not used on this machine")
    from batchinfer.model.moe import SparseMoE
    model, plain = _packed_then_plain(str(request.getfixturevalue(fixture)), dtype,
                                      monkeypatch)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.packed_experts is not None and b.w13 is None and b.w2 is None
                          and len(b.packed_experts) == b.num_experts for b in blocks)
    assert all(m.packed_experts is None for m in plain.modules() if isinstance(m, SparseMoE))
    shape = ModelShape.from_config(plain.config)
    packed_bytes = weight_bytes_read_per_step(model, shape, model.tie_word_embeddings)
    plain_bytes = weight_bytes_read_per_step(plain, shape, plain.tie_word_embeddings)
    assert (packed_bytes.dense, packed_bytes.experts) == (plain_bytes.dense, plain_bytes.experts)
    assert plain_bytes.experts > 0
