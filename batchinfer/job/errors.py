"""The exceptions a job raises for what the user must fix or know; the CLI prints their
message as one line and exits with their `exit_code`."""
from __future__ import annotations


class JobError(Exception):
    """A fatal, user-fixable mistake (missing input, unknown column, bad flag value...).

    The message is one line naming what to fix; the CLI prints it and exits with code 2.
    """
    exit_code = 2


class OutputFailed(JobError):
    """Writing the output failed while the job ran (a full disk, an I/O error): one line
    naming the path and the cause, exit code 1. What was committed before stays."""
    exit_code = 1


class EngineFailed(JobError):
    """The engine lost a rank or a node while the job ran: one line naming it, exit code
    1. What was committed before stays."""
    exit_code = 1


class Stopped(JobError):
    """A signal stopped the job before it ran anything: exit code 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
