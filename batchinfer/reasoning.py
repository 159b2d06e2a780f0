"""The reasoning split, with vLLM's parser names: what a reasoning model writes between
`<think>` and `</think>` apart from the answer after it.

    parser = ReasoningParser("deepseek_r1", tokenizer)
    in_reasoning = parser.starts_in_reasoning(prompt_token_ids)
    reasoning, answer = parser.split(output_token_ids, decode, in_reasoning)

The rules are those of vLLM's DeepSeekR1ReasoningParser and Qwen3ReasoningParser:
- a `<think>` the output writes opens the reasoning (text before it is dropped), its first
  `</think>` closes it, and what follows is the answer;
- output with no `</think>` ended inside the reasoning (it is all reasoning, the answer is
  empty) unless it started in the answer: the prompt already closed the reasoning (its
  last think tag is `</think>`, as Qwen3's template writes for enable_thinking false), or,
  for qwen3, the chat template was told enable_thinking false. Then it is all answer.

The tags are found by token id where each is one token of the vocabulary, else in the
text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START_TAG, END_TAG = "<think>", "</think>"


def check_parser_name(name: str) -> None:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of "
                         f"{', '.join(REASONING_PARSERS)}")


def _token_id(tokenizer, tag: str) -> int | None:
    """The id of `tag` when it is one token of the vocabulary."""
    to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
    if to_id is None:
        return None
    tid = to_id(tag)
    if not isinstance(tid, int) or tokenizer.convert_ids_to_tokens(tid) != tag:
        return None  # the unknown token's id
    return tid


class ReasoningParser:
    def __init__(self, name: str, tokenizer, chat_template_kwargs: dict | None = None):
        check_parser_name(name)
        self.name = name
        self.tokenizer = tokenizer
        # only Qwen3's parser reads the template's switch, as in vLLM
        self.thinking = name != "qwen3" or (chat_template_kwargs or {}).get(
            "enable_thinking", True) is not False
        self.start_token_id = _token_id(tokenizer, START_TAG)
        self.end_token_id = _token_id(tokenizer, END_TAG)
        self.by_token = self.start_token_id is not None and self.end_token_id is not None

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether output after this prompt starts inside the reasoning (see the module)."""
        return self.thinking and not self._prompt_ends_reasoning(prompt_token_ids)

    def _prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        if self.by_token:
            for t in reversed(prompt_token_ids):
                if t == self.end_token_id:
                    return True
                if t == self.start_token_id:
                    return False
            return False
        text = self.tokenizer.decode(list(prompt_token_ids), skip_special_tokens=False)
        return text.rfind(END_TAG) > text.rfind(START_TAG)

    def split(self, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
              in_reasoning: bool, text: str | None = None) -> tuple[str | None, str]:
        """(reasoning, answer) of one completion: reasoning None where it has none, the
        answer "" where it has none. `decode` turns ids into the completion's text; `text`,
        when given, is that text cut short by a stop string (the cut comes off the end)."""
        if not self.by_token:
            return self.split_text(decode(token_ids) if text is None else text, in_reasoning)
        ids = list(token_ids)
        end = ids.index(self.end_token_id) if self.end_token_id in ids else None
        head = ids[:end] if end is not None else ids
        start = head.index(self.start_token_id) if self.start_token_id in head else None
        if start is None and end is None:
            whole = decode(ids) if text is None else text
            return (whole, "") if in_reasoning else (None, whole)
        reasoning = decode(ids[(start + 1 if start is not None else 0):
                               (end if end is not None else len(ids))])
        answer = decode(ids[end + 1:]) if end is not None else ""
        if text is not None:  # a stop string cut the end of the completion
            cut = max(len(decode(ids)) - len(text), 0)
            if end is not None:
                answer = answer[:max(len(answer) - cut, 0)]
            else:
                reasoning = reasoning[:max(len(reasoning) - cut, 0)]
        return reasoning, answer

    def split_text(self, text: str, in_reasoning: bool) -> tuple[str | None, str]:
        """split() on text, for tags that are not single tokens (vLLM's rule on text)."""
        end = text.find(END_TAG)
        start = text.find(START_TAG, 0, end if end >= 0 else len(text))
        if start < 0 and end < 0:
            return (text, "") if in_reasoning else (None, text)
        begin = start + len(START_TAG) if start >= 0 else 0
        if end < 0:
            return text[begin:], ""
        return text[begin:end], text[end + len(END_TAG):]
