"""Signals that stop a job: the first SIGTERM, SIGINT or SIGHUP asks the loop to stop after
its step (finished rows are committed); a second one kills at once."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

# set in the environment of a data-parallel launcher's processes
DP_CHILD = "BATCHINFER_DATA_PARALLEL_CHILD"


class StopSignals:
    """Turns the first SIGTERM/SIGINT/SIGHUP into a request to stop; a second one kills at
    once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if signum == signal.SIGTERM and os.environ.get(DP_CHILD):
                return  # a data-parallel process: the launcher's SIGTERM may follow Slurm's
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def requested(self) -> bool:
        return self.signum is not None
