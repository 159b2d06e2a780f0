"""Batched tokenization (LLMEngine.encode_prompts) gives the ids of encoding each text
alone, for the tokenizer classes transformers picks for our test architectures and for a
SentencePiece-style (Metaspace) tokenizer, whose first piece of a text is treated apart."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from batchinfer.engine.engine import LLMEngine
from batchinfer.random_checkpoint import default_corpus

TEXTS = [
    "A plain sentence about rivers.",
    " leading space",
    "  two leading spaces and a trailing one ",
    "\nstarts with a newline",
    "naïve café, 東京, emoji 🙂",
    "a literal <s> and </s> and <|endoftext|> inside",
    "x",
    "word " * 300,
]


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(default_corpus()[:200], trainer=trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(params=["llama", "qwen2", "gemma3", "phi3", "metaspace"])
def tokenizer(request):
    if request.param == "metaspace":
        return metaspace_tokenizer()
    return AutoTokenizer.from_pretrained(request.getfixturevalue(f"{request.param}_dir"))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_batch_encodes_as_each_text_alone(tokenizer, add_special_tokens):
    engine = SimpleNamespace(tokenizer=tokenizer)
    got = LLMEngine.encode_prompts(engine, TEXTS, add_special_tokens)
    assert got == [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in TEXTS]
    assert all(isinstance(ids, list) and ids for ids in got)
    assert LLMEngine.encode_prompts(engine, [], add_special_tokens) == []


def test_text_that_is_not_unicode_is_refused(llama_dir):
    engine = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(llama_dir))
    with pytest.raises(ValueError, match="not valid Unicode"):
        LLMEngine.encode_prompts(engine, ["fine", "bad \ud800 x"])
