"""The job loop: read rows, order them by shared prefix, keep the engine fed, commit results.

    rows ──▶ PromptBuilder ──▶ ReorderWindow ──▶ engine.add_request ... engine.step()
                  │ (bad rows)                                               │
                  └──────────────────────────▶ PartWriter ◀── sample_rows ◀──┘

Everything a user can get wrong is checked before the model loads. SIGTERM, SIGINT and
SIGHUP stop the loop after the current step; finished rows are committed and the exit code
is 128 + the signal, so a scheduler such as Slurm can requeue the job, which then continues.
"""
from __future__ import annotations

import functools
import json
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from batchinfer.engine.gc_freeze import startup_heap_frozen
from batchinfer.flags import SAMPLING_NAMES, engine_flags_in
from batchinfer.model.generation_config import FILE_NAME, describe
from batchinfer.job.durable import os_error_message
from batchinfer.job.errors import EngineFailed, JobError, OutputFailed, Stopped
from batchinfer.job.manifest import Manifest, OutputDir, fingerprint, now_iso
from batchinfer.job.nodes import announcing
from batchinfer.job.metrics import JobMetrics
from batchinfer.job.openai_output import write_openai_output
from batchinfer.job.options import JobOptions, flag
from batchinfer.job.ordering import ReorderWindow
from batchinfer.job.progress import Progress
from batchinfer.job.prompts import (PromptBuilder, PromptSpec, WorkItem, check_kinds,
                                    check_types, detect, row_settings)
from batchinfer.job.row_sampling import RowSampling
from batchinfer.job.templates import RowTemplates
from batchinfer.job.rangeset import RangeSet
from batchinfer.job.reader import Source, open_input
from batchinfer.job.retry import can_retry, invalid_reason, retry_params
from batchinfer.job.schema import schema_from_json, schema_to_json, storable
from batchinfer.job.shard import check_layout
from batchinfer.job.signals import StopSignals
from batchinfer.job.summary import compute_summary, print_table, write_summary
from batchinfer.job.writer import PartWriter, error_rows, output_schema, sample_rows
from batchinfer.outputs import RequestOutput
from batchinfer.reasoning import END_TAG, ReasoningParser
from batchinfer.sampling_params import SamplingParams
from batchinfer.tool_parsers import ToolParser, call_id


class Engine(Protocol):
    """What the job needs of an engine: LLMEngine (batchinfer/engine/engine.py), or a
    stand-in in the job tests (tests/job/fake_engine.py; a test holds both to this)."""
    config: Any  # its max_num_seqs sizes how many rows are in flight

    def check_params(self, params: SamplingParams) -> None: ...

    def render_chat_text(self, messages: list[dict], add_generation_prompt: bool = True, *,
                         chat_template: str | None = None,
                         chat_template_kwargs: dict | None = None,
                         tools: list[dict] | None = None) -> str: ...

    def encode_prompts(self, texts: list[str],
                       add_special_tokens: bool = True) -> list[list[int]]: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, *,
                    reasoning_parser: ReasoningParser | None = None) -> None: ...

    def get_reasoning_parser(self, name: str,
                             chat_template_kwargs: dict | None = None) -> ReasoningParser: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


EngineFactory = Callable[[str, dict[str, Any]], Engine]


def load_engine(model: str, kwargs: dict[str, Any]) -> Engine:
    from batchinfer.demo import resolve_model
    from batchinfer.engine.engine import LLMEngine
    return LLMEngine.from_kwargs(resolve_model(model), **kwargs)


def check_model(model: str, tokenizer: str | None) -> None:
    """Fail fast (before any input is read) when the model or tokenizer cannot be found, or
    its config.json or GGUF table holds values no model could have."""
    from batchinfer.demo import resolve_model
    from batchinfer.model import gguf
    from batchinfer.model.loader import (check_config_file, resolve_model_path,
                                         resolve_tokenizer_path)
    try:
        path = resolve_model_path(resolve_model(model))
        if gguf.is_gguf(path):
            gguf.check(path)
        else:
            check_config_file(path)
    except (FileNotFoundError, ValueError) as e:
        raise JobError(f"--model: {e}") from None
    try:
        if tokenizer is not None:
            resolve_tokenizer_path(tokenizer)
    except FileNotFoundError as e:
        raise JobError(f"--tokenizer: {e}") from None


