"""Random-weight Hugging Face checkpoints for tests, benchmarks and the demo model.

A checkpoint is a directory that transformers' Auto classes load like any downloaded model:
``config.json`` and ``generation_config.json``, a byte-level BPE tokenizer trained on the
corpus shipped in :mod:`batchinfer.data`, and random safetensors weights written by
transformers' own model class. Nothing is downloaded; the same arguments always produce
byte-identical files.

    python -m batchinfer.random_checkpoint OUT --shape tiny
"""
from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN,
                  EOT_TOKEN)
# Special tokens, the 256 byte symbols and at least one merge.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256 + 1

# Llama-3 layout: a header per message, the body, an end-of-turn token. Every tag trims
# the whitespace before it, so only the quoted strings reach the output.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] | trim }}
    {%- else %}
        {%- for part in message['content'] if part['type'] == 'text' %}
            {{- part['text'] | trim }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

_LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Each shape names its architecture (`model_type`) plus keyword arguments of that
# architecture's transformers config class. `rope_theta` and `rope_scaling` are given in
# the long-standing form and converted for the installed transformers. `initializer_range`
# is the std of the random weights. The small shapes use about 1.2 / sqrt(hidden_size),
# far more than real models: at 0.02 the token embedding dominates the residual stream and
# greedy decoding repeats one token forever (tied embeddings especially), while at this
# std continuations are varied and the top two logits stay far enough apart (median gap
# ~0.25) for exact token-by-token comparisons between implementations.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=688, vocab_size=8192,
        max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.08,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, initializer_range=0.041666666666666664,
    ),
    "llama3-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_SCALING, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    "llama3-70b": dict(
        model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE_SCALING, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    # tiny's attention with a Qwen3-MoE feed-forward whose active width equals tiny's
    # (4 of 16 experts, 172 wide each): MoE routing and expert costs beside the dense shape
    "tiny-moe": dict(
        model_type="qwen3_moe", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, intermediate_size=688, moe_intermediate_size=172,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, vocab_size=8192,
        max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
        use_sliding_window=False, tie_word_embeddings=False, initializer_range=0.08,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        use_sliding_window=False, tie_word_embeddings=False, initializer_range=0.02,
    ),
    # GLM-4.5-Air's shape (106B, 12B active): 128 experts, 8 a token, one shared, a dense
    # first layer, half the head rotated
    "glm-4.5-air": dict(
        model_type="glm4_moe", hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
        num_key_value_heads=8, head_dim=128, intermediate_size=10944,
        moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
        num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "partial_rotary_factor": 0.5},
        vocab_size=151552, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.02,
    ),
    # DeepSeek-V3's shape (671B, 37B active): multi-head latent attention, 256 experts, 8 a
    # token in the best 4 of 8 groups, one shared, three dense first layers, YaRN to 160k
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0},
        vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.02,
    ),
    # tiny's attention with GLM-4.5's feed-forward: 4 of 16 experts 172 wide in groups, a
    # shared expert, a dense first layer (the routing's cost beside tiny-moe's softmax)
    "tiny-glm4-moe": dict(
        model_type="glm4_moe", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, intermediate_size=688, moe_intermediate_size=172,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0,
                         "partial_rotary_factor": 0.5},
        vocab_size=8192, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.08,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
        num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.02,
    ),
    # GQA, llama3 rope scaling whose three frequency bands all occur at head_dim 32,
    # tied embeddings, and a head_dim that is not hidden_size / num_attention_heads.
    "test-llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192, vocab_size=1536,
        max_position_embeddings=2048, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.15,
    ),
    # A sliding window far shorter than the test prompts; a vocab that is not a power of 2.
    "test-mistral": dict(
        model_type="mistral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=192, vocab_size=1000,
        max_position_embeddings=2048, rope_theta=10000.0, sliding_window=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.15,
    ),
    # Bias on q/k/v projections (always on in Qwen2).
    "test-qwen2": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=192, vocab_size=1280,
        max_position_embeddings=2048, rope_theta=1000000.0, use_sliding_window=False,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.15,
    ),
    # test-qwen2 with YaRN, as Qwen2.5's long-context configs set it: a 4x extension of an
    # original context far shorter than the test prompts.
    "test-qwen2-yarn": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=192, vocab_size=1280,
        max_position_embeddings=512, rope_theta=1000000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 128},
        use_sliding_window=False, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.15,
    ),
    # RMSNorm on q and k per head; explicit head_dim.
    "test-qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192, vocab_size=2000,
        max_position_embeddings=2048, rope_theta=1000000.0, use_sliding_window=False,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.15,
    ),
    # q/k/v and gate/up stored fused; LongRoPE (short-context factors that differ per
    # frequency, and the attention factor of a 4x context extension); a sliding window on
    # every layer.
    "test-phi3": dict(
        model_type="phi3", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=256, vocab_size=1800,
        max_position_embeddings=4096, original_max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0 + 0.125 * i for i in range(16)],
                      "long_factor": [4.0] * 16},
        sliding_window=96, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.1,
    ),
    # Phi-4-mini's partial rotary embeddings: 24 of each head's 32 dimensions rotate.
    "test-phi4-mini": dict(
        model_type="phi3", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=256, vocab_size=1700,
        max_position_embeddings=4096, original_max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "longrope", "partial_rotary_factor": 0.75,
                      "short_factor": [1.0 + 0.25 * i for i in range(12)],
                      "long_factor": [4.0] * 12},
        rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.1,
    ),
    # Mixtures of experts: Mixtral (top-2 of 4, weights renormalised, float32 routing
    # weights) and Qwen3-MoE (top-2 of 8, q/k norm, a dense layer between sparse ones).
    "test-mixtral": dict(
        model_type="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=1300, max_position_embeddings=2048,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.15,
    ),
    "test-qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192, moe_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], vocab_size=1400, max_position_embeddings=2048,
        rope_theta=1000000.0, use_sliding_window=False, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.15,
    ),
    # GLM-4.5's MoE: DeepSeekMoE routing (sigmoid scores with a correction bias, the top
    # experts of the best groups, a routed scaling factor, a shared expert), a dense first
    # layer, half the head rotated, q/k norm, q/k/v biases.
    "test-glm4-moe": dict(
        model_type="glm4_moe", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192, moe_intermediate_size=48,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        vocab_size=1500, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.15,
    ),
    # DeepSeek-V3: multi-head latent attention (low-rank queries, a latent KV row of
    # kv_lora_rank + qk_rope_head_dim, interleaved rope, YaRN with mscale_all_dim scaling the
    # query scale) and GLM-4.5's DeepSeekMoE after a dense first layer.
    "test-deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, intermediate_size=192, moe_intermediate_size=48,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 512, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0},
        vocab_size=1500, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.15,
    ),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding (16, shorter than the test prompts)
    # and full layers in turn, YaRN over an original context shorter than the prompts, and
    # experts with biases and the clamped SwiGLU, routed by softmax over the top 2 of 8
    # router logits (the router has a bias too).
    "test-gpt-oss": dict(
        model_type="gpt_oss", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=48, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128, "rope_theta": 150000.0},
        vocab_size=1500, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.15,
    ),
    # Gemma 2: sliding (even) and full attention layers by transformers' default rule, scores
    # and final logits soft-capped with caps the random weights' values often pass, Gemma's
    # norms around both sublayers, a query scale that is not head_dim's, GELU, embeddings
    # scaled by sqrt(hidden_size).
    "test-gemma2": dict(
        model_type="gemma2", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192, vocab_size=1700,
        max_position_embeddings=2048, query_pre_attn_scalar=48, sliding_window=48,
        attn_logit_softcapping=10.0, final_logit_softcapping=8.0,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        initializer_range=0.15,
    ),
    # Gemma 3: sliding and full attention layers, each type with its own rope (linear
    # scaling on the full ones), norms offset from 1 around both sublayers, q/k norm, a
    # query scale that is not head_dim's, GELU, embeddings scaled by sqrt(hidden_size).
    "test-gemma3": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192, vocab_size=1600,
        max_position_embeddings=2048, query_pre_attn_scalar=48, sliding_window=48,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.15,
    ),
}

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "phi3": Phi3Config,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3TextConfig,
    "mixtral": MixtralConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "glm4_moe": Glm4MoeConfig,
    "deepseek_v3": DeepseekV3Config,
    "gpt_oss": GptOssConfig,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_STYLES = ("new", "legacy")
