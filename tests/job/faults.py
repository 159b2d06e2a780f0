"""Fault injection for the output folder's file operations: each call of os.fsync,
os.replace or os.unlink is one step; at a chosen step the process raises an OSError
(once, or at every step from there: a full disk stays full) or kills itself with SIGKILL.

    with Faults(at=3, error=errno.ENOSPC) as faults: ...   # the third step raises
    faults.steps                                           # how many steps ran
"""
from __future__ import annotations

import errno
import os
import signal
from typing import Any

OPERATIONS = ("fsync", "replace", "unlink")


class Faults:
    def __init__(self, at: int | None = None, error: int = errno.ENOSPC,
                 persistent: bool = False, kill: bool = False):
        self.at = at
        self.error = error
        self.persistent = persistent
        self.kill = kill
        self.steps = 0
        self.failed = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "Faults":
        for name in OPERATIONS:
            self._saved[name] = getattr(os, name)
            setattr(os, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, function in self._saved.items():
            setattr(os, name, function)

    def _wrap(self, name: str, function: Any) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            self.steps += 1
            if self.at is not None and (self.steps == self.at
                                        or (self.persistent and self.steps > self.at)):
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                self.failed += 1
                raise OSError(self.error, f"{os.strerror(self.error)} (injected in {name})")
            return function(*args, **kwargs)
        return step