def check_constraint(options: JobOptions) -> None:
    """Fail fast (before the model loads) when the job's regex, JSON schema or grammar
    reaches one of llguidance's bounds in a few random completions under the model's
    tokenizer: its rows share the compiled grammar, so each of them would fail."""
    constraint = options.sampling_params().structured_outputs
    if constraint is None or constraint.choice is not None:
        return
    from batchinfer.demo import resolve_model
    from batchinfer.model.loader import hf_tokenizer, resolve_model_path, resolve_tokenizer_path
    from batchinfer.structured.grammar import GrammarCompiler, probe
    path = resolve_tokenizer_path(options.tokenizer) if options.tokenizer is not None \
        else resolve_model_path(resolve_model(options.model))
    tokenizer = hf_tokenizer(path, bool(options.trust_remote_code))
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos)
    try:
        error = probe(compiler, constraint.grammar_text())
    except ValueError as e:
        error = str(e)
    if error is not None:
        name = next(f for f, v in (("--regex", options.regex), ("--grammar", options.grammar),
                                   ("--json-schema", options.json_schema)) if v is not None) \
            if not options.json_object else "--json-object"
        raise JobError(f"{name}: generating under it reaches a bound of the constrained "
                       f"decoding ({error}), so every row would fail; simplify it")


@dataclass
class JobResult:
    exit_code: int
    summary: dict[str, Any]
    output: Path


@dataclass
class _Plan:
    """What the job is, decided before the model loads."""
    spec: PromptSpec
    input_schema: Any
    json_columns: set[str]
    manifest: Manifest
    fresh: bool
    templates: RowTemplates | None = None
    sampling: RowSampling | None = None


def plan_job(options: JobOptions, source: Source, outdir: OutputDir) -> _Plan:
    """What the job is (JobError for what the user must fix); reads OUTDIR, writes nothing."""
    job = {"input": source.identity(), **options.identity()}
    manifest = outdir.check(job, options.overwrite)
    if manifest is not None:
        plan = _Plan(PromptSpec(**manifest.prompt), schema_from_json(manifest.input_schema),
                     set(manifest.json_columns), manifest, fresh=False)
        if not all(storable(f.type) for f in plan.input_schema):
            raise JobError(f"--output {outdir.path} holds parts with a column nested deeper "
                           "than Parquet readers read back (written before such columns "
                           "became JSON text); pass --overwrite to start over")
    else:
        if options.split is not None and source.format != "arrow":
            # only a new job is refused: an existing one recorded with --split continues
            raise JobError(f"--split {options.split}: INPUT {source.spec} is {source.format} "
                           "data, which has no splits; --split applies to a datasets "
                           "save_to_disk folder or hf:NAME")
        inspection = source.inspect()
        spec = detect(inspection.columns, options)
        if inspection.types is not None and spec.column is not None:
            check_kinds(spec, set(inspection.types.kinds[spec.column]))
        input_schema, json_columns = inspection.schema(spec.restrict())
        check_types(spec, input_schema)
        if options.keep_prompt and "prompt" in input_schema.names:
            raise JobError("--keep-prompt adds a `prompt` column, and INPUT has one already "
                           "(with a prompt column, it is the prompt); leave out --keep-prompt")
        # OpenAI Batch lines may each ask for logprobs and prompt logprobs: their columns
        # are always there
        schema = output_schema(input_schema, spec, options.save_token_ids,
                               options.logprobs is not None or spec.mode == "openai",
                               options.prompt_logprobs is not None or spec.mode == "openai",
                               options.reasoning_parser is not None, options.keep_prompt,
                               # an OpenAI line's tool_choice may name a function
                               options.tool_call_parser is not None or spec.mode == "openai")
        manifest = Manifest(fingerprint(job), job, spec.as_dict(), schema_to_json(input_schema),
                            sorted(json_columns), schema_to_json(schema), inspection.num_rows)
        plan = _Plan(spec, input_schema, json_columns, manifest, fresh=True)
    plan.templates, plan.sampling = row_settings(options, plan.input_schema.names,
                                                 options.system_prompt_text(),
                                                 plan.json_columns)
    plain = ("the prompts --prompt-template renders"
             if plan.spec.mode == "template" and options.prompt_template is not None
             else f"the prompts of column {plan.spec.column!r}"
             if plan.spec.mode == "prompt" else None)
    if options.tools is not None and plain is not None and options.system_prompt is None:
        raise JobError(f"--tools: {plain} are sent as they are, not through the chat "
                       "template; give a messages column or --messages-template, or "
                       "--system-prompt to make each prompt a chat")
    if options.tool_call_parser is not None and options.tools is None \
            and plan.spec.mode != "openai":
        raise JobError(f"--tool-call-parser {options.tool_call_parser} needs --tools (or "
                       "OpenAI Batch lines with tools): the calls are parsed where the chat "
                       "template was given tools")
    if options.output_format == "openai" and plan.spec.mode != "openai":
        raise JobError("--output-format openai needs OpenAI Batch input (lines with "
                       "custom_id and body)")
    return plan


