"""Fixtures shared by the tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Both AR and speculation on one CPU thread: steady timings on a small or busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
