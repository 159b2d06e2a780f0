"""The Llama-family decoder (Llama 2/3, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3,
Gemma 2, Gemma 3, GLM-4.5, gpt-oss; DeepSeek-V3 with batchinfer.model.mla's attention) as
plain PyTorch.

Tokens are flat ([num_tokens, hidden]) with no padding; attention reads and writes the
paged KV cache through the step's AttentionMetadata. The architectures' differences are
fields of the ModelConfig the layers are built from (batchinfer.model.config); the
elementwise operations run the CPU kernels where they apply (batchinfer.model.ops).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.attention import AttentionMetadata
from batchinfer.model import cpu_linear, fp8, mxfp4, ops
from batchinfer.model.config import LayerConfig, ModelConfig
from batchinfer.model.quantization import LinearQuant
from batchinfer.model.mla import MLAttention
from batchinfer.model.moe import (EXPERT_TENSOR, FUSED_EXPERT_TENSOR, SparseMoE, mixtral_name,
                                  moe_block)
from batchinfer.model.parallel import (ColumnParallelLinear, ParallelLMHead, PipelineParallel,
                                       QKVParallelLinear, RowParallelLinear, TensorParallel,
                                       VocabParallelEmbedding, _shard, stage_layers)
from batchinfer.model.rope import RotaryEmbedding, partial_rotary_order, rotary_dim
from batchinfer.model.weights import CheckpointTensor


class RMSNorm(nn.Module):
    gemma = False

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with residual, (norm(x + residual), x + residual), the add fused into
        the norm (residual may be updated in place)."""
        return ops.rms_norm(x, self.weight, self.eps, residual, self.gemma)

    def forward_(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) written over x, which may be a view of some heads of a projection's
        output (q or k of a fused qkv)."""
        return ops.rms_norm_(x, self.weight, self.eps, self.gemma)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the stored weight is an offset from 1, and the product is taken in
    float32 before rounding to the model's dtype (Llama rounds first)."""
    gemma = True


def norm_class(config: ModelConfig) -> type[RMSNorm]:
    return GemmaRMSNorm if config.gemma_norms else RMSNorm


