"""Fixtures for tests that need a real Slurm cluster (see local_cluster.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # local_cluster

from local_cluster import LocalSlurm, ensure_installed  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: starts a real single-node Slurm cluster (apt-get installs "
        "slurm-wlm and munge as root in CI or with BATCHINFER_INSTALL_SLURM=1; skipped "
        "when Slurm is missing and cannot be installed)")


@pytest.fixture(scope="session")
def slurm_installed() -> None:
    """Skips the test when Slurm is not installed and cannot be (not root, no apt-get)."""
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("LocalSlurm runs its daemons and jobs as root (SlurmUser=root)")


@pytest.fixture
def local_slurm(slurm_installed, tmp_path: Path):
    """A started LocalSlurm in tmp_path/"cluster", stopped after the test."""
    with LocalSlurm(tmp_path / "cluster") as cluster:
        yield cluster
