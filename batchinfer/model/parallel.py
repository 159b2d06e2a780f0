"""Tensor-parallel layers, and this process's place in the tensor- and pipeline-parallel
groups. With tensor_parallel_size 1 the layers are plain linears; the weight loaders read
just this rank's shard of each checkpoint tensor (its rows or columns, as
batchinfer.model.weights.CheckpointTensor), so sharding across ranks only needs a process
group and the all-reduce in RowParallelLinear / the embedding. Pipeline stages hold a
contiguous range of the decoder layers (stage_layers)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from batchinfer.model import cpu_linear, fp8
from batchinfer.model.quantization import LinearQuant
from batchinfer.model.weights import CheckpointTensor


class TensorParallel:
    """This process's place in its tensor-parallel group (the ranks of its pipeline stage)."""

    rank: int = 0
    size: int = 1
    group = None       # the device collectives' group
    cpu_group = None   # gloo over every rank of every stage, for host-side agreements

    @classmethod
    def min_across_ranks(cls, n: int) -> int:
        """The smallest of every rank's n, over all stages (rank-local sizing made to
        agree)."""
        if cls.cpu_group is None:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cls.cpu_group)
        return int(t.item())

    @classmethod
    def warm_up(cls, device: torch.device) -> None:
        """One all-reduce on the group (every rank calls it): NCCL creates its communicator
        on the first collective, which must not happen inside a CUDA graph's capture."""
        if cls.size > 1:
            cls.all_reduce(torch.zeros(1, device=device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    @classmethod
    def all_reduce(cls, x: torch.Tensor) -> torch.Tensor:
        if cls.size > 1:
            dist.all_reduce(x, group=cls.group)
        return x

    @classmethod
    def all_gather_last_dim(cls, x: torch.Tensor) -> torch.Tensor:
        if cls.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(cls.size)]
        dist.all_gather(parts, x.contiguous(), group=cls.group)
        return torch.cat(parts, dim=-1)


class PipelineParallel:
    """This process's pipeline stage. Global rank = stage * tensor_parallel_size + tensor-
    parallel rank; a stage sends its hidden states to the same tensor-parallel rank of the
    next stage (point to point over the world group)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def is_first(cls) -> bool:
        return cls.rank == 0

    @classmethod
    def is_last(cls) -> bool:
        return cls.rank == cls.size - 1

    @classmethod
    def peer(cls, stage: int) -> int:
        """The global rank of this tensor-parallel rank's counterpart in `stage`."""
        return stage * TensorParallel.size + TensorParallel.rank


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers a pipeline stage holds: an even split, the later stages taking
    one more where it does not divide (the first stage also embeds, the last also holds
    the LM head and samples)."""
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {stages} exceeds the model's "
                         f"{num_layers} layers")
    base, extra = divmod(num_layers, stages)
    start = stage * base + max(0, stage - (stages - extra))
    return range(start, start + base + (stage >= stages - extra))


def _rank_share(n: int) -> tuple[int, int]:
    """(first, count) of this rank's equal share of n rows or columns."""
    size = n // TensorParallel.size
    return TensorParallel.rank * size, size


def _shard(tensor: torch.Tensor | CheckpointTensor, dim: int) -> torch.Tensor | CheckpointTensor:
    """This rank's share of a torch.Tensor or a CheckpointTensor along dim (not read)."""
    return tensor.narrow(dim, *_rank_share(tensor.shape[dim]))


def _check_divisible(n: int, what: str) -> None:
    if n % TensorParallel.size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({TensorParallel.size})")


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _fp8_parameter(tensor: torch.Tensor) -> nn.Parameter:
    """A parameter that keeps its dtype (FP8 weights, float32 scales) when the model is
    cast to its dtype (batchinfer.model.loader.build_model)."""
    param = _parameter(tensor)
    param.keep_dtype = True
    return param


class _Fp8Weights:
    """FP8 weight, scales and products for the parallel linears (batchinfer.model.fp8):
    `weight` [out, in] in float8_e4m3fn, `weight_scale` [out, groups] in float32, and a
    static `input_scale` where the checkpoint has one (GPU FP8 products use it)."""

    quant: LinearQuant | None = None

    def _init_fp8(self, quant: LinearQuant, rows: int, cols: int, full_cols: int) -> None:
        self.quant = quant
        self.group_size = quant.block[1] if quant.block else cols
        if quant.block and cols != full_cols and cols % quant.block[1]:
            raise ValueError(f"tensor_parallel_size {TensorParallel.size} cuts {full_cols} "
                             f"input features into {cols}, not a multiple of the checkpoint's "
                             f"{quant.block[1]}-wide scale blocks; use a tensor_parallel_size "
                             "that does")
        self.full_groups = fp8.num_groups(full_cols, quant.block[1]) if quant.block else 1
        self.weight = _fp8_parameter(torch.empty(rows, cols, dtype=fp8.FP8))
        self.weight_scale = _fp8_parameter(
            torch.ones(rows, fp8.num_groups(cols, self.group_size), dtype=torch.float32))
        self.input_scale = (_fp8_parameter(torch.zeros((), dtype=torch.float32))
                            if quant.static_activations else None)
        # fbgemm_fp8's bound on dynamic activation scales: a tensor on the layer's device,
        # made once (a CUDA graph's capture cannot copy a host value in)
        ub = None
        if quant.activation_scale_ub is not None:
            ub = torch.tensor([quant.activation_scale_ub], dtype=torch.float32)
            ub.keep_dtype = True
        self.register_buffer("scale_ub", ub, persistent=False)

    def _fp8_rows(self, loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(FP8 rows, their [rows, 1] scales when quantized here) of a checkpoint weight."""
        if loaded.dtype == fp8.FP8:
            return loaded, None
        if self.quant.online:
            return fp8.quantize_rows(loaded)
        raise ValueError(f"is {loaded.dtype}, expected float8_e4m3fn (the checkpoint's "
                         "quantization_config says this layer is FP8)")

    def _scale_rows(self, loaded: torch.Tensor, rows: int) -> torch.Tensor:
        """A checkpoint scale for a weight of `rows` full (unsharded) rows, one row of
        full_groups scales per weight row."""
        return fp8.rows_from_checkpoint(loaded, rows, self.quant.block, self.full_groups)

    def _load_input_scale(self, loaded: torch.Tensor) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"has shape {list(loaded.shape)}, expected a single scale")
        # fused parts each have one: the largest covers them all
        self.input_scale.data = torch.maximum(self.input_scale.data,
                                              loaded.reshape(()).to(torch.float32))

    def _fp8_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8.linear(x, self.weight, self.weight_scale, self.group_size, bias,
                          self.input_scale, self.scale_ub)


class ColumnParallelLinear(_Fp8Weights, nn.Module):
    """y = x W^T + b with W's output rows split across ranks. `output_sizes` lists the
    logical sub-matrices fused into this one (e.g. gate and up), each split separately:
    this rank holds rows first to first + count of each, its `shards` (by default its equal
    share). With `quant`, W is FP8 (_Fp8Weights)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant: LinearQuant | None = None,
                 shards: list[tuple[int, int]] | None = None):
        super().__init__()
        if shards is None:
            for n in output_sizes:
                _check_divisible(n, "output size")
            shards = [_rank_share(n) for n in output_sizes]
        self.full_sizes = list(output_sizes)
        self.shards = shards
        self.output_sizes = [count for _, count in shards]
        out = sum(self.output_sizes)
        if quant is None:
            self.weight = _parameter(torch.empty(out, input_size))
        else:
            self._init_fp8(quant, out, input_size, input_size)
        self.bias = _parameter(torch.empty(out)) if bias else None
        self.packed = None  # the weight in oneDNN's layout, once pack_weights() ran

    def _rows(self, shard_id: int) -> slice:
        """Where part shard_id's rows are in this rank's weight."""
        offset = sum(self.output_sizes[:shard_id])
        return slice(offset, offset + self.output_sizes[shard_id])

    def load_shard(self, param: nn.Parameter, loaded: CheckpointTensor,
                   shard_id: int = 0) -> None:
        """Part shard_id's rows of this rank, read from the checkpoint's tensor of the part
        (its scale, a weight's rows, is read whole and cut here)."""
        first, count = self.shards[shard_id]
        rows = self._rows(shard_id)
        if self.quant is not None and param is self.weight_scale:
            scale = self._scale_rows(loaded.read(), self.full_sizes[shard_id])
            param.data[rows].copy_(scale[first:first + count])
        elif self.quant is not None and param is self.input_scale:
            self._load_input_scale(loaded.read())
        else:
            if loaded.shape[0] != self.full_sizes[shard_id]:
                raise ValueError(f"has {loaded.shape[0]} rows, expected "
                                 f"{self.full_sizes[shard_id]}")
            part = loaded.narrow(0, first, count).read()
            if self.quant is None or param is self.bias:
                param.data[rows].copy_(part)
            else:
                weight, scale = self._fp8_rows(part)
                param.data[rows].copy_(weight)
                if scale is not None:
                    self.weight_scale.data[rows] = scale

    def load_fused(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """Load a checkpoint tensor that holds every part at once, one after another."""
        full = self.full_sizes
        if self.quant is not None and param is self.input_scale:
            return self._load_input_scale(loaded.read())
        if self.quant is not None and param is self.weight_scale:
            # a scale of the fused weight: to rows first (a block may span two parts)
            scale_rows = self._scale_rows(loaded.read(), sum(full))
            for shard_id, part in enumerate(scale_rows.split(full, dim=0)):
                first, count = self.shards[shard_id]
                param.data[self._rows(shard_id)].copy_(part[first:first + count])
            return
        if loaded.shape[0] != sum(full):
            raise ValueError(f"has {loaded.shape[0]} rows, expected "
                             f"{sum(full)} ({' + '.join(map(str, full))})")
        start = 0
        for shard_id, n in enumerate(full):
            self.load_shard(param, loaded.narrow(0, start, n), shard_id)
            start += n

    def pack_weights(self, batch_hint: int) -> None:
        if self.quant is not None:  # FP8 weights run in their own products
            return
        if self.packed is None and self.weight is not None:  # (None: the MLP packed it)
            self.packed = cpu_linear.pack(self.weight, batch_hint)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self._fp8_product(x, self.bias)
        return cpu_linear.apply(x, self.weight, self.packed, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; each rank holds its query heads and the KV heads they
    use. With more ranks than KV heads, each KV head is held by num_kv_head_replicas ranks
    (rank r holds KV head r // num_kv_head_replicas), as in vLLM. num_heads and
    num_kv_heads are this rank's."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant: LinearQuant | None = None):
        tp, rank = TensorParallel.size, TensorParallel.rank
        _check_divisible(num_heads, "num_attention_heads")
        if tp <= num_kv_heads:
            _check_divisible(num_kv_heads, "num_key_value_heads")
        elif tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) neither divides nor is a multiple "
                             f"of num_key_value_heads ({num_kv_heads})")
        replicas = max(1, tp // num_kv_heads)
        q, kv = num_heads // tp * head_dim, max(1, num_kv_heads // tp) * head_dim
        kv_first = rank // replicas * kv
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias, quant,
                         shards=[(rank * q, q), (kv_first, kv), (kv_first, kv)])
        self.num_kv_head_replicas = replicas
        self.num_heads, self.num_kv_heads = q // head_dim, kv // head_dim

    SHARDS = {"q": 0, "k": 1, "v": 2}


class RowParallelLinear(_Fp8Weights, nn.Module):
    """y = x W^T + b with W's input columns split across ranks, summed by all-reduce.
    With `quant`, W is FP8 (_Fp8Weights); block scales are cut with their columns."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant: LinearQuant | None = None):
        super().__init__()
        _check_divisible(input_size, "input size")
        cols = input_size // TensorParallel.size
        if quant is None:
            self.weight = _parameter(torch.empty(output_size, cols))
        else:
            self._init_fp8(quant, output_size, cols, input_size)
        self.bias = _parameter(torch.empty(output_size)) if bias else None
        self.packed = None

    def load_shard(self, param: nn.Parameter, loaded: CheckpointTensor,
                   shard_id: int = 0) -> None:
        """This rank's columns of the weight (its scale and the bias are read whole)."""
        if param is self.bias:
            param.data.copy_(loaded.read())
        elif param is self.weight:
            cols = _shard(loaded, 1).read()
            rows, scale = (cols, None) if self.quant is None else self._fp8_rows(cols)
            param.data.copy_(rows)
            if scale is not None:
                self.weight_scale.data.copy_(scale)
        elif param is self.weight_scale:
            rows = self._scale_rows(loaded.read(), param.shape[0])
            groups = param.shape[1]
            if groups != self.full_groups:  # block scales: this rank's whole groups
                rows = rows[:, TensorParallel.rank * groups:(TensorParallel.rank + 1) * groups]
            param.data.copy_(rows)
        else:
            self._load_input_scale(loaded.read())

    def pack_weights(self, batch_hint: int) -> None:
        if self.packed is None and self.quant is None:
            self.packed = cpu_linear.pack(self.weight, batch_hint)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self._fp8_product(x, None)
        else:
            y = cpu_linear.apply(x, self.weight, self.packed)
        y = TensorParallel.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rows outside this rank's range read as 0
    and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // TensorParallel.size)
        self.start = TensorParallel.rank * self.shard_size
        self.weight = _parameter(torch.empty(self.shard_size, hidden_size))

    def load_shard(self, param: nn.Parameter, loaded: CheckpointTensor,
                   shard_id: int = 0) -> None:
        start = min(self.start, loaded.shape[0])
        rows = min(self.shard_size, loaded.shape[0] - start)
        param.data.zero_()
        param.data[:rows].copy_(loaded.narrow(0, start, rows).read())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if TensorParallel.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return TensorParallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    packed = None
    tied = False  # the weight is the input embedding's table, which stays in use

    def pack_weights(self, batch_hint: int) -> None:
        if self.packed is None:
            self.packed = cpu_linear.pack(self.weight, batch_hint)
            if not self.tied:
                self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_linear.apply(hidden, self.weight, self.packed)
        logits = TensorParallel.all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]
