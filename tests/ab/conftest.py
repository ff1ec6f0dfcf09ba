import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """CI runs two test workers on two cores: one intra-op thread each keeps a step's time from
    waiting on a thread the other worker pre-empted, which timing tests would read as noise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
