"""`batchinfer bench kernels`: the Triton attention kernels on realistic shapes, and with
--cpu-fp8-linear the CPU weight-only FP8 linear product (see the end of this docstring).

For each shape it prints the kernel's time and achieved memory bandwidth next to torch
SDPA on the same shapes, and the bandwidth as a share of the device's measured copy
bandwidth (a large device-to-device copy). Achieved bandwidth counts the bytes the
operation must move at least once: Q, the K/V context, O (and for the KV write, the new
K/V read and written); both implementations are divided by the same bytes, so their
ratio is their speed ratio. SDPA gets its K/V already dense (decode: GQA folded into the
query length as the torch path does; prefill: K/V heads expanded before timing), so it
pays nothing for the paged layout. Needs CUDA; elsewhere it says so and exits 0.

--cpu-fp8-linear times, on the CPU, the FP8 weight-only product (batchinfer.kernels.cpu.
fp8_linear: its C kernel and its tiled path, each at every row count) against bfloat16
F.linear with oneDNN-packed weights (batchinfer.model.cpu_linear), on Llama-3-8B's linear
shapes by default, with per-output-channel and 128-wide block scales, and reports each one's
milliseconds and GB/s of weight bytes read (FP8: the weight and its scales; bfloat16: the
weight). It needs no GPU.
"""
from __future__ import annotations

import json
import math
import statistics
import time
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


# Llama-3-8B's linear layers (N x K): qkv, o, gate+up, down
FP8_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
FP8_SHAPE_NAMES = dict(zip(FP8_SHAPES, ("qkv", "o", "gate_up", "down")))
FP8_ROWS = (1, 8, 32, 64, 256)


@dataclass
class Fp8LinearResult:
    shape: str                # qkv | o | gate_up | down, or N x K
    n: int
    k: int
    rows: int                 # rows of x (bfloat16)
    scales: str               # channel | block128
    runs: str                 # what fp8_linear.linear() runs at this row count: kernel | tiled
    kernel_ms: float | None   # None where the C kernel cannot be built
    kernel_gbps: float | None
    tiled_ms: float
    tiled_gbps: float
    bf16_ms: float
    bf16_gbps: float
    bf16_packed: bool         # False where oneDNN packing is not available here


