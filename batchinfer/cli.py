"""The `batchinfer` command: run, merge, bench."""
from __future__ import annotations

import click

from batchinfer.bench.cli import bench
from batchinfer.job.cli import merge, run


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchinfer")
def main() -> None:
    """Offline batch inference: a dataset in, completions and latency stats out as Parquet."""


main.add_command(run)
main.add_command(merge)
main.add_command(bench)
