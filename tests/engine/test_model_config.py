"""ModelConfig.from_hf over every architecture's test shape: the shapes, the defaults it
fills in, and each architecture's differences as the layers read them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchinfer.model.config import LayerConfig, MoEConfig, ModelConfig
from batchinfer.random_checkpoint import SHAPES, make_config

TEST_SHAPES = [name for name in SHAPES if name.startswith("test-")]


def config(shape: str, **changes) -> ModelConfig:
    hf = make_config(shape)
    for name, value in changes.items():
        setattr(hf, name, value)
    return ModelConfig.from_hf(hf)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes_as_the_hf_config_gives_them(shape):
    hf = make_config(shape)
    c = ModelConfig.from_hf(hf)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
            c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings,
            c.rms_norm_eps, c.model_type) == \
        (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
         hf.num_attention_heads,
         1 if c.mla is not None else hf.num_key_value_heads,  # MLA: one latent row
         hf.max_position_embeddings, hf.rms_norm_eps, hf.model_type)
    assert c.architecture == hf.architectures[0]
    assert len(c.layers) == hf.num_hidden_layers
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert {layer.rope for layer in c.layers} == set(c.rope)
    assert c.dtype == "float32"


def test_head_dim_defaults_to_hidden_size_over_heads_and_sets_the_scale():
    llama, mistral = config("test-llama"), config("test-mistral")
    assert llama.head_dim == 32 != llama.hidden_size // llama.num_attention_heads
    assert mistral.head_dim == 64 // 4
    assert llama.attention_scale == 32 ** -0.5 and mistral.attention_scale == 16 ** -0.5
    assert config("test-gemma3").attention_scale == 48 ** -0.5  # query_pre_attn_scalar
    assert config("test-gemma2").attention_scale == 48 ** -0.5


def test_soft_capping_only_where_the_config_sets_it():
    gemma2 = config("test-gemma2")
    assert (gemma2.attn_softcap, gemma2.logit_softcap) == (10.0, 8.0)
    for shape in ("test-gemma3", "test-llama"):
        assert (config(shape).attn_softcap, config(shape).logit_softcap) == (None, None)


@pytest.mark.parametrize("shape, windows", [
    ("test-llama", [None, None]),
    ("test-mistral", [64, 64]),                 # every layer
    ("test-phi3", [96, 96]),
    ("test-phi4-mini", [None, None]),           # no window set
    ("test-qwen2", [None, None]),               # use_sliding_window off
    ("test-gemma2", [48, None, 48]),            # by layer type (transformers: even layers)
    ("test-gemma3", [48, None, 48]),            # by layer type
])
def test_sliding_windows_per_layer(shape, windows):
    assert [layer.sliding_window for layer in config(shape).layers] == windows


def test_qwen2_window_from_max_window_layers():
    c = config("test-qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1,
               layer_types=None)
    assert [layer.sliding_window for layer in c.layers] == [None, 32]


@pytest.mark.parametrize("shape, qkv_bias, qk_norm, gemma", [
    ("test-llama", False, False, False),
    ("test-mistral", False, False, False),
    ("test-qwen2", True, False, False),
    ("test-qwen3", False, True, False),
    ("test-phi3", False, False, False),
    ("test-mixtral", False, False, False),
    ("test-qwen3-moe", False, True, False),
    ("test-gemma2", False, False, True),
    ("test-gemma3", False, True, True),
])
def test_architecture_differences(shape, qkv_bias, qk_norm, gemma):
    c = config(shape)
    assert (c.qkv_bias, c.o_proj_bias, c.qk_norm) == (qkv_bias, False, qk_norm)
    assert c.gemma_norms == c.sandwich_norms == gemma
    assert c.embed_scale == (c.hidden_size ** 0.5 if gemma else None)
    assert c.hidden_act == ("gelu_pytorch_tanh" if gemma else "silu")


def test_attention_bias_on_all_projections_unless_qkv_always_has_one():
    llama = config("test-llama", attention_bias=True)
    assert llama.qkv_bias and llama.o_proj_bias
    qwen2 = config("test-qwen2", attention_bias=True)
    assert qwen2.qkv_bias and not qwen2.o_proj_bias


def test_rope_settings_per_layer_type_and_longrope_limit():
    gemma = config("test-gemma3")
    assert [layer.rope for layer in gemma.layers] == \
        ["sliding_attention", "full_attention", "sliding_attention"]
    assert gemma.rope["full_attention"]["rope_type"] == "linear"
    assert gemma.rope["full_attention"]["factor"] == 8.0
    assert gemma.rope["sliding_attention"]["rope_theta"] == 10000.0
    llama = config("test-llama")
    assert list(llama.rope) == ["full_attention"]
    assert llama.rope["full_attention"]["rope_type"] == "llama3"
    assert llama.short_context_limit is None
    phi4 = config("test-phi4-mini")
    assert phi4.short_context_limit == 1024
    assert phi4.rope["full_attention"]["partial_rotary_factor"] == 0.75


def older_config(shape: str, **changes) -> ModelConfig:
    """The shape's config as older transformers give it: rope_theta and rope_scaling."""
    hf = SimpleNamespace(**make_config(shape).to_dict())
    hf.rope_parameters = None
    hf.rope_theta = 1e6
    for name, value in changes.items():
        setattr(hf, name, value)
    return ModelConfig.from_hf(hf)


