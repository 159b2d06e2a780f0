"""Greedy outputs of our engine equal transformers' generate on random-weight checkpoints
of each supported architecture, under every cache and scheduling setting."""
from __future__ import annotations

import functools

import pytest
import torch

import checkpoints
from batchinfer import LLM, SamplingParams

NUM_PROMPTS = 32
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)


@functools.lru_cache(maxsize=8)
def _reference(model_dir: str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = checkpoints.mixed_prompts(tokenizer, NUM_PROMPTS, 1, 320, seed=1)
    return prompts, checkpoints.hf_greedy(model_dir, prompts, NEW_TOKENS, ignore_eos=True)


def _check(model_dir, **engine_args) -> LLM:
    prompts, ref = _reference(str(model_dir))
    llm = LLM(model=str(model_dir), dtype="float32", **engine_args)
    outs = llm.generate(prompts, GREEDY)
    ours = [o.outputs[0].token_ids for o in outs]
    ours_top5 = [[set(step) for step in o.outputs[0].logprobs] for o in outs]
    result = checkpoints.compare_greedy(ours, ref.token_ids, ours_top5, ref.top5)
    print(f"{model_dir.name} {engine_args}: {result.exact}/{NUM_PROMPTS} exact, "
          f"{result.tolerated} tolerated near-ties")
    assert result.ok, result.failures
    # exact equality must be the common case, not the tolerated one
    assert result.exact >= NUM_PROMPTS * 0.8, (result.exact, result.tolerated)
    return llm


@pytest.mark.parametrize("fixture", ["llama_dir", "mistral_dir", "qwen2_dir", "qwen2_yarn_dir",
                                     "qwen3_dir", "phi3_dir", "phi4_mini_dir", "gemma2_dir",
                                     "gemma3_dir", "mixtral_dir", "qwen3_moe_dir",
                                     "glm4_moe_dir", "deepseek_v3_dir",
                                     "deepseek_v3_no_q_lora_dir", "gpt_oss_dir"])
def test_matches_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    llm = _check(model_dir)
    assert llm.llm_engine.model_config.num_key_value_heads < llm.llm_engine.model_config.num_attention_heads


def test_gemma2_logprobs_come_from_soft_capped_logits(gemma2_dir):
    # tanh keeps the order of the logits, so greedy tokens cannot show the final cap
    prompts, _ = _reference(str(gemma2_dir))
    model = checkpoints._load_hf_model(str(gemma2_dir))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    outs = LLM(model=str(gemma2_dir), dtype="float32").generate(prompts[:4], params)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        expected = torch.log_softmax(logits, dim=-1)
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert logprob.logprob == pytest.approx(expected[token].item(), abs=1e-4)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_block_sizes_and_caching(llama_dir, block_size, enable_prefix_caching):
    _check(llama_dir, block_size=block_size, enable_prefix_caching=enable_prefix_caching)


def test_chunked_prefill(llama_dir):
    # a 64-token budget splits every prompt longer than 64 across steps
    llm = _check(llama_dir, max_num_batched_tokens=64)
    assert llm.stats()["num_steps"] > NEW_TOKENS + 320 // 64


def test_preemption(llama_dir):
    # 48 blocks of 16 tokens hold a few long requests at a time: the scheduler must preempt
    llm = _check(llama_dir, num_kv_blocks=48)
    assert llm.stats()["num_preemptions"] > 0


def test_preemption_with_chunking_and_small_blocks(mistral_dir):
    llm = _check(mistral_dir, num_kv_blocks=90, block_size=8, max_num_batched_tokens=96)
    assert llm.stats()["num_preemptions"] > 0


def test_grouped_expert_routing_with_chunking_and_preemption(glm4_moe_dir):
    llm = _check(glm4_moe_dir, num_kv_blocks=48, max_num_batched_tokens=64)
    assert llm.stats()["num_preemptions"] > 0


def test_attention_sinks_with_chunking_and_preemption(gpt_oss_dir):
    # gpt-oss: sinks, sliding windows shorter than the chunks, biased experts
    llm = _check(gpt_oss_dir, num_kv_blocks=48, max_num_batched_tokens=64)
    assert llm.stats()["num_preemptions"] > 0


def test_latent_attention_with_chunking_and_preemption(deepseek_v3_dir):
    llm = _check(deepseek_v3_dir, num_kv_blocks=48, max_num_batched_tokens=64)
    assert llm.stats()["num_preemptions"] > 0


def test_legacy_rope_keys_and_sharded_checkpoint(llama_dir, llama_legacy_rope_dir, llama_sharded_dir):
    prompts, _ = _reference(str(llama_dir))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model=str(llama_dir)).generate(prompts[:6], params)]
    for other in (llama_legacy_rope_dir, llama_sharded_dir):
        got = [o.outputs[0].token_ids for o in LLM(model=str(other)).generate(prompts[:6], params)]
        assert got == expected, other.name


def test_attention_bias(tmp_path):
    from batchinfer.random_checkpoint import SHAPES, build_random_checkpoint
    shape = dict(SHAPES["test-llama"], attention_bias=True)
    model_dir = build_random_checkpoint(tmp_path / "llama-bias", shape)
    _check(model_dir)


def test_shared_system_prompt_computed_once(llama_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompts = checkpoints.shared_prefix_prompts(tokenizer, 64, 200, 40, seed=3)
    llm = LLM(model=str(llama_dir), block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    shared_full_blocks_tokens = 200 // 16 * 16
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] >= 63 * shared_full_blocks_tokens
    assert sum(o.num_cached_tokens for o in outs) >= 63 * shared_full_blocks_tokens
    # and caching does not change what is generated
    plain = LLM(model=str(llama_dir), block_size=16, enable_prefix_caching=False)
    expected = plain.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert plain.stats()["prefix_cache_hit_tokens"] == 0


def test_no_blocks_leak(llama_dir):
    prompts, _ = _reference(str(llama_dir))
    llm = LLM(model=str(llama_dir), num_kv_blocks=40, max_num_batched_tokens=64)
    llm.generate(prompts[:12], [SamplingParams(max_tokens=20, n=2, temperature=0.8, seed=i)
                                for i in range(12)])
    pool = llm.llm_engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(llama_dir, dtype):
    prompts, _ = _reference(str(llama_dir))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    ref = LLM(model=str(llama_dir), dtype="float32").generate(prompts[:8], params)
    half = LLM(model=str(llama_dir), dtype=dtype)
    assert half.llm_engine.dtype == getattr(torch, dtype)
    outs = half.generate(prompts[:8], params)
    first_equal = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(outs, ref))
    assert first_equal >= 6
    for a, b in zip(outs, ref):
        tok = b.outputs[0].token_ids[0]
        if a.outputs[0].token_ids[0] == tok:
            assert abs(a.outputs[0].logprobs[0][tok].logprob - b.outputs[0].logprobs[0][tok].logprob) < 0.1
