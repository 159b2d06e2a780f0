"""The model's configuration as the layers read it, built once from its Hugging Face config.

Every supported architecture's differences are resolved here into plain fields: head_dim
and query scale defaults, Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k norms,
Gemma 2's and 3's norms, sandwich layers and scaled embeddings, Gemma 2's tanh soft-capping
of attention scores and final logits, which layers see a sliding window,
each layer's rope settings (Gemma 3: its own per layer type) and the mixture-of-experts
blocks of Mixtral, Qwen3-MoE, GLM-4.5 and DeepSeek-V3 (DeepSeekMoE routing) and gpt-oss,
gpt-oss's attention sinks, and DeepSeek-V3's multi-head latent attention (MLAConfig). A
vision-language checkpoint gives its text decoder's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchinfer.model.quantization import Fp8Scheme, quantization_scheme
from batchinfer.model.rope import SUPPORTED_ROPE_TYPES, yarn_mscale


@dataclass(frozen=True)
class _Arch:
    """What distinguishes one supported architecture from another."""
    qkv_bias: bool = False   # q, k and v projections carry a bias whatever attention_bias says
    qk_norm: bool = False    # an RMSNorm over each head of q and of k
    sliding: str = "none"    # where sliding_window applies: "none", "all", "layer_types"
    gemma: bool = False      # Gemma's norms, sandwich layers and scaled embeddings
    o_proj_bias: bool = True  # attention_bias gives o_proj a bias too (not GLM-4.5's)
    sinks: bool = False      # a learned logit per query head in each softmax's denominator


ARCHITECTURES = {
    "LlamaForCausalLM": _Arch(),
    "MistralForCausalLM": _Arch(sliding="all"),
    "Qwen2ForCausalLM": _Arch(qkv_bias=True, sliding="layer_types"),
    "Qwen3ForCausalLM": _Arch(qk_norm=True, sliding="layer_types"),
    # mixtures of experts (batchinfer.model.moe)
    "MixtralForCausalLM": _Arch(sliding="all"),
    "Qwen3MoeForCausalLM": _Arch(qk_norm=True, sliding="layer_types"),
    # q/k/v and gate/up stored fused; a sliding window on every layer when one is set
    "Phi3ForCausalLM": _Arch(sliding="all"),
    # sliding and full attention layers, GELU, soft-capped attention scores and logits
    "Gemma2ForCausalLM": _Arch(sliding="layer_types", gemma=True),
    # q/k norm, sliding and full attention layers with rope of their own, GELU
    "Gemma3ForCausalLM": _Arch(qk_norm=True, sliding="layer_types", gemma=True),
    # DeepSeekMoE routing and shared experts after dense first layers, partial rotary,
    # q/k norm where use_qk_norm says
    "Glm4MoeForCausalLM": _Arch(o_proj_bias=False),
    # multi-head latent attention (batchinfer.model.mla), DeepSeekMoE as GLM-4.5's
    "DeepseekV3ForCausalLM": _Arch(),
    # attention sinks, q/k/v/o biases, sliding and full layers, YaRN; experts with biases
    # and a clamped SwiGLU, routed by a softmax over the top k router logits
    "GptOssForCausalLM": _Arch(sliding="layer_types", sinks=True),
}
# the architecture of a config that names none, by its model_type
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}
# vision-language checkpoints whose text decoder runs here (text prompts only)
LANGUAGE_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


@dataclass(frozen=True)
class LayerConfig:
    sliding_window: int | None  # the most recent keys a query sees; None: all of them
    rope: str                   # the layer's rotary table: a key of ModelConfig.rope
    moe: bool                   # a mixture-of-experts block instead of the dense MLP


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int                     # experts per token
    intermediate_size: int         # each expert's
    normalize: bool                # the top k routing weights rescaled to sum to 1
    weights_in_model_dtype: bool   # routing weights rounded to the model's dtype (Qwen3-MoE)
    # DeepSeekMoE (GLM-4.5): sigmoid scores, chosen with a learned correction bias added
    # (e_score_correction_bias) among the top topk_groups of num_groups expert groups (a
    # group scored by its two best), the weights scaled by routed_scaling_factor, and
    # shared experts (one MLP of num_shared_experts x intermediate_size) on every token
    scoring: str = "softmax"       # "softmax", "sigmoid" or "topk_softmax" (gpt-oss)
    # gpt-oss: a softmax over the top k router logits (scoring "topk_softmax"), biases on
    # the router and the experts, and the experts' SwiGLU with clamped inputs:
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3): keys and values are expanded per head from
    one latent row per token, kv_lora_rank values normed plus qk_rope_head_dim rotated key
    values shared by all heads; that row is what the KV cache holds."""
    q_lora_rank: int | None       # the queries' low-rank projection (None: q_proj directly)
    kv_lora_rank: int
    qk_nope_head_dim: int         # each query/key head's dimensions without rotation
    qk_rope_head_dim: int         # and with it
    v_head_dim: int
    rope_interleave: bool         # rotated dimensions stored as interleaved pairs

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    attention_scale: float        # of q.k: query_pre_attn_scalar (else head_dim) ** -0.5
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    gemma_norms: bool             # norm weights are offsets from 1, applied in float32
    sandwich_norms: bool          # sublayer outputs normed again, the MLP's input too
    embed_scale: float | None     # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    attn_softcap: float | None    # scores (after the scale) become cap * tanh(scores / cap)
    logit_softcap: float | None   # the LM head's logits likewise (Gemma 2)
    tie_word_embeddings: bool
    rope: dict[str, dict]         # rope settings by table (rope.RotaryEmbedding's params)
    short_context_limit: int | None  # LongRoPE: the context its short factors cover
    layers: tuple[LayerConfig, ...]
    moe: MoEConfig | None
    dtype: Any                    # the checkpoint's, as its config gives it (or None)
    eos_token_id: int | list[int] | None
    quantization: Fp8Scheme | None = None  # FP8 linear layers (batchinfer.model.quantization)
    mla: MLAConfig | None = None  # multi-head latent attention (head_dim: the rotated part)
    # a learned logit per query head added to each softmax's denominator (gpt-oss)
    attention_sinks: bool = False

    @property
    def kv_elements_per_token(self) -> int:
        """The KV cache's values per token over all layers: the latent row with MLA, else
        a key and a value per KV head."""
        if self.mla is not None:
            return self.num_hidden_layers * self.mla.latent_dim
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config, quantization: str | None = None) -> ModelConfig:
        """The engine's view of a transformers config (a vision-language checkpoint's: its
        text decoder's), its linear layers quantized to FP8 when the checkpoint is or
        quantization is "fp8". ValueError for an architecture or a setting not implemented
        here."""
        config, architecture = text_config(hf_config)
        architecture = architecture or supported_architecture(config)
        arch = ARCHITECTURES[architecture]
        scheme = quantization_scheme(hf_config, config, quantization)
        _check(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        rope_keys = [_rope_key(config, i) for i in range(config.num_hidden_layers)]
        full = _rope_parameters(config)
        moe = _moe(config)
        mla = _mla(config)
        scale = (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5
        if mla is not None:
            # the rotary table covers the rotated part; one latent "KV head"; the scale is
            # YaRN's mscale_all_dim factor squared over the whole query/key head
            head_dim = mla.qk_rope_head_dim
            scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
            if full["rope_type"] != "default" and full.get("mscale_all_dim"):
                scale *= yarn_mscale(full["factor"], full["mscale_all_dim"]) ** 2
        layers = tuple(LayerConfig(_sliding_window(config, arch, i), rope_keys[i],
                                   moe is not None and _moe_layer(config, i))
                       for i in range(config.num_hidden_layers))
        # a vision-language checkpoint sets its dtype and stop ids on the outer config only
        outer = hf_config if hf_config is not config else None
        dtype_source = outer if getattr(outer, "dtype", None) is not None else config
        eos = getattr(outer, "eos_token_id", None)
        return cls(
            architecture=architecture,
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=(1 if mla is not None
                                 else getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=(getattr(config, "hidden_activation", None)
                        or getattr(config, "hidden_act", "silu")),
            attention_scale=scale,
            qkv_bias=arch.qkv_bias or attention_bias,
            o_proj_bias=attention_bias and arch.o_proj_bias and not arch.qkv_bias,
            qk_norm=arch.qk_norm or bool(getattr(config, "use_qk_norm", False)),
            gemma_norms=arch.gemma,
            sandwich_norms=arch.gemma,
            embed_scale=config.hidden_size ** 0.5 if arch.gemma else None,
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            logit_softcap=getattr(config, "final_logit_softcapping", None),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope={key: _rope_parameters(config, key) for key in sorted(set(rope_keys))},
            short_context_limit=(full["original_max_position_embeddings"]
                                 if full["rope_type"] == "longrope" else None),
            layers=layers,
            moe=moe,
            dtype=getattr(dtype_source, "dtype", None) or getattr(dtype_source, "torch_dtype", None),
            eos_token_id=eos if eos is not None else getattr(config, "eos_token_id", None),
            quantization=scheme,
            mla=mla,
            attention_sinks=arch.sinks,
        )


def text_config(hf_config) -> tuple[Any, str | None]:
    """(the config the engine runs, its architecture where the checkpoint implies one): a
    vision-language checkpoint's text config and decoder, or the config itself."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in LANGUAGE_MODELS and getattr(hf_config, "text_config", None) is not None:
            return hf_config.text_config, LANGUAGE_MODELS[arch]
    return hf_config, None


def supported_architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    for arch in archs or [_BY_MODEL_TYPE.get(getattr(config, "model_type", ""), "")]:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(f"model architecture {archs or config.model_type!r} is not supported; "
                     f"supported: {', '.join(ARCHITECTURES)}")


def _check(config) -> None:
    """Refuse what the engine does not implement, naming it."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported (embedding models)")


def _sliding_window(config, arch: _Arch, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or arch.sliding == "none":
        return None
    if arch.sliding == "all":
        return int(window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if config.model_type == "gemma2":  # before transformers named the layer types
        return int(window) if layer_idx % 2 == 0 else None
    if getattr(config, "use_sliding_window", False):
        return int(window) if layer_idx >= getattr(config, "max_window_layers", 0) else None
    return None


def _rope_key(config, layer_idx: int) -> str:
    """Which rotary table a layer uses: its layer type's where the config sets rope per
    layer type (Gemma 3: local and global attention), else the one shared table."""
    per_type = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types and isinstance(per_type.get(layer_types[layer_idx]), dict):
        return layer_types[layer_idx]
    return "full_attention"


def _rope_parameters(config, layer_type: str = "full_attention") -> dict:
    """Rope settings from either the newer `rope_parameters` key (per layer type where
    the config has one set for each) or the older `rope_scaling` + `rope_theta` keys."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    factors = getattr(config, "rope_freq_factors", None)  # a GGUF file's (model/gguf.py)
    if factors is not None:
        params["rope_type"], params["freq_factors"] = "freq_factors", list(factors)
    if params["rope_type"] in ("su", "yarn") and "short_factor" in params:  # Phi-3's old names
        params["rope_type"] = "longrope"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {params['rope_type']!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    params["partial_rotary_factor"] = 1.0 if partial is None else float(partial)
    if params["rope_type"] == "longrope":
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None)
                          or config.max_position_embeddings)
        params.setdefault("factor", config.max_position_embeddings
                          / params["original_max_position_embeddings"])
    if params["rope_type"] == "yarn":
        # as transformers: a top-level original_max_position_embeddings wins
        original = (getattr(config, "original_max_position_embeddings", None)
                    or params.get("original_max_position_embeddings")
                    or config.max_position_embeddings)
        params["original_max_position_embeddings"] = original
        if params.get("factor") is None:
            params["factor"] = config.max_position_embeddings / original
    return params


def _mla(config) -> MLAConfig | None:
    if not getattr(config, "kv_lora_rank", None):
        return None
    q_lora = getattr(config, "q_lora_rank", None)
    return MLAConfig(q_lora_rank=int(q_lora) if q_lora else None,
                     kv_lora_rank=int(config.kv_lora_rank),
                     qk_nope_head_dim=int(config.qk_nope_head_dim),
                     qk_rope_head_dim=int(config.qk_rope_head_dim),
                     v_head_dim=int(config.v_head_dim),
                     rope_interleave=bool(getattr(config, "rope_interleave", True)))


def _moe(config) -> MoEConfig | None:
    """The experts of Mixtral (every layer), Qwen3-MoE, GLM-4.5 (see _moe_layer) or
    gpt-oss (every layer)."""
    if getattr(config, "model_type", None) == "gpt_oss":
        return MoEConfig(config.num_local_experts, config.num_experts_per_tok,
                         config.intermediate_size, normalize=False,
                         weights_in_model_dtype=True, scoring="topk_softmax",
                         swiglu_limit=float(config.swiglu_limit),
                         swiglu_alpha=float(config.swiglu_alpha))
    if getattr(config, "n_routed_experts", None):  # DeepSeekMoE
        groups = getattr(config, "n_group", None) or 1
        if config.n_routed_experts % groups:
            raise ValueError(f"n_routed_experts {config.n_routed_experts} is not a multiple of "
                             f"n_group {groups}")
        return MoEConfig(config.n_routed_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, normalize=bool(config.norm_topk_prob),
                         weights_in_model_dtype=False, scoring="sigmoid", num_groups=groups,
                         topk_groups=getattr(config, "topk_group", None) or 1,
                         routed_scaling_factor=float(config.routed_scaling_factor),
                         num_shared_experts=getattr(config, "n_shared_experts", None) or 0)
    if getattr(config, "moe_intermediate_size", None) is None:
        if not getattr(config, "num_local_experts", None):
            return None
        return MoEConfig(config.num_local_experts, config.num_experts_per_tok,  # Mixtral
                         config.intermediate_size, normalize=True,
                         weights_in_model_dtype=False)
    num_experts = getattr(config, "num_experts", 0) or 0
    if num_experts == 0:
        return None
    return MoEConfig(num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                     normalize=bool(config.norm_topk_prob), weights_in_model_dtype=True)


def _moe_layer(config, layer_idx: int) -> bool:
    """Whether a layer has the MoE block: all of Mixtral's; Qwen3-MoE's but its
    mlp_only_layers and those decoder_sparse_step skips; GLM-4.5's after its
    first_k_dense_replace dense ones."""
    if getattr(config, "moe_intermediate_size", None) is None:
        return True
    if getattr(config, "n_routed_experts", None):
        return layer_idx >= (getattr(config, "first_k_dense_replace", None) or 0)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return not (layer_idx in (getattr(config, "mlp_only_layers", None) or [])
                or (layer_idx + 1) % step)
