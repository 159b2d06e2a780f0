"""TritonAttention against the torch path on mixed steps built from synthetic metadata."""
from __future__ import annotations

import pytest
import torch

from batchinfer.attention import TorchAttention, get_attention_backend
from batchinfer.attention.triton_backend import TritonAttention

# Both paths read the same inputs; the torch path runs SDPA in the input dtype, the kernels
# multiply in float32 under the interpreter, so the gap is bounded by the dtype's rounding.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5),
              torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
if torch.cuda.is_available():
    # Compiled, the kernels also round the probabilities to bfloat16 before P @ V.
    TOLERANCES.update({torch.float32: dict(atol=1e-4, rtol=1e-4),
                       torch.bfloat16: dict(atol=5e-2, rtol=5e-2)})


@pytest.mark.parametrize("dtype, window, group, block_size, softcap", [
    (torch.float32, None, 4, 16, None),
    (torch.bfloat16, 12, 1, 8, None),
    (torch.float32, 12, 8, 32, None),
    (torch.float32, 12, 4, 16, 1.0),  # Gemma 2's soft-capped scores
])
def test_forward_matches_torch_backend(paged_batch, dtype, window, group, block_size, softcap):
    # Two decodes, a chunk after a prefix-cache hit that starts mid-block, a fresh
    # prompt, a one-token prompt.
    b = paged_batch([29, 1, 21, 18, 1], [1, 1, 6, 18, 1], block_size=block_size,
                    num_kv_heads=2, group=group, head_dim=64, dtype=dtype, seed=7)
    m = b.meta
    assert m.num_decode_seqs == 2
    caches = {}
    for name in ("torch", "triton"):
        k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
        # The step's own K/V are not in the cache yet: forward must write them.
        k_cache.view(-1, *k_cache.shape[2:])[m.slot_mapping] = float("nan")
        v_cache.view(-1, *v_cache.shape[2:])[m.slot_mapping] = float("nan")
        caches[name] = (k_cache, v_cache)
    backend = TritonAttention()
    m.cache.clear()
    ref = TorchAttention().forward(b.query, b.key, b.value, *caches["torch"], m, 0.125, window,
                                   softcap=softcap)
    m.cache.clear()
    out = backend.forward(b.query, b.key, b.value, *caches["triton"], m, 0.125, window,
                          softcap=softcap)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])
    for a, c in zip(caches["triton"], caches["torch"]):
        assert torch.equal(a.nan_to_num(), c.nan_to_num())
    # A second layer reuses the step's plans from meta.cache.
    assert any(key[0] == "prefill_tiles" for key in m.cache)
    again = backend.forward(b.query * 2, b.key, b.value, *caches["triton"], m, 0.125, window,
                            softcap=softcap)
    m.cache.clear()
    ref2 = TorchAttention().forward(b.query * 2, b.key, b.value, *caches["torch"], m, 0.125,
                                    window, softcap=softcap)
    torch.testing.assert_close(again.float(), ref2.float(), **TOLERANCES[dtype])


def test_decode_only_and_prefill_only_steps(paged_batch):
    for seq_lens, q_lens in (([40, 7, 3], [1, 1, 1]), ([9, 30], [9, 4])):
        b = paged_batch(seq_lens, q_lens, block_size=16, num_kv_heads=1, group=4,
                        head_dim=96, dtype=torch.float32, seed=1)
        ref = TorchAttention().forward(b.query, b.key, b.value, b.k_cache.clone(),
                                       b.v_cache.clone(), b.meta, 0.1)
        b.meta.cache.clear()
        out = TritonAttention().forward(b.query, b.key, b.value, b.k_cache, b.v_cache,
                                        b.meta, 0.1)
        torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])


def test_dispatch_returns_triton_backend(device):
    """On CPU this needs the interpreter, which the test setup turns on."""
    assert isinstance(get_attention_backend("triton", device), TritonAttention)