def linear_quant(config: ModelConfig, prefix: str, parts: tuple[str, ...]) -> LinearQuant | None:
    """How the linear layer fusing the checkpoint's modules `parts` under `prefix` is
    quantized: FP8 (batchinfer.model.quantization) or None."""
    if config.quantization is None:
        return None
    return config.quantization.linear_quant([f"{prefix}.{part}" for part in parts])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: LayerConfig, backend, prefix: str):
        super().__init__()
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          config.qkv_bias,
                                          linear_quant(config, prefix, _stored_parts(config, "qkv_proj")))
        # this rank's (a KV head may be replicated on several ranks)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=config.o_proj_bias,
                                        quant=linear_quant(config, prefix, ("o_proj",)))
        norm = norm_class(config)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.sliding_window = layer.sliding_window
        self.softcap = config.attn_softcap
        # gpt-oss: a logit per query head (this rank's) added to each softmax's denominator
        self.sinks = None
        if config.attention_sinks:
            if getattr(backend, "name", "torch") != "torch":
                raise ValueError(f"{config.architecture}'s attention sinks are not implemented "
                                 f"in the {backend.name} attention backend; use "
                                 "attention_backend='torch'")
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        # partial rotary embeddings: q and k heads are stored with their dimensions reordered
        self.rotary_order = partial_rotary_order(
            rotary_dim(config.rope[layer.rope], self.head_dim), self.head_dim)
        self.backend = backend
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # an FP8 KV cache's scales (batchinfer.model.kv_scales; kernels/fp8.py): it stores
        # k / k_scale and v / v_scale
        self.k_scale = self.v_scale = 1.0

    def load_shard(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int) -> None:
        """The sinks of this rank's query heads."""
        if loaded.shape[0] != self.num_heads * TensorParallel.size:
            raise ValueError(f"has shape {list(loaded.shape)}, expected "
                             f"[{self.num_heads * TensorParallel.size}]")
        param.data.copy_(_shard(loaded, 0).read())

    def cache_layout(self) -> tuple[int, int, int]:
        """(caches per layer, heads, dim): a key and a value cache of this rank's KV heads."""
        return 2, self.num_kv_heads, self.head_dim

    @torch.no_grad()
    def reorder_rotary_dims(self) -> None:
        """Store the q and k heads' dimensions in rotary_order (see rope.partial_rotary_order);
        once, after the weights are loaded."""
        if self.rotary_order is None:
            return
        order = torch.tensor(self.rotary_order, device=self.qkv_proj.weight.device)
        heads = self.num_heads + self.num_kv_heads
        rows = (torch.arange(heads, device=order.device)[:, None] * self.head_dim + order).flatten()
        for param in (self.qkv_proj.weight, self.qkv_proj.bias,
                      getattr(self.qkv_proj, "weight_scale", None)):
            if param is not None:  # rows of q, then k; v's stay
                # FP8 rows moved as bytes (indexing float8 tensors is not on every device)
                data = param.data.view(torch.uint8) if param.dtype == fp8.FP8 else param.data
                data[:len(rows)] = data[rows]
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.weight.data = norm.weight.data[order]

    def forward(self, rope, hidden, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head, in place (qkv is this call's own)
            self.q_norm.forward_(qk[:, :self.num_heads])
            self.k_norm.forward_(qk[:, self.num_heads:])
        # k and v come back None where they were written to the cache with the rotation
        q, k, v = ops.rope_and_cache(qk, v, *rope, self.num_heads, meta.slot_mapping, kv_cache,
                                     self.k_scale, self.v_scale)
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   self.sliding_window, self.k_scale, self.v_scale,
                                   self.softcap, **extra)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [inter, inter],
            quant=linear_quant(config, prefix, _stored_parts(config, "gate_up_proj")))
        self.down_proj = RowParallelLinear(inter, config.hidden_size,
                                           quant=linear_quant(config, prefix, ("down_proj",)))
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {config.hidden_act!r} is not supported; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        self.act = config.hidden_act
        self.packed_halves = None  # gate and up in oneDNN's layout, once pack_weights() ran

    def pack_weights(self, batch_hint: int) -> None:
        if self.packed_halves is not None or self.gate_up_proj.quant is not None:
            return
        weight = self.gate_up_proj.weight
        half = weight.shape[0] // 2
        self.packed_halves = (cpu_linear.pack(weight[:half], batch_hint),
                              cpu_linear.pack(weight[half:], batch_hint))
        self.gate_up_proj.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two products on the fused weight's halves give contiguous outputs; silu and mul
        # on strided halves of one product cost more than the products themselves on CPU
        if self.packed_halves is not None:
            gate, up = (cpu_linear.linear(x, w) for w in self.packed_halves)
        elif self.gate_up_proj.quant is not None:
            proj = self.gate_up_proj
            half = proj.weight.shape[0] // 2
            gate, up = (fp8.linear(x, proj.weight[rows], proj.weight_scale[rows], proj.group_size,
                                   None, proj.input_scale, proj.scale_ub)
                        for rows in (slice(0, half), slice(half, None)))
        else:
            weight = self.gate_up_proj.weight
            half = weight.shape[0] // 2
            gate, up = F.linear(x, weight[:half]), F.linear(x, weight[half:])
        return self.down_proj(ops.act_mul_(gate, up, self.act))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: LayerConfig, backend, prefix: str):
        super().__init__()
        if config.mla is not None:
            self.self_attn = MLAttention(config, layer, norm_class(config), f"{prefix}.self_attn")
        else:
            self.self_attn = Attention(config, layer, backend, f"{prefix}.self_attn")
        if layer.moe:
            moe, shared = config.moe, None
            if moe.num_shared_experts:
                shared = MLP(config, f"{prefix}.mlp.shared_experts",
                             moe.intermediate_size * moe.num_shared_experts)
            self.mlp = moe_block(config, f"{prefix}.mlp", shared)
        else:
            self.mlp = MLP(config, f"{prefix}.mlp")
        norm = norm_class(config)
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.rope_key = layer.rope

    def forward(self, rope, hidden, residual, meta, kv_cache):
        """(hidden, residual) -> the next pair: the stream is residual + hidden, each add
        done inside the next norm (the first layer gets residual None)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2's and 3's layer: the attention and MLP outputs are normed again before each
    residual add, and the MLP input has a norm of its own."""

    def __init__(self, config: ModelConfig, layer: LayerConfig, backend, prefix: str):
        super().__init__(config, layer, backend, prefix)
        norm = norm_class(config)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, meta, kv_cache):
        residual = hidden if residual is None else residual + hidden
        hidden = self.self_attn(rope, self.input_layernorm(residual), meta, kv_cache)
        residual = residual + self.post_attention_layernorm(hidden)
        hidden = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(hidden), residual


