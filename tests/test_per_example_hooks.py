"""Per-example heads with user hooks, and the per-example refusals: funcgrad.per_example /
per_example_gramian / backward(batch_dim=0) against a per-example loop of
torch.autograd.grad with the same hooks, in float64 (hooks counted as in one backward of the
losses); refusals leave .grad untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad

B = 5


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def loop_jacobian(model, losses_fn):
    """(B, P): the rows of torch.autograd.grad(losses[b], params), a fresh forward each (so
    that hooks registered in losses_fn apply to each backward)."""
    params = trainable(model)
    rows = []
    for b in range(B):
        grads = torch.autograd.grad(losses_fn(model)[b], params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)]
            )
        )
    return torch.stack(rows)


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in trainable(model)])


def check_exact(model, losses_fn, counter=None):
    """Gramian and update (UPGrad-free: a native weighting) against the loop; ``counter``, a
    list the hooks append to, sees one call per backward."""
    jac = loop_jacobian(model, losses_fn)
    if counter is not None:
        counter.clear()
    with funcgrad.per_example(model) as pe:
        gram = funcgrad.per_example_gramian(losses_fn(model))
        calls = None if counter is None else len(counter)
        weights = pe.backward(losses_fn(model), weighting=lambda g: 1 / g.diagonal().sqrt())
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(flat_grads(model), weights @ jac, rtol=1e-9, atol=1e-11)
    return calls


def mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 1))


X, Y = torch.randn(B, 3), torch.randn(B)


# -- tensor hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["output", "intermediate", "first", "losses"])
def test_tensor_hook_matches_the_loop_and_fires_once(where):
    """A tensor hook on the last module's output (whose node also runs in the one backward,
    so torch captures its gradient before the hook) was applied wrongly: 2x on that layer."""
    model, calls = mlp(), []

    def hook(g):
        calls.append(1)
        return 2 * g

    def losses_fn(m):
        h = m[0](X)
        if where == "first":
            h.register_hook(hook)
        h = m[2](m[1](h))
        if where == "intermediate":
            h.register_hook(hook)
        out = m[4](m[3](h))
        if where == "output":
            out.register_hook(hook)
        losses = (out.squeeze(1) - Y) ** 2
        if where == "losses":
            losses.register_hook(hook)
        return losses

    assert check_exact(model, losses_fn, calls) == 1
