"""Multi-head latent attention (DeepSeek-V3) over a latent paged KV cache, in PyTorch.

Each token's cache row holds kv_lora_rank normed latent values c and qk_rope_head_dim
rotated key values k_pe, shared by every head ([num_blocks, block_size, 1, latent_dim] per
layer). Keys and values are never expanded: with kv_b_proj's weight split per head into
W_UK [nope, kv_lora_rank] and W_UV [v_head_dim, kv_lora_rank],

    score = (q_nope W_UK) . c + q_pe . k_pe        out = (softmax(score) c) W_UV^T

which equals attention over k = [c W_UK^T, k_pe] and v = c W_UV^T. Scores and softmax
are float32. Under tensor parallelism each rank holds its share of the heads (their rows
of q_b_proj or q_proj and kv_b_proj, their columns of o_proj, summed by its all-reduce);
q_a_proj, kv_a_proj_with_mqa, the latent norms and the latent cache are the same on every
rank. In an FP8 checkpoint every projection stays FP8 but kv_b_proj, which is
dequantized to the model's dtype as it loads (its weight is only used split per head).
Each sequence's context is gathered from the cache through its block table, one sequence
at a time (the model is not captured in CUDA graphs).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from batchinfer.attention import AttentionMetadata
from batchinfer.model import fp8
from batchinfer.model.config import LayerConfig, ModelConfig
from batchinfer.model.parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                       _check_divisible, _fp8_parameter, _parameter)
from batchinfer.model.quantization import LinearQuant
from batchinfer.model.rope import apply_rotary

# transformers' DeepseekV3RMSNorm default, which the q and kv latent norms keep
LATENT_NORM_EPS = 1e-6


class Weight(nn.Module):
    """A weight used in products of its own (never packed for the CPU), in the model's
    dtype: this rank's `shard` (first row, rows) of the checkpoint's `rows`. With `quant`
    (an FP8 checkpoint's layer) the checkpoint's FP8 rows and its scale wait for each
    other, then the weight they stand for is stored and the scale dropped."""

    def __init__(self, rows: int, cols: int, shard: tuple[int, int],
                 quant: LinearQuant | None = None):
        super().__init__()
        self.full_rows, self.shard = rows, shard
        rows = shard[1]
        self.weight = _parameter(torch.empty(rows, cols))
        self.weight_scale = None
        if quant is not None and not quant.online:
            self.block = quant.block
            self.group_size = quant.block[1] if quant.block else cols
            self.weight_scale = _fp8_parameter(
                torch.ones(rows, fp8.num_groups(cols, self.group_size), dtype=torch.float32))
        self._fp8_weight: torch.Tensor | None = None
        self._scale_loaded = False

    def load_shard(self, param: nn.Parameter, loaded, shard_id: int = 0) -> None:
        if param is self.weight:
            full = [self.full_rows, param.shape[1]]
            if list(loaded.shape) != full:
                raise ValueError(f"has shape {list(loaded.shape)}, expected {full}")
            rows = loaded.narrow(0, *self.shard).read()
            if rows.dtype != fp8.FP8:
                param.data.copy_(rows)
                return
            if self.weight_scale is None:
                raise ValueError("is float8_e4m3fn, but the checkpoint's quantization_config "
                                 "leaves this layer unquantized")
            self._fp8_weight = rows
        else:
            scale = fp8.rows_from_checkpoint(loaded.read(), self.full_rows, self.block,
                                             param.shape[1])
            param.data.copy_(scale.narrow(0, *self.shard))
            self._scale_loaded = True
        if self._fp8_weight is not None and self._scale_loaded:
            self.weight.data.copy_(fp8.dequantize(self._fp8_weight, self.weight_scale,
                                                  self.group_size, self.weight.dtype))
            self._fp8_weight, self.weight_scale = None, None


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: LayerConfig, norm: type[nn.Module],
                 prefix: str):
        super().__init__()
        mla = config.mla
        _check_divisible(config.num_attention_heads, "num_attention_heads")
        heads = config.num_attention_heads
        self.num_heads = heads // TensorParallel.size  # this rank's
        self.nope, self.rope_dim, self.v_dim = (mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                                mla.v_head_dim)
        self.kv_lora_rank = mla.kv_lora_rank
        self.latent_dim = mla.latent_dim
        self.rope_interleave = mla.rope_interleave
        self.scale = config.attention_scale
        hidden, q_out = config.hidden_size, heads * (self.nope + self.rope_dim)

        def quant(name: str) -> LinearQuant | None:
            if config.quantization is None:
                return None
            return config.quantization.linear_quant([f"{prefix}.{name}"])

        if mla.q_lora_rank is None:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = ColumnParallelLinear(hidden, [q_out], quant=quant("q_proj"))
        else:
            self.q_proj = None
            self.q_a_proj = ColumnParallelLinear(hidden, [mla.q_lora_rank], config.qkv_bias,
                                                 quant("q_a_proj"),
                                                 shards=[(0, mla.q_lora_rank)])
            self.q_a_layernorm = norm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [q_out],
                                                 quant=quant("q_b_proj"))
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, [self.latent_dim],
                                                       config.qkv_bias,
                                                       quant("kv_a_proj_with_mqa"),
                                                       shards=[(0, self.latent_dim)])
        self.kv_a_layernorm = norm(self.kv_lora_rank, LATENT_NORM_EPS)
        kv_b_rows = self.num_heads * (self.nope + self.v_dim)
        self.kv_b_proj = Weight(heads * (self.nope + self.v_dim), self.kv_lora_rank,
                                (TensorParallel.rank * kv_b_rows, kv_b_rows),
                                quant("kv_b_proj"))
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden,
                                        bias=config.o_proj_bias, quant=quant("o_proj"))

    def cache_layout(self) -> tuple[int, int, int]:
        """(caches per layer, heads, dim): one latent row per token."""
        return 1, 1, self.latent_dim

    @torch.no_grad()
    def reorder_rotary_dims(self) -> None:
        """DeepSeek's rotated dimensions come as interleaved pairs (x0, x1), (x2, x3), ...;
        store the projections' rows for them evens first, then odds, so that the
        rotate-halves rotation gives what transformers' interleaved one gives (in the
        order it returns). Once, after the weights are loaded."""
        if not self.rope_interleave:
            return
        order = torch.cat((torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)))
        q_proj = self.q_proj if self.q_proj is not None else self.q_b_proj
        head = self.nope + self.rope_dim
        q_rows = (torch.arange(self.num_heads)[:, None] * head + self.nope + order).flatten()
        kv_rows = self.kv_lora_rank + order
        for proj, rows in ((q_proj, q_rows), (self.kv_a_proj_with_mqa, kv_rows)):
            for param in (proj.weight, proj.bias, getattr(proj, "weight_scale", None)):
                if param is not None:
                    rows = rows.to(param.device)
                    # FP8 rows moved as bytes (indexing float8 tensors is not on every device)
                    data = param.data.view(torch.uint8) if param.dtype == fp8.FP8 else param.data
                    data[rows.sort().values] = data[rows]

    def forward(self, rope, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([self.nope, self.rope_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], -1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe = apply_rotary(q_pe, *rope)
        k_pe = apply_rotary(k_pe[:, None], *rope)[:, 0]
        cache = kv_cache[0].view(-1, self.latent_dim)
        cache[meta.slot_mapping] = torch.cat((c, k_pe), dim=-1).to(cache.dtype)

        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, -1)
        w_uk, w_uv = w_kv[:, :self.nope], w_kv[:, self.nope:]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        out_latent = torch.empty_like(q_latent)
        for start, end, slots, mask in _sequences(meta, cache.device):
            context = cache[slots].to(q_latent.dtype)
            c_ctx, pe_ctx = context.split([self.kv_lora_rank, self.rope_dim], -1)
            scores = (torch.einsum("nhr,lr->hnl", q_latent[start:end], c_ctx)
                      + torch.einsum("nhp,lp->hnl", q_pe[start:end], pe_ctx)).float()
            scores = scores * self.scale
            if mask is not None:
                scores.masked_fill_(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(c_ctx.dtype)
            out_latent[start:end] = torch.einsum("hnl,lr->nhr", probs, c_ctx)
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))


def _sequences(meta: AttentionMetadata, device: torch.device):
    """Per sequence of the step: (first query row, end row, its context's cache slots,
    the causal mask [queries, context] or None for one query). Made once a step and
    kept in meta.cache for every layer."""
    found = meta.cache.get("mla_sequences")
    if found is not None:
        return found
    qsl, seq_lens, bs = meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_size
    tables = meta.host_block_tables()
    found = []
    for i, length in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        positions = np.arange(length)
        slots = tables[i, positions // bs].astype(np.int64) * bs + positions % bs
        mask = None
        if end - start > 1:
            query_pos = np.arange(length - (end - start), length)
            mask = torch.from_numpy(positions[None, :] > query_pos[:, None]).to(device)
        found.append((start, end, torch.from_numpy(slots).to(device), mask))
    meta.cache["mla_sequences"] = found
    return found
