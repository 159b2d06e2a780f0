"""FP8 weights: checkpoints in each on-disk form the hub ships, and online quantization.

Each FP8 checkpoint is made from a random-weight test checkpoint (fp8_checkpoints.py) with
a float32 reference holding the weights its FP8 bytes and scales stand for; greedy tokens
of the two must agree by vLLM's criterion (equal up to the first divergence, and there each
side's token in the other's top 5).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import checkpoints
import fp8_checkpoints
from batchinfer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
NUM_PROMPTS = 12


def _greedy(llm: LLM, prompts):
    outs = llm.generate(prompts, GREEDY)
    return ([o.outputs[0].token_ids for o in outs],
            [[set(step) for step in o.outputs[0].logprobs] for o in outs])


def _prompts(model_dir):
    from transformers import AutoTokenizer
    return checkpoints.mixed_prompts(AutoTokenizer.from_pretrained(model_dir), NUM_PROMPTS,
                                     1, 200, seed=3)


def _agree(fp8_model, reference, **engine_args) -> LLM:
    prompts = _prompts(reference)
    llm = LLM(model=str(fp8_model), dtype="float32", **engine_args)
    ours, ours_top = _greedy(llm, prompts)
    theirs, theirs_top = _greedy(LLM(model=str(reference), dtype="float32"), prompts)
    result = checkpoints.compare_greedy(ours, theirs, ours_top, theirs_top)
    print(f"{fp8_model.name}: {result.exact}/{NUM_PROMPTS} exact, {result.tolerated} close")
    assert result.ok, (f"{result.exact} exact, {result.tolerated} close", result.failures)
    assert result.exact >= NUM_PROMPTS * 0.8, (result.exact, result.tolerated)
    return llm


@pytest.mark.parametrize("form", list(fp8_checkpoints.FORMS))
def test_fp8_checkpoint_runs_its_dequantized_weights(tmp_path, llama_dir, form):
    model = fp8_checkpoints.write_fp8(llama_dir, tmp_path / form, form, tmp_path / "ref")
    llm = _agree(model, tmp_path / "ref")
    qkv = llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.packed is None
    assert llm.stats()["quantization"] == fp8_checkpoints.FORMS[form][1]["quant_method"]


@pytest.mark.parametrize("fixture, form", [
    ("phi3_dir", "fp8-block"),                        # q/k/v and gate/up stored fused
    ("phi4_mini_dir", "compressed-tensors-channel"),  # partial rotary: q/k rows reordered
    ("qwen3_dir", "compressed-tensors-block"),        # q/k norms
    ("gemma3_dir", "fbgemm_fp8"),                     # sandwich norms, GELU
    ("mistral_dir", "fp8-tensor"),                    # sliding window
    ("qwen3_moe_dir", "fp8-block"),                   # FP8 experts, partial blocks
    ("mixtral_dir", "compressed-tensors-channel"),    # Mixtral's expert names (w1, w2, w3)
    ("glm4_moe_dir", "fp8-block"),                    # shared experts; the router not FP8
    ("deepseek_v3_dir", "fp8-block"),                 # latent attention; kv_b_proj dequantized
    ("deepseek_v3_no_q_lora_dir", "fp8-block-32"),    # MLA's q_proj; blocks cut heads
])
def test_fp8_checkpoints_of_other_architectures(tmp_path, request, fixture, form):
    src = request.getfixturevalue(fixture)
    model = fp8_checkpoints.write_fp8(src, tmp_path / form, form, tmp_path / "ref")
    _agree(model, tmp_path / "ref", enable_prefix_caching=True, max_num_batched_tokens=128)


def test_online_quantization_is_per_channel_fp8(tmp_path, llama_dir):
    # quantization="fp8" makes the bytes and scales llm-compressor's per-channel scheme
    # stores, so it runs exactly as that checkpoint does
    model = fp8_checkpoints.write_fp8(llama_dir, tmp_path / "channel", "compressed-tensors-channel")
    prompts = _prompts(llama_dir)
    online = LLM(model=str(llama_dir), dtype="bfloat16", quantization="fp8")
    stored = LLM(model=str(model), dtype="bfloat16")
    assert _greedy(online, prompts)[0] == _greedy(stored, prompts)[0]
    full = LLM(model=str(llama_dir), dtype="bfloat16")
    linears = sum(m.weight.numel() for m in online.llm_engine.model_runner.model.modules()
                  if getattr(m, "quant", None) is not None)
    rows = sum(m.weight.shape[0] for m in online.llm_engine.model_runner.model.modules()
               if getattr(m, "quant", None) is not None)
    # each linear weight: 1 byte instead of 2, plus a float32 scale per row
    saved = full.stats()["weight_bytes"] - online.stats()["weight_bytes"]
    assert saved == linears - 4 * rows, (saved, linears, rows)
    assert online.stats()["quantization"] == "fp8-online"


def test_online_quantization_of_experts(tmp_path, qwen3_moe_dir):
    model = fp8_checkpoints.write_fp8(qwen3_moe_dir, tmp_path / "channel",
                                      "compressed-tensors-channel")
    prompts = _prompts(qwen3_moe_dir)
    online = LLM(model=str(qwen3_moe_dir), dtype="float32", quantization="fp8")
    assert online.llm_engine.model_runner.model.model.layers[0].mlp.w13.dtype == torch.float8_e4m3fn
    assert _greedy(online, prompts)[0] == _greedy(LLM(model=str(model), dtype="float32"),
                                                   prompts)[0]


def test_online_quantization_with_random_weights(llama_dir):
    llm = LLM(model=str(llama_dir), load_format="dummy", quantization="fp8")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_ignored_modules_stay_in_the_model_dtype(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file
    model = fp8_checkpoints.write_fp8(llama_dir, tmp_path / "fp8", "fbgemm_fp8", tmp_path / "ref")
    weights = load_file(model / "model.safetensors")
    reference = load_file(tmp_path / "ref" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    weights[f"{name}.weight"] = reference[f"{name}.weight"].to(torch.bfloat16)
    del weights[f"{name}.weight_scale"]
    reference[f"{name}.weight"] = weights[f"{name}.weight"].to(torch.float32)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    save_file(reference, tmp_path / "ref" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] += [name]
    (model / "config.json").write_text(json.dumps(config))
    llm = _agree(model, tmp_path / "ref")
    layers = llm.llm_engine.model_runner.model.model.layers
    assert layers[1].mlp.down_proj.quant is None and layers[0].mlp.down_proj.quant is not None


@pytest.mark.slow
@pytest.mark.parametrize("fixture, form", [("llama_dir", "compressed-tensors-channel"),
                                           ("llama_dir", "fp8-block-32"),
                                           ("mixtral_dir", "compressed-tensors-channel")])
def test_tensor_parallel_cuts_weights_and_scales_together(tmp_path, request, fixture, form):
    src = request.getfixturevalue(fixture)
    model = fp8_checkpoints.write_fp8(src, tmp_path / form, form, tmp_path / "ref")
    prompts = _prompts(src)[:6]
    one = _greedy(LLM(model=str(model), dtype="float32"), prompts)[0]
    two = LLM(model=str(model), dtype="float32", tensor_parallel_size=2)
    try:
        assert _greedy(two, prompts)[0] == one
    finally:
        two.shutdown()


def _edit(model, **changes):
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"].update(changes)
    (model / "config.json").write_text(json.dumps(config))


def test_bad_fp8_input_is_named(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file
    model = fp8_checkpoints.write_fp8(llama_dir, tmp_path / "fp8", "fp8-block")
    with pytest.raises(ValueError, match=r"already quantized \(quant_method 'fp8'\); drop "
                                         r"--quantization"):
        LLM(model=str(model), quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of fp8; got 'int8'"):
        LLM(model=str(llama_dir), quantization="int8")

    weights = load_file(model / "model.safetensors")
    good = dict(weights)
    weights["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(3)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.mlp.down_proj"
                                         r".weight_scale' has shape \[3\], expected \[1, 2\] "
                                         r"\(128x128 blocks\)"):
        LLM(model=str(model))

    weights = dict(good)
    weights["model.layers.0.mlp.down_proj.weight"] = weights[
        "model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj.weight' is torch.bfloat16, expected "
                                         r"float8_e4m3fn"):
        LLM(model=str(model))

    save_file(good, model / "model.safetensors", metadata={"format": "pt"})
    _edit(model, modules_to_not_convert=["model.layers.0.self_attn.k_proj"])
    with pytest.raises(ValueError, match=r"quantizes model.layers.0.self_attn.q_proj, "
                                         r"model.layers.0.self_attn.v_proj but not "
                                         r"model.layers.0.self_attn.k_proj"):
        LLM(model=str(model))


def test_block_scales_tensor_parallelism_cannot_cut_is_refused(tmp_path, llama_dir):
    model = fp8_checkpoints.write_fp8(llama_dir, tmp_path / "fp8", "fp8-block")
    shutil.rmtree(tmp_path / "unused", ignore_errors=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 cuts 128 input features "
                                         r"into 64, not a multiple of the checkpoint's "
                                         r"128-wide scale blocks"):
        LLM(model=str(model), tensor_parallel_size=2)
