"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights.

transformers reads the file's metadata into a config and a tokenizer with its chat
template (`gguf_file=`); the weights are dequantized here by the `gguf` package, one tensor
at a time, to the compute dtype under transformers' names, with the q/k rows llama.cpp
permutes for its rotary layout put back, as transformers' load_gguf_checkpoint does.
"""
from __future__ import annotations

import copy
import functools
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from batchinfer.model.weights import CheckpointTensor

# general.architecture -> whether llama.cpp permuted its q/k rows (convert_hf_to_gguf.py
# does for llama, and for Mistral, which it writes as llama)
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


ROPE_FREQS = "rope_freqs.weight"


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def find_gguf(directory: Path) -> Path | None:
    """The one .gguf file of a directory without config.json; None when it holds none.
    ValueError when it holds several (which one is meant?)."""
    if (directory / "config.json").is_file():
        return None
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{directory} holds {len(files)} .gguf files "
                         f"({', '.join(f.name for f in files)}); pass one of them as --model")
    return files[0] if files else None


def hf_name(name: str) -> str:
    """transformers' name of a GGUF tensor (get_tensor_name_map's, for the llama family);
    ValueError for a tensor the engine's models do not have."""
    stem, _, suffix = name.rpartition(".")
    if stem in _MODEL_TENSORS and suffix == "weight":
        return f"{_MODEL_TENSORS[stem]}.weight"
    match = _LAYER_NAME.fullmatch(name)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"
    if name == ROPE_FREQS:
        return name  # not a weight: the rotary table's factors (hf_config)
    raise ValueError(f"its tensor {name} has no counterpart in the engine's models")


# GGUF metadata value types (gguf.GGUFValueType) -> bytes of one value; 8: string, 9: array
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_MAX_DIMS = 4  # llama.cpp's GGML_MAX_DIMS


@dataclass(frozen=True)
class TableEntry:
    name: str
    shape: tuple[int, ...]  # transformers' order (llama.cpp's dims reversed)
    quant_type: int
    start: int              # byte range of its data in the file
    end: int


def tensor_table(path: Path) -> list[TableEntry]:
    """The file's tensor table, read with every count and length checked against the file's
    size, and every tensor's data inside the file: ValueError naming what does not fit.
    (The gguf package's reader takes the header's counts and offsets on trust.)"""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{path} is not a readable GGUF file (only {size} bytes)")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with data:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a readable GGUF file (magic {magic!r}, "
                             f"version {version}; batchinfer reads GGUF versions 2 and 3)")
        # each entry takes at least 13 (metadata) or 25 (tensor) bytes
        if 24 + 13 * n_kv + 25 * n_tensors > size:
            raise ValueError(f"{path}: its header says {n_tensors} tensors and {n_kv} "
                             f"metadata entries, more than its {size} bytes can hold; the "
                             "file is damaged or truncated")
        pos = 24

        def take(fmt: str, what: str) -> tuple:
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > size:
                raise ValueError(f"{path}: {what} runs past the end of the file "
                                 f"({size} bytes); the file is damaged or truncated")
            values = struct.unpack_from(fmt, data, pos)
            pos += n
            return values

        def string(what: str) -> str:
            nonlocal pos
            (length,) = take("<Q", what)
            if pos + length > size:
                raise ValueError(f"{path}: {what} is {length} bytes long, past the end of the "
                                 f"file ({size} bytes); the file is damaged or truncated")
            pos += length
            return data[pos - length:pos].decode("utf-8", errors="replace")

        def skip_value(kind: int, what: str) -> None:
            nonlocal pos
            if kind == 8:
                string(what)
            elif kind == 9:
                item, count = take("<IQ", what)
                if item in _VALUE_BYTES:
                    if pos + count * _VALUE_BYTES[item] > size:
                        raise ValueError(f"{path}: {what} holds {count} values, past the end "
                                         f"of the file ({size} bytes)")
                    pos += count * _VALUE_BYTES[item]
                else:
                    for _ in range(count):
                        skip_value(item, what)
            elif kind in _VALUE_BYTES:
                take(f"<{_VALUE_BYTES[kind]}s", what)
            else:
                raise ValueError(f"{path}: {what} has an unknown value type {kind}")

        alignment = 32
        for i in range(n_kv):
            key = string(f"metadata entry {i}'s key")
            (kind,) = take("<I", f"metadata {key}")
            if key == "general.alignment" and kind == 4:
                (alignment,) = take("<I", f"metadata {key}")
                if alignment == 0 or alignment & (alignment - 1):
                    raise ValueError(f"{path}: general.alignment is {alignment}; it must be "
                                     "a power of 2")
            else:
                skip_value(kind, f"metadata {key}")
        infos = []
        for i in range(n_tensors):
            name = string(f"tensor {i}'s name")
            (n_dims,) = take("<I", f"tensor {name}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions; a GGUF "
                                 f"tensor has 1 to {_MAX_DIMS}")
            dims = take(f"<{n_dims}Q", f"tensor {name}")
            quant_type, offset = take("<IQ", f"tensor {name}")
            infos.append((name, dims, quant_type, offset))
        start = -(-pos // alignment) * alignment
        table = []
        for name, dims, quant_type, offset in infos:
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(quant_type)]
            except (ValueError, KeyError):
                raise ValueError(f"{path}: tensor {name} has an unknown type {quant_type}") from None
            elements = 1
            for d in dims:
                elements *= d
            if dims[0] % block:
                raise ValueError(f"{path}: tensor {name} has rows of {dims[0]} values, not a "
                                 f"multiple of its type's block of {block}")
            begin = start + offset
            end = begin + elements // block * type_bytes
            if end > size:
                raise ValueError(f"{path}: tensor {name} ({list(reversed(dims))}) lies at bytes "
                                 f"{begin} to {end}, past the end of the file ({size} bytes); "
                                 "the file is damaged or truncated")
            table.append(TableEntry(name, tuple(reversed(dims)), quant_type, begin, end))
        return table


