"""Fixes from the review of the attention change (perex4): each against the per-example
autograd loop (`tests.helpers.per_example_jacobian`) in float64, or a clear refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad
from tests.helpers import per_example_jacobian

pytestmark = pytest.mark.usefixtures("float64_default")


def _check_all(model, losses_fn, max_norm=0.5):
    """G, norms and the clipped sum of per_example against the loop."""
    params = [p for p in model.parameters() if p.requires_grad]
    jac = per_example_jacobian(model, losses_fn, params)
    norms = jac.norm(dim=1)
    clipped = (max_norm / (norms + 1e-6)).clamp(max=1.0) @ jac
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(losses_fn(model))
        found = funcgrad.per_example_norms(losses_fn(model))
        for p in params:
            p.grad = None
        funcgrad.per_example_clip(losses_fn(model), max_norm, accumulate=False)
    flat = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(found, norms, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(flat, clipped, rtol=1e-9, atol=1e-10)


# -- 1: a frozen out-projection (its product saves no input) ---------------------------------


@pytest.mark.parametrize("frozen", ["out_proj", "out_proj.weight", "no_bias"])
def test_frozen_attention_out_projection_is_exact(frozen):
    torch.manual_seed(1)
    enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, bias=True)
    if frozen == "no_bias":
        enc.self_attn = nn.MultiheadAttention(8, 2, batch_first=True, bias=False)
    out_proj = enc.self_attn.out_proj
    if frozen == "out_proj.weight":
        out_proj.weight.requires_grad_(False)
    else:
        out_proj.requires_grad_(False)
    x = torch.randn(3, 4, 8)
    _check_all(enc, lambda m: m(x).pow(2).sum((1, 2)))


# -- 2: a tensor made from a parameter before the call (a cache, a view) ---------------------


class _Cached(nn.Module):
    """Its weight's transpose, made on the first forward (a lazy cache), at init (a view),
    or kept in a list: the generic rule's functional call would read it as it is."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.how = how
        self._wt = self.weight.t() if how == "view" else None
        self._kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "list":
            if not self._kept:
                self._kept.append(self.weight.t().clone())
            return torch.tanh(x @ self._kept[0])
        if self._wt is None:
            self._wt = self.weight.t()
        return torch.tanh(x @ self._wt)


@pytest.mark.parametrize("how", ["lazy", "view", "list"])
def test_tensor_made_from_a_parameter_before_the_call_is_exact(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Cached(how), nn.Linear(3, 3))
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    _check_all(model, lambda m: (m(x) - y).pow(2).sum(1))


# -- 3: buffers updated in forward are not updated again by the rule's calls ------------------


class _Stat(nn.Module):
    """Running statistics (in place) and a counter (in place, or assigned anew)."""

    def __init__(self, assign: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.assign = assign
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.T
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * y.mean(0))
                if self.assign:
                    self.count = self.count + 1
                else:
                    self.count += 1
        return torch.tanh(y)


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("check", [True, False])
def test_buffers_updated_in_forward_once_per_forward(assign, check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Stat(assign), nn.Linear(3, 3))
    twin = nn.Sequential(nn.Linear(4, 4), _Stat(assign), nn.Linear(3, 3))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    with funcgrad.per_example(model):
        for _ in range(2):
            losses = model(x).pow(2).sum(1)
            jac = per_example_jacobian(twin, lambda m: m(x).pow(2).sum(1))
            gram = funcgrad.per_example_gramian(losses, check=check)
            torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-10)
    # each model ran forward twice: the same statistics
    assert model[1].count.item() == twin[1].count.item() == 2
    torch.testing.assert_close(model[1].mean, twin[1].mean, rtol=0, atol=0)


# -- 4: attention whose own parameters are frozen, its out-projection trained ----------------


class _FrozenIn(nn.Module):
    def __init__(self, cross: bool) -> None:
        super().__init__()
        kv = dict(kdim=5, vdim=6) if cross else {}
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True, **kv)
        for p in self.mha.parameters(recurse=False):  # all but the out-projection's
            p.requires_grad_(False)
        self.post = nn.Linear(8, 8)
        self.cross = cross

    def forward(self, x: torch.Tensor, memory: tuple[torch.Tensor, torch.Tensor]):
        k, v = memory if self.cross else (x, x)
        return self.post(self.mha(x, k, v, need_weights=False)[0])


@pytest.mark.parametrize("cross", [False, True])
def test_attention_with_frozen_in_projection_is_exact(cross):
    torch.manual_seed(1)
    model = _FrozenIn(cross)
    x, memory = torch.randn(3, 4, 8), (torch.randn(3, 5, 5), torch.randn(3, 5, 6))
    _check_all(model, lambda m: m(x, memory).pow(2).sum((1, 2)))


class _KeepsOutput(nn.Module):
    """Keeps its output (made from its weight) in an attribute it never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = torch.tanh(x @ self.weight.T)
        return self.last


@pytest.mark.parametrize("module", ["cache", "kept"])
def test_only_a_tensor_read_by_the_call_takes_the_loop(module):
    """The cache, read by the call: the loop; an output kept but not read: vmap stays."""
    torch.manual_seed(0)
    layer = _Cached("lazy") if module == "cache" else _KeepsOutput()
    model = nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(3, 3))
    x = torch.randn(5, 4)
    with funcgrad.per_example(model) as hooked:
        for _ in range(2):
            funcgrad.per_example_gramian(model(x).pow(2).sum(1))
        row = next(line for line in str(hooked.plan).splitlines() if type(layer).__name__ in line)
    assert ("materialised, loop" if module == "cache" else "materialised, vmap") in row
