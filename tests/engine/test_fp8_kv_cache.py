"""kv_cache_dtype="fp8": an E4M3 KV cache with per-layer scales.

Greedy outputs, on the correctness models and under every cache and scheduling setting:
- equal those of the model dtype's cache holding what an FP8 cache holds (K/V rounded to
  E4M3 and back before they are written: `emulated`), which pins the FP8 path down to the
  token;
- agree with the model dtype's own cache by vLLM's criterion (equal up to the first
  divergence, and there each side's token among the other's top 5).
The pool holds twice the blocks of a bfloat16 cache in the same memory; a checkpoint's
k_scale / v_scale are loaded and used."""
from __future__ import annotations

import functools
import shutil

import pytest
import torch
from safetensors.torch import save_file

import checkpoints
from batchinfer import LLM, SamplingParams
from batchinfer.model import ops
from batchinfer.model.kv_scales import take_kv_scales
from batchinfer.model.rope import apply_rotary
from reference import read_fp8, to_fp8

NUM_PROMPTS = 16
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)


@functools.lru_cache(maxsize=8)
def _prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer
    return checkpoints.mixed_prompts(AutoTokenizer.from_pretrained(model_dir), NUM_PROMPTS, 1,
                                     240, seed=2)


def _generate(model_dir, prompts, **engine_args):
    """(tokens, top-5 ids per step, the LLM) of a greedy run."""
    llm = LLM(model=str(model_dir), **engine_args)
    outs = llm.generate(prompts, GREEDY)
    return ([o.outputs[0].token_ids for o in outs],
            [[set(step) for step in o.outputs[0].logprobs] for o in outs], llm)


@pytest.fixture
def emulated(monkeypatch):
    """emulated(): from then on models write K/V to a cache of their dtype rounded to E4M3
    and back with their layer's scales (the torch path's rotation, then reference.to_fp8
    and read_fp8): what an FP8 cache holds, read as it is read."""
    def rope_and_cache(qk, v, cos, sin, num_heads, slot_mapping, kv_cache, k_scale=1.0,
                       v_scale=1.0):
        qk = apply_rotary(qk, cos, sin)
        k = read_fp8(to_fp8(qk[:, num_heads:], k_scale), k_scale).to(qk.dtype)
        return qk[:, :num_heads], k, read_fp8(to_fp8(v, v_scale), v_scale).to(v.dtype)

    return lambda: monkeypatch.setattr(ops, "rope_and_cache", rope_and_cache)


def _agree(model_dir, emulated, prompts=None, max_mismatched=0, **engine_args) -> LLM:
    """Run with FP8, with the model dtype's cache, and with that cache holding E4M3 values
    (emulated); assert FP8 gives the emulated tokens and agrees with the model dtype's
    cache by vLLM's rule (but for at most max_mismatched prompts). Returns the FP8 LLM."""
    prompts = prompts or _prompts(str(model_dir))
    ids, top5, llm = _generate(model_dir, prompts, kv_cache_dtype="fp8", **engine_args)
    assert llm.stats()["kv_cache_dtype"] == "float8_e4m3fn"
    base_ids, base_top5, _ = _generate(model_dir, prompts, kv_cache_dtype="auto", **engine_args)
    emulated()
    emulated_ids, _, _ = _generate(model_dir, prompts, kv_cache_dtype="auto", **engine_args)
    result = checkpoints.compare_greedy(ids, base_ids, top5, base_top5)
    same = sum(a == b for a, b in zip(ids, emulated_ids))
    summary = (f"{model_dir.name} {engine_args}: against the model dtype's cache "
               f"{result.exact}/{len(prompts)} exact, {result.tolerated} close, "
               f"{result.mismatched} mismatched {result.failures}; {same}/{len(prompts)} "
               "equal to the emulated FP8 cache")
    print(summary)
    assert same == len(prompts), summary
    assert result.mismatched <= max_mismatched, summary
    return llm


@pytest.mark.parametrize("fixture, dtype", [
    ("llama_dir", "float32"), ("llama_dir", "bfloat16"),
    ("mistral_dir", "bfloat16"),   # sliding window shorter than the prompts
    ("qwen3_dir", "float32"),      # q/k norms
    ("gemma3_dir", "bfloat16"),    # local and global layers
])
def test_agrees_with_the_model_dtypes_cache(fixture, dtype, request, emulated):
    _agree(request.getfixturevalue(fixture), emulated, dtype=dtype)


