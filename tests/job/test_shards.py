"""--num-shards/--shard-index: independent runs (a Slurm array's tasks) split the input in
blocks; their outputs together hold every row exactly once and read as one dataset."""
from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchinfer.job.errors import JobError
from batchinfer.job.options import JobOptions
from batchinfer.job.rangeset import RangeSet
from batchinfer.job.reader import open_input
from batchinfer.job.runner import run_job
from batchinfer.job.shard import BLOCK_ROWS, Shard
from fake_engine import FakeEngine


def test_shards_partition_rows_in_blocks():
    for count in (1, 2, 3, 5):
        shards = [Shard(i, count) for i in range(count)]
        for total in (0, 1, BLOCK_ROWS - 1, BLOCK_ROWS, 7 * BLOCK_ROWS + 5, 12 * BLOCK_ROWS):
            owners = [[s.index for s in shards if s.owns(r)] for r in range(total)]
            assert all(len(o) == 1 for o in owners)
            for s in shards:
                assert s.rows_below(total) == sum(o == [s.index] for o in owners)
        for s in shards:
            for row in (0, 5, BLOCK_ROWS, 3 * BLOCK_ROWS + 7):
                nxt = s.next_owned(row)
                assert s.owns(nxt) and not any(s.owns(r) for r in range(row, nxt))
    assert Shard(1, 2).owns(BLOCK_ROWS) and not Shard(1, 2).owns(BLOCK_ROWS - 1)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_reader_yields_only_the_shards_rows(tmp_path, fmt):
    n = 3 * BLOCK_ROWS + 100
    rows = [{"prompt": f"row {i}"} for i in range(n)]
    path = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=700)
    source = open_input(str(path))
    schema, json_columns = source.inspect().schema({"prompt": "text"})
    done = RangeSet([(BLOCK_ROWS + 10, BLOCK_ROWS + 20)])
    seen = []
    for index in range(2):
        got = [r.index for b in source.batches(schema, json_columns, done, None,
                                               Shard(index, 2)) for r in b]
        assert got == sorted(got)
        assert all(Shard(index, 2).owns(i) for i in got)
        seen += got
    assert sorted(seen) == [i for i in range(n) if i not in done]


def _job(tmp_path, rows: int, **kwargs) -> JobOptions:
    path = tmp_path / "in.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(rows)))
    return JobOptions(input=str(path), model="stand-in", output=str(tmp_path / "out"),
                      progress=False, **{"max_tokens": 2, **kwargs})


def _run(options: JobOptions):
    return run_job(options, lambda m, k: FakeEngine(16), out=io.StringIO(), err=io.StringIO())


def test_sharded_runs_write_every_row_once_and_resume(tmp_path):
    rows = 2 * BLOCK_ROWS + 300
    unsharded = _job(tmp_path, rows)
    unsharded.output = str(tmp_path / "whole")
    assert _run(unsharded).exit_code == 0
    # shard 1 first stops part way (--limit), then finishes; shard 0 runs once
    partial = _run(_job(tmp_path, rows, num_shards=2, shard_index=1, limit=BLOCK_ROWS + 50,
                        commit_rows=20))
    assert partial.exit_code == 0 and partial.summary["rows"] == 50
    for index in (1, 0):
        result = _run(_job(tmp_path, rows, num_shards=2, shard_index=index, commit_rows=200))
        assert result.exit_code == 0
        assert result.summary["rows"] == Shard(index, 2).rows_below(rows)
        assert result.output == tmp_path / "out" / f"shard-{index:05d}-of-00002"
    table = ds.dataset(tmp_path / "out").to_table()  # both shards, bookkeeping skipped
    assert sorted(table.column("id").to_pylist()) == list(range(rows))
    whole = ds.dataset(tmp_path / "whole").to_table()
    key = lambda t: sorted(zip(t.column("id").to_pylist(), t.column("completion").to_pylist()))  # noqa: E731
    assert key(table) == key(whole)
    import pandas
    assert len(pandas.read_parquet(tmp_path / "out")) == rows


def test_mixed_layouts_are_refused(tmp_path):
    assert _run(_job(tmp_path, 10, num_shards=2, shard_index=0)).exit_code == 0
    with pytest.raises(JobError, match="2-way split"):
        _run(_job(tmp_path, 10))
    with pytest.raises(JobError, match="2-way split, not 3"):
        _run(_job(tmp_path, 10, num_shards=3, shard_index=0))
    whole = _job(tmp_path, 10)
    whole.output = str(tmp_path / "whole")
    assert _run(whole).exit_code == 0
    sharded = _job(tmp_path, 10, num_shards=2, shard_index=1)
    sharded.output = whole.output
    with pytest.raises(JobError, match="unsharded job"):
        _run(sharded)
    with pytest.raises(JobError, match=r"--shard-index must be in \[0, --num-shards\)"):
        _run(_job(tmp_path, 10, num_shards=2, shard_index=2))
    with pytest.raises(JobError, match="needs --shard-index"):
        _run(_job(tmp_path, 10, num_shards=2))
    # a sibling shard of another job (here: other sampling) would mix two jobs in OUTDIR
    with pytest.raises(JobError, match=r"shard-00000-of-00002 holds rows of a different job "
                                       r"\(sampling.max_tokens differ\)"):
        _run(_job(tmp_path, 10, num_shards=2, shard_index=1, max_tokens=3))
    (tmp_path / "file").write_text("")
    on_file = _job(tmp_path, 10, num_shards=2, shard_index=1)
    on_file.output = str(tmp_path / "file")
    with pytest.raises(JobError, match="is a file"):
        _run(on_file)


def test_cli_flags(tmp_path, run_cli):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(3)))
    for index in ("0", "1"):  # the same job in both, with a list-valued setting (--stop)
        result = run_cli(path, "-o", tmp_path / "out", "--max-tokens", "2", "--stop", "zz",
                         "--num-shards", "2", "--shard-index", index)
        assert result.exit_code == 0, result.output
    table = ds.dataset(tmp_path / "out" / "shard-00000-of-00002").to_table()
    assert sorted(table.column("id").to_pylist()) == [0, 1, 2]  # the first block is shard 0's
    assert not list((tmp_path / "out" / "shard-00001-of-00002").glob("*.parquet"))


def test_merge_of_a_sharded_outdir_merges_each_shard(tmp_path):
    from click.testing import CliRunner

    from batchinfer.job.cli import merge
    rows = BLOCK_ROWS + 200
    for index in (0, 1):
        assert _run(_job(tmp_path, rows, num_shards=2, shard_index=index,
                         commit_rows=100)).exit_code == 0
    out = tmp_path / "out"
    before = sorted(ds.dataset(out).to_table().column("id").to_pylist())
    assert len(list(out.glob("shard-*/*.parquet"))) > 2
    result = CliRunner().invoke(merge, [str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.count("part file(s) -> 1") == 2
    assert len(list(out.glob("shard-*/*.parquet"))) == 2
    assert sorted(ds.dataset(out).to_table().column("id").to_pylist()) == before == list(range(rows))
