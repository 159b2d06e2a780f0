"""FP8 checkpoints made from the tests' random-weight checkpoints, in the on-disk forms the
hub ships (tensor names, dtypes and scale shapes as each format stores them), each with a
float32 reference checkpoint holding the weights the FP8 bytes and scales stand for.

conftest.py puts this directory on sys.path: `import fp8_checkpoints`.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj", "w1", "w2", "w3",  # w1-w3: Mixtral's experts
           # DeepSeek-V3's latent attention (its latent norms and router stay unquantized)
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")

# form -> (how weights are scaled, the quantization_config written to config.json)
FORMS = {
    "compressed-tensors-tensor": ("tensor", {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                        "symmetric": True, "block_structure": None, "group_size": None},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": False, "symmetric": True}}}}),
    "compressed-tensors-channel": ("channel", {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                        "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": True, "symmetric": True}}}}),
    "compressed-tensors-block": ((32, 48), {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "block", "dynamic": False,
                        "symmetric": True, "block_structure": [32, 48]},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                  "group_size": 48, "dynamic": True, "symmetric": True}}}}),
    "fbgemm_fp8": ("channel", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                               "modules_to_not_convert": ["lm_head"]}),
    "fp8-block": ((128, 128), {"quant_method": "fp8", "activation_scheme": "dynamic",
                               "fmt": "e4m3", "weight_block_size": [128, 128]}),
    "fp8-tensor": ("tensor", {"quant_method": "fp8", "activation_scheme": "static"}),
    # blocks that tensor parallelism can cut: the test models' shards are 32-column multiples
    "fp8-block-32": ((32, 32), {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32]}),
}


STATIC_ACTIVATIONS = {"compressed-tensors-tensor": (1,), "fp8-tensor": ()}


def quantize(weight: torch.Tensor, how) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale as the format stores it) with scales so each scaled group's
    largest magnitude is 448."""
    w = weight.to(torch.float32)
    out, cols = w.shape
    if how == "tensor":
        scale = (w.abs().max() / 448).reshape(1)
        return (w / scale).to(FP8), scale
    if how == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        return (w / scale).to(FP8), scale
    b0, b1 = how
    rb, cb = math.ceil(out / b0), math.ceil(cols / b1)
    scale = torch.empty(rb, cb)
    for i in range(rb):
        for j in range(cb):
            scale[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / 448
    full = scale.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :cols]
    return (w / full).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, how) -> torch.Tensor:
    w = q.to(torch.float32)
    if how == "tensor":
        return w * scale.reshape(())
    if how == "channel":
        return w * scale
    b0, b1 = how
    return w * scale.repeat_interleave(b0, 0)[:w.shape[0]].repeat_interleave(b1, 1)[:, :w.shape[1]]


def write_fp8(src: Path, dst: Path, form: str, reference: Path | None = None) -> Path:
    """An FP8 copy of checkpoint `src` at `dst` in `form` (a FORMS key); with `reference`,
    also a float32 checkpoint of the dequantized weights there."""
    from safetensors.torch import load_file, save_file
    how, quant = FORMS[form]
    shutil.copytree(src, dst)
    weights = {}
    for file in sorted(src.glob("*.safetensors")):
        weights.update(load_file(file))
        (dst / file.name).unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    quantized, dequantized = {}, {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if parts[-1] == "weight" and len(parts) > 1 and parts[-2] in LINEARS:
            q, scale = quantize(tensor, how)
            module = name[:-len(".weight")]
            quantized[name] = q
            scale_name = "weight_scale_inv" if form.startswith("fp8-block") else "weight_scale"
            quantized[f"{module}.{scale_name}"] = scale.reshape(()) \
                if form == "fp8-tensor" else scale
            if form in STATIC_ACTIVATIONS:  # a calibrated scale: [1], or [] in fp8's form
                quantized[f"{module}.input_scale"] = torch.tensor(0.05).reshape(
                    STATIC_ACTIVATIONS[form])
            dequantized[name] = dequantize(q, scale, how)
        else:
            quantized[name] = tensor
            dequantized[name] = tensor.to(torch.float32)
    save_file(quantized, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=1))
    if reference is not None:
        shutil.copytree(src, reference, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
        (reference / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=1))
    return dst
