"""Find a model directory and fill our modules from its weights.

Never downloads: a model is a local directory or a hub id already in the local HF cache.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from batchinfer.model import cpu_linear, fp8, gguf
from batchinfer.model.checks import check_config, checked_scales
from batchinfer.model.config import ModelConfig, supported_architecture, text_config
from batchinfer.model.kv_scales import take_kv_scales
from batchinfer.model.llama import CausalLM, GemmaRMSNorm
from batchinfer.model.weights import CheckpointTensor, file_tensors


def resolve_model_path(model: str) -> Path:
    """A local directory, a hub id from the cache, or a GGUF file (given, or the one .gguf
    of a directory without config.json). (The built-in "demo" model is found by the callers
    that offer it: batchinfer.demo.resolve_model.)"""
    path = Path(model).expanduser()
    if gguf.is_gguf(path):
        return path
    if path.is_dir():
        try:
            found = gguf.find_gguf(path)
        except ValueError as e:
            raise FileNotFoundError(str(e)) from None
        if found is not None:
            return found
    return _resolve(model, "model", ("config.json",))


def hf_config(path: Path, trust_remote_code: bool = False):
    """transformers' config of the model at path (a resolve_model_path), its values checked
    (batchinfer.model.checks) before and after transformers reads them: ValueError naming
    the file and field."""
    if gguf.is_gguf(path):
        config, where = gguf.hf_config(path), str(path)
    else:
        where = check_config_file(path)
        from transformers import AutoConfig
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 (what transformers raises on a file's values varies)
            raise ValueError(f"{where}: transformers cannot read it "
                             f"({type(e).__name__}: {_first_line(e)})") from None
    text, architecture = text_config(config)
    architecture or supported_architecture(text)  # an unsupported one is named first
    check_config(text, where)
    return config


def check_config_file(path: Path) -> str:
    """Check the values of a model directory's config.json as the file gives them (before
    transformers reads it, which some values crash); returns the file's name."""
    where = str(path / "config.json")
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object")
    check_config(raw, where, complete=False)
    return where


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def tensor_shapes(path: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors' shapes under transformers' names, from the files' headers
    (nothing is read); none for pickle weights."""
    if gguf.is_gguf(path):
        yield from gguf.tensor_shapes(path)
        return
    for name, tensor in language_model_weights(iter_weights(path, allow_pickle=False,
                                                            headers_only=True)):
        yield name, tuple(tensor.shape)


def hf_tokenizer(path: Path, trust_remote_code: bool = False):
    """transformers' tokenizer of a model (a resolve_model_path) or tokenizer directory."""
    if gguf.is_gguf(path):
        return gguf.hf_tokenizer(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_tokenizer_path(tokenizer: str) -> Path:
    """A tokenizer given apart from the model: a local directory or a hub id from the cache."""
    return _resolve(tokenizer, "tokenizer", TOKENIZER_FILES)


def _resolve(name: str, what: str, markers: tuple[str, ...]) -> Path:
    """The directory `name` names: itself, or the newest snapshot of a hub id in the local
    cache; it must hold one of the marker files."""
    def marked(path: Path) -> bool:
        return any((path / m).is_file() for m in markers)

    path = Path(name).expanduser()
    if path.is_dir():
        if not marked(path):
            raise FileNotFoundError(f"{what} directory {path} has no {' or '.join(markers)}")
        return path
    looked = [str(path.resolve())]
    if "/" in name and not name.startswith((".", "/", "~")):
        cache = _hf_hub_cache()
        snapshots = cache / ("models--" + name.replace("/", "--")) / "snapshots"
        looked.append(str(snapshots))
        if snapshots.is_dir():
            found = sorted((p for p in snapshots.iterdir() if marked(p)),
                           key=lambda p: p.stat().st_mtime, reverse=True)
            if found:
                return found[0]
    raise FileNotFoundError(f"{what} {name!r} not found (looked in: {', '.join(looked)}); "
                            f"pass a local {what} directory or a hub id already in the local "
                            "Hugging Face cache — batchinfer never downloads")


def _hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


# vision-language checkpoints' weight names (config.LANGUAGE_MODELS): the decoder's under a
# prefix (older and newer transformers' layouts); the vision tower and projector are not loaded
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def language_model_weights(weights: Iterator[tuple[str, CheckpointTensor]]
                           ) -> Iterator[tuple[str, CheckpointTensor]]:
    """A checkpoint's tensors under the text decoder's names; vision tensors dropped."""
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        yield name, tensor


def iter_weights(path: Path, allow_pickle: bool, headers_only: bool = False
                 ) -> Iterator[tuple[str, CheckpointTensor]]:
    """Tensors of a (possibly sharded) safetensors checkpoint, each read when and as far as
    the model asks (batchinfer.model.weights); pickle only when allowed. headers_only:
    the safetensors files' tensors alone, nothing for pickle weights."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if files:
        from safetensors import SafetensorError
        for name in files:
            try:
                tensors = file_tensors(path / name)
            except (SafetensorError, OSError) as e:
                raise ValueError(f"cannot read the weights file {path / name} ({e}); it is "
                                 "damaged or incomplete: copy or download it again") from None
            yield from tensors
        return
    pickles = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
    if headers_only:
        return
    if not pickles:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    if not allow_pickle:
        raise ValueError(f"{path} holds only pickle weights ({pickles[0].name}); set "
                         "allow_pickle_weights to load them with torch.load(weights_only="
                         "True), or convert them to safetensors")
    for file in pickles:
        state = torch.load(file, map_location="cpu", weights_only=True)
        for key, tensor in state.items():
            yield key, CheckpointTensor.in_memory(tensor)


def build_model(config: ModelConfig, backend, dtype: torch.dtype,
                device: torch.device, max_position: int | None = None) -> CausalLM:
    """The model with empty parameters in dtype, FP8 layers' weights and scales kept in
    theirs (parameters marked keep_dtype); its rotary tables cover max_position positions
    (default: the config's max_position_embeddings)."""
    with torch.device(device):
        model = CausalLM(config, backend, dtype, max_position)
    return model._apply(lambda t: t if getattr(t, "keep_dtype", False) or not t.is_floating_point()
                        else t.to(dtype))


def load_model(path: Path, config: ModelConfig, backend, dtype: torch.dtype,
               device: torch.device, load_format: str = "auto", allow_pickle: bool = False,
               seed: int = 0, fp8_kv_cache: bool = False,
               max_position: int | None = None) -> CausalLM:
    """The model with its weights; with fp8_kv_cache, also the checkpoint's KV-cache scales
    (kv_scales), which are passed over otherwise. FP8 weight and input scales are checked
    as they load (checks.checked_scales)."""
    model = build_model(config, backend, dtype, device, max_position)
    if load_format == "dummy":
        _init_random(model, seed)
    elif gguf.is_gguf(path):
        model.load_weights(gguf.iter_weights(path, config.num_attention_heads,
                                             config.num_key_value_heads, dtype))
    else:
        weights = checked_scales(language_model_weights(iter_weights(path, allow_pickle)))
        model.load_weights(take_kv_scales(model, weights, fp8_kv_cache))
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights on this rank: its parameters (a tied table once) and
    the CPU linears' packed copies, which replace theirs."""
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(params.values()) + cpu_linear.packed_bytes(model)


def _init_random(model: CausalLM, seed: int) -> None:
    """Random weights for benchmarks on shapes with no checkpoint, drawn on the model's
    device (on one CPU thread, an 8B model's draws alone take about 45 s)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith(("_scale", "input_scale")):
            continue  # set with their FP8 weight
        if name.endswith("norm.weight"):  # unit scale (Gemma's norms store an offset from 1)
            norm = model.get_submodule(name.rsplit(".", 1)[0])
            param.data.fill_(0.0 if isinstance(norm, GemmaRMSNorm) else 1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            gen = gens.get(param.device)
            if gen is None:
                gen = gens[param.device] = torch.Generator(param.device).manual_seed(seed)
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            values.normal_(0.0, 0.02, generator=gen)
            if param.dtype == fp8.FP8:  # its scales too: weight_scale, or w13_scale ...
                owner_name, attr = name.rsplit(".", 1)
                owner = model.get_submodule(owner_name)
                rows, scale = fp8.quantize_rows(values.reshape(-1, values.shape[-1]))
                values = rows.reshape(values.shape)
                scales = getattr(owner, f"{attr}_scale")
                scales.data.copy_(scale.reshape(*scales.shape[:-1], 1).expand_as(scales))
                if getattr(owner, "input_scale", None) is not None:
                    owner.input_scale.data.fill_(0.02 * 4 / fp8.FP8_MAX)
            param.data.copy_(values)
