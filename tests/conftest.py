"""Shared fixtures; the model and batch helpers live in tiny_models.py (on pytest's pythonpath)."""
import pytest
import torch

from tiny_models import FAMILIES


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture
def one_torch_thread():
    """Tiny models are overhead-bound: one intra-op thread is as fast on an idle machine and avoids
    thread spin-waits that make every matmul ~50x slower on a loaded 2-core one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
