"""The package installs the kernels under its own namespace, never as a top-level
`kernels` module (the name of the Hugging Face kernels package transformers probes for)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_kernels_not_importable_as_top_level_module():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or REPO not in Path(spec.origin or "").parents
    import batchinfer.kernels
    assert Path(batchinfer.kernels.__file__).parent == REPO / "kernels"


def test_python_dash_m_batchinfer_runs():
    out = subprocess.run([sys.executable, "-m", "batchinfer", "--help"], capture_output=True,
                         text=True, cwd=REPO.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("run", "merge", "bench"):
        assert command in out.stdout