class OtherStage(nn.Module):
    """The place of a decoder layer that another pipeline stage holds."""


class DecoderModel(nn.Module):
    """The decoder layers of this pipeline stage (stage_layers; all of them without
    pipeline parallelism), the embedding on the first stage and the final norm on the
    last. The others' layers are OtherStage placeholders, so names keep their indices."""

    def __init__(self, config: ModelConfig, backend, dtype: torch.dtype,
                 max_position: int | None = None):
        super().__init__()
        self.stage = stage_layers(config.num_hidden_layers, PipelineParallel.size,
                                  PipelineParallel.rank)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if PipelineParallel.is_first() else None)
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the model's dtype
        self.embed_scale = config.embed_scale
        layer_class = SandwichDecoderLayer if config.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(
            layer_class(config, layer, backend, f"model.layers.{i}") if i in self.stage
            else OtherStage() for i, layer in enumerate(config.layers))
        self.norm = (norm_class(config)(config.hidden_size, config.rms_norm_eps)
                     if PipelineParallel.is_last() else None)
        # one table for all layers, or one per layer type where each has its own settings,
        # as long as the run's context (max_model_len), not the config's largest
        positions = max_position or config.max_position_embeddings
        self.rotary = nn.ModuleDict({
            key: RotaryEmbedding(config.head_dim, positions, params, dtype)
            for key, params in config.rope.items()})

    @property
    def stage_layers(self) -> list[DecoderLayer]:
        return [self.layers[i] for i in self.stage]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden


