"""`batchinfer run` and `batchinfer merge`."""
from __future__ import annotations

from typing import Any

import click

from batchinfer import flags
from batchinfer.job.config_file import load_job_file
from batchinfer.job.errors import JobError
from batchinfer.job.options import OUTPUT_FORMATS, JobOptions
from batchinfer.reasoning import REASONING_PARSERS
from batchinfer.tool_parsers import TOOL_CALL_PARSERS


class FatalError(click.ClickException):
    """Printed as one line, `Error: ...`, with exit code 2 (or the JobError's own)."""
    exit_code = 2

    @classmethod
    def of(cls, error: JobError) -> "FatalError":
        fatal = cls(str(error))
        fatal.exit_code = error.exit_code
        return fatal


class JobCommand(click.Command):
    """A command whose usage mistakes are one line (no usage dump), exit code 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            raise FatalError(e.format_message()) from None


def _options(f):
    """The flags of `run`, in groups; every default is None so a job file can fill it (and
    every on/off flag has its --no- form, so a flag given here can turn a file's value off)."""
    O = click.option
    decorators = [
        O("--config", "config", type=click.Path(dir_okay=False),
          help="TOML job file with any of these options; flags given here override it."),
        O("--model", help='Model directory, hub id in the local cache, or "demo".'),
        O("--output", "-o", help="Output directory (a Parquet dataset)."),
        O("--split", help="Split of a saved DatasetDict or hf: dataset (default: train)."),
        O("--prompt-column", help="Column holding the prompt text (default: prompt)."),
        O("--messages-column", help="Column holding chat messages (default: messages)."),
        O("--system-prompt", help="System message for every row; @FILE reads it from a file."),
        O("--chat-template", type=click.Path(dir_okay=False),
          help="Jinja chat template file used instead of the tokenizer's."),
        O("--chat-template-kwargs", metavar="JSON",
          help='Extra chat template variables, e.g. \'{"enable_thinking": false}\'.'),
        O("--prompt-template", metavar="TEXT|@FILE",
          help="Jinja template rendering each row's prompt from its columns, e.g. "
               "'Summarize {{ title }}'."),
        O("--messages-template", metavar="@FILE",
          help="JSON or TOML list of {role, content} chat messages, each content a "
               "template over the row's columns."),
        O("--keep-prompt/--no-keep-prompt", default=None,
          help="Add a `prompt` column: the text each row's prompt was made of."),
        O("--sampling-columns", is_flag=False, flag_value="all", metavar="[NAMES]",
          help="Columns named like the sampling flags (max_tokens, temperature, top_p, "
               "top_k, min_p, seed, n, stop, json_schema, regex, choice) set their row's "
               "value; alone: each of them INPUT has; or a comma-separated subset."),
        O("--id-column", help="Column whose value becomes `id` (default: the row index)."),
        O("--limit", type=click.IntRange(min=0), help="Process only the first N input rows."),
        # SamplingParams (batchinfer/flags.py), then constraints on every completion
        flags.options(flags.SAMPLING_NAMES),
        O("--max-n", type=click.IntRange(min=1),
          help="Most completions one row may ask for (--n, an OpenAI line's n; default 128)."),
        O("--choice", multiple=True,
          help="Every completion is exactly one of these strings (repeatable)."),
        O("--regex", metavar="PATTERN",
          help="Every completion matches this regular expression."),
        O("--json-schema", metavar="JSON",
          help="Every completion is a JSON instance of this schema, draft 2020-12 (@FILE "
               "reads a file)."),
        O("--json-object/--no-json-object", default=None,
          help="Every completion is a JSON object."),
        O("--grammar", metavar="GRAMMAR",
          help="Every completion is a sentence of this Lark (or GBNF) grammar (@FILE reads "
               "a file)."),
        O("--reasoning-parser", type=click.Choice(REASONING_PARSERS),
          help="deepseek_r1 or qwen3: the text inside <think>...</think> goes to a "
               "`reasoning` column, the answer after it to `completion`."),
        O("--max-attempts", type=click.IntRange(min=1),
          help="Generate a completion that is not valid for its constraint again, with a "
               "new seed, up to K attempts in all (default 1); an `attempts` column."),
        O("--tools", metavar="JSON",
          help="An OpenAI tools list for the chat template (@FILE reads a file)."),
        O("--tool-call-parser", type=click.Choice(TOOL_CALL_PARSERS),
          help="hermes, llama3_json, mistral or qwen3: the tool calls in a completion go to "
               "a `tool_calls` column."),
        # EngineConfig (batchinfer/flags.py)
        flags.options(flags.ENGINE_NAMES),
        flags.options(flags.NODE_NAMES),
        # The job
        O("--num-shards", type=click.IntRange(min=1),
          help="Split the input among this many independent runs (e.g. a Slurm array)."),
        O("--data-parallel-size", type=click.IntRange(min=1),
          help="Run N engines in N processes, each on its own GPUs and input shard."),
        O("--shard-index", type=click.IntRange(min=0),
          help="Which of --num-shards this run takes; it writes OUTDIR/shard-I-of-N."),
        O("--reorder-window", type=int,
          help="Rows read ahead and grouped by shared prefix (default 4096; 0 = input order)."),
        O("--max-row-bytes", type=flags.Size(),
          help="Longest JSONL line, JSON array element or CSV record read (default 16MiB); "
               "a longer one is a failed row."),
        O("--commit-rows", type=int, help="Commit a part every N finished rows (default 10000)."),
        O("--commit-seconds", type=float, help="...or every T seconds (default 60)."),
        O("--output-format", type=click.Choice(OUTPUT_FORMATS),
          help="openai: also write the OpenAI Batch output JSONL (OpenAI Batch input only)."),
        O("--save-token-ids/--no-save-token-ids", default=None,
          help="Add prompt_token_ids and token_ids columns."),
        O("--overwrite/--no-overwrite", default=None,
          help="Replace the output of a different job in OUTDIR."),
        O("--progress/--no-progress", default=None, help="Progress bar (or log lines)."),
        O("--progress-interval", type=float, help="Seconds between log lines off a TTY (30)."),
        O("--metrics-port", type=int, help="Serve Prometheus metrics on this port (0 = any)."),
        O("--metrics-host", help="Address of the metrics endpoint (default 127.0.0.1)."),
        O("--metrics-textfile", help="Write metrics to this node_exporter textfile."),
        O("--metrics-interval", type=float, help="Seconds between textfile writes (15)."),
        O("--dry-run/--no-dry-run", default=None,
          help="Read the input, render and tokenize the prompts and print the job's size "
               "and an estimate of its time; write nothing."),
        O("--dry-run-rows", type=click.IntRange(min=1),
          help="With --dry-run: read only the first N rows (default: all)."),
    ]
    for decorator in reversed(decorators):
        f = decorator(f)
    return f


def _convert(value: Any, param: click.Option, ctx: click.Context) -> Any:
    """A TOML value through its flag's type, kept to that type's own kind of value: click
    would turn 2.5 into 2 for an integer, true into 1, and 1 into the string "1"."""
    type_ = param.type
    if isinstance(type_, click.types.IntParamType):
        ok = isinstance(value, int) and not isinstance(value, bool)
        want = "an integer"
    elif isinstance(type_, click.types.FloatParamType):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want = "a number"
    elif isinstance(type_, (click.types.StringParamType, click.Choice, click.Path)):
        ok, want = isinstance(value, str), "a string"
    else:
        ok, want = True, ""
    if not ok:
        raise click.BadParameter(f"expected {want}, got {value!r}")
    return type_.convert(value, param, ctx)


def _from_job_file(ctx: click.Context, path: str) -> dict[str, Any]:
    """Job-file values, checked and converted by the types of the matching flags."""
    params = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)}
    values = {}
    for name, value in load_job_file(path).items():
        param = params.get(name)
        if name == "input":
            values[name] = str(value)
            continue
        if param is None or name == "config":
            raise JobError(f"--config {path}: unknown option {name!r}")
        try:
            if param.multiple:
                items = value if isinstance(value, list) else [value]
                values[name] = [_convert(v, param, ctx) for v in items]
            elif param.is_flag:
                if not isinstance(value, bool):
                    raise click.BadParameter(f"expected true or false, got {value!r}")
                values[name] = value
            else:
                values[name] = _convert(value, param, ctx)
        except click.BadParameter as e:
            raise JobError(f"--config {path}: {name}: {e.format_message()}") from None
    return values


