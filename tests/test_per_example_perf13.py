"""Session 13's per-example change, exact in float64 against a per-example autograd loop
and counted (never timed): on the CPU, the per-example gradients of a convolution of stride
and dilation 1 on at most 4 input and 32 output channels (an image's first layer) are ONE
grouped convolution of the input with each example's output gradients as the kernel, where the
grouped weight-gradient kernel with 3 channels a group was slow; and a convolution's
per-example gradients and update under a caller's CPU autocast (which main refused)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import per_example_jacobian
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import funcgrad


class _Convolutions(TorchDispatchMode):
    """The groups of each convolution and convolution backward run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name in ("aten.convolution", "aten.convolution_backward"):
            self.calls.append((name, args[8] if name == "aten.convolution" else args[9]))
        return func(*args, **(kwargs or {}))


def _image_model(bias: bool, padding: Any) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=padding, bias=bias),
        nn.Tanh(),
        nn.Conv2d(5, 6, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.LazyLinear(2),
    )


def _signal_model(bias: bool, padding: Any) -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=padding, bias=bias),
        nn.Tanh(),
        nn.Conv1d(4, 3, 3, stride=2),
        nn.Flatten(),
        nn.LazyLinear(2),
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("padding", [1, "valid", 2])
@pytest.mark.parametrize("kind", ["image", "signal"])
def test_a_first_convolution_on_few_channels_is_exact(kind, padding, bias):
    """G, the norms and the clipped update of a model whose first convolution has 3 (2-D)
    or 2 (1-D) input channels, against the loop, in float64 to 1e-10."""
    torch.manual_seed(0)
    if kind == "image":
        model, x = _image_model(bias, padding), torch.randn(5, 3, 9, 9)
    else:
        model, x = _signal_model(bias, padding), torch.randn(5, 2, 17)
    model, x = model.double(), x.double()
    model(x)  # the lazy Linear's shape

    def losses_of(m: nn.Module) -> torch.Tensor:
        return m(x).pow(2).sum(1)

    rows = per_example_jacobian(model, losses_of)
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(losses_of(model))
        norms = funcgrad.per_example_norms(losses_of(model))
        for p in model.parameters():
            p.grad = None
        funcgrad.per_example_clip(losses_of(model), 0.5)
    torch.testing.assert_close(gram, rows @ rows.T, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(norms, rows.norm(dim=1), rtol=1e-10, atol=1e-10)
    factors = (0.5 / (rows.norm(dim=1) + 1e-6)).clamp(max=1)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads, factors @ rows, rtol=1e-10, atol=1e-10)


def _grouped_convolutions(model, x):
    """The convolutions with the B examples as groups that one steady Gramian call runs
    (after a first, checked call), the first layer's rule materialised."""
    with funcgrad.per_example(model) as pe:
        funcgrad.per_example_gramian(model(x).pow(2).sum(1))  # the first: checked
        losses = model(x).pow(2).sum(1)
        with _Convolutions() as mode:
            funcgrad.per_example_gramian(losses)
        assert "materialised" in str(pe.plan).splitlines()[1], str(pe.plan)
    return [call for call in mode.calls if call[1] == x.shape[0]]


def test_a_first_convolution_on_few_channels_takes_one_convolution_with_the_examples_as_groups():
    """The Gramian of the image model (B = 5): the 3-channel convolution's per-example
    gradients come from one ``convolution`` with the 5 examples as groups, not from a
    grouped ``convolution_backward`` (main: both convolutions' from the latter); the
    5-channel, stride-2 one keeps the grouped weight-gradient kernel."""
    torch.manual_seed(0)
    model = _image_model(True, 1).double()
    x = torch.randn(5, 3, 9, 9, dtype=torch.float64)
    model(x)
    grouped = _grouped_convolutions(model, x)
    want = [("aten.convolution", 5), ("aten.convolution_backward", 5)]
    assert sorted(grouped) == want, grouped


def test_a_first_convolution_with_many_outputs_keeps_the_grouped_kernel():
    """A 3-channel convolution with 64 output channels (B = 4): the input as kernel costs
    more than the grouped weight-gradient kernel there (its cost grows with the outputs;
    docs/benchmarks_per_example.md), so its per-example gradients come from the grouped
    ``convolution_backward`` and no ``convolution`` has the examples as groups."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.Flatten(), nn.Linear(64 * 16, 2))
    x = torch.randn(4, 3, 4, 4, dtype=torch.float64)
    model = model.double()
    grouped = _grouped_convolutions(model, x)
    assert grouped == [("aten.convolution_backward", 4)], grouped


@pytest.mark.parametrize("channels", [3, 6])
def test_a_convolution_under_cpu_autocast_is_close_to_the_loop(channels):
    """Under a caller's CPU bf16 autocast, Δ is bf16 and the recorded input float32: the
    grouped weight-gradient kernel refused the pair on main (oneDNN "could not create a
    primitive descriptor"), for the G, the norms and the clip; both forms now run in the
    wider dtype. The (float32) G and the clipped update against the loop on the same
    autocast losses, with both forms: 3 input channels (the input as kernel) and 6 (the
    grouped kernel)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(channels, 5, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(5 * 64, 2)
    ).float()  # (autocast casts float32 alone; the tests' default dtype is float64)
    x = torch.randn(6, channels, 8, 8, dtype=torch.float32)

    def losses_of(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float().pow(2).sum(1)

    rows = per_example_jacobian(model, losses_of).double()
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(losses_of(model))
        for p in model.parameters():
            p.grad = None
        funcgrad.per_example_clip(losses_of(model), 1.0)
    want = rows @ rows.T
    assert float((gram.double() - want).norm() / want.norm()) < 1e-3  # 2.3e-4 here
    factors = (1.0 / (rows.norm(dim=1) + 1e-6)).clamp(max=1)
    update = factors @ rows
    grads = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    assert float((grads - update).norm() / update.norm()) < 1e-2  # bf16 Δ: 2.5e-3 here
