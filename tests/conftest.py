"""Settings shared by every test."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Run on one CPU thread: tiny tensors are faster without OpenMP synchronization, and results
    are bit-identical to torchrun workers, which default to OMP_NUM_THREADS=1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
