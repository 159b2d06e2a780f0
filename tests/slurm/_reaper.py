"""python _reaper.py COMMAND...: run COMMAND (a daemon in the foreground) as a child
subreaper, so that whatever it leaves behind (slurmd's slurmstepd and the jobs' processes,
which slurmd double-forks away) is reparented here instead of to PID 1: reaped when it exits
(no zombies where PID 1 does not reap), and killed when COMMAND exits.

SIGTERM/SIGINT are forwarded to COMMAND; the reaper also gets SIGTERM when the process that
started it dies (PR_SET_PDEATHSIG), so a killed test run does not leave daemons behind.
Exits with COMMAND's status (128+N for a signal).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _children() -> list[int]:
    me = str(os.getpid())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[1] == me and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    parent = int(os.environ.pop("_REAPER_PARENT", "0"))
    if parent and os.getppid() != parent:  # the parent died before prctl
        return 1
    command = sys.argv[1:]
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # if the reaper is killed
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    status = 0
    while True:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            status = os.waitstatus_to_exitcode(wait_status)
            status = 128 - status if status < 0 else status
            break
    # COMMAND is gone: end everything it left behind, SIGTERM first, then SIGKILL.
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        deadline = time.monotonic() + grace
        while True:
            _reap()
            left = _children()
            if not left:
                return status
            if time.monotonic() > deadline:
                break
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
    return status


if __name__ == "__main__":
    sys.exit(main())
