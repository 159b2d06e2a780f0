"""Prompts rendered from a row's columns: Jinja templates in the sandbox transformers renders
chat templates in (ImmutableSandboxedEnvironment), with StrictUndefined.

    --prompt-template 'Summarize "{{ title }}":\n{{ body }}'
    --messages-template @turns.json     [{"role": "system", "content": "..."}, ...]
    --system-prompt 'You review {{ category }} products.'

A column that is null in a row is undefined there: `{{ title }}` fails that row, `{{ title |
default('') }}` and `{% if title is defined %}` do not. Rendering is bounded: its output
to MAX_RENDER_CHARS and its time to MAX_RENDER_SECONDS; a row over either fails alone.
"""
from __future__ import annotations

import functools
import json
import re
import signal
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchinfer.job.errors import JobError

MAX_RENDER_CHARS = 1 << 22  # 4 Mi characters: far over any context
MAX_RENDER_SECONDS = 2.0
# a width or count in a format string or filter argument that would build a huge string
_HUGE_WIDTH = re.compile(r"\d{8,}")


class RenderError(ValueError):
    """A row's template failed: the message names the flag and the reason."""


class _Deadline(Exception):
    pass


class _CodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to the environment's checked_join, which bounds what it builds."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, with the work of one render bounded: `*`, `**`, `%`, `+` and `~`
    checked before they build a value, the width arguments of filters checked, and a
    deadline checked at every call, filter, attribute and item (and by a timer signal on
    the main thread)."""
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _CodeGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
                         extensions=[jinja2.ext.loopcontrols], keep_trailing_newline=False)
        self.deadline = float("inf")
        self.filters = {name: self._guarded(name, f) for name, f in self.filters.items()}

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Deadline

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.check_time()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                        and len(seq) * count > MAX_RENDER_CHARS):
                    raise RenderError(f"a repetition of {len(seq) * count} items is over the "
                                      f"limit of {MAX_RENDER_CHARS}")
        if (operator == "+" and isinstance(left, (str, list, tuple))
                and isinstance(right, (str, list, tuple))
                and len(left) + len(right) > MAX_RENDER_CHARS):
            raise RenderError(f"a concatenation of {len(left) + len(right)} items is over "
                              f"the limit of {MAX_RENDER_CHARS}")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1000:
            raise RenderError(f"the power {right} is over the limit of 1000")
        if operator == "%" and isinstance(left, str) and _HUGE_WIDTH.search(left):
            raise RenderError("a format width is over the limit")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.check_time()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):  # a string's method: the same checks as the filters
            _check_sizes(__obj.__name__, (owner, *args), kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def checked_join(self, items: tuple) -> str:
        """`a ~ b ~ ...`: the texts joined, refused over the limit."""
        self.check_time()
        texts = [str(item) for item in items]
        size = sum(map(len, texts))
        if size > MAX_RENDER_CHARS:
            raise RenderError(f"a concatenation of {size} characters is over the limit of "
                              f"{MAX_RENDER_CHARS}")
        return "".join(texts)

    def _guarded(self, name: str, func: Any) -> Any:
        """The filter, refusing a width or count that would build a huge string (the
        compiled template calls filters directly)."""
        # a filter passed its context or environment takes it first (jinja's pass_* marks)
        skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1

        @functools.wraps(func)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.check_time()
            _check_sizes(name, args[skip:], kwargs)
            return func(*args, **kwargs)
        return guarded

    def format_string(self, s: str, *args: Any, **kwargs: Any) -> str:
        if _HUGE_WIDTH.search(s):
            raise RenderError("a format width is over the limit")
        return super().format_string(s, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check_time()
        return super().getitem(obj, argument)


def _check_sizes(name: str, args: tuple, kwargs: dict) -> None:
    """Refuse a call (args[0] the value it works on) that would build a string over the
    limit: a width or count argument, a format width, or a replacement's growth."""
    sizes = [*args[1:], *kwargs.values()]
    if any(isinstance(a, int) and abs(a) > MAX_RENDER_CHARS for a in sizes):
        raise RenderError(f"an argument of {name!r} is over the limit")
    if name == "format" and any(isinstance(a, str) and _HUGE_WIDTH.search(a) for a in args):
        raise RenderError("a format width is over the limit")
    if name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        value, old, new = args[:3]
        if len(value) + (value.count(old) if old else len(value) + 1) * len(new) > MAX_RENDER_CHARS:
            raise RenderError(f"the text of {name!r} would be over the limit")


