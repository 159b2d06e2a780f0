"""The reasoning split (batchinfer/reasoning.py), by token id and by text."""
import pytest

from batchinfer.reasoning import ReasoningParser

START, END = 900, 901  # the tags' ids in the tokenizer below


class Tokenizer:
    """Ids 0-25 are the letters a-z; START and END are the think tags."""

    def convert_tokens_to_ids(self, token):
        return {"<think>": START, "</think>": END}.get(token, 0)

    def convert_ids_to_tokens(self, tid):
        return {START: "<think>", END: "</think>"}.get(tid, chr(ord("a") + tid % 26))

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.convert_ids_to_tokens(t) for t in ids)


class TextTokenizer:
    """No tags in the vocabulary: the text decides."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(t) for t in ids)


def ids(text):
    """'ab<think>cd</think>e' -> token ids of Tokenizer."""
    out = []
    for part in text.replace("<think>", "\0S\0").replace("</think>", "\0E\0").split("\0"):
        out += ([START] if part == "S" else [END] if part == "E"
                else [ord(c) - ord("a") for c in part])
    return out


def split(name, output, prompt="", by_token=True, stop_text=None, **kwargs):
    tok = Tokenizer() if by_token else TextTokenizer()
    parser = ReasoningParser(name, tok, kwargs or None)
    assert parser.by_token == by_token
    prompt_ids = ids(prompt) if by_token else [ord(c) for c in prompt]
    out_ids = ids(output) if by_token else [ord(c) for c in output]
    return parser.split(out_ids, tok.decode, parser.starts_in_reasoning(prompt_ids), stop_text)


CASES = [
    # (parser, prompt, output, (reasoning, answer))
    ("deepseek_r1", "q", "<think>abc</think>yes", ("abc", "yes")),  # the model opens it
    ("deepseek_r1", "q<think>", "abc</think>yes", ("abc", "yes")),  # the template opened it
    ("deepseek_r1", "q<think>", "abcd", ("abcd", "")),  # cut off inside the reasoning
    ("deepseek_r1", "q", "<think>abcd", ("abcd", "")),
    ("deepseek_r1", "q", "abcd", ("abcd", "")),  # vLLM: no </think> is all reasoning
    ("deepseek_r1", "q<think>", "</think>yes", ("", "yes")),
    ("deepseek_r1", "q<think>", "ab</think>", ("ab", "")),
    ("deepseek_r1", "q<think>x</think>", "yes", (None, "yes")),  # the prompt closed it
    ("qwen3", "q<think>", "abc</think>yes", ("abc", "yes")),
    ("qwen3", "q", "<think>abc</think>yes", ("abc", "yes")),
    ("qwen3", "q<think>", "abc", ("abc", "")),
    ("qwen3", "q<think></think>", "yes", (None, "yes")),  # enable_thinking false's template
    ("qwen3", "q", "yes", ("yes", "")),
]


@pytest.mark.parametrize("by_token", [True, False])
@pytest.mark.parametrize("name,prompt,output,expected", CASES)
def test_split(name, prompt, output, expected, by_token):
    assert split(name, output, prompt, by_token) == expected


@pytest.mark.parametrize("by_token", [True, False])
def test_qwen3_without_thinking_is_all_answer(by_token):
    assert split("qwen3", "yes", "q", by_token, enable_thinking=False) == (None, "yes")
    assert split("qwen3", "<think>a</think>yes", "q", by_token,
                 enable_thinking=False) == ("a", "yes")
    # deepseek_r1 does not read the switch, as in vLLM
    assert split("deepseek_r1", "yes", "q", by_token, enable_thinking=False) == ("yes", "")


def test_a_stop_string_cuts_the_last_part():
    assert split("deepseek_r1", "abc</think>yesno", "q<think>",
                 stop_text="abc</think>yes") == ("abc", "yes")
    assert split("deepseek_r1", "abcdef", "q<think>", stop_text="abc") == ("abc", "")


def test_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'.*deepseek_r1, qwen3"):
        ReasoningParser("r1", Tokenizer())