def test_gemma2_windows_on_even_layers_where_the_config_names_no_layer_types():
    gemma2 = older_config("test-gemma2", layer_types=None)
    assert [layer.sliding_window for layer in gemma2.layers] == [48, None, 48]


def test_yarn_under_the_older_keys_and_phi3s_old_name_for_longrope():
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    qwen = older_config("test-qwen2", rope_scaling=yarn)
    assert qwen.rope["full_attention"] == {
        "type": "yarn", "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
        "original_max_position_embeddings": 128, "partial_rotary_factor": 1.0}
    assert qwen.short_context_limit is None  # YaRN runs to max_position_embeddings
    # no factor: the ratio of the context lengths; a top-level original length wins
    implied = older_config("test-qwen2", original_max_position_embeddings=256, rope_scaling={
        "type": "yarn", "original_max_position_embeddings": 128})
    assert implied.rope["full_attention"]["original_max_position_embeddings"] == 256
    assert implied.rope["full_attention"]["factor"] == 2048 / 256
    phi3 = older_config("test-phi3", rope_scaling={
        "type": "yarn", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16})
    assert phi3.rope["full_attention"]["rope_type"] == "longrope"


def test_mixture_of_experts_blocks():
    mixtral = config("test-mixtral")
    assert mixtral.moe == MoEConfig(num_experts=4, top_k=2, intermediate_size=96,
                                    normalize=True, weights_in_model_dtype=False)
    assert [layer.moe for layer in mixtral.layers] == [True, True]
    qwen = config("test-qwen3-moe")
    assert qwen.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=48,
                                 normalize=True, weights_in_model_dtype=True)
    assert [layer.moe for layer in qwen.layers] == [True, False, True]  # mlp_only_layers [1]
    stepped = config("test-qwen3-moe", mlp_only_layers=[], decoder_sparse_step=2)
    assert [layer.moe for layer in stepped.layers] == [False, True, False]
    assert config("test-qwen3-moe", num_experts=0).moe is None
    assert config("test-llama").moe is None
    assert config("test-llama").layers[0] == LayerConfig(None, "full_attention", False)


def test_a_vision_language_checkpoint_gives_its_text_decoder():
    from transformers import Gemma3Config, SiglipVisionConfig
    text = make_config("test-gemma3")
    outer = Gemma3Config(text_config=text.to_dict(),
                         vision_config=SiglipVisionConfig(hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2,
                                                          intermediate_size=32).to_dict())
    outer.architectures = ["Gemma3ForConditionalGeneration"]
    outer.dtype, outer.eos_token_id = "bfloat16", [1, 106]
    c = ModelConfig.from_hf(outer)
    assert c.architecture == "Gemma3ForCausalLM" and c.model_type == "gemma3_text"
    assert (c.hidden_size, c.num_hidden_layers) == (text.hidden_size, text.num_hidden_layers)
    assert c.dtype == "bfloat16" and c.eos_token_id == [1, 106]


def test_a_config_without_architectures_goes_by_its_model_type():
    hf = make_config("test-qwen3")
    hf.architectures = None
    assert ModelConfig.from_hf(hf).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize("change, message", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "not supported; supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0}),
     "rope type 'dynamic' is not supported"),
])
def test_refuses_what_the_engine_does_not_implement(change, message):
    with pytest.raises(ValueError, match=message):
        config("test-llama", **change)
