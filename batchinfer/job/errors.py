"""The one exception type a job raises for mistakes the user must fix."""
from __future__ import annotations


class JobError(Exception):
    """A fatal, user-fixable mistake (missing input, unknown column, bad flag value...).

    The message is one line naming what to fix; the CLI prints it and exits with code 2.
    """