def test_mixture_of_experts(mixtral_dir, emulated):
    """Random routers turn E4M3's rounding (a few percent of each K/V element) into other
    experts, and then into unrelated logits: against the model dtype's own cache about one
    prompt in seven diverges outside the top 5, exactly as the emulated FP8 cache does (the
    same prompts, at the same steps). So the tokens are held to the emulated cache's, and
    vLLM's criterion to three prompts in four."""
    _agree(mixtral_dir, emulated, max_mismatched=NUM_PROMPTS // 4, dtype="float32")


def test_prefix_caching(llama_dir, emulated):
    """Shared system prompts: the cascade reads the shared blocks once (the shared-prefix
    kernel), the rest per sequence."""
    from transformers import AutoTokenizer
    prompts = checkpoints.shared_prefix_prompts(AutoTokenizer.from_pretrained(llama_dir), 24,
                                                150, 40, seed=3)
    llm = _agree(llama_dir, emulated, prompts, dtype="bfloat16", block_size=16)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 23 * 144


def test_chunked_prefill(mistral_dir, emulated):
    llm = _agree(mistral_dir, emulated, dtype="float32", max_num_batched_tokens=64)
    assert llm.stats()["num_steps"] > NEW_TOKENS + 240 // 64


def test_preemption(llama_dir, emulated):
    llm = _agree(llama_dir, emulated, dtype="float32", num_kv_blocks=24)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("dtype, factor", [("bfloat16", 2), ("float32", 4)])
def test_the_pool_holds_more_blocks_in_the_same_memory(llama_dir, dtype, factor):
    runner = LLM(str(llama_dir), dtype=dtype, num_kv_blocks=1).llm_engine.model_runner
    budget = 64 * runner.block_bytes
    plain = LLM(str(llama_dir), dtype=dtype, kv_cache_memory_bytes=budget)
    fp8 = LLM(str(llama_dir), dtype=dtype, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    assert plain.stats()["num_total_blocks"] == 64
    assert fp8.stats()["num_total_blocks"] == 64 * factor
    assert plain.stats()["kv_cache_dtype"] == dtype
    caches = fp8.llm_engine.model_runner.kv_caches
    assert caches[0][0].dtype == torch.float8_e4m3fn
    assert sum(t.nbytes for pair in caches for t in pair) == budget


# ---- scales from the checkpoint ---------------------------------------------------------------

# test-llama's two layers, in the names of two generations of quantizers; k and v apart
SCALES = {"model.layers.0.self_attn.k_scale": 0.37, "model.layers.0.self_attn.v_scale": 3.1,
          "model.layers.1.self_attn.k_proj.output_scale": 1.7,
          "model.layers.1.self_attn.v_proj.output_scale": 0.45}


def _with_scales(model_dir, tmp_path, scales: dict[str, float | list[float]]):
    """A copy of the checkpoint with the given KV-cache scales in a file of their own."""
    out = tmp_path / f"{model_dir.name}-scaled"
    shutil.copytree(model_dir, out)
    save_file({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()},
              str(out / "kv_scales.safetensors"))
    return out


def _attention_scales(llm: LLM) -> list[tuple[float, float]]:
    return [(layer.self_attn.k_scale, layer.self_attn.v_scale)
            for layer in llm.llm_engine.model_runner.model.model.layers]


def test_checkpoint_scales_are_loaded_and_used(llama_dir, tmp_path, emulated):
    scaled = _with_scales(llama_dir, tmp_path, SCALES)
    prompts = _prompts(str(llama_dir))[:8]
    ids, top5, llm = _generate(scaled, prompts, kv_cache_dtype="fp8", dtype="float32")
    f32 = [float(torch.tensor(x, dtype=torch.float32)) for x in SCALES.values()]
    loaded = [(f32[0], f32[1]), (f32[2], f32[3])]
    assert _attention_scales(llm) == loaded
    # the same weights with unit scales: what is stored and read differs
    unit_ids, _, unit = _generate(llama_dir, prompts, kv_cache_dtype="fp8", dtype="float32")
    assert _attention_scales(unit) == [(1.0, 1.0), (1.0, 1.0)]
    logprobs = [o.outputs[0].logprobs[0] for o in llm.generate(prompts, GREEDY)]
    unit_logprobs = [o.outputs[0].logprobs[0] for o in unit.generate(prompts, GREEDY)]
    assert logprobs != unit_logprobs
    # with the model dtype's cache the scales are passed over: the checkpoint's own outputs
    auto_ids, _, auto = _generate(scaled, prompts, dtype="float32")
    assert _attention_scales(auto) == [(1.0, 1.0), (1.0, 1.0)]
    plain_ids, _, _ = _generate(llama_dir, prompts, dtype="float32")
    assert auto_ids == plain_ids
    # the float32 cache holding E4M3 values stored and read with those scales: the same
    # tokens (but where folding k_scale into the query's scale moves a near-tie)
    emulated()
    reference = LLM(str(llama_dir), dtype="float32")
    for layer, (k_scale, v_scale) in zip(reference.llm_engine.model_runner.model.model.layers,
                                         loaded):
        layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale
    outs = reference.generate(prompts, GREEDY)
    result = checkpoints.compare_greedy(
        ids, [o.outputs[0].token_ids for o in outs], top5,
        [[set(step) for step in o.outputs[0].logprobs] for o in outs])
    assert result.ok and result.exact >= len(prompts) - 1, (result.exact, result.failures)


def test_one_scale_for_both_and_bad_scales(llama_dir, tmp_path):
    both = _with_scales(llama_dir, tmp_path / "both", {"model.layers.1.self_attn.kv_scale": 2.5})
    llm = LLM(str(both), kv_cache_dtype="fp8", num_kv_blocks=8)
    assert _attention_scales(llm) == [(1.0, 1.0), (2.5, 2.5)]
    bad = _with_scales(llama_dir, tmp_path / "bad",
                       {"model.layers.0.self_attn.v_scale": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.v_scale': .* one number"):
        LLM(str(bad), kv_cache_dtype="fp8", num_kv_blocks=8)
    LLM(str(bad), num_kv_blocks=8)  # passed over without an FP8 cache


class _Attention(torch.nn.Module):
    k_scale = v_scale = 1.0


@pytest.mark.parametrize("value, why", [(0.0, "> 0"), (-1.0, "> 0"), (float("inf"), "finite"),
                                        (float("nan"), "finite"), ([[2.0]], None)])
def test_scale_values(value, why):
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].self_attn = attention = _Attention()
    name = "model.layers.0.self_attn.k_scale"
    weights = [("model.embed_tokens.weight", torch.zeros(2)), (name, torch.tensor(value)),
               ("model.layers.0.self_attn.q_scale", torch.tensor(5.0))]
    if why is None:  # a [1, 1] tensor is one number
        assert [n for n, _ in take_kv_scales(model, weights, True)] == ["model.embed_tokens.weight"]
        assert attention.k_scale == 2.0 and attention.v_scale == 1.0
        return
    with pytest.raises(ValueError, match=rf"'{name}'.*{why}"):
        list(take_kv_scales(model, weights, True))
    assert [n for n, _ in take_kv_scales(model, weights, False)] == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="has no place in the model"):
        list(take_kv_scales(model, [("model.layers.7.self_attn.v_scale", torch.tensor(1.0))],
                            True))


def test_the_config_refuses_other_values():
    from batchinfer.config import EngineConfig
    assert EngineConfig(model="m", kv_cache_dtype="fp8_e4m3").kv_cache_torch_dtype(
        torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3; "
                                         "got 'fp8_e5m2'"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")


@pytest.mark.slow
def test_tensor_parallel_ranks_use_the_same_scales(llama_dir, tmp_path):
    """Two ranks (gloo on CPU), each loading the checkpoint's scales: the tokens of one."""
    scaled = _with_scales(llama_dir, tmp_path, SCALES)
    prompts = _prompts(str(llama_dir))[:8]
    kwargs = dict(dtype="float32", device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
    expected, _, _ = _generate(scaled, prompts, **kwargs)
    llm = LLM(str(scaled), tensor_parallel_size=2, **kwargs)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()
    assert got == expected