def open_job(options: JobOptions, engine_factory: EngineFactory | None
             ) -> tuple[Source, EngineFactory]:
    """The input and the engine factory, after the checks that need neither the model
    loaded nor OUTDIR locked."""
    if engine_factory is None:
        check_model(options.model, options.tokenizer)
        check_constraint(options)
        engine_factory = load_engine
    source = open_input(options.input, options.split, output=options.output,
                        max_row_bytes=options.max_row_bytes)
    check_layout(options.output, options.shard(),
                 {"input": source.identity(), **options.identity()})
    return source, engine_factory


def run_job(options: JobOptions, engine_factory: EngineFactory | None = None,
            out: TextIO | None = None, err: TextIO | None = None) -> JobResult:
    """Run (or continue) a job. Raises JobError for mistakes the user must fix."""
    out, err = out or sys.stdout, err or sys.stderr
    options.validate()
    with announcing(options, err):  # across nodes: the others wait for node 0's word
        return _run_job(options, engine_factory, out, err)


def _run_job(options: JobOptions, engine_factory: EngineFactory | None, out: TextIO,
             err: TextIO) -> JobResult:
    source, engine_factory = open_job(options, engine_factory)
    outdir = OutputDir(options.output_dir())
    with StopSignals() as stop:
        outdir.lock()  # before looking at OUTDIR: what the look finds stays true
        try:
            return _run_locked(options, source, outdir, stop, engine_factory, out, err)
        finally:
            outdir.close()


def _run_locked(options: JobOptions, source: Source, outdir: OutputDir, stop: StopSignals,
                engine_factory: EngineFactory, out: TextIO, err: TextIO) -> JobResult:
    plan = plan_job(options, source, outdir)
    manifest = plan.manifest
    known = manifest.num_input_rows
    total = known if options.limit is None else (
        options.limit if known is None else min(known, options.limit))
    shard = options.shard()
    if shard is not None and total is not None:
        total = shard.rows_below(total)
    for warning in outdir.prepare(manifest, plan.fresh):
        print(f"batchinfer: warning: {warning}", file=err)
    manifest.runs.append({"started": now_iso(), "wall_s": 0.0, "input_rows": 0})
    done = RangeSet(tuple(r) for r in manifest.done)
    writer = PartWriter(outdir, manifest, schema_from_json(manifest.output_schema), done,
                        options.commit_rows, options.commit_seconds, source.dictionaries)
    if not plan.fresh:
        print(f"batchinfer: continuing {outdir.path}: {len(done)} rows already done",
              file=err)
    try:
        finished = total is not None and len(done) >= total
        if not finished:
            finished = _run_engine(options, source, plan, writer, done, total, stop,
                                   engine_factory, err)
        else:
            writer.commit(complete=True)
        return _finish(options, outdir, manifest, finished, stop, out, err)
    except OSError as e:
        raise OutputFailed(f"{os_error_message(e)}; {len(done)} rows are committed in "
                           f"{outdir.path}; run the same command again to continue") from e


