"""Settings shared by the job tests (imported as `jobtools`; tests/job/conftest.py puts this
directory on sys.path, also for the subprocesses that import fake_engine)."""
from __future__ import annotations

# Small KV pool and batch: engine start-up stays fast and several requests are in flight.
ENGINE_KWARGS = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8}
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "8"]


def nested_list(depth: int, leaf=1):
    """`leaf` inside `depth` lists."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def corrupt_row_group(path, row_group: int) -> None:
    """Scramble 64 bytes in the middle of a row group's first column chunk (compressed, so
    reading it fails)."""
    import pyarrow.parquet as pq
    chunk = pq.ParquetFile(path).metadata.row_group(row_group).column(0)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    middle = start + chunk.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[middle:middle + 64] = bytes(b ^ 0x5A for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
