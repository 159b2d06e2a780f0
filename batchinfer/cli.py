"""The `batchinfer` command: run, merge, bench, build-kernels."""
from __future__ import annotations

import click

from batchinfer.bench.cli import bench
from batchinfer.job.cli import merge, run


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchinfer")
def main() -> None:
    """Offline batch inference: a dataset in, completions and latency stats out as Parquet."""


@click.command("build-kernels")
def build_kernels() -> None:
    """Build the C kernels for this CPU into the cache, as a first run would (once per CPU
    model, compiler and -march): ahead of a job, or once per kind of node of a cluster
    whose nodes share the cache ($BATCHINFER_CACHE_DIR). Exit 1 when one fails."""
    from batchinfer.kernels.cpu import build
    if build.switched_off():
        raise click.ClickException(f"{build.ENV_SWITCH}=0 switches the CPU kernels off")
    built = build.build_all(say=lambda message: click.echo(f"batchinfer: {message}", err=True))
    failed = [source.name for source, library in built.items() if library is None]
    if failed:
        raise click.ClickException(f"{', '.join(failed)} could not be built (the warnings "
                                   "above say why)")
    folders = sorted({str(library.parent) for library in built.values()})
    click.echo(f"batchinfer: {len(built)} CPU kernels ready in {', '.join(folders)}", err=True)


main.add_command(run)
main.add_command(merge)
main.add_command(bench)
main.add_command(build_kernels)
