"""Host reads (each a stall of the stream on a GPU), counted on the CPU by
funcgrad.HostReadCounter: the counter itself, then every entry point's steady state."""

from __future__ import annotations

import torch

import funcgrad


def _count(fn) -> funcgrad.HostReadCounter:
    with funcgrad.HostReadCounter() as counter:
        fn()
    return counter


def test_the_counter_counts_each_way_of_reading_a_value():
    x = torch.tensor([1.0, -2.0])
    assert _count(lambda: bool(x[0])).count == 1
    assert _count(lambda: x[0].item()).count == 1
    assert _count(lambda: float(x.sum())).count == 1
    assert _count(lambda: torch.equal(x, x)).count == 1
    assert _count(lambda: torch.allclose(x, x)).count == 1

    def branch():
        if x.any():
            return 1
        return 0

    assert _count(branch).count == 1
    # Outputs whose shape depends on the values read a count from the device.
    assert _count(lambda: x[x > 0]).count == 1
    assert _count(lambda: torch.nonzero(x)).count == 1


def test_the_counter_counts_nothing_for_pure_tensor_ops():
    x = torch.randn(3, 4, requires_grad=True)

    def pure():
        y = torch.where(torch.isfinite(x), x, 0.0).tanh() @ torch.randn(4, 2)
        (g,) = torch.autograd.grad(y.sum(), x)
        torch._assert_async(torch.isfinite(g).all())  # the device-side check: no read
        torch.func.vmap(torch.func.grad(lambda v: v.sin().sum()))(x.detach())
        return x[torch.tensor([0, 2])], g.max(), y.sort()

    counter = _count(pure)
    assert counter.count == 0, [str(read) for read in counter.reads]


def test_the_counter_names_the_line_that_reads():
    x = torch.tensor(1.0)
    counter = _count(lambda: x.item())
    (read,) = counter.reads
    assert read.op == "aten._local_scalar_dense"
    assert read.where.startswith(__file__) and "lambda" in read.where
    counter.reset()
    assert counter.count == 0 and repr(counter) == "HostReadCounter(count=0)"
