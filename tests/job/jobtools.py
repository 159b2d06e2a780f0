"""Settings shared by the job tests (imported as `jobtools`; tests/job/conftest.py puts this
directory on sys.path, also for the subprocesses that import fake_engine)."""
from __future__ import annotations

# Small KV pool and batch: engine start-up stays fast and several requests are in flight.
ENGINE_KWARGS = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8}
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-num-seqs", "8"]
