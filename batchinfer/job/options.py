"""The options of one job: a dataclass validated once, before any model is loaded."""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchinfer.flags import (ENGINE_NAMES, NODE_NAMES, SAMPLING_NAMES, engine_flags_in,
                              engine_kwargs)
from batchinfer.job.errors import JobError
from batchinfer.job.manifest import META_DIR, digest_of_text
from batchinfer.job.row_sampling import ALL_SAMPLING_COLUMNS, SAMPLING_COLUMNS
from batchinfer.job.shard import Shard
from batchinfer.job.templates import parse_messages, read_template_text
from batchinfer.job.text_rows import MAX_ROW_BYTES
from batchinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchinfer.config import EngineConfig

OUTPUT_FORMATS = ("parquet", "openai")


def flag(name: str) -> str:
    """The command-line flag of an option name: max_num_seqs -> --max-num-seqs."""
    return "--" + name.replace("_", "-")


@dataclass
class JobOptions:
    input: str | None = None
    model: str | None = None
    output: str | None = None
    split: str | None = None
    prompt_column: str | None = None
    messages_column: str | None = None
    system_prompt: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: str | None = None
    id_column: str | None = None
    prompt_template: str | None = None
    messages_template: str | None = None
    keep_prompt: bool = False
    sampling_columns: str | None = None
    limit: int | None = None
    # SamplingParams
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    choice: list[str] | None = None
    regex: str | None = None
    json_schema: str | None = None
    json_object: bool | None = None
    grammar: str | None = None
    reasoning_parser: str | None = None
    max_attempts: int = 1
    tools: str | None = None
    tool_call_parser: str | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # EngineConfig
    dtype: str | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    tensor_parallel_size: int | None = None
    attention_backend: str | None = None
    enforce_eager: bool | None = None
    async_scheduling: bool | None = None
    load_format: str | None = None
    pipeline_parallel_size: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    node_secret_file: str | None = None
    quantization: str | None = None
    device: str | None = None
    tokenizer: str | None = None
    generation_config: str | None = None
    trust_remote_code: bool | None = None
    allow_pickle_weights: bool | None = None
    # The job itself
    num_shards: int = 1
    shard_index: int | None = None
    data_parallel_size: int = 1
    reorder_window: int = 4096
    max_row_bytes: int = MAX_ROW_BYTES
    commit_rows: int = 10000
    commit_seconds: float = 60.0
    output_format: str = "parquet"
    save_token_ids: bool = False
    overwrite: bool = False
    progress: bool = True
    progress_interval: float = 30.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_textfile: str | None = None
    metrics_interval: float = 15.0
    max_n: int = 128
    dry_run: bool = False
    dry_run_rows: int | None = None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "JobOptions":
        unknown = set(values) - set(cls.names())
        if unknown:
            raise JobError(f"unknown option(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def validate(self) -> None:
        """Check everything that can be checked without the input or the model."""
        for name in ("input", "model", "output"):
            if not getattr(self, name):
                what = "INPUT" if name == "input" else flag(name)
                raise JobError(f"missing {what}: give it on the command line or in the job file")
        if self.tool_call_parser is not None:
            from batchinfer.tool_parsers import check_tool_parser_name
            try:
                check_tool_parser_name(self.tool_call_parser)
            except ValueError as e:
                raise JobError(f"--tool-call-parser: {e}") from None
        if self.reasoning_parser is not None:
            from batchinfer.reasoning import check_parser_name
            try:
                check_parser_name(self.reasoning_parser)
            except ValueError as e:
                raise JobError(f"--reasoning-parser: {e}") from None
        checks = [
            ("reorder_window", self.reorder_window >= 0, "must be >= 0"),
            ("max_row_bytes", self.max_row_bytes >= 1, "must be >= 1"),
            ("commit_rows", self.commit_rows >= 1, "must be >= 1"),
            ("commit_seconds", self.commit_seconds > 0, "must be > 0"),
            ("progress_interval", self.progress_interval > 0, "must be > 0"),
            ("metrics_interval", self.metrics_interval > 0, "must be > 0"),
            ("limit", self.limit is None or self.limit >= 0, "must be >= 0"),
            ("num_shards", self.num_shards >= 1, "must be >= 1"),
            ("data_parallel_size", self.data_parallel_size >= 1, "must be >= 1"),
            ("shard_index", self.shard_index is None
             or 0 <= self.shard_index < max(self.num_shards, 1),
             f"must be in [0, --num-shards) = [0, {self.num_shards})"),
            ("metrics_port", self.metrics_port is None
             or 0 <= self.metrics_port <= 65536 - self.data_parallel_size,
             "must be in [0, 65535]" if self.data_parallel_size == 1 else
             f"must be in [0, {65536 - self.data_parallel_size}] (process j of "
             f"--data-parallel-size {self.data_parallel_size} serves port P + j)"),
            ("max_n", self.max_n >= 1, "must be >= 1"),
            ("max_attempts", self.max_attempts >= 1, "must be >= 1"),
            ("node_rank", self.node_rank is None or 0 <= self.node_rank < (self.nnodes or 1),
             f"must be in [0, --nnodes) = [0, {self.nnodes or 1})"),
            ("data_parallel_size", self.data_parallel_size == 1 or (self.nnodes or 1) == 1,
             "cannot be combined with --nnodes (one engine spans the nodes)"),
            ("output_format", self.output_format in OUTPUT_FORMATS,
             f"must be one of {', '.join(OUTPUT_FORMATS)}"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise JobError(f"{flag(name)} {why}, got {getattr(self, name)!r}")
        if self.dry_run_rows is not None and not self.dry_run:
            raise JobError("--dry-run-rows needs --dry-run")
        if self.num_shards > 1 and self.shard_index is None:
            raise JobError(f"--num-shards {self.num_shards} needs --shard-index (which shard "
                           "this run takes)")
        if (self.n or 1) > self.max_n:
            raise JobError(f"--n {self.n} is over --max-n {self.max_n} completions per row; "
                           "raise --max-n to allow it")
        given = [flag(name) for name in ("prompt_column", "messages_column", "prompt_template",
                                         "messages_template") if getattr(self, name) is not None]
        if len(given) > 1:
            raise JobError(f"{' and '.join(given)} cannot be combined; give one of them")
        _check_can_hold(self.output, "--output")
        if self.metrics_textfile is not None:
            self._check_textfile(Path(self.metrics_textfile).expanduser())
        self.sampling_params()
        self.engine_config()
        self.system_prompt_text()
        self.chat_template_text()
        self.template_kwargs()
        self.prompt_template_text()
        self.messages_template_list()
        self.sampling_column_names()
        self.tools_value()
        if (self.nnodes or 1) > 1:
            self._check_nodes()

    def _check_nodes(self) -> None:
        """A multi-node job: the secret is there and --master-addr resolves."""
        import socket
        from batchinfer.engine.node_store import node_secret
        try:
            node_secret(self.node_secret_file)
        except ValueError as e:
            raise JobError(f"--nnodes {self.nnodes}: {e}") from None
        addr = self.master_addr or "127.0.0.1"
        try:
            socket.getaddrinfo(addr, self.master_port or 29501, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise JobError(f"--master-addr {addr}: cannot resolve it ({e.strerror}); give "
                           "node 0's host name or address") from None

    def _check_textfile(self, textfile: Path) -> None:
        """--metrics-textfile: a file in an existing directory, or in OUTDIR/__batchinfer__
        (which the job creates); not in OUTDIR itself, whose files readers take as Parquet."""
        outdir = Path(self.output).expanduser().resolve()
        where = textfile.parent.resolve()
        name = f"--metrics-textfile {self.metrics_textfile}"
        if where == outdir:
            raise JobError(f"{name}: a file in OUTDIR would be read as part of the Parquet "
                           f"dataset; write it elsewhere or in OUTDIR/{META_DIR}")
        if textfile.is_dir() or not (where.is_dir() or where == outdir / META_DIR):
            raise JobError(f"{name}: needs a file path in an existing directory")

    def model_sampling_defaults(self) -> dict[str, Any]:
        """The sampling defaults --generation-config gives (by default the model's
        generation_config.json), as SamplingParams fields, flags or not."""
        from batchinfer.model.generation_config import generation_defaults
        setting = self.generation_config or "auto"
        model_dir = None
        if self.model not in (None, "demo"):  # the demo's sets none
            from batchinfer.model.loader import resolve_model_path
            try:
                model_dir = resolve_model_path(self.model)
            except FileNotFoundError:
                pass  # check_model says so before any row runs
        try:
            return generation_defaults(model_dir, setting)
        except ValueError as e:
            raise JobError(re.sub(r"^generation_config ", "--generation-config ", str(e)))

    def sampling_from_model(self) -> dict[str, Any]:
        """The model's sampling defaults that apply: those no flag or job-file value sets."""
        return {k: v for k, v in self.model_sampling_defaults().items()
                if getattr(self, k) is None}

    def sampling_params(self) -> SamplingParams:
        """The job's SamplingParams: flags and job-file values, the model's defaults
        (sampling_from_model) for the rest, then SamplingParams' own, except max_tokens:
        unset, a completion runs until its end-of-sequence token or the context is full."""
        kwargs = {"max_tokens": None, **self.sampling_from_model()}
        kwargs.update((k, getattr(self, k)) for k in SAMPLING_NAMES
                      if getattr(self, k) is not None)
        given = [f for f, v in (("--choice", self.choice), ("--regex", self.regex),
                                ("--json-schema", self.json_schema),
                                ("--json-object", self.json_object),
                                ("--grammar", self.grammar)) if v]
        if len(given) > 1:
            raise JobError(f"{' and '.join(given)} cannot be combined; give one of them")
        if self.choice:
            kwargs["structured_outputs"] = {"choice": list(self.choice)}
        if self.regex is not None:
            kwargs["structured_outputs"] = {"regex": self.regex}
        if self.json_schema is not None:
            kwargs["structured_outputs"] = {"json": self.json_schema_value()}
        if self.json_object:
            kwargs["structured_outputs"] = {"json_object": True}
        if self.grammar is not None:
            kwargs["structured_outputs"] = {"grammar": self.grammar_value()}
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            message = re.sub(r"(SamplingParams|StructuredOutputsParams)\.(\w+)",
                             lambda m: flag(m.group(2)), str(e))
            constraint = given[0] if given else "--choice"
            message = message.replace("--structured-outputs", constraint)
            message = re.sub(r"^json schema:? ?", "--json-schema: ", message)
            message = re.sub(r"^grammar:? ?", f"{constraint}: ", message)
            raise JobError(re.sub(r"^regex:? ?", "--regex: ", message))

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of LLMEngine.from_kwargs, without `model`."""
        return engine_kwargs({name: getattr(self, name) for name in ENGINE_NAMES}) | {
            name: getattr(self, name) for name in NODE_NAMES if getattr(self, name) is not None}

    def engine_config(self) -> "EngineConfig":
        from batchinfer.config import EngineConfig  # imports torch: not needed for --help
        try:
            return EngineConfig(model=self.model, **self.engine_kwargs())
        except ValueError as e:
            raise JobError(engine_flags_in(str(e)))

    def system_prompt_text(self) -> str | None:
        """--system-prompt as given, or the contents of the file after an "@"."""
        text = self.system_prompt
        if text is None or not text.startswith("@"):
            return text
        path = Path(text[1:]).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise JobError(f"--system-prompt {text}: cannot read {path}: {e}")

    def prompt_template_text(self) -> str | None:
        """--prompt-template as given, or the contents of the file after an "@"."""
        if self.prompt_template is None:
            return None
        text = read_template_text(self.prompt_template, "--prompt-template")
        if not text.strip():
            raise JobError(f"--prompt-template {self.prompt_template!r}: the template is empty")
        return text

    def messages_template_list(self) -> list[dict[str, str]] | None:
        """--messages-template's {role, content} messages (content a template)."""
        if self.messages_template is None:
            return None
        return parse_messages(self.messages_template)

    def sampling_column_names(self) -> tuple[list[str], bool] | None:
        """--sampling-columns: the names, and whether they must all be columns (False for
        the bare flag: every known name the input has)."""
        value = self.sampling_columns
        if value is None:
            return None
        if value == ALL_SAMPLING_COLUMNS:
            return list(SAMPLING_COLUMNS), False
        names = [n.strip() for n in value.split(",") if n.strip()]
        unknown = [n for n in names if n not in SAMPLING_COLUMNS]
        if unknown or not names:
            raise JobError(f"--sampling-columns: {unknown[0] if unknown else value!r} is not "
                           f"a sampling column; the names are {', '.join(SAMPLING_COLUMNS)}")
        return names, True

    def grammar_value(self) -> str:
        """--grammar as given, or the contents of the file after an "@"."""
        text = self.grammar
        if text.startswith("@"):
            path = Path(text[1:]).expanduser()
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise JobError(f"--grammar {text}: cannot read {path}: {e}")
        return text

    def json_schema_value(self) -> Any:
        """--json-schema parsed: JSON text, or the JSON file after an "@"."""
        text = self.json_schema
        if text is not None and text.startswith("@"):
            path = Path(text[1:]).expanduser()
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise JobError(f"--json-schema {self.json_schema}: cannot read {path}: {e}")
        from batchinfer.structured.grammar import schema_value
        try:
            return schema_value(text)  # (its nesting checked before json.loads reads it)
        except ValueError as e:
            raise JobError(re.sub(r"^json schema:? ?", "--json-schema: ", str(e))) from None

    def tools_value(self) -> list[dict] | None:
        """--tools parsed and checked: an OpenAI tools list, as JSON text or the JSON file
        after an "@"."""
        if self.tools is None:
            return None
        from batchinfer.tool_parsers import check_tools
        text = self.tools
        if text.startswith("@"):
            path = Path(text[1:]).expanduser()
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise JobError(f"--tools {self.tools}: cannot read {path}: {e}") from None
        try:
            return check_tools(json.loads(text))
        except json.JSONDecodeError as e:
            raise JobError(f"--tools {self.tools}: not valid JSON ({e})") from None
        except ValueError as e:
            raise JobError(f"--tools {self.tools}: {e}") from None

    def chat_template_text(self) -> str | None:
        """The Jinja template in the --chat-template file."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise JobError(f"--chat-template {self.chat_template}: cannot read it: {e}")
        import jinja2  # transformers renders chat templates with it
        try:
            _template_environment().parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise JobError(f"--chat-template {self.chat_template}: line {e.lineno}: {e.message}")
        return text

    def template_kwargs(self) -> dict[str, Any] | None:
        """--chat-template-kwargs: a JSON object of extra chat template variables."""
        if self.chat_template_kwargs is None:
            return None
        from batchinfer.engine.chat import check_chat_template_kwargs
        try:
            return check_chat_template_kwargs(json.loads(self.chat_template_kwargs))
        except (json.JSONDecodeError, ValueError) as e:
            raise JobError(f"--chat-template-kwargs must be a JSON object such as "
                           f"'{{\"enable_thinking\": false}}': {e}")

    def identity(self) -> dict[str, Any]:
        """What makes two runs the same job: everything that changes the rows written.

        Engine sizing, progress, metrics, commit cadence, --limit and --max-row-bytes are
        left out, so a job can be resumed on another machine, with another batch size, or
        extended.
        """
        params = asdict(self.sampling_params())
        return {
            "model": local_path(self.model),
            "tokenizer": local_path(self.tokenizer),
            "dtype": self.dtype or "auto",  # the numerics of every row
            "load_format": self.load_format or "auto",  # dummy: random weights
            "quantization": self.quantization,  # fp8: weights rounded at load
            # what attention reads: the model's dtype or E4M3 (fp8 and fp8_e4m3 alike)
            "kv_cache_dtype": "auto" if self.kv_cache_dtype in (None, "auto") else "fp8",
            "split": self.split,
            "prompt_column": self.prompt_column,
            "messages_column": self.messages_column,
            # texts read from files are recorded by digest: a file may be any local file,
            # and its text is not to be copied into OUTDIR
            "system_prompt": digest_of_text(self.system_prompt_text())
            if (self.system_prompt or "").startswith("@") else self.system_prompt,
            "chat_template": digest_of_text(self.chat_template_text()),
            "chat_template_kwargs": self.template_kwargs(),
            "reasoning_parser": self.reasoning_parser,
            # recorded where set, so that jobs written before these options continue
            **({"max_attempts": self.max_attempts} if self.max_attempts != 1 else {}),
            **({"tools": self.tools_value()} if self.tools is not None else {}),
            **({"tool_call_parser": self.tool_call_parser}
               if self.tool_call_parser is not None else {}),
            "id_column": self.id_column,
            # how a row becomes a request (texts by digest, as above)
            "rows": {
                "prompt_template": digest_of_text(self.prompt_template_text()),
                "messages_template": None if self.messages_template is None
                else digest_of_text(json.dumps(self.messages_template_list())),
                "sampling_columns": self.sampling_columns,
                "keep_prompt": self.keep_prompt,
            },
            "save_token_ids": self.save_token_ids,
            "sampling": params,
            **({"shard": [self.shard_index, self.num_shards]} if self.num_shards > 1 else {}),
        }

    def shard(self) -> Shard | None:
        return Shard(self.shard_index or 0, self.num_shards) if self.num_shards > 1 else None

    def output_dir(self) -> str:
        """Where this process writes: OUTDIR, or its shard's directory inside it."""
        shard = self.shard()
        return str(shard.directory(self.output)) if shard is not None else self.output


def _template_environment():
    """A Jinja environment that parses what transformers' chat templates may use: loop
    controls ({% break %}, {% continue %}) and {% generation %} ... {% endgeneration %}."""
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return jinja2.Environment(extensions=[jinja2.ext.loopcontrols, Generation])


def local_path(name: str | None) -> str | None:
    """A model or tokenizer as a job records it: a local directory by its absolute path (so
    `models/m`, `./models/m` and `../x/models/m` are one model), anything else as given."""
    if name is None or name == "demo":
        return name
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


def _check_can_hold(path: str, name: str) -> None:
    """path can be (or is) a directory: no part of it is an existing file."""
    at = Path(path).expanduser()
    for part in (at, *at.parents):
        if part.exists():
            if not part.is_dir():
                raise JobError(f"{name} {path}: {part} is a file, not a directory")
            return
