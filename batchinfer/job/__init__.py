"""The batch job: `batchinfer run` streams a dataset through the engine into Parquet.

reader (rows) -> prompts (requests) -> ordering (prefix-grouped window) -> runner (engine
loop) -> writer (parts) -> manifest (exactly-once commits); metrics, progress and summary
report on it; cli defines the `run` and `merge` commands.
"""