def read_template_text(value: str, flag: str) -> str:
    """A template given as TEXT, or the contents of the file after an "@"."""
    if not value.startswith("@"):
        return value
    path = Path(value[1:]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(f"{flag} {value}: cannot read {path}: {e}") from None


def parse_messages(value: str) -> list[dict[str, str]]:
    """--messages-template: @FILE (a JSON list, or TOML with a `messages` list or a role ->
    template table) or the JSON text of such a list; each item {role, content}."""
    flag = "--messages-template"
    where = f"{flag} {value}" if value.startswith("@") else flag
    text = read_template_text(value, flag)
    try:
        if value.startswith("@") and value.endswith(".toml"):
            data: Any = tomllib.loads(text).get("messages")
        else:
            data = json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise JobError(f"{where}: cannot parse it: {e}") from None
    if isinstance(data, dict):  # role -> template, in order
        data = [{"role": role, "content": content} for role, content in data.items()]
    if not isinstance(data, list) or not data:
        raise JobError(f"{where}: expected a non-empty list of {{role, content}} messages")
    for i, m in enumerate(data):
        if (not isinstance(m, dict) or set(m) != {"role", "content"}
                or not all(isinstance(v, str) and v for v in m.values())):
            raise JobError(f"{where}: message {i} must be {{\"role\": TEXT, \"content\": "
                           f"TEMPLATE}}, got {m!r}")
    return data


@dataclass(frozen=True)
class _Compiled:
    flag: str
    template: jinja2.Template
    names: frozenset[str]  # the columns it reads


class RowTemplates:
    """The job's templates, compiled once and checked against the input's columns."""

    def __init__(self, prompt: str | None, messages: list[dict[str, str]] | None,
                 system: str | None, columns: list[str]):
        self.env = _Environment()
        self.columns = columns
        self.prompt = self._compile(prompt, "--prompt-template") if prompt is not None else None
        self.messages = None if messages is None else [
            (m["role"], self._compile(m["content"], f"--messages-template message {i}"))
            for i, m in enumerate(messages)]
        self.system = self._compile(system, "--system-prompt") if system is not None else None

    def _compile(self, text: str, flag: str) -> _Compiled:
        try:
            ast = self.env.parse(text)
            template = self.env.from_string(ast)
        except jinja2.TemplateSyntaxError as e:
            raise JobError(f"{flag}: line {e.lineno}: {e.message}") from None
        names = meta.find_undeclared_variables(ast)  # less the globals (range, ...)
        missing = sorted(names - set(self.columns))
        if missing:
            raise JobError(f"{flag}: no column {missing[0]!r} in INPUT (columns: "
                           f"{', '.join(self.columns)})")
        # a column named like a global is the column
        names |= {node.name for node in ast.find_all(nodes.Name)
                  if node.ctx == "load" and node.name in self.env.globals} & set(self.columns)
        return _Compiled(flag, template, frozenset(names))

    def render_prompt(self, values: dict[str, Any]) -> str:
        return self._render(self.prompt, values)

    def render_messages(self, values: dict[str, Any]) -> list[dict[str, str]]:
        """The rendered messages; one whose content renders blank is left out."""
        messages = []
        for role, compiled in self.messages:
            content = self._render(compiled, values)
            if content.strip():
                messages.append({"role": role, "content": content})
        if not messages:
            raise RenderError("--messages-template: every message rendered empty")
        return messages

    def render_system(self, values: dict[str, Any]) -> str | None:
        return None if self.system is None else self._render(self.system, values)

    def _render(self, compiled: _Compiled, values: dict[str, Any]) -> str:
        """The template over the row's non-null columns, within the bounds. RenderError
        naming the flag and the reason when it fails."""
        context = {k: values[k] for k in compiled.names if values.get(k) is not None}
        self.env.deadline = time.monotonic() + MAX_RENDER_SECONDS
        try:
            with _alarm(MAX_RENDER_SECONDS):
                pieces, size = [], 0
                for piece in compiled.template.generate(context):
                    size += len(piece)
                    if size > MAX_RENDER_CHARS:
                        raise RenderError(f"{compiled.flag}: the text is over the limit of "
                                          f"{MAX_RENDER_CHARS} characters")
                    pieces.append(piece)
                    self.env.check_time()
                return "".join(pieces)
        except _Deadline:
            raise RenderError(f"{compiled.flag}: rendering took over {MAX_RENDER_SECONDS:g} "
                              "s") from None
        except RenderError as e:
            if str(e).startswith(compiled.flag):
                raise
            raise RenderError(f"{compiled.flag}: {e}") from None
        except jinja2.UndefinedError as e:
            name = re.match(r"'(\w+)' is undefined", str(e))
            null = name is not None and name.group(1) in values
            raise RenderError(f"{compiled.flag}: {e}" + (" (the column is null in this row)"
                                                         if null else "")) from None
        except (jinja2.TemplateError, ArithmeticError, TypeError, ValueError, LookupError,
                RecursionError, MemoryError) as e:
            raise RenderError(f"{compiled.flag}: {type(e).__name__}: {e}") from None
        finally:
            self.env.deadline = float("inf")


class _alarm:
    """A SIGALRM after `seconds` raising _Deadline, on the main thread (where a template's
    empty loops, which call nothing, can also be stopped); elsewhere nothing."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.armed = False

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
            return  # someone else's timer: leave it
        self.previous = signal.signal(signal.SIGALRM, _raise_deadline)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        self.armed = True

    def __exit__(self, *exc: Any) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def _raise_deadline(signum: int, frame: Any) -> None:
    raise _Deadline