@click.command(cls=JobCommand)
@click.argument("input", required=False)
@_options
@click.pass_context
def run(ctx: click.Context, input: str | None, config: str | None, **flags: Any) -> None:
    """Stream INPUT through the model into a Parquet dataset in --output.

    INPUT is a .parquet, .jsonl/.json or .csv file, a directory of them, a
    datasets.save_to_disk folder, or hf:NAME[:SPLIT] from the local cache. Run the same
    command again to continue a stopped job.
    """
    from batchinfer.job.nodes import serve_node, serves
    from batchinfer.job.runner import run_job
    try:
        values = _from_job_file(ctx, config) if config else {}
        if input is not None:
            values["input"] = input
        for name, value in flags.items():
            if value is not None and value != ():
                values[name] = list(value) if isinstance(value, tuple) else value
        options = JobOptions.from_dict(values)
        if options.dry_run:
            from batchinfer.job.dry_run import dry_run
            ctx.exit(dry_run(options).exit_code)
        if serves(options):
            ctx.exit(serve_node(options))
        if options.data_parallel_size > 1:
            from batchinfer.job.data_parallel import run_data_parallel
            ctx.exit(run_data_parallel(options))
        result = run_job(options)
    except JobError as e:
        raise FatalError.of(e) from None
    except KeyboardInterrupt:  # Ctrl-C while starting, before the job's own handling
        click.echo("Interrupted while starting; run the same command to start again.",
                   err=True)
        ctx.exit(130)
    ctx.exit(result.exit_code)


@click.command(cls=JobCommand)
@click.argument("outdir", type=click.Path(file_okay=False, exists=True))
@click.option("--rows-per-file", type=int, default=1_000_000, show_default=True,
              help="Rows per merged Parquet file.")
def merge(outdir: str, rows_per_file: int) -> None:
    """Compact the part files of OUTDIR (or of each of its shard directories) into one or
    a few Parquet files."""
    from batchinfer.job.manifest import OutputDir
    from batchinfer.job.merge import merge_parts
    from batchinfer.job.shard import shard_dirs
    target = OutputDir(outdir)
    dirs = [target] if target.meta.is_dir() else [OutputDir(d) for d in shard_dirs(outdir)]
    try:
        for directory in dirs or [target]:  # (no output at all: merge_parts says so)
            before, after = merge_parts(directory, rows_per_file)
            click.echo(f"batchinfer: {directory.path}: {before} part file(s) -> {after}")
    except JobError as e:
        raise FatalError.of(e) from None

