"""Fixtures shared by every test module; shared data and builders are in tests/helpers.py."""

import os

# The suite's expected values are the CPU's (bitwise resumes, digests of in-process runs, Gloo process groups), so on
# a machine with a GPU it hides the GPU from every test and subprocess; `EDM2_TEST_CUDA=1 python -m pytest -m cuda`
# runs the tests marked `cuda` on it instead (scripts/gpu_check.py checks and measures the GPU itself). Set before
# PyTorch reads it, which is when CUDA first starts.
if os.environ.get("EDM2_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# train_edm2.py starts one process per core on a CPU unless told (cli.local_launch); the tests train as one process,
# where they can watch it, unless a test asks for more (--processes, or EDM2_PROCESSES unset).
os.environ["EDM2_PROCESSES"] = "1"

import pytest  # noqa: E402 (after hiding the GPU)
import torch  # noqa: E402

from edm2.plots import toy as toy_plots  # noqa: E402
from tests.helpers import (
    built_once, forget_release_standins, install_release_standins, run_training, save_tiny_vae, write_image_dataset,
)

# EDM2_TEST_THREADS=2 runs the suite with two threads per process, to show that no tolerance depends
# on how a reduction is split across threads.
TEST_THREADS = int(os.environ.get("EDM2_TEST_THREADS", "1"))


# The test files with the slowest tests, slowest first: the Makefile's pytest-xdist processes (worksteal) even out
# by taking tests from each other's end, so the end should hold short tests, not a minute-long one that leaves a
# core idle.
SLOW_FILES = ("test_speed_compile.py", "test_readme.py", "test_text_toy.py", "test_slurm.py", "test_train_cli.py",
              "test_train_faults.py", "test_tracking.py", "test_sample_grid_threads.py", "test_disk.py",
              "test_nonfinite.py", "test_utilization.py", "test_text_generation.py", "test_text_conditioning.py",
              "test_encode_text.py", "test_consistency_training.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run SLOW_FILES first, in that order; every other file and each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked `cuda` where no GPU is visible (always, unless EDM2_TEST_CUDA=1)."""
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a GPU: EDM2_TEST_CUDA=1 python -m pytest -m cuda on a machine with one")


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """torch.compile's cache in a folder of this session (subprocesses inherit it), not the shared one in /tmp:
    torch 2.13 reused code from that cache built under another ATEN_CPU_CAPABILITY and crashed (segfault)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
        yield


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory):
    """$EDM2_CACHE_DIR (downloads, the CPU's measured peak) in a folder of this session, for subprocesses too:
    the suite writes nothing to the user's cache and reads nothing from it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDM2_CACHE_DIR", str(tmp_path_factory.mktemp("edm2-cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def session_threads():
    """Run everything, module and session fixtures included, on TEST_THREADS CPU threads (default 1: tiny tensors
    are faster without OpenMP synchronization, and torchrun workers default to OMP_NUM_THREADS=1). A fixture that
    trained on the machine's default thread count while its test resumed on TEST_THREADS differed from it in the last
    bits (tests/test_nonfinite.py's good_run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def test_threads(session_threads):
    """TEST_THREADS again after a test that changed the thread count."""
    yield
    torch.set_num_threads(TEST_THREADS)


@pytest.fixture
def release_standins(tmp_path):
    """(persistence, util) stand-ins of the release's modules; unimportable again after the test."""
    try:
        yield install_release_standins(tmp_path)
    finally:
        forget_release_standins()


@pytest.fixture(scope="session")
def tiny_vae_dir(tmp_path_factory):
    """A saved tiny random AutoencoderKL (see helpers.save_tiny_vae)."""
    return save_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae")


@pytest.fixture(scope="session")
def train_data(tmp_path_factory):
    """The training tests' dataset: 48 labeled 8x8 RGB images in 4 classes (helpers.write_image_dataset), at one
    path for every test process, so that runs made once for all of them (built_once) name the data each trains on."""
    folder, name = built_once(tmp_path_factory, "train-data", lambda folder: write_image_dataset(folder / "toy").name)
    return folder / name


@pytest.fixture(scope="session")
def reference_run(train_data, tmp_path_factory):
    """An uninterrupted 2048-image toy-tiny run (helpers.TRAIN_ARGS) that interrupted runs must match bit for bit."""
    outdir = tmp_path_factory.mktemp("runs") / "reference"
    result = run_training(train_data, outdir, "--workers=0")
    assert result.returncode == 0, result.stderr
    return outdir


@pytest.fixture
def small_views(monkeypatch):
    """The toy figures' grids and sample counts shrunk, so that a test draws one in a second."""
    for name in ("OVERVIEW", "CLOSE_UP", "PROGRESS"):
        view = getattr(toy_plots, name)
        monkeypatch.setattr(toy_plots, name, type(view)(**{**view.__dict__, "resolution": 24, "num_samples": 96}))
