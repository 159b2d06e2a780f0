"""gpt-oss beyond the parity of test_correctness: its config as the layers read it, the
sinks' effect, MXFP4 experts dequantized at load, and the torch attention's sinks against
transformers' eager formula."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoints
from batchinfer import LLM, SamplingParams
from batchinfer.attention.torch_backend import _attention_with_lse
from batchinfer.model import mxfp4
from batchinfer.model.config import ModelConfig
from batchinfer.random_checkpoint import SHAPES, build_random_checkpoint, make_config

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _prompts(model_dir, n: int = 8):
    from transformers import AutoTokenizer
    return checkpoints.mixed_prompts(AutoTokenizer.from_pretrained(model_dir), n, 1, 160, seed=2)


def _greedy(model_dir, prompts) -> list[list[int]]:
    outs = LLM(model=str(model_dir), dtype="float32").generate(prompts, GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


def _rewrite(src, dst, change, config_change=None):
    """A copy of checkpoint src at dst, its tensors passed through change (dict -> dict),
    its config.json through config_change."""
    shutil.copytree(src, dst)
    tensors = change(load_file(str(dst / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config_change is not None:
        path = dst / "config.json"
        path.write_text(json.dumps(config_change(json.loads(path.read_text())), indent=2))
    return dst


def test_config():
    c = ModelConfig.from_hf(make_config("test-gpt-oss"))
    assert c.attention_sinks and c.qkv_bias and c.o_proj_bias
    assert [layer.sliding_window for layer in c.layers] == [16, None, 16, None]
    assert all(layer.moe for layer in c.layers)
    assert (c.moe.scoring, c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == \
        ("topk_softmax", 8, 2, 48)
    assert (c.moe.swiglu_limit, c.moe.swiglu_alpha) == (7.0, 1.702)
    rope = c.rope["full_attention"]
    assert rope["rope_type"] == "yarn" and rope["truncate"] is False
    assert not ModelConfig.from_hf(make_config("test-mixtral")).attention_sinks


def test_sinks_against_eager_formula():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    sinks = torch.randn(4) * 2
    out, _ = _attention_with_lse(q, k, v, None, 0.3, causal=True, sink=sinks.view(4, 1))
    # transformers' eager: a softmax over [scores, sink], the sink's column dropped
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ kk.transpose(-1, -2) * 0.3
    scores = scores + torch.full((5, 5), float("-inf")).triu(1)
    combined = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)], dim=-1)
    expected = torch.softmax(combined, dim=-1)[..., :-1] @ vv
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_removing_the_sinks_changes_the_tokens(gpt_oss_dir, tmp_path):
    def no_sinks(tensors):
        return {name: torch.full_like(t, float("-inf")) if name.endswith(".sinks") else t
                for name, t in tensors.items()}

    prompts = _prompts(gpt_oss_dir)
    without = _rewrite(gpt_oss_dir, tmp_path / "no_sinks", no_sinks)
    assert _greedy(gpt_oss_dir, prompts) != _greedy(without, prompts)


def test_triton_backend_refuses_sinks(gpt_oss_dir):
    from batchinfer.attention import TorchAttention
    from batchinfer.model.llama import Attention
    config = ModelConfig.from_hf(make_config("test-gpt-oss"))
    backend = TorchAttention()
    backend.name = "triton"
    with pytest.raises(ValueError, match="GptOssForCausalLM's attention sinks .* triton"):
        Attention(config, config.layers[0], backend, "model.layers.0.self_attn")


def test_mxfp4_round_trip_and_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    torch.manual_seed(0)
    weight = torch.randn(3, 64, 96) * 0.2  # [E, columns, rows]
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2)
    ours = mxfp4.dequantize(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, theirs)
    # values on the grid are kept exactly
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(ours), torch.float32), ours)
    error = (ours - weight).abs().amax(dim=1)  # per expert and row, over the groups
    assert (error <= weight.abs().amax(dim=1) / 4).all()


def test_mxfp4_checkpoint_equals_its_dequantized_float_model(tmp_path):
    # the experts' widths must be multiples of 32 for the MXFP4 groups
    src = build_random_checkpoint(tmp_path / "float", {**SHAPES["test-gpt-oss"],
                                                       "intermediate_size": 64})
    names = ("gate_up_proj", "down_proj")

    def dequantized(tensors):
        return {name: (mxfp4.dequantize(*mxfp4.quantize(t), t.dtype)
                       if name.endswith(names) else t) for name, t in tensors.items()}

    def packed(tensors):
        out = {}
        for name, t in tensors.items():
            if name.endswith(names):
                out[name + "_blocks"], out[name + "_scales"] = mxfp4.quantize(t)
            else:
                out[name] = t
        return out

    def mxfp4_config(config):
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
        return config

    reference = _rewrite(src, tmp_path / "dequantized", dequantized)
    quantized = _rewrite(src, tmp_path / "mxfp4", packed, mxfp4_config)
    prompts = _prompts(src)
    expected = _greedy(reference, prompts)
    assert _greedy(quantized, prompts) == expected
    assert expected != _greedy(src, prompts)  # the rounding is large enough to show


def test_tensor_parallel_ranks_hold_their_heads_sinks_and_expert_slices(gpt_oss_dir,
                                                                       monkeypatch):
    from transformers import AutoConfig
    from batchinfer.attention import get_attention_backend
    from batchinfer.model.loader import load_model
    from batchinfer.model.parallel import TensorParallel

    def load(rank: int, size: int):
        config = ModelConfig.from_hf(AutoConfig.from_pretrained(gpt_oss_dir))
        with monkeypatch.context() as m:
            m.setattr(TensorParallel, "rank", rank)
            m.setattr(TensorParallel, "size", size)
            return load_model(gpt_oss_dir, config,
                              get_attention_backend("torch", torch.device("cpu")),
                              torch.float32, torch.device("cpu"))

    full = load(0, 1)
    for rank in range(2):
        part = load(rank, 2)
        for whole, mine in zip(full.model.layers, part.model.layers):
            heads = slice(2 * rank, 2 * rank + 2)
            assert torch.equal(mine.self_attn.sinks, whole.self_attn.sinks[heads])
            n = 24  # of the experts' 48
            gate, up = slice(rank * n, (rank + 1) * n), slice(48 + rank * n, 48 + (rank + 1) * n)
            w, m = whole.mlp, mine.mlp
            assert torch.equal(m.w13, torch.cat([w.w13[:, gate], w.w13[:, up]], dim=1))
            assert torch.equal(m.b13, torch.cat([w.b13[:, gate], w.b13[:, up]], dim=1))
            assert torch.equal(m.w2, w.w2[:, :, gate])
            assert torch.equal(m.b2, w.b2)
            assert torch.equal(m.gate.bias, w.gate.bias)
