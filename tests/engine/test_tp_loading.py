"""Splitting a model across tensor-parallel ranks: the splits refused before any process
starts, and loading, one rank at a time in this process (no group is needed to load): each
rank holds its query heads and the KV head they use (replicated when there are more ranks
than KV heads), and reads only its slices of the checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fp8_checkpoints
from batchinfer import LLM
from batchinfer.attention import get_attention_backend
from batchinfer.model import weights
from batchinfer.model.config import ModelConfig
from batchinfer.model.loader import load_model
from batchinfer.model.parallel import TensorParallel
from batchinfer.random_checkpoint import SHAPES, build_random_checkpoint


@pytest.mark.parametrize("heads, kv_heads, size, message", [
    (12, 4, 6, r"tensor_parallel_size 6 neither divides nor is a multiple of the model's "
               r"num_key_value_heads \(4\); use a divisor or a multiple of it"),
    (12, 4, 8, r"tensor_parallel_size 8 does not divide the model's num_attention_heads "
               r"\(12\); use a divisor of it"),
], ids=["kv-heads", "query-heads"])
def test_a_split_the_heads_do_not_allow_is_refused_before_starting(tmp_path, monkeypatch, heads,
                                                                   kv_heads, size, message):
    shape = {**SHAPES["test-llama"], "hidden_size": 96, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "head_dim": 16}
    path = build_random_checkpoint(tmp_path / "model", shape, weights=False)

    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started")
    monkeypatch.setattr("batchinfer.engine.engine.TensorParallelGroup", no_workers)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu", tensor_parallel_size=size)


def _load(path, rank: int, size: int, monkeypatch) -> tuple[torch.nn.Module, int]:
    """Rank `rank` of `size`'s model, and the bytes it read from the checkpoint."""
    from transformers import AutoConfig
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
    with monkeypatch.context() as m:
        m.setattr(TensorParallel, "rank", rank)
        m.setattr(TensorParallel, "size", size)
        before = weights.bytes_read
        model = load_model(path, config, get_attention_backend("torch", torch.device("cpu")),
                           torch.float32, torch.device("cpu"))
    return model, weights.bytes_read - before


def _checkpoint_bytes(path) -> int:
    return sum(t.shape.numel() * t.dtype.itemsize for file in path.glob("*.safetensors")
               for _, t in weights.file_tensors(file))


@pytest.mark.parametrize("fixture, form, size", [
    ("llama_kv1_dir", None, 2),
    ("llama_dir", None, 4),                                 # 2 KV heads, each on 2 ranks
    ("qwen2_kv1_dir", None, 2),                             # k and v biases
    ("phi4_mini_kv1_dir", None, 2),                         # fused qkv_proj, partial rotary
    ("llama_kv1_dir", "compressed-tensors-channel", 2),     # FP8 scale rows
    ("llama_kv1_dir", "fp8-block-32", 2),                   # FP8 32x32 block scales
])
def test_each_rank_holds_the_kv_head_its_query_heads_use(request, tmp_path, monkeypatch,
                                                         fixture, form, size):
    path = request.getfixturevalue(fixture)
    if form is not None:
        path = fp8_checkpoints.write_fp8(path, tmp_path / form, form)
    full, _ = _load(path, 0, 1, monkeypatch)
    attn = full.model.layers[0].self_attn
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    replicas = size // kv_heads
    read = 0
    for rank in range(size):
        part, read_by_rank = _load(path, rank, size, monkeypatch)
        read += read_by_rank
        kv = rank // replicas
        for whole, mine in zip(full.model.layers, part.model.layers):
            proj = mine.self_attn.qkv_proj
            assert (mine.self_attn.num_heads, mine.self_attn.num_kv_heads) == (heads // size, 1)
            assert proj.num_kv_head_replicas == replicas
            for name in ("weight", "bias", "weight_scale"):
                tensor = getattr(whole.self_attn.qkv_proj, name, None)
                if tensor is None:
                    continue
                q, k, v = tensor.split([heads * d, kv_heads * d, kv_heads * d])
                share = heads // size * d
                expected = torch.cat([q[rank * share:(rank + 1) * share],
                                      k[kv * d:(kv + 1) * d], v[kv * d:(kv + 1) * d]])
                assert torch.equal(getattr(proj, name).view(torch.uint8),
                                   expected.view(torch.uint8)), (rank, name)
            # per-head norms are per head_dim: the same on every rank
            if whole.self_attn.k_norm is not None:
                assert torch.equal(mine.self_attn.k_norm.weight, whole.self_attn.k_norm.weight)
    # the ranks' reads add up to the checkpoint, and a little more: KV heads, norms and
    # scales that several ranks hold
    assert _checkpoint_bytes(path) <= read < 1.15 * _checkpoint_bytes(path)


_LOAD_RANK = """
import gc, json, sys
from pathlib import Path
import torch
from transformers import AutoConfig
from batchinfer.attention import get_attention_backend
from batchinfer.model import weights
from batchinfer.model.config import ModelConfig
from batchinfer.model.loader import build_model, iter_weights
from batchinfer.model.parallel import TensorParallel

path, rank, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
TensorParallel.rank, TensorParallel.size = rank, size
config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))
cpu = torch.device("cpu")
model = build_model(config, get_attention_backend("torch", cpu), torch.float32, cpu)

def status(key):
    line = next(line for line in open("/proc/self/status") if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024

gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS")
model.load_weights(iter_weights(path, allow_pickle=False))
params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
print(json.dumps(dict(growth=status("VmHWM") - before, shard=sum(params.values()),
                      read=weights.bytes_read)))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_each_rank_reads_only_its_slices(tmp_path):
    """A 240 MB checkpoint loaded as rank 0 and 1 of 2, each in a process of its own: a
    rank's peak memory grows by its shard and at most one tensor's slice (plus a little),
    never by the checkpoint or by a file's worth of mapped pages, and the two read one
    checkpoint between them."""
    shape = {**SHAPES["test-llama"], "hidden_size": 512, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 8192,
             "tie_word_embeddings": False}
    path = build_random_checkpoint(tmp_path / "model", shape, vocab_size=32768)
    total = _checkpoint_bytes(path)
    largest_slice = max(t.shape.numel() * t.dtype.itemsize
                        for _, t in weights.file_tensors(path / "model.safetensors")) // 2
    ranks = [subprocess.Popen([sys.executable, "-c", _LOAD_RANK, str(path), str(rank), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    allowance = 16 << 20
    for r in results:
        assert r["shard"] < 0.55 * total
        assert r["growth"] < r["shard"] + largest_slice + allowance, (r, largest_slice)
    assert total <= sum(r["read"] for r in results) < 1.01 * total
