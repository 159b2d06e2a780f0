"""Linear weights packed for oneDNN on CPU (batchinfer/model/cpu_linear.py): used only
where they give F.linear's exact bits, and then the engine's output does not change."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchinfer import LLM, SamplingParams
from batchinfer.bench.roofline import ModelShape, weight_bytes_read_per_step
from batchinfer.model import cpu_linear


@pytest.fixture
def fresh_probe():
    cpu_linear.available.cache_clear()
    yield
    cpu_linear.available.cache_clear()


def test_float32_is_never_packed(fresh_probe):
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


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])  # tied / untied embeddings
def test_engine_output_unchanged_by_packing(fixture, request, fresh_probe, monkeypatch):
    if not cpu_linear.available(torch.bfloat16):
        pytest.skip("oneDNN packing of bfloat16 is not available on this machine")
    model_dir = str(request.getfixturevalue(fixture))
    prompts = ["The quick brown fox", "Batch inference on a CPU", "a b c d e f g"]
    packed_llm = LLM(model=model_dir, dtype="bfloat16", device="cpu")
    model = packed_llm.llm_engine.model_runner.model
    layer = model.model.layers[0]
    # every product packed; only the embedding table keeps a plain copy
    assert layer.self_attn.qkv_proj.packed is not None and layer.self_attn.qkv_proj.weight is None
    assert layer.self_attn.o_proj.weight is None and layer.mlp.packed_halves is not None
    assert layer.mlp.gate_up_proj.weight is None
    assert model.lm_head.packed is not None
    assert (model.lm_head.weight is not None) == model.tie_word_embeddings
    packed_tokens = _greedy(packed_llm, prompts)

    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    cpu_linear.available.cache_clear()
    plain_llm = LLM(model=model_dir, dtype="bfloat16", device="cpu")
    plain = plain_llm.llm_engine.model_runner.model
    assert plain.model.layers[0].mlp.packed_halves is None
    assert _greedy(plain_llm, prompts) == packed_tokens
    # the bench's bytes-per-step count sees the packed weights as the same bytes
    shape = ModelShape.from_config(plain.config)
    assert weight_bytes_read_per_step(model, shape, model.tie_word_embeddings).dense == \
        weight_bytes_read_per_step(plain, shape, plain.tie_word_embeddings).dense > 0