def _run_engine(options: JobOptions, source: Source, plan: _Plan, writer: PartWriter,
                done: RangeSet, total: int | None, stop: StopSignals,
                engine_factory: EngineFactory, err: TextIO) -> bool:
    """Start the metrics and the engine, run the loop. Returns True when every row was
    processed, False when stopped by a signal."""
    from batchinfer.engine.tensor_parallel import WorkerError  # (imports torch)
    metrics = JobMetrics(options.metrics_textfile, options.metrics_interval)
    if total is not None:
        metrics.set_total(total)
    try:
        if options.metrics_port is not None:
            try:
                port = metrics.serve(options.metrics_port, options.metrics_host)
            except OSError as e:
                raise JobError(f"--metrics-port {options.metrics_port}: cannot listen on "
                               f"{options.metrics_host}: {e.strerror or e}") from None
            print(f"batchinfer: metrics on http://{options.metrics_host}:{port}/metrics",
                  file=err)
        if options.model == "demo":
            from batchinfer.demo import DEMO_NOTICE
            print(DEMO_NOTICE, file=err)
        from_model = options.sampling_from_model()
        if from_model:
            print(f"batchinfer: sampling defaults from {_generation_config_file(options)}: "
                  f"{describe(from_model)} (flags override them; --generation-config vllm "
                  "ignores the file)", file=err)
        engine = start_engine(options, engine_factory)
        try:
            parser = check_with_engine(options, engine)
            progress = Progress(total, len(done), options.progress, err,
                                options.progress_interval)
            loop = _Loop(options, source, plan, writer, done, engine, metrics, progress, parser)
            try:
                return loop.run(stop)
            except WorkerError as e:  # a rank or node of the engine is gone
                raise EngineFailed(f"{e}; {len(done)} rows are committed in "
                                   f"{options.output_dir()}; run the same command again (on "
                                   "every node) to continue") from None
            finally:
                progress.close()
        finally:
            engine.shutdown()  # tensor-parallel workers, also when a check refused the job
    finally:
        metrics.close()


def check_with_engine(options: JobOptions, engine: Engine) -> ReasoningParser | None:
    """What only the loaded engine can check (JobError): the bounds the model's vocabulary
    sets (--logprobs, --stop-token-ids), what its parallelism allows, and the reasoning
    parser's tags; the parser, when one is asked for."""
    try:
        engine.check_params(options.sampling_params())
    except ValueError as e:
        raise JobError(engine_flags_in(re.sub(r"^(\w+)", lambda m: flag(m.group(1)),
                                              str(e)))) from None
    if options.reasoning_parser is None:
        return None
    parser = engine.get_reasoning_parser(options.reasoning_parser, options.template_kwargs())
    if options.sampling_params().structured_outputs is not None and parser.end_token_id is None:
        raise JobError(f"--reasoning-parser {options.reasoning_parser}: a constraint applies "
                       f"after {END_TAG}, which is not one token of the model's tokenizer")
    return parser


def make_builder(options: JobOptions, plan: _Plan, engine: Engine) -> PromptBuilder:
    return PromptBuilder(
        plan.spec, options.sampling_params(), options.system_prompt_text(),
        functools.partial(engine.render_chat_text, chat_template=options.chat_template_text()),
        engine.encode_prompts, options.template_kwargs(), options.max_n,
        templates=plan.templates, sampling=plan.sampling, keep_prompt=options.keep_prompt,
        tools=options.tools_value())


