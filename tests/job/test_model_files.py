"""Model files are input too: a broken config.json, GGUF file or FP8 checkpoint ends the job
with exit 2 and one line naming the problem, before any large allocation; never a
traceback, an absurd allocation or a run on poisoned numbers. Valid controls exit 0.

Most cases run in this process through the CLI; those that would allocate run in a
subprocess under an address-space limit (RLIMIT_AS, LIMIT_BYTES), with a valid control
beside them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8_checkpoints
from batchinfer.random_checkpoint import build_random_checkpoint
from test_bad_input import assert_fatal

# RLIMIT_AS of the subprocess cases. Address space, not resident memory: a valid control's
# process (Python, torch, transformers, the tiny model) maps about 2.0 GiB at its peak with
# the thread and arena settings of run_limited (2.35 GiB without them), 0.47 GiB resident
LIMIT_BYTES = 5 << 29  # 2.5 GiB
RSS_BYTES = 2 << 30  # and each case's peak resident memory under 2 GiB
SECONDS = 30           # the most any case may take
# llama with head_dim = hidden_size / heads, as a GGUF file's metadata implies it
GGUF_SHAPE = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=192, vocab_size=1536,
                  max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True)


@pytest.fixture(scope="module")
def small_dir(checkpoint_root) -> Path:
    path = checkpoint_root / "model-files-llama"
    return path if path.is_dir() else build_random_checkpoint(path, shape=GGUF_SHAPE)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": "a second row"}\n')
    return path


def with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def with_tensors(src: Path, dst: Path, change) -> Path:
    """A copy of src whose tensors `change` (a function of the name -> tensor dict) edits."""
    shutil.copytree(src, dst)
    tensors = {}
    for file in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def run_timed(run_cli, data: Path, out: Path, model: Path, *flags: str):
    start = time.monotonic()
    result = run_cli(data, "-o", out, "--model", model, "--max-tokens", "2", *flags)
    assert time.monotonic() - start < SECONDS
    return result


YARN_ZERO = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}
LLAMA3_FLAT = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 256}
CT_BAD_REGEX = {**fp8_checkpoints.FORMS["compressed-tensors-tensor"][1], "ignore": ["re:(lm_head"]}

CONFIG_CASES = {
    "heads-zero": ({"num_attention_heads": 0}, ["config.json", "num_attention_heads is 0",
                                                "integer >= 1"]),
    "hidden-negative": ({"hidden_size": -64}, ["hidden_size is -64"]),
    "layers-string": ({"num_hidden_layers": "2"}, ["num_hidden_layers is a string '2'"]),
    "vocab-zero": ({"vocab_size": 0}, ["vocab_size is 0"]),
    "kv-heads-zero": ({"num_key_value_heads": 0}, ["num_key_value_heads is 0"]),
    "kv-heads-not-dividing": ({"num_key_value_heads": 3}, ["multiple of num_key_value_heads 3"]),
    "head-dim-odd": ({"head_dim": 33}, ["head_dim is 33", "even"]),
    "eps-nan": ({"rms_norm_eps": float("nan")}, ["rms_norm_eps is nan", "finite number > 0"]),
    "eps-negative": ({"rms_norm_eps": -1e-5}, ["rms_norm_eps is -1e-05"]),
    "rope-theta-zero": ({"rope_theta": 0}, ["rope_theta is 0"]),
    "yarn-original-zero": ({"rope_scaling": YARN_ZERO},
                           ["rope_scaling.original_max_position_embeddings is 0"]),
    "llama3-equal-freq-factors": ({"rope_scaling": LLAMA3_FLAT}, ["high_freq_factor", "differ"]),
    "quantization-string": ({"quantization_config": "fp8"},
                            ["quantization_config is a string 'fp8'"]),
    "quantization-list": ({"quantization_config": [1]}, ["quantization_config is a list"]),
    "ignore-bad-regex": ({"quantization_config": CT_BAD_REGEX},
                         ["quantization_config.ignore", "'re:(lm_head'", "regular expression"]),
    "hidden-beyond-weights": ({"hidden_size": 1 << 30}, ["model.embed_tokens.weight",
                                                         "[1536, 1073741824]"]),
    "vocab-beyond-weights": ({"vocab_size": 100_000}, ["model.embed_tokens.weight",
                                                       "[100000, 64]"]),
    "context-2**30": ({"max_position_embeddings": 1 << 30}, ["rotary tables", "1073741824 "
                                                             "positions"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_broken_config_exits_2_naming_the_field(tmp_path, run_cli, small_dir, data, case):
    change, words = CONFIG_CASES[case]
    model = with_config(small_dir, tmp_path / case, **change)
    assert_fatal(run_timed(run_cli, data, tmp_path / "out", model), *words)


def test_config_controls_run(tmp_path, run_cli, small_dir, data):
    """The valid checkpoint, and a context of 2**24 cut to the run's --max-model-len: the
    rotary table covers the positions used."""
    assert run_timed(run_cli, data, tmp_path / "a", small_dir).exit_code == 0
    huge = with_config(small_dir, tmp_path / "huge", max_position_embeddings=1 << 24)
    result = run_timed(run_cli, data, tmp_path / "b", huge, "--max-model-len", "64")
    assert result.exit_code == 0, result.output


def test_a_norm_weight_of_the_wrong_rank_is_named(tmp_path, run_cli, small_dir, data):
    def reshape(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"].reshape(1, -1).contiguous()
    model = with_tensors(small_dir, tmp_path / "norm", reshape)
    assert_fatal(run_timed(run_cli, data, tmp_path / "out", model),
                 "tensor model.norm.weight has shape [1, 64]", "need [64]")


FP8_POISON = {
    "weight-scale-nan": ("model.layers.0.self_attn.q_proj.weight_scale", float("nan")),
    "weight-scale-inf": ("model.layers.1.mlp.down_proj.weight_scale", float("inf")),
    "weight-scale-zero": ("model.layers.0.mlp.up_proj.weight_scale", 0.0),
    "weight-scale-negative": ("model.layers.0.self_attn.o_proj.weight_scale", -0.5),
    "input-scale-nan": ("model.layers.1.self_attn.k_proj.input_scale", float("nan")),
}


@pytest.fixture(scope="module")
def fp8_dir(small_dir, tmp_path_factory) -> Path:
    return fp8_checkpoints.write_fp8(small_dir, tmp_path_factory.mktemp("fp8") / "m",
                                     "compressed-tensors-tensor")


@pytest.mark.parametrize("case", list(FP8_POISON))
def test_a_poisoned_fp8_scale_exits_2_naming_it(tmp_path, run_cli, fp8_dir, data, case):
    name, value = FP8_POISON[case]

    def poison(tensors):
        tensors[name] = torch.full_like(tensors[name], value)
    model = with_tensors(fp8_dir, tmp_path / case, poison)
    assert_fatal(run_timed(run_cli, data, tmp_path / "out", model), repr(name),
                 "finite numbers > 0", f"got {value}")


def test_fp8_control_runs(tmp_path, run_cli, fp8_dir, data):
    assert run_timed(run_cli, data, tmp_path / "out", fp8_dir).exit_code == 0


# ---- GGUF ------------------------------------------------------------------------------------

def write_gguf(src: Path, path: Path, swap: str | None = None, **metadata) -> Path:
    """A GGUF file of checkpoint src (F32, llama), its metadata overridden by `metadata`
    (GGUFWriter's add_* names without add_), the tensor `swap` written transposed."""
    gguf = pytest.importorskip("gguf")
    from batchinfer.model import gguf as gguf_checkpoint
    config = json.loads((src / "config.json").read_text())
    fields = dict(block_count=config["num_hidden_layers"],
                  context_length=config["max_position_embeddings"],
                  embedding_length=config["hidden_size"],
                  feed_forward_length=config["intermediate_size"],
                  head_count=config["num_attention_heads"],
                  head_count_kv=config["num_key_value_heads"],
                  layer_norm_rms_eps=config["rms_norm_eps"], rope_freq_base=config.get("rope_theta", 10000.0),
                  vocab_size=config["vocab_size"])
    fields.update(metadata)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        getattr(writer, f"add_{key}")(value)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight",
             **{f".{hf}.weight": f".{g}.weight"
                for g, hf in gguf_checkpoint._LAYER_TENSORS.items()}}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name in names:
                gguf_name = names[name]
            else:
                layer, rest = name.removeprefix("model.layers.").split(".", 1)
                gguf_name = f"blk.{layer}" + names["." + rest]
            array = tensor.float().numpy()
            writer.add_tensor(gguf_name, array.T.copy() if gguf_name == swap else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patched(path: Path, offset: int, value: int) -> Path:
    """path with the 8-byte little-endian integer at offset set to value."""
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = value.to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return path


def truncated(path: Path, cut: int) -> Path:
    path.write_bytes(path.read_bytes()[:-cut])
    return path


GGUF_CASES = {
    "tensor-count-beyond-file": (lambda p: patched(p, 8, 10**9), ["says 1000000000 tensors",
                                                                  "more than its"]),
    "kv-count-beyond-file": (lambda p: patched(p, 16, 10**12), ["1000000000000 metadata"]),
    "tensor-data-beyond-file": (lambda p: truncated(p, 4096), ["past the end of the file"]),
    "embedding-length-huge": ({"embedding_length": 10**9}, ["model.embed_tokens.weight"]),
    "ffn-length-huge": ({"feed_forward_length": 4 * 10**9}, ["model.layers.0.mlp.", "intermediate_size 4000000000"]),
    "vocab-huge": ({"vocab_size": 10**9}, ["model.embed_tokens.weight", "[1000000000, 64]"]),
    "context-huge": ({"context_length": 1 << 31}, ["rotary tables"]),
    "head-count-kv-zero": ({"head_count_kv": 0}, ["num_key_value_heads is 0"]),
    "swapped-dims": ("blk.0.ffn_up.weight", ["model.layers.0.mlp.up_proj.weight",
                                             "has shape [64, 192]"]),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_a_broken_gguf_exits_2_naming_the_problem(tmp_path, run_cli, small_dir, data, case):
    how, words = GGUF_CASES[case]
    path = tmp_path / f"{case}.gguf"
    if callable(how):
        how(write_gguf(small_dir, path))
    elif isinstance(how, str):
        write_gguf(small_dir, path, swap=how)
    else:
        write_gguf(small_dir, path, **how)
    assert_fatal(run_timed(run_cli, data, tmp_path / "out", path, "--tokenizer", small_dir),
                 *words)


def test_gguf_control_runs(tmp_path, run_cli, small_dir, data):
    path = write_gguf(small_dir, tmp_path / "m.gguf")
    result = run_timed(run_cli, data, tmp_path / "out", path, "--tokenizer", small_dir)
    assert result.exit_code == 0, result.output


# ---- generation_config.json --------------------------------------------------------------------

def test_generation_config_values_no_user_means_are_ignored_with_a_warning(tmp_path, run_cli,
                                                                            small_dir, data):
    model = tmp_path / "m"
    shutil.copytree(small_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 10**12, "temperature": -1, "top_p": 1.5, "top_k": 1}))
    result = run_timed(run_cli, data, tmp_path / "out", model)
    assert result.exit_code == 0, result.output
    for words in ("max_new_tokens 1000000000000 exceeds the model's context (2048 tokens); "
                  "ignored", "temperature must be", "top_p must be"):
        assert words in result.stderr, result.stderr
    assert "sampling defaults from the model's generation_config.json: top_k=1" in result.stderr


