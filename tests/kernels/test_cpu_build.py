"""Building the C kernels: all at once when an engine starts on a CPU (while its weights
load), saying so, never inside a row's latency; `batchinfer build-kernels` ahead of a job;
a build that fails or times out says why and how to try again."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pyarrow.dataset as ds
import pytest

from batchinfer.kernels import cpu


def test_a_failed_build_says_which_and_how_to_retry(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    said = []
    with caplog.at_level(logging.WARNING, logger=cpu.build.__name__):
        built = cpu.build.build_all(say=said.append)
    assert set(built) == set(cpu.build.SOURCES) and not any(built.values())
    assert said[0].startswith(f"building the CPU kernels for this CPU, once "
                              f"({len(built)} of {len(built)} sources")
    assert "decode.c" in said[1] and "failed" in said[1]
    assert "`batchinfer build-kernels` tries again" in said[1]
    assert "CPU kernel decode.c could not be built" in caplog.text


def test_a_compile_past_its_time_is_given_up_with_its_cause(fresh_loader, monkeypatch, caplog):
    monkeypatch.setattr(cpu.build, "COMPILE_TIMEOUT_S", 0.001)
    with caplog.at_level(logging.WARNING, logger=cpu.build.__name__):
        assert cpu.build.build(cpu.ops.SOURCE) is None
    assert "took over 0 s compiling ops.c" in caplog.text and "torch path" in caplog.text


def test_nothing_to_build_says_nothing(fresh_loader, monkeypatch):
    monkeypatch.setenv(cpu.build.ENV_SWITCH, "0")
    said = []
    assert cpu.build.unbuilt() == [] and cpu.build.start_build_all(said.append) is None
    assert not any(cpu.build.build_all(say=said.append).values()) and said == []


@pytest.mark.slow
def test_a_first_run_builds_the_kernels_before_its_clock_starts(tmp_path, llama_dir):
    env = {**os.environ, "BATCHINFER_CACHE_DIR": str(tmp_path / "cache")}
    # the two large kernels (minutes with an AVX2 -march) come from the usual cache: the
    # first run builds the other six
    large = [cpu.decode.SOURCE, cpu.prefill.SOURCE]
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    for source in large:
        library = cpu.build.build(source)
        if library is None:
            pytest.skip("the C kernels cannot be built here")
        shutil.copy(library, tmp_path / "cache" / "kernels" / library.name)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(4)))
    batchinfer = [sys.executable, "-m", "batchinfer"]
    first = subprocess.run([*batchinfer, "run", str(source), "--model", str(llama_dir), "-o",
                            str(tmp_path / "out"), "--max-tokens", "4", "--no-progress"],
                           env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    sources = len(cpu.build.SOURCES)
    assert f"building the CPU kernels for this CPU, once ({sources - len(large)} of " \
        f"{sources} sources" in first.stderr
    built_s = int(re.search(r"CPU kernels built in (\d+) s", first.stderr).group(1))
    assert len(list((tmp_path / "cache" / "kernels").glob("*.so"))) == sources
    ttft = ds.dataset(tmp_path / "out").to_table().column("ttft_s").to_pylist()
    assert max(ttft) < max(2.0, built_s / 2)  # the build is in no row's latency
    again = subprocess.run([*batchinfer, "build-kernels"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and "building" not in again.stderr
    assert f"{sources} CPU kernels ready in {tmp_path / 'cache' / 'kernels'}" in again.stderr


@pytest.mark.parametrize("identity, isa", [
    ("flags\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n",
     "AVX-512 BF16 AMX"),
    ("flags\t: fpu avx2 fma avx512f avx512_bf16\n", "AVX-512 BF16"),
    ("flags\t: fpu avx2 fma avx512f avx512bw\n", "AVX-512"),
    ("vendor_id\t: AuthenticAMD\nflags\t: fpu sse2 avx avx2 fma\n", "AVX2 FMA"),
    ("Features\t: fp asimd evtstrm aes sve bf16\n", "SVE BF16"),
    ("Features\t: fp asimd evtstrm\n", "NEON"),
])
def test_benchmarks_name_the_vector_isa(identity, isa):
    assert cpu.build.vector_isa(identity) == isa
