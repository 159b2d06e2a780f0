"""Finding and loading models: local directories, the local HF cache, sharded and pickle
weights, unsupported architectures — and clear errors for each mistake."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from batchinfer import LLM, SamplingParams
from batchinfer.model.loader import resolve_model_path

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 301, 302]]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_missing_model_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError) as err:
        LLM(model="some-org/no-such-model")
    message = str(err.value)
    assert "some-org/no-such-model" in message and str(tmp_path / "hub") in message
    assert "never downloads" in message


def test_hub_id_found_in_local_cache(llama_dir, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(llama_dir, snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("acme/tiny-llama") == snapshot
    assert _tokens(LLM(model="acme/tiny-llama")) == _tokens(LLM(model=str(llama_dir)))


def test_pickle_weights_refused_unless_allowed(llama_dir, tmp_path):
    from safetensors.torch import load_file
    pickled = tmp_path / "pickled"
    shutil.copytree(llama_dir, pickled, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = {}
    for f in llama_dir.glob("*.safetensors"):
        state.update(load_file(f))
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle_weights"):
        LLM(model=str(pickled))
    llm = LLM(model=str(pickled), allow_pickle_weights=True)
    assert _tokens(llm) == _tokens(LLM(model=str(llama_dir)))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_weights_file_is_named(llama_dir, tmp_path, damage):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = sorted(broken.glob("*.safetensors"))[0]
    data = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file" if damage == "garbage" else data[:len(data) // 2])
    with pytest.raises(ValueError) as err:
        LLM(model=str(broken))
    assert str(weights) in str(err.value) and "damaged or incomplete" in str(err.value)


def test_unsupported_architecture_lists_supported(llama_dir, tmp_path):
    other = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LLM(model=str(other))
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model=str(tmp_path))


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=12), "block_size"), (dict(dtype="float8"), "dtype"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(attention_backend="cuda"), "attention_backend"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
])
def test_bad_engine_arguments_name_the_field(llama_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(llama_dir), **kwargs)


def test_unknown_argument(llama_dir):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(model=str(llama_dir), max_num_sequences=4)


def test_max_model_len_beyond_the_model(llama_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(model=str(llama_dir), max_model_len=10 ** 6)


def test_longrope_runs_within_its_short_context(phi3_dir):
    # test-phi3: LongRoPE, max_position_embeddings 4096, original 1024
    assert LLM(model=str(phi3_dir)).llm_engine.max_model_len == 1024
    assert LLM(model=str(phi3_dir), max_model_len=600).llm_engine.max_model_len == 600
    with pytest.raises(ValueError, match="exceeds 1024: .*LongRoPE .*short-context factors"):
        LLM(model=str(phi3_dir), max_model_len=2048)


def test_fused_tensor_of_the_wrong_size(tmp_path, phi3_dir):
    from safetensors.torch import load_file, save_file
    model = shutil.copytree(phi3_dir, tmp_path / "cut")
    weights = load_file(model / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-32]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint tensor .*qkv_proj.weight. has 224 rows, expected 256 "
                                         r"\(128 \+ 64 \+ 64\)"):
        LLM(model=str(model))


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_vision_language_checkpoint_runs_its_text_decoder(tmp_path, gemma3_dir, layout):
    # a Gemma 3 vision-language checkpoint (4B and up) holding test-gemma3's decoder under
    # the prefix of older or newer transformers, beside vision tensors that are not loaded
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Gemma3Config, SiglipVisionConfig
    model = tmp_path / "vlm"
    shutil.copytree(gemma3_dir, model)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    text_config = AutoConfig.from_pretrained(gemma3_dir).to_dict()
    del text_config["dtype"], text_config["eos_token_id"]  # hub files set them outside only
    config = Gemma3Config(text_config=text_config, vision_config=vision.to_dict(),
                          eos_token_id=[5, 7])
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.save_pretrained(model)
    (model / "generation_config.json").unlink()
    weights = {layout + name.removeprefix("model."): t
               for name, t in load_file(gemma3_dir / "model.safetensors").items()}
    weights["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(32)
    weights["multi_modal_projector.mm_soft_emb_norm.weight"] = torch.ones(32)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 40, 50, 60, 70], [1, 300, 301, 302, 303, 304, 305, 306]]
    text_only = LLM(model=str(gemma3_dir), dtype="bfloat16").generate(prompts, params)
    llm = LLM(model=str(model))
    assert llm.llm_engine.model_config.model_type == "gemma3_text"
    assert llm.llm_engine.dtype == torch.bfloat16  # the outer config's, under dtype "auto"
    assert {5, 7} <= llm.llm_engine.eos_token_ids
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in text_only]


def test_moe_checkpoint_missing_an_expert(tmp_path, qwen3_moe_dir):
    from safetensors.torch import load_file, save_file
    model = shutil.copytree(qwen3_moe_dir, tmp_path / "cut")
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model.layers.2.mlp: expert 5 up_proj"):
        LLM(model=str(model))


def test_moe_models_on_cpu_are_not_captured_in_graphs(mixtral_dir, llama_dir):
    # the CPU expert loop reads token counts on the host (CUDA runs the grouped kernels)
    model = LLM(model=str(mixtral_dir), device="cpu").llm_engine.model_runner.model
    assert not model.graph_safe
    assert LLM(model=str(llama_dir), device="cpu").llm_engine.model_runner.model.graph_safe


def test_dummy_weights_load_format(llama_dir):
    llm = LLM(model=str(llama_dir), load_format="dummy")
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"},
     "compressed-tensors format 'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     "weights of type 'float' with 4 bits"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
])
def test_a_quantized_checkpoint_is_refused_before_its_weights_load(tmp_path, llama_dir,
                                                                    monkeypatch, quant, message):
    import batchinfer.engine.model_runner as model_runner
    model = shutil.copytree(llama_dir, tmp_path / "quantized")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = quant
    (model / "config.json").write_text(json.dumps(config))

    def load_model(*args, **kwargs):
        raise AssertionError("weights were loaded")
    monkeypatch.setattr(model_runner, "load_model", load_model)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(model))
