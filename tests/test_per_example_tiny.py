"""Tiny Linears (`_rules._tiny`: rows A and Δ of at most `_TINY` elements) formed together,
one product per shape, rather than one by one in the backward: exact in float64 against a
per-example loop on models of tiny layers alone and of tiny and large layers mixed, with inf
in the rows no loss reads, with the tiny layers formed during the backward in several
groups (`_TINY_HELD`) or at the end, with user hooks, with a failure of the grouped work,
and with as few host reads as before; a model that mixes the examples is still refused."""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from helpers import PER_EXAMPLE_CALLS, per_example_jacobian
from torch import nn

import funcgrad
from funcgrad._per_example import _rules, _run

B, T, D, W = 4, 10, 4, 512


class Mixed(nn.Module):
    """Residual tiny Linear(4, 4)s, a Linear(4, 3) (tiny, another shape), then large
    Linears (4 -> 512 -> 512 -> 4, rows over `_TINY` elements), then tiny ones again.
    The rows of x that no loss reads reach the first layer alone (inf there: its A).
    ``mix``: the examples mixed after the first layer. ``spy``: at the first layer's output
    gradient, whether the third's is still alive (weak reference)."""

    def __init__(self, tiny: int = 3, large: bool = True, mix: bool = False) -> None:
        super().__init__()
        self.low = nn.ModuleList(nn.Linear(D, D) for _ in range(tiny))
        self.narrow = nn.Linear(D, 3)
        self.back = nn.Linear(3, D)
        self.large = (
            nn.Sequential(nn.Linear(D, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, D))
            if large
            else None
        )
        self.high = nn.ModuleList(nn.Linear(D, D) for _ in range(tiny))
        self.mix, self.spy = mix, False
        self.watch: weakref.ref[torch.Tensor] | None = None
        self.alive: bool | None = None

    def forward(self, x: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.low):
            out = layer(h)
            if self.spy and i == 0:
                out.register_hook(self._below)
            if self.spy and i == len(self.low) - 1:
                out.register_hook(self._keep)
            if i == 0:  # x's rows that no loss reads (inf there) go no further
                h = torch.tanh(torch.where(read[..., None], out, 0.0))
            else:
                h = h + torch.tanh(out) * 0.5
            if self.mix and i == 0:
                h = h - h.mean(0, keepdim=True)
        h = h + self.back(torch.tanh(self.narrow(h)))
        if self.large is not None:
            h = h + self.large(h)
        for layer in self.high:
            h = h + torch.tanh(layer(h)) * 0.5
        return torch.where(read[..., None], h, 0.0).pow(2).sum((1, 2))

    def _keep(self, grad: torch.Tensor) -> None:
        self.watch = weakref.ref(grad)

    def _below(self, grad: torch.Tensor) -> None:
        gc.collect()
        self.alive = self.watch is not None and self.watch() is not None


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x with inf in the rows no loss reads, the same x with 0 there, and the rows read."""
    torch.manual_seed(seed)
    x = torch.randn(B, T, D, dtype=torch.float64)
    length = torch.tensor([T, 7, 3, 5])
    read = torch.arange(T) < length[:, None]
    return x.masked_fill(~read[..., None], float("inf")), x.masked_fill(~read[..., None], 0), read


def grads(model: nn.Module) -> torch.Tensor:
    found = torch.cat([p.grad.flatten() for p in model.parameters()])
    for p in model.parameters():
        p.grad = None
    return found


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("held", [None, 700])
def test_every_call_is_exact_with_inf_in_unread_rows(large, held, monkeypatch):
    """G, the norms, the weighted update, the sum and the clipped sum, each called several
    times (the first call of a signature checks independence, without the stream), equal a
    per-example loop on the input with the unread rows set to 0. ``held``: the tiny layers
    formed during the backward in groups of 2 or 3, and stacked 2 at most (else all at the
    end, one stack per shape)."""
    if held is not None:
        monkeypatch.setattr(_rules, "_TINY_HELD", held)
    model = Mixed(large=large).double()
    x_inf, x_zero, read = data(0)
    jac = per_example_jacobian(model, lambda m: m(x_zero, read))
    assert torch.isfinite(jac).all()
    norms = jac.norm(dim=1)
    weights = torch.rand(B, dtype=torch.float64)
    clip = float(norms.median())
    with funcgrad.per_example(model) as pe:
        for _ in range(3):
            got = pe.gramian(model(x_inf, read))
            torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
            tiny = [layer for layer in pe.plan.layers if "tiny" in layer.rule]
            assert len(tiny) == 2 * 3 + 2, str(pe.plan)
            assert len(pe.plan.layers) == len(tiny) + (3 if large else 0), str(pe.plan)
            if held is not None:  # stacks of at most `_TINY_HELD` elements: 2 layers here
                assert all(re.search(r"for [12] tiny", layer.rule) for layer in tiny), pe.plan
            got = funcgrad.per_example_norms(model(x_inf, read))
            torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-12)
            pe.backward(model(x_inf, read), weighting=lambda g: weights)
            torch.testing.assert_close(grads(model), weights @ jac, rtol=1e-10, atol=1e-12)
            funcgrad.per_example_clip(model(x_inf, read), clip)
            factors = (clip / (norms + 1e-6)).clamp(max=1)
            torch.testing.assert_close(grads(model), factors @ jac, rtol=1e-10, atol=1e-12)
        funcgrad.backward(model(x_zero, read), batch_dim=0)
        torch.testing.assert_close(grads(model), jac.sum(0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("large", [False, True])
def test_a_nan_in_a_read_row_is_reported_not_hidden(large):
    """A NaN in a row a loss reads is not zeroed: G is refused as not finite, naming the
    example, and .grad is left as it was."""
    model = Mixed(large=large).double()
    _, x, read = data(1)
    x[2, 0, 1] = float("nan")
    with funcgrad.per_example(model) as pe:
        pe.gramian(model(data(1)[1], read))
        with pytest.raises(ValueError, match=r"example\(s\) \[2\]"):
            pe.gramian(model(x, read))
        with pytest.raises(ValueError, match="not finite"):
            pe.backward(model(x, read), weighting=lambda g: torch.ones(B, dtype=g.dtype))
    assert all(p.grad is None for p in model.parameters())


def test_the_tiny_layers_rows_are_let_go_once_their_group_is_formed(monkeypatch):
    """With `_TINY_HELD` reached, the tiny layers waiting are formed during the backward and
    their Δ let go before the backward reaches the layers below; under it (the default
    here, a small model), they wait for the end."""
    model = Mixed(large=False).double()
    x_inf, x_zero, read = data(2)
    jac = per_example_jacobian(model, lambda m: m(x_zero, read))
    found = {}
    for held in (1 << 20, 1):
        monkeypatch.setattr(_rules, "_TINY_HELD", held)
        with funcgrad.per_example(model) as pe:
            pe.gramian(model(x_inf, read))  # the first call: no stream
            model.spy = True
            got = pe.gramian(model(x_inf, read))
            model.spy = False
        torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
        found[held] = model.alive
    assert found == {1 << 20: True, 1: False}


def test_hooks_on_tiny_layers_fire_once_and_act():
    """A forward hook and a tensor hook that doubles the output gradient of a tiny layer,
    and a post-accumulate-grad hook on its weight: each fires once a call, and the doubled
    gradient is the one used (against the loop with the same hook)."""
    model = Mixed(large=True).double()
    x_inf, x_zero, read = data(3)
    fired = {"forward": 0, "tensor": 0, "post": 0}
    target = model.low[1]

    def doubled(grad: torch.Tensor) -> torch.Tensor:
        fired["tensor"] += 1
        return 2 * grad

    def forward_hook(module, args, out):
        fired["forward"] += 1
        if out.requires_grad:
            out.register_hook(doubled)

    target.register_forward_hook(forward_hook)
    jac = per_example_jacobian(model, lambda m: m(x_zero, read))
    target.weight.register_post_accumulate_grad_hook(
        lambda p: fired.__setitem__("post", fired["post"] + 1)
    )
    weights = torch.rand(B, dtype=torch.float64)
    with funcgrad.per_example(model) as pe:
        for _ in range(3):
            for call in ("gramian", "norms", "backward"):
                fired.update(forward=0, tensor=0, post=0)
                losses = model(x_inf, read)
                if call == "gramian":
                    got = pe.gramian(losses)
                    torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
                elif call == "norms":
                    got = funcgrad.per_example_norms(losses)
                    torch.testing.assert_close(got, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
                else:
                    pe.backward(losses, weighting=lambda g: weights)
                    torch.testing.assert_close(grads(model), weights @ jac, rtol=1e-10, atol=1e-12)
                post = 1 if call == "backward" else 0
                assert fired == {"forward": 1, "tensor": 1, "post": post}, (call, fired)


def test_a_model_mixing_examples_after_a_tiny_layer_is_refused_before_grad_is_written():
    model = Mixed(large=False, mix=True).double()
    _, x, read = data(4)
    with funcgrad.per_example(model) as pe:
        with pytest.raises(ValueError, match="depend"):
            pe.backward(model(x, read), weighting=lambda g: torch.ones(B, dtype=g.dtype))
        with pytest.raises(ValueError, match="depend"):
            pe.gramian(model(x, read))
    assert all(p.grad is None for p in model.parameters())


def test_a_failure_of_the_grouped_work_in_the_backward_is_formed_again_at_the_end(monkeypatch):
    """Where forming a group raises during the backward (the engine's callback must not
    raise), its layers are kept and formed at the end, as without the stream: exact."""
    monkeypatch.setattr(_rules, "_TINY_HELD", 700)
    model = Mixed(large=True).double()
    x_inf, x_zero, read = data(5)
    jac = per_example_jacobian(model, lambda m: m(x_zero, read))
    share = _run._tiny_share
    failures = [0]

    def failing(layers, dtype, diagonal):
        if torch._C._current_graph_task_id() != -1:  # inside the backward
            failures[0] += 1
            raise RuntimeError("grouped work failed")
        return share(layers, dtype, diagonal)

    with funcgrad.per_example(model) as pe:
        pe.gramian(model(x_inf, read))
        monkeypatch.setattr(_run, "_tiny_share", failing)
        got = pe.gramian(model(x_inf, read))
        torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
        got = funcgrad.per_example_norms(model(x_inf, read))
        torch.testing.assert_close(got, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
    assert failures[0] >= 2


def _reads(model: nn.Module, losses, call) -> list[int]:
    counts = []
    with funcgrad.per_example(model):
        for _ in range(3):
            found = losses()
            with funcgrad.HostReadCounter() as reads:
                call(found)
            counts.append(reads.count)
            for p in model.parameters():
                p.grad = None
    return counts


@pytest.mark.parametrize("call", list(PER_EXAMPLE_CALLS))
def test_tiny_layers_cost_no_host_read(call):
    """Whatever the number of tiny layers on (B, T, d) rows: the end-of-call finiteness
    check alone (main, before streaming, read one value per layer for the Gramian here: its
    live-row count; the clip's factors, finite once G is, were checked too before session
    12)."""
    found = []
    for tiny in (1, 5):
        model = Mixed(tiny=tiny, large=False).double()
        x_inf, _, read = data(6)
        found.append(
            _reads(model, lambda m=model, x=x_inf, r=read: m(x, r), PER_EXAMPLE_CALLS[call])
        )
    expected = {"gramian": 1, "norms": 1, "backward": 0, "clip": 1}[call]
    assert found == [[expected] * 3] * 2, found


def test_reuse_across_shapes_threads_and_after_a_failure():
    """One hooked model called on other batch sizes and lengths (other groups), from
    another thread, and after a refused call: each exact."""
    import threading

    model = Mixed(large=False).double()
    results: dict[str, BaseException | None] = {}
    with funcgrad.per_example(model) as pe:
        _, x, read = data(7)
        bad = x.clone()
        bad[0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="not finite"):
            pe.gramian(model(bad, read))
        for batch, length in ((4, 10), (3, 2), (6, 5), (4, 10)):
            torch.manual_seed(batch)
            xs = torch.randn(batch, length, D, dtype=torch.float64)
            rows = torch.ones(batch, length, dtype=torch.bool)
            jac = per_example_jacobian(model, lambda m, xs=xs, rows=rows: m(xs, rows))
            got = pe.gramian(model(xs, rows))
            torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)

        def other() -> None:
            try:
                jac = per_example_jacobian(model, lambda m: m(x, read))
                got = funcgrad.per_example_norms(model(x, read))
                torch.testing.assert_close(got, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
                results["thread"] = None
            except BaseException as error:
                results["thread"] = error

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert results == {"thread": None}


def test_tiny_hf_conv1d_layers_weights_stored_transposed_are_exact():
    """Hugging Face's Conv1D (weight stored (d, p)) tiny: two of one shape in one stack,
    G and a weighted update exact (the update's per-layer products transposed back)."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = pytorch_utils.Conv1D(6, 4), pytorch_utils.Conv1D(4, 6)
            self.c = pytorch_utils.Conv1D(6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.b(torch.tanh(self.a(x))).pow(2).sum((1, 2))
            return out + self.c(x).pow(2).sum((1, 2))

    torch.manual_seed(8)
    model = Model().double()
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    jac = per_example_jacobian(model, lambda m: m(x))
    weights = torch.rand(5, dtype=torch.float64)
    with funcgrad.per_example(model) as pe:
        for _ in range(3):
            got = pe.gramian(model(x))
            torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
            assert "one product for 2 tiny" in pe.plan.layers[0].rule, str(pe.plan)
            pe.backward(model(x), weighting=lambda g: weights)
            torch.testing.assert_close(grads(model), weights @ jac, rtol=1e-10, atol=1e-12)
