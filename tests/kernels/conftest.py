"""Synthetic paged batches for the kernel tests (tests/conftest.py turns on the Triton
interpreter when there is no CUDA, before any kernel module is imported)."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from batchinfer.attention.metadata import AttentionMetadata
from batchinfer.kernels import cpu

# On a CUDA machine the kernels run compiled on the GPU, elsewhere under the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_batch(seq_lens: list[int], query_lens: list[int], *, block_size: int,
                num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
                seed: int = 0, cache_dtype: torch.dtype | None = None,
                device: torch.device = DEVICE) -> SimpleNamespace:
    """A batch whose sequence i has seq_lens[i] tokens of context, the last query_lens[i] new.

    Blocks are handed out in shuffled order; every cache slot outside a context holds NaN
    (block 0, the block-table padding, included), so a kernel that reads past a mask fails.
    The cache already holds the whole context; key/value are the new tokens' K/V again, and
    slot_mapping says where they go.
    """
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    keys, values, slots = [], [], []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        ids = [order.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
        for p in range(n):
            k_cache[ids[p // block_size], p % block_size] = k[p]
            v_cache[ids[p // block_size], p % block_size] = v[p]
            if p >= n - q:
                slots.append(ids[p // block_size] * block_size + p % block_size)
        keys.append(k[n - q:])
        values.append(v[n - q:])
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_decode = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        num_decode_seqs=num_decode, block_size=block_size,
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))
    return SimpleNamespace(query=query.to(device), key=torch.cat(keys).to(device, dtype),
                           value=torch.cat(values).to(device, dtype), k_cache=k_cache.to(device),
                           v_cache=v_cache.to(device), meta=meta)


@pytest.fixture
def paged_batch():
    """build_batch on the test device (fixtures are how pytest shares helpers between modules)."""
    return functools.partial(build_batch, device=DEVICE)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def model_dtype_logits(monkeypatch):
    """kept(llm): the float32 flag of every compute_logits call llm's model makes from now
    on; widen(): from then on the sampler never takes the model's dtype (a float32 copy
    of every step's logits), for results to compare against."""
    from batchinfer.engine.sampler import Sampler

    def kept(llm) -> list[bool]:
        seen: list[bool] = []
        model = llm.llm_engine.model_runner.model
        compute = model.compute_logits
        monkeypatch.setattr(model, "compute_logits", lambda hidden, float32=True:
                            seen.append(float32) or compute(hidden, float32))
        return seen

    def widen() -> None:
        monkeypatch.setattr(Sampler, "takes_model_dtype",
                            staticmethod(lambda batch, device: False))
    return SimpleNamespace(kept=kept, widen=widen)


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """No kernel built or loaded in this process yet, and an empty cache root."""
    monkeypatch.setattr(cpu.build, "_built", {})
    monkeypatch.setattr(cpu.build, "_loaded", {})
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="session")
def built_or_skip():
    """For the C kernels on CPU: the library built from a wrapper module's SOURCE. A build's
    None skips the test only on a machine without gcc or libgomp; elsewhere a kernel that
    stops compiling must fail, not fall back quietly."""
    def check(module, what: str) -> Path:
        path = cpu.build.build(module.SOURCE)
        if path is None:
            assert shutil.which("gcc") is None or cpu.build.torch_openmp_runtime() is None, \
                f"gcc and torch's libgomp are here, yet {what} did not build"
            pytest.skip(f"no gcc or no libgomp here: {what} cannot be built")
        return path
    return check