# ---- under an address-space limit ------------------------------------------------------------

LIMITED = """
import atexit, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
# (VmHWM: this program's own peak; ru_maxrss would count the parent's memory before exec)
atexit.register(lambda: open({rss_file!r}, "w").write(str(1024 * int(next(
    line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))))))
from batchinfer.cli import main
sys.argv = ["batchinfer", *sys.argv[1:]]
main()
"""


def run_limited(data: Path, out: Path, model: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2", "TRITON_INTERPRET": "1"}
    rss_file = out.with_name(out.name + ".rss")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", LIMITED.format(limit=LIMIT_BYTES, rss_file=str(rss_file)),
         "run", str(data), "-o",
         str(out), "--model", str(model), "--max-tokens", "2", "--no-progress", "--dtype",
         "float32", "--max-num-seqs", "4", *flags],
        capture_output=True, text=True, timeout=SECONDS + 30, env=env)
    assert time.monotonic() - start < SECONDS, proc.stderr
    peak = int(rss_file.read_text())
    assert peak < RSS_BYTES, f"peak resident memory {peak / 2**30:.2f} GiB"
    return proc


def test_allocation_cases_exit_2_within_the_address_space_limit(tmp_path, small_dir, data):
    """The control runs under the limit; a context of 2**24 (its rotary table alone would
    take 10 GiB), a million layers and a GGUF context of 2**31 are refused under it."""
    control = run_limited(data, tmp_path / "ok", small_dir, "--num-kv-blocks", "64")
    assert control.returncode == 0, control.stderr[-2000:]
    gguf_file = write_gguf(small_dir, tmp_path / "ctx.gguf", context_length=1 << 31)
    cases = {
        "context": (with_config(small_dir, tmp_path / "ctx", max_position_embeddings=1 << 24),
                    "address-space limit"),
        "layers": (with_config(small_dir, tmp_path / "layers", num_hidden_layers=10**6),
                   "1000000 layers"),
        "gguf-context": (gguf_file, "rotary tables"),
    }
    for name, (model, words) in cases.items():
        flags = ("--tokenizer", str(small_dir)) if model.suffix == ".gguf" else ()
        proc = run_limited(data, tmp_path / f"out-{name}", model, *flags)
        # (transformers may log a deprecation of its own before it, reading a GGUF file)
        message = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert message.startswith("Error: ") and words in message, (name, message)
        assert "Traceback" not in proc.stderr and proc.stderr.count("Error") == 1, proc.stderr
