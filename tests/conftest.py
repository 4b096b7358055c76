import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import funcgrad

# Checked by mypy, never run: under --doctest-modules pytest would import it, and its typos
# (on purpose) raise.
collect_ignore = ["typecheck_api.py"]

settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("FUNCGRAD_HYPOTHESIS_PROFILE", "default"))

# float64 everywhere, also for tensors built at collection time in parametrize lists.
torch.set_default_dtype(torch.float64)


@pytest.fixture(autouse=True)
def _seeded_float64():
    """Every test starts from the same RNG state, in float64, with funcgrad's defaults."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    previous = funcgrad.set_check(None)
    yield
    torch.set_default_dtype(torch.float64)
    funcgrad.set_check(previous)


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for the test, restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