# Std of the noise added to the unit RMSNorm weights, so that a norm applied without its
# weight (or with the wrong one) changes the output.
_NORM_WEIGHT_STD = 0.1


def default_corpus() -> list[str]:
    """The English text shipped with the package, split into paragraphs."""
    text = resources.files("batchinfer.data").joinpath("corpus.txt").read_text("utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _filler_tokens(count: int, taken: set[str]) -> list[str]:
    """`count` distinct pronounceable pseudo-words, each with a leading space in byte-level
    form ("Ġ"), none in `taken`. Used to pad a trained vocab to its requested size, so that
    ids the model may sample decode to word-like text."""
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    rng = random.Random(0)
    fillers: list[str] = []
    seen = set(taken)
    while len(fillers) < count:
        word = "Ġ" + "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            fillers.append(word)
    return fillers


def _pad_vocab(tokenizer: Tokenizer, vocab_size: int) -> Tokenizer:
    """Append filler entries to the BPE vocab (not as added tokens, which would slow down
    encoding) until it holds `vocab_size` ids. No merge produces them, so encoding never
    emits them, but they decode like any other token."""
    state = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    for token in _filler_tokens(vocab_size - len(vocab), set(vocab)):
        vocab[token] = len(vocab)
    return Tokenizer.from_str(json.dumps(state))


def build_tokenizer(out_dir: str | Path, vocab_size: int,
                    corpus: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` ids and save it to
    `out_dir` (tokenizer.json, tokenizer_config.json, chat template).

    Ids 0-5 are `<|begin_of_text|>` (bos, prepended when encoding), `<|end_of_text|>` (eos),
    `<|pad|>`, `<|start_header_id|>`, `<|end_header_id|>` and `<|eot_id|>`; then come the
    256 byte symbols and the learned merges. A corpus too small to fill the vocab is padded
    with filler words. Same arguments, same files.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (special tokens, 256 "
                         f"byte symbols and one merge), got {vocab_size}")
    texts = list(default_corpus() if corpus is None else corpus)
    if not texts:
        raise ValueError("corpus is empty: give at least one text to train the tokenizer on")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        tokenizer = _pad_vocab(tokenizer, vocab_size)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN}:0 $A:0",
            pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, bos_id)],
        ),
    ])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN, additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        chat_template=CHAT_TEMPLATE, model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} ids, expected {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # Say explicitly that there is no unk token: byte-level BPE never needs one, and
    # tokenizer classes that default it (transformers 5 loads qwen2 checkpoints with
    # Qwen2Tokenizer, whatever tokenizer_config.json names) would otherwise add an id
    # beyond vocab_size.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["unk_token"] = None
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return fast


def resolve_shape(shape: str | Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the named shape from SHAPES, or of a custom shape dict after checking it
    names a supported `model_type`."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known shapes: {', '.join(SHAPES)}")
        return dict(SHAPES[shape])
    spec = dict(shape)
    if spec.get("model_type") not in CONFIG_CLASSES:
        raise ValueError(f"shape needs model_type in {sorted(CONFIG_CLASSES)}, "
                         f"got {spec.get('model_type')!r}")
    return spec


def make_config(shape: str | Mapping[str, Any], *, vocab_size: int | None = None,
                dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | list[int] | None = None,
                pad_token_id: int | None = None) -> PretrainedConfig:
    """The transformers config for `shape`, with rope settings in the installed
    transformers' native form."""
    spec = resolve_shape(shape)
    config_class = CONFIG_CLASSES[spec.pop("model_type")]
    rope_parameters = spec.pop("rope_parameters", None) or {  # given per layer type as is
        "rope_type": "default", **(spec.pop("rope_scaling", None) or {}),
        "rope_theta": float(spec.pop("rope_theta", 10000.0))}
    if vocab_size is not None:
        spec["vocab_size"] = vocab_size
    config = config_class(**spec, rope_parameters=rope_parameters, bos_token_id=bos_token_id,
                          eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    config.dtype = dtype
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Draw every parameter from one seeded generator, in name order: matrices and biases
    from N(0, std), RMSNorm weights from 1 + N(0, 0.1), attention sinks (gpt-oss) from
    N(0, 1), then DeepSeekMoE router biases from N(0, 1). Tied parameters are drawn once."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.normal_(1.0, _NORM_WEIGHT_STD, generator=generator)
        elif name.endswith("self_attn.sinks"):  # logits of the same order as the scores
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, std, generator=generator)
    # DeepSeekMoE's router bias (a buffer), drawn too, so that routing depends on it
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 1.0, generator=generator)


def _write_legacy_rope(config_path: Path) -> None:
    """Rewrite config.json with top-level `rope_theta` and `rope_scaling` (null for plain
    rope) instead of transformers 5's `rope_parameters`, as checkpoints written by older
    transformers have them."""
    data = json.loads(config_path.read_text())
    rope = dict(data.pop("rope_parameters"))
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_random_checkpoint(out_dir: str | Path, shape: str | Mapping[str, Any], *,
                            dtype: str = "float32", seed: int = 0,
                            vocab_size: int | None = None,
                            max_shard_size: int | str | None = None,
                            rope_style: str = "new", weights: bool = True) -> Path:
    """Write a loadable Hugging Face checkpoint of architecture `shape` to `out_dir`.

    `shape` is a SHAPES name or a dict of the same form. `rope_style="legacy"` writes
    `rope_theta`/`rope_scaling` instead of `rope_parameters`; `max_shard_size` (bytes or a
    string such as "200KB") splits the weights into shards with an index file;
    `weights=False` writes config and tokenizer only. Same arguments, same files.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if rope_style not in ROPE_STYLES:
        raise ValueError(f"rope_style must be one of {', '.join(ROPE_STYLES)}, "
                         f"got {rope_style!r}")
    spec = resolve_shape(shape)
    vocab_size = spec["vocab_size"] if vocab_size is None else vocab_size
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(out, vocab_size)
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT_TOKEN)]
    config = make_config(spec, vocab_size=vocab_size, dtype=dtype,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids,
                         pad_token_id=tokenizer.pad_token_id)
    generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=eos_ids,
                                         pad_token_id=tokenizer.pad_token_id)
    if weights:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, seed, config.initializer_range)
        model.to(DTYPES[dtype])
        model.generation_config = generation_config
        save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, **save_kwargs)
    else:
        config.save_pretrained(out)
    generation_config.save_pretrained(out)
    if rope_style == "legacy":
        _write_legacy_rope(out / "config.json")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m batchinfer.random_checkpoint",
        description="Write a random-weight Hugging Face checkpoint (config, tokenizer, "
                    "safetensors). Its output text is meaningless.")
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="override the shape's vocab size")
    parser.add_argument("--max-shard-size", default=None,
                        help='split weights into shards of at most this size, e.g. "200MB"')
    parser.add_argument("--rope-style", default="new", choices=ROPE_STYLES,
                        help="'legacy' writes rope_theta/rope_scaling, 'new' rope_parameters")
    parser.add_argument("--no-weights", action="store_true",
                        help="write config and tokenizer only")
    args = parser.parse_args(argv)
    try:
        path = build_random_checkpoint(
            args.out_dir, args.shape, dtype=args.dtype, seed=args.seed,
            vocab_size=args.vocab_size, max_shard_size=args.max_shard_size,
            rope_style=args.rope_style, weights=not args.no_weights)
    except ValueError as exc:
        parser.error(str(exc))
    print(path)


if __name__ == "__main__":
    main()
