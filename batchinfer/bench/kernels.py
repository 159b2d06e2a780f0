"""`batchinfer bench kernels`: the Triton attention kernels on realistic shapes.

For each shape it prints the kernel's time and achieved memory bandwidth next to torch
SDPA on the same shapes, and the bandwidth as a share of the device's measured copy
bandwidth (a large device-to-device copy). Achieved bandwidth counts the bytes the
operation must move at least once: Q, the K/V context, O (and for the KV write, the new
K/V read and written); both implementations are divided by the same bytes, so their
ratio is their speed ratio. SDPA gets its K/V already dense (decode: GQA folded into the
query length as the torch path does; prefill: K/V heads expanded before timing), so it
pays nothing for the paged layout. Needs CUDA; elsewhere it says so and exits 0.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch
import torch.nn.functional as F

NO_CUDA_MESSAGE = ("CUDA is not available: the kernel benchmark needs a GPU, so nothing was "
                   "measured.")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class KernelResult:
    kernel: str           # decode | prefill | kv_write
    batch: int
    context: int
    detail: str           # e.g. the split-KV count chosen
    triton_us: float
    triton_gbps: float
    triton_pct_copy: float
    sdpa_us: float | None
    sdpa_gbps: float | None
    tflops: float | None  # prefill only: causal attention FLOP/s of the Triton kernel, 1e12


def _time_us(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100) * 1e3


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (us * 1e-6)


def _paged_cache(batch: int, context: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, seq_lens


def _dense_kv(cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
    """[batch, num_kv_heads, context, head_dim], gathered once outside any timing."""
    flat = cache.flatten(0, 1)
    block_size = cache.shape[1]
    pos = torch.arange(context, device=cache.device)
    slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size
    return flat[slots].transpose(1, 2).contiguous()


def _bench_decode(batch, context, heads, kv_heads, head_dim, block_size, dtype, device,
                  copy_bw) -> KernelResult:
    from batchinfer.kernels.triton.decode import (choose_num_splits, sm_count,
                                                     paged_decode_attention)
    k_cache, v_cache, tables, seq_lens = _paged_cache(batch, context, block_size, kv_heads,
                                                      head_dim, dtype, device)
    query = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(query)
    scale = head_dim ** -0.5
    scratch: dict = {}
    splits = choose_num_splits(batch, kv_heads, context, sm_count(device))
    triton_us = _time_us(lambda: paged_decode_attention(
        query, k_cache, v_cache, tables, seq_lens, scale, out=out, max_seq_len=context,
        scratch=scratch))
    k, v = _dense_kv(k_cache, tables, context), _dense_kv(v_cache, tables, context)
    del k_cache, v_cache
    q = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    sdpa_us = _time_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale))
    elem = query.element_size()
    nbytes = 2 * batch * context * kv_heads * head_dim * elem + 2 * query.numel() * elem
    return _result("decode", batch, context, f"splits={splits}", nbytes, triton_us, sdpa_us,
                   copy_bw, None)


def _bench_prefill(batch, context, heads, kv_heads, head_dim, block_size, dtype, device,
                   copy_bw) -> KernelResult:
    from batchinfer.kernels.triton.prefill import paged_prefill_attention
    k_cache, v_cache, tables, seq_lens = _paged_cache(batch, context, block_size, kv_heads,
                                                      head_dim, dtype, device)
    qsl_cpu = [i * context for i in range(batch + 1)]
    qsl = torch.tensor(qsl_cpu, dtype=torch.int32, device=device)
    query = torch.randn(batch * context, heads, head_dim, dtype=dtype, device=device)
    out = torch.empty_like(query)
    scale = head_dim ** -0.5
    scratch: dict = {}
    triton_us = _time_us(lambda: paged_prefill_attention(
        query, k_cache, v_cache, tables, seq_lens, qsl, scale, out=out,
        query_start_loc_cpu=qsl_cpu, scratch=scratch))
    group = heads // kv_heads
    k = _dense_kv(k_cache, tables, context).repeat_interleave(group, dim=1)
    v = _dense_kv(v_cache, tables, context).repeat_interleave(group, dim=1)
    del k_cache, v_cache
    q = query.view(batch, context, heads, head_dim).transpose(1, 2)
    sdpa_us = _time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              scale=scale))
    elem = query.element_size()
    nbytes = 2 * batch * context * kv_heads * head_dim * elem + 2 * query.numel() * elem
    flops = 4 * batch * heads * head_dim * context * (context + 1) / 2
    return _result("prefill", batch, context, f"tokens={batch * context}", nbytes, triton_us,
                   sdpa_us, copy_bw, flops / (triton_us * 1e-6) / 1e12)


def _bench_kv_write(num_tokens, kv_heads, head_dim, block_size, dtype, device,
                    copy_bw) -> KernelResult:
    from batchinfer.kernels.triton.kv_write import write_kv
    num_blocks = math.ceil(num_tokens / block_size) * 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    key = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    triton_us = _time_us(lambda: write_kv(key, value, k_cache, v_cache, slots))
    nbytes = 4 * key.numel() * key.element_size()
    return _result("kv_write", num_tokens, 0, f"tokens={num_tokens}", nbytes, triton_us,
                   None, copy_bw, None)


def _result(kernel, batch, context, detail, nbytes, triton_us, sdpa_us, copy_bw,
            tflops) -> KernelResult:
    gbps = nbytes / (triton_us * 1e-6) / 1e9
    return KernelResult(
        kernel, batch, context, detail, round(triton_us, 2), round(gbps, 1),
        round(100 * gbps * 1e9 / copy_bw, 1),
        None if sdpa_us is None else round(sdpa_us, 2),
        None if sdpa_us is None else round(nbytes / (sdpa_us * 1e-6) / 1e9, 1),
        None if tflops is None else round(tflops, 1))


def run_kernel_bench(dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
                     num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                     batch_sizes: tuple[int, ...] = (1, 32, 128),
                     context_lens: tuple[int, ...] = (1024, 8192),
                     max_prefill_tokens: int = 32768,
                     device: torch.device | None = None) -> tuple[float, list[KernelResult]]:
    """(copy bandwidth in bytes/s, one result per kernel and shape). Defaults: Llama-3-8B.

    Decode runs every batch x context; prefill runs the pairs with at most
    max_prefill_tokens tokens; the KV write stores one decode step and one 8192-token step.
    """
    device = device or torch.device("cuda")
    if device.type != "cuda":
        raise ValueError(f"the kernel benchmark needs a CUDA device, got {device}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    torch.manual_seed(0)
    copy_bw = measure_copy_bandwidth(device)
    args = (num_heads, num_kv_heads, head_dim, block_size, dtype, device, copy_bw)
    results = []
    for batch in batch_sizes:
        for context in context_lens:
            results.append(_bench_decode(batch, context, *args))
            torch.cuda.empty_cache()
    for batch in batch_sizes:
        for context in context_lens:
            if batch * context <= max_prefill_tokens:
                results.append(_bench_prefill(batch, context, *args))
                torch.cuda.empty_cache()
    for num_tokens in (max(batch_sizes), 8192):
        results.append(_bench_kv_write(num_tokens, num_kv_heads, head_dim, block_size, dtype,
                                       device, copy_bw))
    return copy_bw, results


def format_results(copy_bw: float, results: list[KernelResult], device_name: str) -> str:
    lines = [f"device: {device_name}; measured copy bandwidth {copy_bw / 1e9:.0f} GB/s",
             f"{'kernel':<9}{'batch':>6}{'context':>8}  {'detail':<14}{'triton us':>11}"
             f"{'GB/s':>8}{'% copy':>8}{'sdpa us':>10}{'GB/s':>8}{'TFLOP/s':>9}"]
    for r in results:
        sdpa_us = "-" if r.sdpa_us is None else f"{r.sdpa_us:.1f}"
        sdpa_bw = "-" if r.sdpa_gbps is None else f"{r.sdpa_gbps:.0f}"
        tflops = "-" if r.tflops is None else f"{r.tflops:.0f}"
        lines.append(f"{r.kernel:<9}{r.batch:>6}{r.context:>8}  {r.detail:<14}"
                     f"{r.triton_us:>11.1f}{r.triton_gbps:>8.0f}{r.triton_pct_copy:>8.1f}"
                     f"{sdpa_us:>10}{sdpa_bw:>8}{tflops:>9}")
    return "\n".join(lines)


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        items = ()
    if not items or min(items) < 1:
        raise click.BadParameter(f"expected comma-separated positive integers, got {value!r}")
    return items


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--dtype", type=click.Choice(sorted(_DTYPES)), default="bfloat16")
@click.option("--block-size", type=click.IntRange(min=1), default=16)
@click.option("--num-heads", type=click.IntRange(min=1), default=32)
@click.option("--num-kv-heads", type=click.IntRange(min=1), default=8)
@click.option("--head-dim", type=click.IntRange(min=16), default=128)
@click.option("--batch-sizes", default="1,32,128", callback=_int_list)
@click.option("--context-lens", default="1024,8192", callback=_int_list)
@click.option("--max-prefill-tokens", type=click.IntRange(min=1), default=32768,
              help="Prefill shapes with more tokens (batch x context) are skipped.")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(dtype: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
         batch_sizes: tuple[int, ...], context_lens: tuple[int, ...], max_prefill_tokens: int,
         output_json: Path | None) -> None:
    """Time the Triton attention kernels against torch SDPA (Llama-3-8B shapes by default)."""
    if not torch.cuda.is_available():
        click.echo(NO_CUDA_MESSAGE)
        return
    try:
        copy_bw, results = run_kernel_bench(_DTYPES[dtype], block_size, num_heads, num_kv_heads,
                                            head_dim, batch_sizes, context_lens,
                                            max_prefill_tokens)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(format_results(copy_bw, results, torch.cuda.get_device_name()))
    if output_json is not None:
        output_json.parent.mkdir(parents=True, exist_ok=True)
        output_json.write_text(json.dumps({"copy_bandwidth_bytes_per_s": copy_bw,
                                           "results": [asdict(r) for r in results]}, indent=2)
                               + "\n")


if __name__ == "__main__":
    main()
