"""The package installs the kernels under its own namespace, never as a top-level
`kernels` module (the name of the Hugging Face kernels package transformers probes for)."""
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_kernels_not_importable_as_top_level_module():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin or "").parent != REPO / "kernels"
    import batchinfer.kernels
    assert Path(batchinfer.kernels.__file__).parent == REPO / "kernels"


def _import_kernels_from_the_checkout_root(pythonpath: str | None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = ("import kernels, batchinfer.kernels\n"
            "print(kernels.__file__)\nprint(batchinfer.kernels.__file__)\n"
            "print(kernels.MARK if hasattr(kernels, 'MARK') else '')")
    # python -c puts the working directory, the checkout's root here, first on sys.path
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


def test_from_the_checkout_root_kernels_is_the_hugging_face_package(tmp_path):
    # transformers imports the Hugging Face `kernels` package when it is installed; python
    # started in a checkout must find that one, not the kernels/ folder beside it
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from .inner import MARK\n")
    (tmp_path / "kernels" / "inner.py").write_text("MARK = 'the other kernels'\n")
    out = _import_kernels_from_the_checkout_root(str(tmp_path))
    assert out.returncode == 0, out.stderr
    top, ours, mark = out.stdout.splitlines()
    assert Path(top) == tmp_path / "kernels" / "__init__.py"
    assert Path(ours) == REPO / "kernels" / "__init__.py"
    assert mark == "the other kernels"


@pytest.mark.skipif(bool(importlib.metadata.packages_distributions().get("kernels")),
                    reason="the Hugging Face kernels package is installed")
def test_from_the_checkout_root_kernels_is_missing_when_not_installed():
    out = _import_kernels_from_the_checkout_root(None)
    assert out.returncode != 0
    assert "ModuleNotFoundError: No module named 'kernels'" in out.stderr


def test_python_dash_m_batchinfer_runs():
    out = subprocess.run([sys.executable, "-m", "batchinfer", "--help"], capture_output=True,
                         text=True, cwd=REPO.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("run", "merge", "bench"):
        assert command in out.stdout
