import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import batchinfer.demo as demo
import batchinfer.random_checkpoint as random_checkpoint
import checkpoints
from batchinfer.random_checkpoint import (
    MIN_VOCAB_SIZE,
    SHAPES,
    build_random_checkpoint,
    build_tokenizer,
    main,
)

TEXTS = [
    "The lighthouse keeper wrote the weather in the logbook twice a day.",
    "  leading spaces, trailing tab\t and\nnew lines\n\n",
    "Ünïcödé, emoji 🙂🚲, CJK 灯台, and an unseen word: zyxwvut.",
    "<|eot_id|> is text here only when it is not special",
    "",
]


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("vocab_size", [300, 1000])
def test_tokenizer_round_trips_and_has_requested_size(tmp_path, vocab_size):
    build_tokenizer(tmp_path, vocab_size)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == vocab_size
    for text in TEXTS[:3] + TEXTS[4:]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids[1:]) == text
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Every id the model can sample decodes; the last ids (fillers at 300) are words.
    assert len(tok.convert_ids_to_tokens(list(range(vocab_size)))) == vocab_size
    assert tok.decode([vocab_size - 1]).strip()
    assert tok.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]) \
        == [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]


def test_tokenizer_files_are_deterministic(tmp_path):
    build_tokenizer(tmp_path / "a", 700)
    build_tokenizer(tmp_path / "b", 700)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_tokenizer_rejects_tiny_vocab_and_empty_corpus(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, MIN_VOCAB_SIZE - 1)
    with pytest.raises(ValueError, match="corpus"):
        build_tokenizer(tmp_path, 400, corpus=[])


