"""Root pytest configuration: doctests run in torch's defaults (float32), seeded."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _torch_defaults():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)
    yield
