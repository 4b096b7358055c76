"""Where users already work: imperative autograd code, stacked heads, nn.Module, torch.compile."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import autograd_reference

import funcgrad
from funcgrad._counting import BackwardCounter, counted


def _seed_graph(n, counter):
    # The seed's code, unchanged up to the line that asks for the gradients.
    def slow_fun(x):
        A = counted(x, counter) * torch.ones((n, n))
        B = torch.matrix_exp(1j * A)
        return torch.real(torch.trace(B))

    x = torch.tensor(1.0, requires_grad=True)
    y = slow_fun(x)
    z1 = y**2
    z2 = torch.sqrt(y)
    return x, y, [z1, z2, torch.log(y), torch.sin(y) * y]


def test_grads_on_the_seed_matches_closed_form_with_one_pass():
    counter = BackwardCounter()
    x, y, outputs = _seed_graph(40, counter)
    (dz_dx,) = funcgrad.grads(outputs, x, through=y, retain_graph=True)
    assert counter.backward == 1
    yv, dy = 39 + math.cos(40.0), -40 * math.sin(40.0)
    expected = [
        2 * yv * dy,
        0.5 / math.sqrt(yv) * dy,
        dy / yv,
        (math.cos(yv) * yv + math.sin(yv)) * dy,
    ]
    torch.testing.assert_close(dz_dx, torch.tensor(expected), rtol=1e-9, atol=0)
    reference = [torch.autograd.grad(z, x, retain_graph=True)[0] for z in outputs]
    torch.testing.assert_close(dz_dx, torch.stack(reference))


def test_grads_with_several_inputs_and_through_tensors():
    a, b = torch.randn(3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    h1 = torch.tanh(b @ a)  # (2,)
    h2 = torch.sin(a).sum() * b  # (2, 3)
    outputs = [(h1 * h2.sum(1)).sum(), h2.pow(2).mean(), h1[0] * 3, (h1.sum() + h2.sum()) ** 2]
    ga, gb = funcgrad.grads(outputs, [a, b], through=[h1, h2], retain_graph=True)
    assert ga.shape == (4, 3) and gb.shape == (4, 2, 3)
    for i, z in enumerate(outputs):
        ra, rb = torch.autograd.grad(z, [a, b], retain_graph=True)
        torch.testing.assert_close(ga[i], ra)
        torch.testing.assert_close(gb[i], rb)


def test_grads_create_graph_gives_second_order():
    x = torch.randn(3, requires_grad=True)
    y = torch.tanh(x) * x.sum()
    outputs = [(y**2).sum(), y.prod()]
    (g,) = funcgrad.grads(outputs, x, through=y, create_graph=True)
    (second,) = torch.autograd.grad(g.sum(), x, retain_graph=True)
    total = sum(torch.autograd.grad(z, x, create_graph=True)[0].sum() for z in outputs)
    (expected,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(second, expected)


def _head_graph():
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)  # a head's parameter, not differentiated
    y = torch.exp(x)
    return x, w, y, [(w * y).sum(), (y**2).sum() + w.sum()]


def _raises(fn):
    try:
        fn()
    except RuntimeError as error:
        assert "backward through the graph a second time" in str(error)
        return True
    return False


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("retain_graph", [None, False, True])
def test_grads_frees_the_graph_as_torch_autograd_grad_does(retain_graph, create_graph):
    """retain_graph as in torch.autograd.grad (default: create_graph): without it, a second
    call or the user's own backward through the graph raises torch's error, before any
    .grad is written; with it, both run again. (The graph is kept during the call for
    `check` and the non-finite recompute.)"""
    kwargs = {"retain_graph": retain_graph, "create_graph": create_graph}
    x, w, y, zs = _head_graph()
    (want,) = torch.autograd.grad(zs, x, **kwargs)
    torch_raises = _raises(lambda: torch.autograd.grad(zs, x))
    assert torch_raises == (not (create_graph if retain_graph is None else retain_graph))
    (only_w,) = torch.autograd.grad(zs[1], w)  # runs no freed node: torch answers

    x, w, y, zs = _head_graph()
    (g,) = funcgrad.grads(zs, x, through=y, **kwargs)
    torch.testing.assert_close(g.sum(0), want)
    assert _raises(lambda: funcgrad.grads(zs, x, through=y, retain_graph=True)) == torch_raises
    assert _raises(lambda: sum(zs).backward()) == torch_raises
    if torch_raises:
        assert x.grad is None and w.grad is None  # torch itself writes w.grad before raising
    else:
        torch.testing.assert_close(x.grad, want)
    torch.testing.assert_close(torch.autograd.grad(zs[1], w)[0], only_w)


def test_grads_in_inference_mode_as_torch():
    """A graph built outside inference mode, differentiated inside it, as torch allows."""
    x, _, y, zs = _head_graph()
    with torch.inference_mode():
        want = [torch.autograd.grad(z, x, retain_graph=True)[0] for z in zs]
        (g,) = funcgrad.grads(zs, x, through=y)
    torch.testing.assert_close(g, torch.stack(want))


def test_grads_allow_unused_and_errors():
    x, unused = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    y = torch.sin(x)
    with pytest.raises(
        ValueError, match=r"`through` does not depend on inputs\[1\]; pass allow_unused=True"
    ):
        funcgrad.grads([y.sum()], [x, unused], through=y)
    gx, gu = funcgrad.grads([y.sum(), y[0]], [x, unused], through=y, allow_unused=True)
    torch.testing.assert_close(gu, torch.zeros(2, 2))
    torch.testing.assert_close(gx[1], torch.tensor([math.cos(x[0].item()), 0.0, 0.0]))
    other = torch.cos(x).sum()
    with pytest.raises(ValueError, match=r"outputs\[1\] does not depend on `through`"):
        funcgrad.grads([y.sum(), other], x, through=y)
    with pytest.raises(ValueError, match=r"outputs\[0\] depends on inputs\[0\] other than through"):
        funcgrad.grads([y.sum() + x.sum()], x, through=y)
    with pytest.raises(ValueError, match=r"outputs\[0\] must be a scalar, got shape \(3,\)"):
        funcgrad.grads([y], x, through=y)
    with pytest.raises(ValueError, match=r"`inputs`\[0\] does not require grad"):
        funcgrad.grads([y.sum()], torch.randn(3), through=y)
    with pytest.raises(TypeError, match=r"`outputs` must be a tensor or a non-empty sequence"):
        funcgrad.grads([], x, through=y)


def test_stacked_probes_plan_m_directions_and_match_a_loop():
    torch.manual_seed(1)
    w1 = torch.randn(64, 128) / 10
    f = lambda x: torch.tanh(w1 @ x)  # noqa: E731
    probes = {"w": torch.randn(512, 64), "b": torch.randn(512)}

    def probe(p, y):
        return torch.nn.functional.softplus(p["w"] @ y + p["b"])

    composed = funcgrad.compose_heads(f, funcgrad.stacked_heads(probe, probes))
    x = torch.randn(128)
    assert composed.plan(x).directions == 64
    values, grads = composed(x)
    heads = [
        lambda y, j=j: probe({"w": probes["w"][j], "b": probes["b"][j]}, y) for j in range(512)
    ]
    ref_values, ref_grads = autograd_reference(f, heads[:20], (x,))
    torch.testing.assert_close(values[:20], torch.stack(ref_values))
    torch.testing.assert_close(grads[:20], torch.stack(ref_grads))


class Encoder(torch.nn.Module):
    def __init__(self, d_in=12, d_hidden=16, d_out=8):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d_in, d_hidden), torch.nn.GELU(), torch.nn.Linear(d_hidden, d_out)
        )

    def forward(self, x):
        return self.net(x)


def test_multi_task_gradients_on_module_parameters():
    encoder = Encoder()
    batch = torch.randn(10, 12)
    tasks = []
    for t in range(4):
        w = torch.randn(3 if t % 2 else 1, 8)
        if t % 2:  # linear + cross-entropy
            target = torch.randint(0, 3, (10,))
            tasks.append(lambda z, w=w, y=target: torch.nn.functional.cross_entropy(z @ w.T, y))
        else:  # linear + MSE
            target = torch.randn(10, 1)
            tasks.append(lambda z, w=w, y=target: torch.nn.functional.mse_loss(z @ w.T, y))

    def f(params, x):
        return torch.func.functional_call(encoder, params, (x,))

    params = {name: p.detach() for name, p in encoder.named_parameters()}
    losses, grads = funcgrad.compose_heads(f, tasks)(params, batch)
    assert set(grads) == set(params) and grads["net.0.weight"].shape == (4, 16, 12)
    for t, task in enumerate(tasks):
        loss = task(encoder(batch))
        reference = torch.autograd.grad(loss, list(encoder.parameters()))
        torch.testing.assert_close(losses[t], loss.detach())
        for (name, _), expected in zip(encoder.named_parameters(), reference):
            torch.testing.assert_close(grads[name][t], expected)


@pytest.mark.slow  # inductor compiles five graphs
@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_torch_compile_fullgraph_matches_eager(strategy):
    torch._dynamo.reset()
    w = torch.randn(4, 3)
    f = lambda x: {"y": torch.tanh(w @ x), "s": x.sum()}  # noqa: E731
    heads = [lambda y: y["y"].sum() * y["s"], lambda y: (y["y"] ** 2).sum(), lambda y: y["y"][0]]
    composed = funcgrad.compose_heads(f, heads, strategy=strategy)
    compiled = torch.compile(composed, fullgraph=True)
    x = torch.randn(3)
    values, grads = compiled(x)
    eager_values, eager_grads = composed(x)
    torch.testing.assert_close(values, eager_values)
    torch.testing.assert_close(grads, eager_grads)


@pytest.mark.slow  # inductor compiles
def test_compiled_steady_state_on_a_module_matches_eager():
    """The README's recipe: compile the whole compose_heads call of an nn.Module with list
    heads (fullgraph=True); it equals eager, builds no graph of its results, and later calls
    on the same shapes reuse the compiled graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    w = torch.randn(6, 8)
    heads = [lambda y, i=i: (y @ w[i]).tanh().mean() for i in range(6)]
    fn = funcgrad.compose_heads(mlp, heads, strategy="vjp")
    compiled = torch.compile(fn, fullgraph=True)
    for x in (torch.randn(4, 8), torch.randn(4, 8)):
        values, grads = compiled(x)
        eager_values, eager_grads = fn(x)
        torch.testing.assert_close(values, eager_values)
        torch.testing.assert_close(grads, eager_grads)
        assert not grads.requires_grad


def test_a_pullback_does_not_cross_a_compile_boundary():
    """Documented limit of torch 2.13: compile the whole transform, not a pullback object."""
    torch._dynamo.reset()
    _, pb = funcgrad.pullback(torch.tanh, torch.randn(3))
    with pytest.raises(Exception, match=r"PyTreeSpec|Unsupported"):
        torch.compile(lambda v: pb(v), fullgraph=True)(torch.ones(3))