def tensor_shapes(path: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The file's tensors' shapes under transformers' names (rope_freqs left out)."""
    for entry in tensor_table(path):
        name = hf_name(entry.name)
        if name != ROPE_FREQS:
            yield name, entry.shape


def check(path: Path) -> None:
    """Refuse, before anything loads, a file whose tensor table does not fit the file, or
    whose architecture, tensors or quantization types this engine cannot run: ValueError
    naming what and where. (A file checked once is not read again while unchanged.)"""
    _check(*_file_key(path))


@functools.lru_cache(maxsize=16)
def _check(name: str, size: int, mtime_ns: int) -> None:
    path = Path(name)
    try:
        from gguf import GGMLQuantizationType, GGUFReader
        from gguf.quants import _type_traits
    except ImportError:
        raise ValueError(f"{path} is a GGUF file, which needs the gguf package: pip install "
                         "'batchinfer[gguf]'") from None
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    tensor_table(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 (the reader's errors on a damaged file vary)
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _architecture(reader)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    unreadable = sorted({t.tensor_type.name for t in reader.tensors} - {q.name for q in readable})
    if unreadable:
        raise ValueError(f"{path}: GGUF quantization type {', '.join(unreadable)} is not "
                         "supported (the gguf package cannot dequantize it)")
    for tensor in reader.tensors:
        try:
            hf_name(tensor.name)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def hf_config(path: Path):
    """transformers' config of the file, with its rope_freqs (Llama 3.1's rope scaling as
    llama.cpp stores it: a factor each frequency is divided by, which transformers drops)
    as `rope_freq_factors` for batchinfer.model.config."""
    check(path)
    return copy.deepcopy(_hf_config(*_file_key(path)))


def hf_tokenizer(path: Path):
    """transformers' tokenizer of the file (a copy: the caller may change it)."""
    return copy.deepcopy(_hf_tokenizer(*_file_key(path)))


def _file_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


# transformers reads a GGUF file's whole metadata for each (the vocabulary's tokens and
# merges among it): 6-13 s for SmolLM2's 49k tokens. A process reads a file once for each,
# however many engines, jobs or checks ask; a file changed since is read again.
@functools.lru_cache(maxsize=4)
def _hf_config(name: str, size: int, mtime_ns: int):
    from gguf import GGUFReader
    from transformers import AutoConfig
    path = Path(name)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 (what transformers raises on a file's values varies)
        message = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{path}: transformers cannot read its metadata "
                         f"({type(e).__name__}: {message})") from None
    for tensor in GGUFReader(path).tensors:
        if tensor.name == ROPE_FREQS:
            config.rope_freq_factors = [float(v) for v in tensor.data.reshape(-1)]
    return config


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(name: str, size: int, mtime_ns: int):
    from transformers import AutoTokenizer
    path = Path(name)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def iter_weights(path: Path, num_heads: int, num_kv_heads: int, dtype: torch.dtype
                 ) -> Iterator[tuple[str, CheckpointTensor]]:
    """The file's tensors under transformers' names, each dequantized to dtype when the
    loader reaches it (only one tensor is held dequantized at a time)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    reader = GGUFReader(path)
    permuted = ARCHITECTURES[_architecture(reader)]
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name == ROPE_FREQS:  # read into the config
            continue
        values = dequantize(tensor.data, tensor.tensor_type)
        if not values.flags.writeable:  # F32 tensors come as views of the read-only file
            values = values.copy()
        values = torch.from_numpy(values)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, num_heads if "q_proj" in name else num_kv_heads)
        yield name, CheckpointTensor.in_memory(values.to(dtype))


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's permute: per head, llama.cpp interleaves the two halves
    of the rotary dimensions; transformers keeps them apart."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _architecture(reader) -> str:
    field = reader.get_field("general.architecture")
    return field.contents() if field is not None else "(none)"