def test_tokenizer_trains_on_given_corpus(tmp_path):
    tok = build_tokenizer(tmp_path, 400, corpus=["abracadabra " * 50])
    assert len(tok("abracadabra", add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_with_and_without_system(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    chat = [{"role": "user", "content": "Hi there "}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>")
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + chat, tokenize=False,
        add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + chat,
                                  add_generation_prompt=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    header_end = [tok.convert_tokens_to_ids("<|end_header_id|>")] + \
        tok("\n\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(header_end):] == header_end
    assert tok.decode(ids) == rendered


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3"])
def test_test_shapes_load_and_generate_deterministically(request, name):
    path = request.getfixturevalue(f"{name}_dir")
    shape = SHAPES[checkpoints.CHECKPOINTS[name]["shape"]]
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == shape["model_type"]
    tok = AutoTokenizer.from_pretrained(path)
    assert config.vocab_size == len(tok)
    ids = tok(TEXTS[2])["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == TEXTS[2]
    assert config.max_position_embeddings >= 1024
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [1, 5]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    norms = [p for n, p in params.items() if n.endswith("norm.weight")]
    assert norms and all(not torch.allclose(p, torch.ones_like(p)) for p in norms)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    if shape["tie_word_embeddings"]:
        assert "lm_head.weight" not in stored
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert "lm_head.weight" in stored
    if name == "qwen2":
        assert params["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    if name == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in params
    if "head_dim" in shape:
        assert params["model.layers.0.self_attn.q_proj.weight"].shape[0] == \
            shape["num_attention_heads"] * shape["head_dim"] != shape["hidden_size"]

    prompts = checkpoints.mixed_prompts(tok, 3, 1, 80)
    first = checkpoints.hf_greedy(path, prompts, 16, ignore_eos=True)
    second = checkpoints.hf_greedy(path, prompts, 16, ignore_eos=True)
    assert first == second
    # Random weights still give varied continuations, not one token repeated.
    assert all(len(tokens) == 16 and len(set(tokens)) >= 4 for tokens in first.token_ids)
    assert len({t for tokens in first.token_ids for t in tokens}) >= 24
    assert len({tuple(t) for t in first.token_ids}) == 3
    assert all(steps[i][0] == tokens[i] for tokens, steps in zip(first.token_ids, first.top5)
               for i in range(16))


def test_mistral_sliding_window_is_smaller_than_test_prompts(mistral_dir):
    config = AutoConfig.from_pretrained(mistral_dir)
    assert config.sliding_window == 64


def test_legacy_and_new_rope_keys_load_to_same_parameters(llama_dir, llama_legacy_rope_dir):
    new = json.loads((llama_dir / "config.json").read_text())
    legacy = json.loads((llama_legacy_rope_dir / "config.json").read_text())
    assert "rope_theta" not in new and new["rope_parameters"]["rope_type"] == "llama3"
    assert "rope_parameters" not in legacy
    assert legacy["rope_theta"] == 500000.0 and legacy["rope_scaling"]["rope_type"] == "llama3"
    assert AutoConfig.from_pretrained(llama_legacy_rope_dir).rope_parameters == \
        AutoConfig.from_pretrained(llama_dir).rope_parameters
    assert _files(llama_dir)["model.safetensors"] == \
        _files(llama_legacy_rope_dir)["model.safetensors"]


def test_legacy_rope_without_scaling_writes_null(tmp_path):
    build_random_checkpoint(tmp_path, "test-mistral", rope_style="legacy", weights=False)
    legacy = json.loads((tmp_path / "config.json").read_text())
    assert legacy["rope_scaling"] is None and legacy["rope_theta"] == 10000.0
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == \
        {"rope_type": "default", "rope_theta": 10000.0}


def test_sharded_checkpoint_has_index_and_loads(llama_dir, llama_sharded_dir):
    index = json.loads((llama_sharded_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert shards == {p.name for p in llama_sharded_dir.glob("model-*.safetensors")}
    sharded = AutoModelForCausalLM.from_pretrained(llama_sharded_dir).state_dict()
    whole = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_checkpoint_is_deterministic_and_seeded(tmp_path):
    build_random_checkpoint(tmp_path / "a", "test-qwen2", vocab_size=400, dtype="bfloat16")
    build_random_checkpoint(tmp_path / "b", "test-qwen2", vocab_size=400, dtype="bfloat16")
    build_random_checkpoint(tmp_path / "c", "test-qwen2", vocab_size=400, dtype="bfloat16",
                            seed=1)
    a, b, c = (_files(tmp_path / d) for d in "abc")
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert json.loads(a["config.json"])["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())


def test_big_shape_without_weights(tmp_path):
    path = build_random_checkpoint(tmp_path, "llama3-8b", weights=False)
    assert not list(path.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads,
            config.vocab_size) == (4096, 32, 8, 128256)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["original_max_position_embeddings"] == 8192
    assert len(AutoTokenizer.from_pretrained(path)) == 128256


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'llama9'"):
        build_random_checkpoint(tmp_path, "llama9")
    with pytest.raises(ValueError, match="model_type"):
        build_random_checkpoint(tmp_path, {"model_type": "gpt2", "hidden_size": 8})
    with pytest.raises(ValueError, match="dtype"):
        build_random_checkpoint(tmp_path, "test-llama", dtype="int8")
    with pytest.raises(ValueError, match="rope_style"):
        build_random_checkpoint(tmp_path, "test-llama", rope_style="old")


def test_main_writes_checkpoint(tmp_path, capsys):
    main([str(tmp_path / "out"), "--shape", "test-qwen3", "--vocab-size", "512",
          "--no-weights"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert AutoConfig.from_pretrained(tmp_path / "out").vocab_size == 512
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--shape", "nope"])


def test_demo_model_is_built_once(demo_dir, monkeypatch):
    assert demo_dir.name == "demo-v1" and (demo_dir / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(demo_dir).model_type == "llama"
    assert "random weights" in demo.DEMO_NOTICE and "\n" not in demo.DEMO_NOTICE

    def fail(*args, **kwargs):
        raise AssertionError("demo model rebuilt")

    monkeypatch.setattr(random_checkpoint, "build_random_checkpoint", fail)
    assert demo.demo_model_path() == demo_dir
    # no staging copy left beside it (the cache root also holds other things: kernels, ...)
    assert [p.name for p in demo_dir.parent.iterdir() if "demo-v1" in p.name] == ["demo-v1"]


def test_demo_build_losing_a_race_keeps_the_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path))

    def build_while_another_process_finishes(out_dir, shape, **kwargs):
        winner = tmp_path / "demo-v1"
        winner.mkdir()
        (winner / "config.json").write_text("{}")
        (Path(out_dir) / "config.json").write_text('{"loser": true}')

    monkeypatch.setattr(random_checkpoint, "build_random_checkpoint",
                        build_while_another_process_finishes)
    path = demo.demo_model_path()
    assert path == tmp_path / "demo-v1"
    assert (path / "config.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["demo-v1"]


def test_demo_refuses_an_incomplete_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path))
    (tmp_path / "demo-v1").mkdir()
    (tmp_path / "demo-v1" / "stray").write_text("")
    with pytest.raises(RuntimeError, match="delete it"):
        demo.demo_model_path()


def test_mixed_prompts_cover_the_length_range(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    prompts = checkpoints.mixed_prompts(tok, 20, 1, 320, seed=3)
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 1 and max(lengths) == 320 and len(set(lengths)) > 10
    assert all(p[0] == tok.bos_token_id for p in prompts)
    assert prompts == checkpoints.mixed_prompts(tok, 20, 1, 320, seed=3)
    assert prompts != checkpoints.mixed_prompts(tok, 20, 1, 320, seed=4)
    shared = checkpoints.shared_prefix_prompts(tok, 5, 40, 10)
    assert all(p[:40] == shared[0][:40] and 41 <= len(p) <= 50 for p in shared)


def test_compare_greedy_counts_exact_tolerated_and_mismatched():
    theirs = [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]]
    ours = [[1, 2, 3], [1, 7, 8], [1, 9, 3], [1, 2]]
    top = [[[1, 0], [2, 7], [3, 0]]] * 4
    our_top = [[[1], [2], [3]], [[1], [7, 2], [8]], [[1], [9], [3]], [[1], [2]]]
    result = checkpoints.compare_greedy(ours, theirs, our_top, top)
    assert (result.exact, result.tolerated, result.mismatched) == (1, 1, 2)
    assert not result.ok and "prompt 2: step 1" in result.failures[0]
    assert "lengths 2 (ours) and 3" in result.failures[1]
    with pytest.raises(ValueError, match="one entry per prompt"):
        checkpoints.compare_greedy(ours, theirs[:1], our_top, top)


def test_hf_greedy_stops_at_eos_unless_told_not_to(tmp_path):
    path = build_random_checkpoint(tmp_path, "test-mistral", vocab_size=300)
    prompts = [[0, 10 + i, 20 + i] for i in range(8)]
    stopped = checkpoints.hf_greedy(path, prompts, 40)
    early = [i for i, t in enumerate(stopped.token_ids) if len(t) < 40]
    assert early, "no prompt reached eos; pick prompts that do"
    assert all(stopped.token_ids[i][-1] in (1, 5) for i in early)
    full = checkpoints.hf_greedy(path, [prompts[i] for i in early], 40, ignore_eos=True)
    for i, tokens in zip(early, full.token_ids):
        assert len(tokens) == 40 and tokens[:len(stopped.token_ids[i])] == \
            stopped.token_ids[i]


def test_a_cached_demo_model_loads_without_transformers_model_classes(demo_dir):
    """Only building the demo model needs them (a second of imports on every start)."""
    import subprocess
    import sys
    code = ("import sys; from batchinfer.demo import resolve_model; "
            "from batchinfer.model.loader import resolve_model_path; "
            "print(resolve_model_path(resolve_model('demo'))); "
            "print('transformers.models.auto.modeling_auto' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == [str(demo_dir), "False"]
