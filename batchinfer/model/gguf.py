"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights.

transformers reads the file's metadata into a config and a tokenizer with its chat
template (`gguf_file=`); the weights are dequantized here by the `gguf` package, one tensor
at a time, to the compute dtype under transformers' names, with the q/k rows llama.cpp
permutes for its rotary layout put back, as transformers' load_gguf_checkpoint does.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
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


def check(path: Path) -> None:
    """Refuse, before anything loads, a file whose architecture, tensors or quantization
    types this engine cannot run: ValueError naming what and where."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
        from gguf.quants import _type_traits
    except ImportError:
        raise ValueError(f"{path} is a GGUF file, which needs the gguf package: pip install "
                         "'batchinfer[gguf]'") from None
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None
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
    from gguf import GGUFReader
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for tensor in GGUFReader(path).tensors:
        if tensor.name == ROPE_FREQS:
            config.rope_freq_factors = [float(v) for v in tensor.data.reshape(-1)]
    return config


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer
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
