"""Tensor-parallel layers. With tensor_parallel_size 1 they are plain linears; the weight
loaders already cut each checkpoint tensor into this rank's shard, so sharding across ranks
only needs a process group and the all-reduce in RowParallelLinear / the embedding."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from batchinfer.model import cpu_linear


class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group = None       # the device collectives' group
    cpu_group = None   # gloo, for host-side agreements

    @classmethod
    def min_across_ranks(cls, n: int) -> int:
        """The smallest of every rank's n (rank-local sizing made to agree)."""
        if cls.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cls.cpu_group)
        return int(t.item())

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


def _shard(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    size = tensor.shape[dim] // TensorParallel.size
    return tensor.narrow(dim, TensorParallel.rank * size, size)


def _check_divisible(n: int, what: str) -> None:
    if n % TensorParallel.size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({TensorParallel.size})")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks. `output_sizes` lists the
    logical sub-matrices fused into this one (e.g. gate and up), each split separately."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        for n in output_sizes:
            _check_divisible(n, "output size")
        self.output_sizes = [n // TensorParallel.size for n in output_sizes]
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.packed = None  # the weight in oneDNN's layout, once pack_weights() ran

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        param.data[offset:offset + size].copy_(_shard(loaded, 0))

    def load_fused(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Load a checkpoint tensor that holds every part at once, one after another."""
        full = [n * TensorParallel.size for n in self.output_sizes]
        if loaded.shape[0] != sum(full):
            raise ValueError(f"fused checkpoint tensor has {loaded.shape[0]} rows, expected "
                             f"{sum(full)} ({' + '.join(map(str, full))})")
        for shard_id, part in enumerate(loaded.split(full, dim=0)):
            self.load_shard(param, part, shard_id)

    def pack_weights(self, batch_hint: int) -> None:
        if self.packed is None and self.weight is not None:  # (None: the MLP packed it)
            self.packed = cpu_linear.pack(self.weight, batch_hint)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.apply(x, self.weight, self.packed, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; each rank holds its query heads and their KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        _check_divisible(num_heads, "num_attention_heads")
        _check_divisible(num_kv_heads, "num_key_value_heads")
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias)

    SHARDS = {"q": 0, "k": 1, "v": 2}


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks, summed by all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        _check_divisible(input_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, input_size // TensorParallel.size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.packed = None

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        param.data.copy_(_shard(loaded, 1) if param is self.weight else loaded)

    def pack_weights(self, batch_hint: int) -> None:
        if self.packed is None:
            self.packed = cpu_linear.pack(self.weight, batch_hint)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = TensorParallel.all_reduce(cpu_linear.apply(x, self.weight, self.packed))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rows outside this rank's range read as 0
    and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // TensorParallel.size)
        self.start = TensorParallel.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        rows = loaded[self.start:self.start + self.shard_size]
        param.data.zero_()
        param.data[:rows.shape[0]].copy_(rows)

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
