"""Debian packages the tests need (Slurm, a cross compiler), installed with apt-get when
they are missing and the tests may: as root, in CI (CI=true) or when the switch the caller
names is 1. Several test processes may ask at once: one installs."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time

_SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def which(program: str) -> str | None:
    """shutil.which, also looking in the sbin directories a non-login PATH may lack."""
    found = shutil.which(program)
    if found:
        return found
    for directory in _SBIN_DIRS:
        candidate = os.path.join(directory, program)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def ensure_installed(what: str, programs: tuple[str, ...], packages: tuple[str, ...],
                     switch: str, timeout: float = 600.0) -> str | None:
    """None when every program is found (installing the packages with apt-get first where
    allowed); otherwise a one-line reason, for pytest.skip."""
    def missing() -> list[str]:
        return [program for program in programs if which(program) is None]

    if not missing():
        return None
    what = f"{what} not installed (missing {', '.join(missing())})"
    if os.environ.get("CI", "").lower() != "true" and os.environ.get(switch) != "1":
        return f"{what}; set {switch}=1 to let the tests apt-get install it"
    if os.geteuid() != 0:
        return f"{what} and not root, cannot apt-get install {' '.join(packages)}"
    apt_get = which("apt-get")
    if apt_get is None:
        return f"{what} and no apt-get to install {' '.join(packages)}"
    deadline = time.monotonic() + timeout
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [apt_get, "install", "-y", "-q", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=120",
               "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
               *packages]
    update = [apt_get, "update", "-q", "-o", "DPkg::Lock::Timeout=120"]

    def run(command: list[str]) -> subprocess.CompletedProcess | str:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"{what}: apt-get timed out after {timeout:.0f}s"
        try:
            return subprocess.run(command, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=left)
        except subprocess.TimeoutExpired:
            return f"{what}: '{' '.join(command[:2])}' timed out after {timeout:.0f}s"
        except OSError as error:
            return f"{what}: cannot run apt-get: {error}"

    # (apt's own lock is not enough: a second process would find the packages half there)
    with open(os.path.join(tempfile.gettempdir(), "batchinfer-apt-install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not missing():
            return None
        result = run(install)
        if isinstance(result, str):
            return result
        if result.returncode != 0:  # stale or missing package lists: update, then retry
            updated = run(update)
            if isinstance(updated, str):
                return updated
            if updated.returncode != 0:
                return f"{what}: apt-get update failed: {_last_line(updated.stdout)}"
            result = run(install)
            if isinstance(result, str):
                return result
            if result.returncode != 0:
                return f"{what}: apt-get install failed: {_last_line(result.stdout)}"
    if missing():
        return f"apt-get installed {' '.join(packages)} but {', '.join(missing())} still missing"
    return None