class CausalLM(nn.Module):
    """forward() returns final hidden states; compute_logits() applies the LM head to the
    rows that sample (float32 logits, or the model's dtype with float32=False). Under
    pipeline parallelism a stage runs its own layers: forward() takes the previous stage's
    (hidden, residual) and, but on the last stage, returns its own pair."""

    def __init__(self, config: ModelConfig, backend, dtype: torch.dtype,
                 max_position: int | None = None):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, backend, dtype, max_position)
        self.tie_word_embeddings = config.tie_word_embeddings
        self.logit_softcap = config.logit_softcap
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size)
                        if PipelineParallel.is_last() else None)
        if self.tie_word_embeddings and self.lm_head is not None \
                and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.tied = True

    @property
    def graph_safe(self) -> bool:
        """Whether a forward pass can be captured in a CUDA graph: not where MoE blocks
        loop over their experts, reading the counts on the host, nor with multi-head
        latent attention (a loop over the sequences)."""
        if self.config.mla is not None:
            return False
        probe = next(self.parameters())
        return all(layer.mlp.fused(probe) for layer in self.model.stage_layers
                   if isinstance(layer.mlp, SparseMoE))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """kv_caches: this stage's layers' caches, in order. intermediate: the previous
        stage's (hidden, residual), on every stage but the first."""
        if intermediate is None:
            hidden, residual = self.model.embed(input_ids), None
        else:
            hidden, residual = intermediate
        ropes = {key: table.lookup(positions) for key, table in self.model.rotary.items()}
        for layer, kv_cache in zip(self.model.stage_layers, kv_caches):
            hidden, residual = layer(ropes[layer.rope_key], hidden, residual, meta, kv_cache)
        if self.model.norm is None:
            return hidden, residual
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logit_softcap is not None:  # in the model's dtype, as transformers does
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float() if float32 else logits

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy checkpoint tensors (HF names) into this rank's parameters, reading only the
        parts of each that this rank holds."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        if self.config.mla is not None:  # its q_proj is a layer of its own
            del fused["q_proj"], fused["k_proj"], fused["v_proj"]
        experts: dict[str, SparseMoE] = {}
        mxfp4_parts: dict[str, dict[str, CheckpointTensor]] = {}  # blocks or scales seen
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            name = self.stage_name(name)
            if name is None:  # another pipeline stage's
                continue
            name = mixtral_name(name).replace(".mlp.router.", ".mlp.gate.")  # gpt-oss's
            fused_expert = FUSED_EXPERT_TENSOR.fullmatch(name)
            expert = fused_expert or EXPERT_TENSOR.fullmatch(name)
            if expert is not None:  # an MoE block's, per expert or all experts fused
                block = self.get_submodule(expert.group(1))
                if not isinstance(block, SparseMoE):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                try:
                    if fused_expert is None:
                        block.load_expert(int(expert.group(2)), expert.group(3), tensor,
                                          expert.group(4).removesuffix("_inv"))
                    else:
                        projection, suffix = expert.group(2), expert.group(3)
                        if suffix in ("_blocks", "_scales"):  # MXFP4: dequantized once both read
                            packed = mxfp4_parts.setdefault(name.removesuffix(suffix), {})
                            packed[suffix] = tensor
                            if len(packed) < 2:
                                continue
                            tensor = mxfp4.dequantize(packed["_blocks"].read(),
                                                      packed["_scales"].read(), block.w2.dtype)
                            suffix = ""
                        block.load_fused_experts(projection, suffix, tensor)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r} {e}") from None
                experts[expert.group(1)] = block
                loaded.update(f"{expert.group(1)}.{p}" for p, _ in block.named_parameters()
                              if not p.startswith(("gate.", "shared_experts.")))
                continue
            shard_id = None  # a part of a fused parameter, or (None) a whole parameter
            parts = name.split(".")
            if parts[-1] == "weight_scale_inv":  # block scales of fp8 checkpoints (multipliers)
                parts[-1] = "weight_scale"
            if len(parts) >= 2 and parts[-2] in fused:
                parts[-2], shard_id = fused[parts[-2]]
            name = ".".join(parts)
            owner_name = name.rsplit(".", 1)[0]
            # an FP8 layer's (its weight keeps its dtype, and so does a float32 router's)
            quant = (getattr(params.get(owner_name + ".weight"), "keep_dtype", False)
                     and getattr(self.get_submodule(owner_name), "quant", None) is not None)
            if quant and parts[-1] in ("input_scale", "input_scale_ub") and name not in params:
                continue  # dynamic activations here: the static scale (bound) is not used
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[name]
            owner = self.get_submodule(owner_name)
            # the owner reads its part into the parameter's dtype (FP8 layers' as stored)
            try:
                if shard_id is None and isinstance(owner, ColumnParallelLinear) \
                        and len(owner.output_sizes) > 1:
                    # stored fused (Phi-3's qkv_proj and gate_up_proj): each part split apart
                    owner.load_fused(param, tensor)
                elif hasattr(owner, "load_shard"):
                    owner.load_shard(param, tensor, shard_id or 0)
                else:
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(f"has shape {list(tensor.shape)}, expected "
                                         f"{list(param.shape)}")
                    param.data.copy_(tensor.read())
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from None
            loaded.add(name)
            if quant and owner.quant.online and parts[-1] == "weight":
                loaded.add(owner_name + ".weight_scale")  # made from the weight
        tied = self.lm_head is not None and self.lm_head.tied
        expected = {n for n in params if not (tied and n == "lm_head.weight")}
        missing = sorted(expected - loaded)
        missing += [f"{name}: {what}" for name, block in experts.items()
                    for what in block.missing_experts()]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        for layer in self.model.stage_layers:
            layer.self_attn.reorder_rotary_dims()

    def stage_name(self, name: str) -> str | None:
        """A checkpoint tensor's name here, or None where another pipeline stage holds it:
        another stage's layers, the embedding off the first stage (the last stage's LM
        head reads a tied table), the final norm and LM head off the last."""
        if name.startswith("model.layers."):
            index = int(name.split(".", 3)[2])
            return name if index in self.model.stage else None
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            tied_head = self.tie_word_embeddings and self.lm_head is not None
            return name.replace("model.embed_tokens.", "lm_head.") if tied_head else None
        if name.startswith("model.norm."):
            return name if self.model.norm is not None else None
        if name.startswith("lm_head."):
            return name if self.lm_head is not None else None
        return name


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# the checkpoint modules our fused layers hold, where the checkpoint stores them apart
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _stored_parts(config: ModelConfig, fused: str) -> tuple[str, ...]:
    """The checkpoint's modules for a fused layer (Phi-3 stores them fused)."""
    return (fused,) if config.architecture == "Phi3ForCausalLM" else _PARTS[fused]