def start_engine(options: JobOptions, engine_factory: EngineFactory) -> Engine:
    """The engine, or JobError naming what stopped it from starting."""
    # (these import torch)
    import torch

    from batchinfer.engine.nodes import NodesInterrupted
    from batchinfer.engine.tensor_parallel import WorkerError
    try:
        return engine_factory(options.model, options.engine_kwargs())
    except FileNotFoundError as e:
        raise JobError(f"--model {options.model}: {e}") from None
    except ValueError as e:
        raise JobError(f"cannot start the engine: {engine_flags_in(str(e))}") from None
    except (MemoryError, torch.OutOfMemoryError):
        raise JobError("cannot start the engine: out of memory while loading the model; "
                       "lower --max-model-len or the KV cache (--kv-cache-memory), or use a "
                       "machine with more memory") from None
    except (ConnectionError, TimeoutError, WorkerError) as e:  # a node or rank is gone
        raise EngineFailed(f"cannot start the engine: {e}") from None
    except NodesInterrupted as e:
        raise Stopped(str(e), e.signum) from None


@dataclass(slots=True)
class _Attempt:
    """A request in the engine: a row's first attempt (all its samples), or one sample's
    attempt `number` > 1."""
    item: WorkItem
    sample: int | None
    number: int


class _Loop:
    """Reads rows into the reorder window, keeps the engine fed, records what finishes."""

    def __init__(self, options: JobOptions, source: Source, plan: _Plan, writer: PartWriter,
                 done: RangeSet, engine: Engine, metrics: JobMetrics, progress: Progress,
                 reasoning_parser: ReasoningParser | None = None):
        self.options = options
        self.tool_calls = "tool_calls" in writer.schema.names
        self.tool_parser = (ToolParser(options.tool_call_parser)
                            if options.tool_call_parser is not None else None)
        self.writer = writer
        self.logprobs = "logprobs" in writer.schema.names
        self.prompt_logprobs = "prompt_logprobs" in writer.schema.names
        self.reasoning = "reasoning" in writer.schema.names
        self.reasoning_parser = reasoning_parser
        self.engine = engine
        self.metrics = metrics
        self.progress = progress
        params = options.sampling_params()
        self.builder = make_builder(options, plan, engine)
        self.window: ReorderWindow[WorkItem] = ReorderWindow(options.reorder_window)
        self.target = max(1, 2 * engine.config.max_num_seqs // params.n)
        self.batches = source.batches(plan.input_schema, plan.json_columns, done, options.limit,
                                      options.shard())
        self.exhausted = False
        self.inflight: dict[str, _Attempt] = {}
        self.samples: dict[int, list[dict[str, Any]]] = {}  # a row's latest samples
        self.retrying: dict[int, int] = {}  # a row's samples asked for again, in flight
        self.finished: list[list[dict[str, Any]]] = []  # output rows of rows just finished

    def run(self, stop: StopSignals) -> bool:
        with startup_heap_frozen():
            return self._run(stop)

    def _run(self, stop: StopSignals) -> bool:
        try:
            while not stop.requested:
                self.fill(stop)
                self.feed(stop)
                if not self.inflight and self.exhausted and not len(self.window):
                    break
                if self.inflight:
                    self.step()
                self.report()
                if self.writer.due():
                    self.writer.commit()
                self.metrics.tick()
            complete = not stop.requested
            self.writer.commit(complete=complete)
            return complete
        except BaseException:
            try:  # rows already finished are kept whatever went wrong
                self.writer.commit()
            except OSError:
                pass  # the first failure is the one to report
            raise

    def fill(self, stop: StopSignals) -> None:
        """Read rows until the window is full; rows that cannot be requests are recorded.
        A stop asked for ends it after the batch of rows at hand (each row's constraint is
        checked as its request is built)."""
        while not self.exhausted and self.window.has_room() and not stop.requested:
            batch = next(self.batches, None)
            if batch is None:
                self.exhausted = True
                return
            for item in self.builder.build_batch(batch):
                if item.error is None:
                    self.window.push(item.sort_key, item)
                else:
                    self.record(item, error_rows(item))

    def feed(self, stop: StopSignals) -> None:
        """Top the engine up to about 2 x max_num_seqs unfinished requests, or until a stop
        is asked for (adding a request may build its regex's automaton)."""
        while len(self.window) and len(self.inflight) < self.target and not stop.requested:
            item = self.window.pop()
            self.add(str(item.row.index), _Attempt(item, None, 1), item.params)

    def add(self, request_id: str, attempt: _Attempt, params: SamplingParams) -> None:
        item = attempt.item
        if params.prompt_logprobs is not None and not self.prompt_logprobs:
            # an OpenAI line's ask, in a job whose output predates the columns
            params = params.clone(prompt_logprobs=None)
        if item.with_tools and self.tool_parser is not None \
                and not self.tool_parser.skip_special_tokens:
            params = params.clone(skip_special_tokens=False)
        if self.reasoning_parser is None:  # (an engine may not take the argument)
            self.engine.add_request(request_id, item.prompt.tolist(), params)
        else:
            self.engine.add_request(request_id, item.prompt.tolist(), params,
                                    reasoning_parser=self.reasoning_parser)
        self.inflight[request_id] = attempt

    def step(self) -> None:
        for output in self.engine.step():
            attempt = self.inflight.pop(output.request_id)
            item = attempt.item
            rows = sample_rows(item, output, self.options.save_token_ids, self.logprobs,
                               self.prompt_logprobs, self.reasoning)
            index = item.row.index
            if attempt.sample is None:
                self.samples[index] = rows
            else:  # one sample again: it takes its place among the row's samples
                row = rows[0]
                row.update(sample_index=attempt.sample, attempts=attempt.number)
                self.samples[index] = [row if r["sample_index"] == attempt.sample else r
                                       for r in self.samples[index]]
                self.retrying[index] -= 1
                rows = [row]
            for row in rows:
                self.validate(item, row, attempt.number)
            if not self.retrying.get(index):
                self.retrying.pop(index, None)
                self.record(item, self.samples.pop(index))
        self.metrics.observe_engine(self.engine.stats())

    def validate(self, item: WorkItem, row: dict[str, Any], number: int) -> None:
        """With --max-attempts above 1, check a sample against its row's constraint: an
        invalid one is asked for again (until --max-attempts), or keeps its output with the
        reason as its error."""
        constraint = item.params.structured_outputs
        if self.options.max_attempts == 1 or constraint is None \
                or row["finish_reason"] == "error":
            return
        reason = invalid_reason(row["completion"], row["finish_reason"], constraint)
        if reason is None:
            return
        if number >= self.options.max_attempts or not can_retry(item.params):
            row["error"] = reason
            return
        sample = row["sample_index"]
        index = item.row.index
        self.add(f"{index}:{sample}:{number + 1}", _Attempt(item, sample, number + 1),
                 retry_params(item.params, item.row_id, sample, number + 1))
        self.retrying[index] = self.retrying.get(index, 0) + 1

    def record(self, item: WorkItem, rows: list[dict[str, Any]]) -> None:
        """A row's final output rows: committed with the next part, never before."""
        if self.tool_calls:
            for row in rows:
                self.parse_tool_calls(item, row)
        self.writer.add(item.row.index, rows)
        self.finished.append(rows)

    def parse_tool_calls(self, item: WorkItem, row: dict[str, Any]) -> None:
        """The row's tool calls: those --tool-call-parser finds where the template was given
        tools, or the one call a line's tool_choice named (its output is the arguments); a
        malformed call leaves the text in the completion."""
        if row["finish_reason"] == "error":
            row["tool_calls"] = None
            return
        found: list[dict[str, str]] = []
        text = row["completion"]
        if item.forced_tool is not None:
            if _is_json_object(text):
                row["completion"], found = "", [{"name": item.forced_tool, "arguments": text}]
        elif item.with_tools and self.tool_parser is not None and text is not None:
            row["completion"], found = self.tool_parser.parse(text)
        row["tool_calls"] = [{"id": call_id(self.options.tool_call_parser, item.row_id,
                                            row["sample_index"], i),
                              "type": "function", "function": call}
                             for i, call in enumerate(found)]

    def report(self) -> None:
        """Metrics and progress, once per step for all rows that finished in it."""
        self.metrics.observe_rows(self.finished)
        output_tokens = prompt_tokens = cached_tokens = 0
        for rows in self.finished:
            if rows[0]["finish_reason"] != "error":  # a failed row's prompt never ran
                prompt_tokens += rows[0].get("prompt_tokens") or 0
            cached_tokens += rows[0].get("cached_tokens") or 0
            output_tokens += sum(r["output_tokens"] for r in rows)
        self.progress.update(len(self.finished), output_tokens, prompt_tokens, cached_tokens)
        self.finished.clear()


def _finish(options: JobOptions, outdir: OutputDir, manifest: Manifest, complete: bool,
            stop: StopSignals, out: TextIO, err: TextIO) -> JobResult:
    paths = outdir.part_paths(manifest)
    wall_s = sum(run.get("wall_s", 0.0) for run in manifest.runs)
    summary = compute_summary(paths, wall_s)
    summary["complete"] = complete
    summary["runs"] = len(manifest.runs)
    params = asdict(options.sampling_params())
    summary["sampling"] = {k: params[k] for k in SAMPLING_NAMES}  # the effective values
    summary["sampling_from_model"] = options.sampling_from_model()
    warning = _length_warning(options, summary)
    if warning is not None:
        summary["warnings"] = [warning]
        print(f"batchinfer: warning: {warning}", file=err)
    write_summary(outdir.summary_path, summary)
    if complete and options.output_format == "openai":
        write_openai_output(outdir.parts_with_sampled_first(manifest), outdir.openai_path,
                            options.model, options.logprobs)
    if stop.requested:
        name = signal.Signals(stop.signum).name
        print(f"batchinfer: stopped by {name}; {summary['rows']} rows committed in "
              f"{outdir.path}; run the same command again to continue", file=err)
        return JobResult(128 + stop.signum, summary, outdir.path)
    print(f"batchinfer: {summary['rows']} rows ({summary['errors']} failed) in {outdir.path}",
          file=out)
    print_table(summary, out)
    if options.output_format == "openai":
        print(f"batchinfer: OpenAI Batch output in {outdir.openai_path}", file=out)
    return JobResult(0, summary, outdir.path)


def _is_json_object(text: str | None) -> bool:
    try:
        return isinstance(json.loads(text or ""), dict)
    except (json.JSONDecodeError, RecursionError):
        return False


# the share of completions that may end by length, with no --max-tokens, before a warning
LENGTH_WARNING_SHARE = 0.01


def _length_warning(options: JobOptions, summary: dict[str, Any]) -> str | None:
    """A warning when, with no --max-tokens, over 1% of the completions ended by length:
    cut off where the context was full (or at the model's max_new_tokens), not finished."""
    completions = summary["samples"] - summary["errors"]
    cut = summary["finished_by_length"]
    if options.max_tokens is not None or cut <= LENGTH_WARNING_SHARE * completions:
        return None
    default = summary["sampling_from_model"].get("max_tokens")
    where = (f"the model's max_new_tokens ({default}, {_generation_config_file(options)})"
             if default is not None else "a full context (--max-model-len)")
    return (f"{cut} of {completions} completions ({100 * cut / completions:.1f}%) ended by "
            f"length with no --max-tokens, at {where}; they may be cut short: set "
            "--max-tokens, or raise --max-model-len")


def _generation_config_file(options: JobOptions) -> str:
    setting = options.generation_config or "auto"
    return f"the model's {FILE_NAME}" if setting == "auto" else f"{setting}/{FILE_NAME}"
