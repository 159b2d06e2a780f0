"""GLM-4.5's mixture of experts (DeepSeekMoE routing, shared experts, dense first layers)
against transformers' Glm4MoeForCausalLM on a random-weight checkpoint that keeps every
feature: groups of experts, a correction bias that changes the choice, a routed scaling
factor, a shared expert, a dense first layer, half the head rotated, q/k norm and biases."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoints
from batchinfer import LLM, SamplingParams
from batchinfer.model.config import ModelConfig
from batchinfer.model.moe import SparseMoE


def _hf_model(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                attn_implementation="eager").eval()


def _prompts(model_dir, n: int = 8):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return checkpoints.mixed_prompts(tokenizer, n, 4, 120, seed=5)


def test_the_config_reads_glm4_moes_settings(glm4_moe_dir):
    from transformers import AutoConfig
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(str(glm4_moe_dir)))
    assert [layer.moe for layer in config.layers] == [False, True, True]  # first_k_dense_replace
    moe = config.moe
    assert (moe.scoring, moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups,
            moe.routed_scaling_factor, moe.num_shared_experts) == ("sigmoid", 8, 3, 4, 2, 2.5, 1)
    assert config.qkv_bias and not config.o_proj_bias and config.qk_norm  # use_qk_norm
    assert config.rope["full_attention"]["partial_rotary_factor"] == 0.5


def test_routing_is_transformers(glm4_moe_dir):
    """The experts and weights each token gets, against Glm4MoeTopkRouter's, for hidden
    states of the model's dtype; and the correction bias and the groups do change them."""
    hf = _hf_model(glm4_moe_dir)
    llm = LLM(str(glm4_moe_dir), dtype="float32", device="cpu")
    blocks = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == 2 and all(b.shared_experts is not None for b in blocks)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for block, layer in zip(blocks, hf.model.layers[1:]):
        _, hf_weights, hf_experts = layer.mlp.gate(x)
        weights, experts = block.route(x)
        assert torch.equal(experts, hf_experts)
        assert torch.equal(weights, hf_weights)
    block = blocks[0]
    weights, experts = block.route(x)
    bias = block.gate.e_score_correction_bias.data.clone()
    block.gate.e_score_correction_bias.data.zero_()
    assert not torch.equal(block.route(x)[1], experts)  # the bias moves the choice
    block.gate.e_score_correction_bias.data.copy_(bias)
    groups = block.routing
    block.routing = type(groups)(**{**vars(groups), "num_groups": 1, "topk_groups": 1})
    assert not torch.equal(block.route(x)[1], experts)  # and so do the groups
    block.routing = groups


def test_bfloat16_against_transformers_in_bfloat16(glm4_moe_dir):
    """The router in float32 (its weights and bias kept so, as transformers keeps them),
    the rest in bfloat16: the first tokens and their logprobs are transformers'."""
    hf = _hf_model(glm4_moe_dir, torch.bfloat16)
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    prompts = _prompts(glm4_moe_dir)
    llm = LLM(str(glm4_moe_dir), dtype="bfloat16", device="cpu")
    assert llm.llm_engine.model_runner.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=1))
    equal = 0
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        token = out.outputs[0].token_ids[0]
        equal += token == int(logits.argmax())
        assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(
            expected[token].item(), abs=0.1)
    assert equal >= len(prompts) - 1


def test_multi_token_prediction_layers_are_skipped(glm4_moe_dir, tmp_path):
    """A checkpoint as published holds num_nextn_predict_layers more layers after the
    decoder's (the multi-token-prediction module): they are not loaded."""
    model = shutil.copytree(glm4_moe_dir, tmp_path / "mtp")
    config = json.loads((model / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    n = config["num_hidden_layers"]
    with safe_open(model / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    extra = {k.replace("model.layers.1.", f"model.layers.{n}."): v.clone()
             for k, v in tensors.items() if k.startswith("model.layers.1.")}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    extra[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    save_file({**tensors, **extra}, model / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts(glm4_moe_dir, 3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = LLM(str(glm4_moe_dir), dtype="float32").generate(prompts, params)
    got = LLM(str(model), dtype="float32").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
