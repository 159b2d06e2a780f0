"""The grouped Triton MoE products against the per-expert loop (on CPU under the
interpreter), and the block plan they run on."""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels.triton.fused_moe import BLOCK_M, fused_moe, plan_blocks
from batchinfer.model.moe import SparseMoE

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _moe(hidden, inter, num_experts, top_k, normalize, model_dtype_weights, dtype, seed=0):
    torch.manual_seed(seed)
    block = SparseMoE(hidden, inter, num_experts, top_k, normalize, model_dtype_weights)
    for p in (block.gate.weight, block.w13, block.w2):
        p.data.normal_(0.0, 0.2)
    return block.to(device=DEVICE, dtype=dtype)


def test_plan_groups_pairs_by_expert_in_padded_blocks():
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])  # expert 4 gets nothing
    slot_pair, block_expert = plan_blocks(experts, num_experts=5, block_m=4)
    pairs = experts.numel()
    assert slot_pair.numel() % 4 == 0 and block_expert.numel() == slot_pair.numel() // 4
    flat = experts.flatten()
    for b, e in enumerate(block_expert.tolist()):
        rows = [p for p in slot_pair[4 * b:4 * b + 4].tolist() if p < pairs]
        if e < 0:
            assert rows == []
        else:
            assert all(flat[p] == e for p in rows)
    # every pair exactly once, in input order within its expert
    placed = [p for p in slot_pair.tolist() if p < pairs]
    assert sorted(placed) == list(range(pairs))
    assert block_expert.tolist()[:4] == [0, 1, 2, 3] and set(block_expert.tolist()[4:]) == {-1}


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("normalize, model_dtype_weights", [(True, True), (False, False)])
def test_fused_matches_the_expert_loop(num_tokens, normalize, model_dtype_weights):
    # inter 40 and hidden 48 are not multiples of the tiles; 8 experts, top 2
    block = _moe(48, 40, 8, 2, normalize, model_dtype_weights, torch.float32)
    x = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    block.use_fused = False
    expected = block(x)
    block.use_fused = True
    got = block(x)
    assert got.shape == x.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("model_dtype_weights", [True, False])
def test_fused_bfloat16_is_as_close_to_float32_as_the_loop(model_dtype_weights):
    block = _moe(48, 40, 8, 2, True, model_dtype_weights, torch.bfloat16)
    exact = _moe(48, 40, 8, 2, True, model_dtype_weights, torch.float32)
    exact.load_state_dict({k: v.float() for k, v in block.state_dict().items()})
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    reference = exact(x.float())
    block.use_fused = False
    loop_error = (block(x).float() - reference).abs()
    block.use_fused = True
    got = block(x)
    assert got.dtype == torch.bfloat16
    fused_error = (got.float() - reference).abs()
    # rounding in another order: errors of the loop's size, not of a wrong sum. The
    # interpreter rounds float32 to bfloat16 toward zero (a GPU to nearest), which about
    # triples the fused path's error there.
    slack = 2 if DEVICE.type == "cuda" else 5
    assert fused_error.mean() < slack * loop_error.mean()
    assert fused_error.max() < (slack + 1) * loop_error.max()


@pytest.mark.parametrize("block_m", [BLOCK_M, 64])
def test_experts_with_more_tokens_than_a_block(block_m):
    # 3 experts, top 3: every expert gets all 70 tokens, more than a block's rows each
    block = _moe(32, 32, 3, 3, False, True, torch.float32, seed=2)
    x = torch.randn(70, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    block.use_fused = False
    expected = block(x)
    w = torch.softmax(torch.nn.functional.linear(x, block.gate.weight), -1)
    got = fused_moe(x, block.w13, block.w2, torch.arange(3).expand(70, 3).contiguous(), w, True,
                    block_m=block_m)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