def _time_cpu_ms(fn, min_time: float) -> float:
    """Median milliseconds of fn's calls, after one warm-up call: at least 3 calls, repeated
    until min_time seconds have passed (at most 100 calls)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < 100):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _fp8_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """float8_e4m3fn [n, k] spread over E4M3's range as quantised weights are, made a slice
    of rows at a time (no float32 copy of the whole weight)."""
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    step = max(1, (64 << 20) // (4 * k))
    for n0 in range(0, n, step):
        rows = min(step, n - n0)
        weight[n0:n0 + rows] = (torch.randn(rows, k, generator=gen) * 64).clamp(-448, 448)
    return weight


def run_fp8_linear_bench(shapes: tuple[tuple[int, int], ...] = FP8_SHAPES,
                         rows: tuple[int, ...] = FP8_ROWS, min_time: float = 0.5
                         ) -> list[Fp8LinearResult]:
    """One result per shape (N x K), row count and kind of scales (per output channel, and
    per 128-wide block), on the CPU with torch's threads."""
    from batchinfer.kernels.cpu import fp8_linear
    from batchinfer.model import cpu_linear
    gen = torch.Generator().manual_seed(0)
    packed_ok = cpu_linear.available(torch.bfloat16)
    results = []
    for n, k in shapes:
        weight = _fp8_weight(n, k, gen)
        weight_bf16 = weight.to(torch.bfloat16)
        scales = {"channel": k, "block128": 128}
        weight_scales = {name: torch.rand(n, -(-k // group), generator=gen) * 1e-3
                         for name, group in scales.items()}
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            packed = cpu_linear.pack(weight_bf16, m) if packed_ok else None
            bf16_ms = _time_cpu_ms(lambda: cpu_linear.apply(x, weight_bf16, packed), min_time)
            for name, group in scales.items():
                scale = weight_scales[name]
                fp8_bytes = weight.numel() + scale.numel() * scale.element_size()
                kernel_ms = None
                if fp8_linear.supports(x, weight, scale, group):
                    kernel_ms = _time_cpu_ms(
                        lambda: fp8_linear.linear_kernel(x, weight, scale, group), min_time)
                tiled_ms = _time_cpu_ms(
                    lambda: fp8_linear.linear_tiled(x, weight, scale, group), min_time)
                runs = "kernel" if kernel_ms is not None and m <= fp8_linear.KERNEL_MAX_ROWS \
                    else "tiled"
                results.append(Fp8LinearResult(
                    FP8_SHAPE_NAMES.get((n, k), f"{n}x{k}"), n, k, m, name, runs,
                    None if kernel_ms is None else round(kernel_ms, 3),
                    None if kernel_ms is None else round(fp8_bytes / kernel_ms / 1e6, 1),
                    round(tiled_ms, 3), round(fp8_bytes / tiled_ms / 1e6, 1),
                    round(bf16_ms, 3), round(2 * weight.numel() / bf16_ms / 1e6, 1),
                    packed is not None))
        del weight, weight_bf16
    return results


def format_fp8_results(results: list[Fp8LinearResult]) -> str:
    packed = all(r.bf16_packed for r in results)
    lines = [f"CPU weight-only FP8 linear, bfloat16 x, {torch.get_num_threads()} threads; GB/s "
             f"= weight bytes read / time; bfloat16 F.linear "
             f"{'with oneDNN-packed weights' if packed else '(oneDNN packing unavailable here)'}",
             f"{'shape':<9}{'N x K':>12}{'rows':>6}  {'scales':<9}{'runs':<7}"
             f"{'kernel ms':>10}{'GB/s':>7}{'tiled ms':>10}{'GB/s':>7}{'bf16 ms':>10}{'GB/s':>7}"]
    for r in results:
        kernel_ms = "-" if r.kernel_ms is None else f"{r.kernel_ms:.3f}"
        kernel_bw = "-" if r.kernel_gbps is None else f"{r.kernel_gbps:.1f}"
        lines.append(f"{r.shape:<9}{f'{r.n}x{r.k}':>12}{r.rows:>6}  {r.scales:<9}{r.runs:<7}"
                     f"{kernel_ms:>10}{kernel_bw:>7}{r.tiled_ms:>10.3f}{r.tiled_gbps:>7.1f}"
                     f"{r.bf16_ms:>10.3f}{r.bf16_gbps:>7.1f}")
    return "\n".join(lines)


def _int_list(ctx, param, value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        items = ()
    if not items or min(items) < 1:
        raise click.BadParameter(f"expected comma-separated positive integers, got {value!r}")
    return items


def _shape_list(ctx, param, value: str) -> tuple[tuple[int, int], ...]:
    try:
        shapes = tuple(tuple(int(d) for d in v.lower().split("x")) for v in value.split(",")
                       if v.strip())
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise click.BadParameter(f"expected comma-separated NxK shapes, got {value!r}")
    return shapes


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
@click.option("--cpu-fp8-linear", is_flag=True,
              help="Instead, time the CPU weight-only FP8 linear product against bfloat16 "
                   "F.linear with oneDNN-packed weights (no GPU needed).")
@click.option("--fp8-shapes", default=",".join(f"{n}x{k}" for n, k in FP8_SHAPES),
              callback=_shape_list, help="--cpu-fp8-linear: weight shapes, N x K.")
@click.option("--fp8-rows", default=",".join(map(str, FP8_ROWS)), callback=_int_list,
              help="--cpu-fp8-linear: rows of x.")
@click.option("--min-time", type=click.FloatRange(min=0), default=0.5,
              help="--cpu-fp8-linear: seconds each timing repeats for (at least 3 calls).")
@click.option("--output-json", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(dtype: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
         batch_sizes: tuple[int, ...], context_lens: tuple[int, ...], max_prefill_tokens: int,
         cpu_fp8_linear: bool, fp8_shapes: tuple[tuple[int, int], ...],
         fp8_rows: tuple[int, ...], min_time: float, output_json: Path | None) -> None:
    """Time the Triton attention kernels against torch SDPA (Llama-3-8B shapes by default);
    with --cpu-fp8-linear, the CPU FP8 weight-only linear product against bfloat16."""
    if cpu_fp8_linear:
        results = run_fp8_linear_bench(fp8_shapes, fp8_rows, min_time)
        click.echo(format_fp8_results(results))
        if output_json is not None:
            output_json.parent.mkdir(parents=True, exist_ok=True)
            output_json.write_text(json.dumps({"fp8_linear": [asdict(r) for r in results]},
                                              indent=2) + "\n")
        return
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
