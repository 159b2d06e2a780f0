"""DeepSeek-V3's multi-head latent attention: the config it reads, the latent KV cache's
size, and the settings it refuses. (Greedy parity with transformers, also with chunked
prefill and preemption, is in test_correctness.py.)"""
from __future__ import annotations

import pytest
import torch

import fp8_checkpoints
from batchinfer import LLM
from batchinfer.model.config import ModelConfig


def test_the_config_reads_mla_settings(deepseek_v3_dir):
    from transformers import AutoConfig
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(str(deepseek_v3_dir)))
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim, mla.rope_interleave) == (48, 32, 16, 16, 24, True)
    assert (config.head_dim, config.num_key_value_heads) == (16, 1)
    # (16 + 16) ** -0.5 times YaRN's (0.1 * ln 4 + 1) squared, as transformers' scaling
    assert config.attention_scale == pytest.approx(32 ** -0.5 * (0.1 * torch.log(
        torch.tensor(4.0)).item() + 1) ** 2)
    assert [layer.moe for layer in config.layers] == [False, True, True]


def test_kv_bytes_per_token(deepseek_v3_dir, llama_dir):
    from transformers import AutoConfig
    llm = LLM(model=str(deepseek_v3_dir), dtype="float32", num_kv_blocks=8)
    cache = llm.llm_engine.model_runner.kv_caches
    assert len(cache) == 3 and all(v is None for _, v in cache)
    assert tuple(cache[0][0].shape) == (8, 16, 1, 32 + 16)
    assert llm.stats()["kv_bytes_per_token"] == 3 * (32 + 16) * 4
    hf = AutoConfig.from_pretrained(str(llama_dir))
    llama = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=8)
    assert llama.stats()["kv_bytes_per_token"] == (
        2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * 4)


def test_heads_not_divisible_by_tensor_parallel_size_are_refused(deepseek_v3_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the "
                                         r"model's num_attention_heads \(4\)"):
        LLM(model=str(deepseek_v3_dir), tensor_parallel_size=3)


def test_fp8_kv_cache_is_refused(deepseek_v3_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        LLM(model=str(deepseek_v3_dir), kv_cache_dtype="fp8")


def test_fp8_block_checkpoint_layers(tmp_path, deepseek_v3_dir):
    # DeepSeek's FP8 form: every linear FP8 but kv_b_proj, dequantized as it loads, and the
    # float32 router (test_fp8.py checks the outputs against the dequantized weights)
    model = fp8_checkpoints.write_fp8(deepseek_v3_dir, tmp_path / "fp8", "fp8-block")
    llm = LLM(model=str(model), dtype="bfloat16", num_kv_blocks=8)
    layer = llm.llm_engine.model_runner.model.model.layers[1]
    attn = layer.self_attn
    for proj in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj):
        assert proj.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16 and attn.kv_b_proj.weight_scale is None
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.mlp.w13.dtype == torch.float8_e4m3fn
    assert layer.mlp.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("fixture, form", [("deepseek_v3_dir", None),
                                           ("deepseek_v3_no_q_lora_dir", None),
                                           ("deepseek_v3_dir", "fp8-block")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_check_estimates_the_weights(request, tmp_path, fixture, form, dtype):
    # the memory check's estimate from the config against the built model's parameters
    # (FP8: a byte a weight, float32 scales per row and block, kv_b_proj in the dtype)
    from transformers import AutoConfig
    from batchinfer.model import checks
    from batchinfer.model.loader import build_model
    path = request.getfixturevalue(fixture)
    if form is not None:
        path = fp8_checkpoints.write_fp8(path, tmp_path / form, form)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)))
    model = build_model(config, None, dtype, torch.device("cpu"), max_position=64)
    actual = sum(p.numel() * p.element_size() for p in model.parameters())
    assert checks.weight_bytes(config, dtype.itemsize) == pytest.approx(actual, rel=0.03)


def test_deepseek_v3_shape_weights():
    # docs/scaling.md's arithmetic: 671.0B parameters; FP8 as the published checkpoints
    # (a byte a linear weight, float32 scales per row and 128 columns, kv_b_proj, the
    # embeddings and LM head in bfloat16, the router in float32): 695 GB
    from batchinfer.model import checks
    from batchinfer.model.loader import build_model
    from batchinfer.random_checkpoint import make_config
    hf = make_config("deepseek-v3")
    hf.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                              "fmt": "e4m3", "weight_block_size": [128, 128]}
    config = ModelConfig.from_hf(hf)
    model = build_model(config, None, torch.bfloat16, torch.device("meta"), max_position=64)
    params = {n: p for n, p in model.named_parameters() if not n.endswith("_scale")}
    assert round(sum(p.numel() for p in params.values()) / 1e9, 1) == 671.0
    actual = sum(p.numel() * p.element_size() for p in model.parameters())
    assert round(actual / 1e9) == 695
    assert checks.weight_bytes(config, 2) == pytest.approx(actual, rel=0.01)
