"""Per-example independence: loss b must read example b alone, between the hooked layers and
the losses. The models that mix examples there (9 cases of issue #42) are refused, naming
the module whose output was mixed and the ops after it, before any ``.grad`` is written;
the models that do not stay exact (against a per-example loop of torch.autograd.grad in
float64). The check costs one extra backward to the layers' outputs on the first call of
a signature (every call under ``check=True``), counted with funcgrad.PassCounter. A parent
module that calls a child and reads the child's parameter itself is refused too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import per_example_jacobian
from torch import nn

import funcgrad

B = 6
MIXED = r"do not treat the examples independently"


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


def between(mix, out=1):
    """Linear -> mix (no parameters) -> Tanh -> Linear: the mixing breaks the first layer."""
    return nn.Sequential(nn.Linear(3, 4), Lambda(mix), nn.Tanh(), nn.Linear(4, out))


class SortedLayer(nn.Module):
    """Sorts the batch by its first feature, runs a Linear on the sorted rows, unsorts."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        order = x[:, 0].argsort()
        h = self.inner(x[order])[order.argsort()]
        return self.head(torch.tanh(h)).squeeze(1)


class TimeMajor(nn.Module):
    """A layer run on (T, B, d) with T == B: its dim 0 is time, not the examples."""

    def __init__(self):
        super().__init__()
        self.step = nn.Linear(3, 4)

    def forward(self, x):  # x: (B, T, 3)
        return self.step(x.transpose(0, 1)).tanh().pow(2).sum((0, 2))  # (B,)


def mixing_cases():
    x, noise = torch.randn(B, 3), 0.1 * torch.randn(B, 3)  # noise: InfoNCE's second view
    squared = lambda m: m(x).squeeze(1).pow(2)  # noqa: E731

    def pairwise(m):
        z = m(x)
        return (z[:, None] - z[None]).pow(2).sum(-1).mean(1)

    def info_nce(m):
        z1, z2 = F.normalize(m(x), dim=1), F.normalize(m(x + noise), dim=1)
        return F.cross_entropy(z1 @ z2.T / 0.5, torch.arange(B), reduction="none")

    seq = torch.randn(B, B, 3)  # T == B
    return {
        # (model, losses_fn, the module named as mixed, an op after it)
        "centred": (between(lambda h: h - h.mean(0)), squared, "'0' (Linear)", "mean"),
        "softmax over dim 0": (between(lambda h: h.softmax(0)), squared, "'0'", "softmax"),
        "batch statistics": (
            between(lambda h: F.batch_norm(h, None, None, training=True)),
            squared,
            "'0'",
            "batch_norm",
        ),
        "normalised over dim 0": (between(lambda h: h / h.norm(dim=0)), squared, "'0'", "norm"),
        "rolled and concatenated": (
            between(lambda h: torch.cat([h, h.roll(1, 0)], 1)[:, 2:6]),
            squared,
            "'0'",
            "roll",
        ),
        "sorted then unsorted": (SortedLayer(), lambda m: m(x).exp(), "'inner'", "index"),
        "pairwise loss": (between(lambda h: h, out=2), pairwise, "'3' (Linear)", "sub"),
        "InfoNCE loss": (between(lambda h: h, out=2), info_nce, "'3' (Linear)", "mm"),
        "time-major, T == B": (TimeMajor(), lambda m: m(seq), "'step' (Linear)", "sum"),
    }


def loop_gramian(model, losses_fn):
    jac = per_example_jacobian(model, losses_fn)
    return jac @ jac.T


@pytest.mark.parametrize("name", list(mixing_cases()))
def test_a_model_that_mixes_examples_is_refused(name):
    """Each case: the one-backward Gramian is wrong there (so the refusal is due), and
    gramian and backward both refuse, naming the module and an op, with .grad untouched."""
    model, losses_fn, module, op = mixing_cases()[name]
    torch.manual_seed(0)
    want = loop_gramian(copy.deepcopy(model), losses_fn)
    with funcgrad.per_example(model) as pe:
        with funcgrad.checking(False), pytest.raises(ValueError, match=MIXED) as refused:
            pe.gramian(losses_fn(model))  # check=False: the first call of a signature
        message = str(refused.value)
        assert message.startswith("funcgrad.per_example_gramian(losses): ")
        assert f"module {module}" in message, message
        assert op in message, message
        assert "inputs=" in message  # the fix: leave the mixed layers out
        with pytest.raises(ValueError, match=r"funcgrad.backward\(losses, batch_dim=0\).*" + MIXED):
            funcgrad.backward(losses_fn(model), batch_dim=0, weighting=lambda g: g.diagonal())
    assert all(p.grad is None for p in model.parameters())
    # The rules alone (no check) would be silently wrong here:
    with funcgrad.per_example(model) as pe:
        unchecked = _unchecked_gramian(pe, losses_fn(model))
    assert not torch.allclose(unchecked, want, rtol=1e-3, atol=1e-6)


def _unchecked_gramian(pe, losses):
    """The Gramian with the independence check switched off (test only)."""
    from funcgrad import _per_example

    original = _per_example._independence_due
    _per_example._independence_due = lambda run, blocks: None
    try:
        return pe.gramian(losses)
    finally:
        _per_example._independence_due = original


def test_the_repro_of_the_issue():
    """Linear -> h - h.mean(0) -> Linear: G was 0.46 off J Jᵀ, silently."""

    class Center(nn.Module):
        def forward(self, h):
            return h - h.mean(0)

    m = nn.Sequential(nn.Linear(3, 4), Center(), nn.Linear(4, 1))
    x = torch.randn(8, 3)
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(m, p, (x,)).squeeze(1) ** 2)(
        dict(m.named_parameters())
    )
    jac = torch.cat([j.flatten(1) for j in jac.values()], 1)
    with funcgrad.per_example(m) as pe:
        unchecked = _unchecked_gramian(pe, m(x).squeeze(1) ** 2)
        assert (unchecked - jac @ jac.T).norm() > 0.05 * (jac @ jac.T).norm()  # silently off
        with pytest.raises(
            ValueError, match=r"output of module '0' \(Linear\).*the input of module '2'"
        ):
            funcgrad.per_example_gramian(m(x).squeeze(1) ** 2)
    # The layers after the mixing are exact: select them with inputs=.
    params = list(m[2].parameters())
    losses = m(x).squeeze(1) ** 2
    jac = torch.stack(
        [
            torch.cat(
                [g.flatten() for g in torch.autograd.grad(losses[b], params, retain_graph=True)]
            )
            for b in range(8)
        ]
    )
    with funcgrad.per_example(m):
        gram = funcgrad.per_example_gramian(m(x).squeeze(1) ** 2, inputs=params)
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


def test_mixing_before_the_first_layer_is_fine():
    """Mixing the inputs (data, no parameters before it) keeps loss b a function of the
    parameters through example b's rows alone: exact, not refused."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    losses_fn = lambda m: m(x - x.mean(0)).squeeze(1).exp()  # noqa: E731
    want = loop_gramian(copy.deepcopy(model), losses_fn)
    with funcgrad.per_example(model) as pe, funcgrad.checking(True):
        gram = pe.gramian(losses_fn(model))
    torch.testing.assert_close(gram, want, rtol=1e-9, atol=1e-11)


def test_mixing_after_frozen_layers_only_is_fine():
    """The check looks at the layers whose parameters count: mixing that reaches only a
    frozen layer's output (or one left out with inputs=) changes nothing that is computed."""
    model = between(lambda h: h - h.mean(0))
    model[0].requires_grad_(False)
    x = torch.randn(B, 3)
    losses_fn = lambda m: m(x).squeeze(1).pow(2)  # noqa: E731
    want = loop_gramian(copy.deepcopy(model), losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model))
    torch.testing.assert_close(gram, want, rtol=1e-9, atol=1e-11)


def test_float32_independent_models_are_not_refused():
    """Rounding is not mixing: float32 models (an MLP, a CNN with GroupNorm, a transformer
    encoder layer) pass the check; the tolerance is sqrt(eps) relative, per example."""
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(3)
    mlp = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)
    )
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
    enc = nn.Sequential(layer, nn.Flatten(), nn.Linear(5 * 16, 10))
    for model, x in (
        (mlp, torch.randn(64, 20)),
        (cnn, torch.randn(32, 3, 8, 8)),
        (enc, torch.randn(16, 5, 16)),
    ):
        y = torch.randint(10, (x.shape[0],))
        with funcgrad.per_example(model) as pe, funcgrad.checking(True):
            pe.backward(F.cross_entropy(model(x), y, reduction="none") * 1e-3)
        assert all(p.grad is not None for p in model.parameters())


def test_the_check_costs_one_backward_on_the_first_call_of_a_signature():
    """Passes through the point between the two layers: 2 on the first call (the check and
    the collect), 1 on later calls of the same signature, 2 again on a new batch size, and
    2 on every call under check=True (funcgrad.checking, set_check or the argument)."""
    counter = funcgrad.PassCounter()
    model = nn.Sequential(nn.Linear(3, 4), Lambda(counter), nn.Tanh(), nn.Linear(4, 1))

    def passes(batch, **kwargs):
        counter.reset()
        losses = model(torch.randn(batch, 3)).squeeze(1).exp()
        funcgrad.backward(losses, batch_dim=0, **kwargs)
        return counter.backward

    with funcgrad.per_example(model):
        assert [passes(B), passes(B), passes(B)] == [2, 1, 1]
        assert [passes(B + 1), passes(B + 1)] == [2, 1]
        assert [passes(B, check=True), passes(B, check="strict"), passes(B, check=False)] == [
            2,
            2,
            1,
        ]
        with funcgrad.checking(True):
            assert [passes(B), passes(B)] == [2, 2]
        with pytest.raises(ValueError, match=r"batch_dim=0\): `check` must be True, False"):
            passes(B, check="full")
        previous = funcgrad.set_check("strict")
        try:
            assert passes(B) == 2
        finally:
            funcgrad.set_check(previous)
    with funcgrad.per_example(model) as pe:  # new hooks: checked again
        counter.reset()
        pe.gramian(model(torch.randn(B, 3)).squeeze(1).exp())
        assert counter.backward == 2


def test_the_check_consumes_no_random_draw_and_keeps_the_graph_rule():
    """u comes from funcgrad's own generator; without retain_graph the graph is freed as
    before (torch's error on a second backward)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    with funcgrad.per_example(model) as pe:
        losses = model(x).squeeze(1).exp()
        state = torch.random.get_rng_state()
        pe.backward(losses)
        assert torch.equal(torch.random.get_rng_state(), state)
        with pytest.raises(RuntimeError, match=r"second time"):
            losses.sum().backward()


def test_a_data_dependent_mixing_absent_on_the_checked_call_is_seen_under_check():
    """The limit of the first-call check: a branch that mixes only on some calls, with the
    same shapes, is seen on every call under check=True."""
    model = between(lambda h: h - h.mean(0) if h.sum() > 0 else h)
    with funcgrad.per_example(model) as pe:
        # (the branch reads the first layer's output: the mixed output's own sum is 0 up to
        # rounding, either sign, so it cannot tell the branches apart)
        x = torch.randn(B, 3)
        while model[0](x).sum() > 0:
            x = torch.randn(B, 3)
        pe.gramian(model(x).squeeze(1).pow(2))  # checked, independent
        while model[0](x).sum() <= 0:
            x = torch.randn(B, 3)
        with pytest.raises(ValueError, match=MIXED):
            pe.gramian(model(x).squeeze(1).pow(2), check=True)


# -- a parent reading its child's parameter (item 4) -------------------------------------------


class Parent(nn.Module):
    """Its own parameter, a child it calls, and the child's weight read again in its own
    forward: that second use is outside every hooked call."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, h):
        h = self.lin(h) * self.gain
        return h + F.linear(h, self.lin.weight)


class Foreign(nn.Module):
    """A leaf module with its own parameter that reads another module's parameter."""

    def __init__(self, other):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(4))
        self.other = [other]  # not a submodule

    def forward(self, h):
        return torch.tanh(h * self.gain) @ self.other[0].weight.T


def test_a_parent_reading_its_childs_parameter_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), Parent(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    with funcgrad.per_example(model) as pe:
        with pytest.raises(
            ValueError,
            match=r"module '1' \(Parent\) reads parameter '1.lin.weight'.*outside the calls",
        ):
            pe.backward(model(x).squeeze(1).exp())
        # Leaving that parameter out makes the rest exact.
        chosen = [p for n, p in model.named_parameters() if n != "1.lin.weight"]
        reference = copy.deepcopy(model)
        losses = reference(x).squeeze(1).exp()
        ref_params = [p for n, p in reference.named_parameters() if n != "1.lin.weight"]
        jac = torch.stack(
            [
                torch.cat(
                    [
                        g.flatten()
                        for g in torch.autograd.grad(losses[b], ref_params, retain_graph=True)
                    ]
                )
                for b in range(B)
            ]
        )
        gram = pe.gramian(model(x).squeeze(1).exp(), inputs=chosen)
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    assert all(p.grad is None for p in model.parameters())


def test_a_module_reading_another_modules_parameter_is_refused():
    last = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(3, 4), Foreign(last), last)
    x = torch.randn(B, 3)
    refused = r"module '1' \(Foreign\) reads parameter '2.weight'.*another module"
    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match=refused):
        pe.gramian(model(x).pow(2).sum(1))


# -- mixing inside a module materialised by its functional call ------------------------------


class CenterScale(nn.Module):
    """A custom module with a parameter that centres its batch: its per-example gradients,
    from calls on each example alone, are not the rows of its Jacobian."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return (x - x.mean(0)) * self.gain


def test_a_module_that_mixes_examples_inside_its_forward_is_refused():
    """The first hooked module: no layer before it whose output gradients would show the
    mixing; its rows, weighted by u, do not add up to the probe's gradient."""
    model = nn.Sequential(CenterScale(), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(B, 3)
    losses_fn = lambda m: m(x).squeeze(1).exp()  # noqa: E731
    want = loop_gramian(copy.deepcopy(model), losses_fn)
    refused = r"module '0' \(CenterScale\) does not treat the examples independently in its own"
    with funcgrad.per_example(model) as pe:
        assert not torch.allclose(_unchecked_gramian(pe, losses_fn(model)), want, rtol=1e-3)
        with pytest.raises(ValueError, match=refused):
            pe.backward(losses_fn(model), weighting=lambda g: g.diagonal())
        # Its parameter left out, the rest is exact.
        gram = pe.gramian(losses_fn(model), inputs=list(model[2].parameters()))
    assert all(p.grad is None for p in model.parameters())
    params = list(model[2].parameters())
    losses = losses_fn(model)
    jac = torch.stack(
        [
            torch.cat(
                [g.flatten() for g in torch.autograd.grad(losses[b], params, retain_graph=True)]
            )
            for b in range(B)
        ]
    )
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


class Offset(nn.Module):
    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(()))

    def forward(self, x):
        return x + self.offset


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rounding_noise_is_not_mixing(dtype):
    """Gradients that are zero but for rounding (an offset before a LayerNorm, a layer whose
    output gradient a LayerNorm cancels): independent, so not refused, and exact in
    float64."""
    torch.manual_seed(0)
    offset = nn.Sequential(nn.Linear(5, 8), Offset(), nn.LayerNorm(8), nn.Linear(8, 3))
    cancelled = nn.Sequential(
        nn.Linear(5, 8), nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 8)
    )
    with torch.no_grad():
        cancelled[2].weight.fill_(1.0)  # equal rows: the LayerNorm's input gradient is 0
    x = torch.randn(16, 5, dtype=dtype)
    for model in (offset.to(dtype), cancelled.to(dtype)):
        losses_fn = lambda m: m(x).pow(2).sum(1)  # noqa: E731
        with funcgrad.per_example(model) as pe, funcgrad.checking(True):
            gram = pe.gramian(losses_fn(model))
        if dtype == torch.float64:
            want = loop_gramian(copy.deepcopy(model), losses_fn)
            torch.testing.assert_close(gram, want, rtol=1e-9, atol=1e-9 * want.abs().max())


def test_two_examples_mixed_in_a_large_batch_are_seen():
    """Only examples 0 and 1 of 64 interact (their losses swap a term): the probe's weights
    differ within each block of 16 examples, so that pair shows."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(64, 3)

    def losses_fn(m):
        z = m(x).squeeze(1)
        swap = torch.arange(64)
        swap[0], swap[1] = 1, 0
        return z.pow(2) + 0.5 * z[swap]

    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match=MIXED):
        pe.gramian(losses_fn(model))


class Monitored(nn.Module):
    """A custom module that counts its calls in a buffer: the check's re-runs of it on
    single examples must leave the count as it was."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(3))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x * self.gain)


def test_the_check_leaves_buffers_generators_and_preset_grads_alone():
    model = nn.Sequential(Monitored(), nn.Linear(3, 1))
    x = torch.randn(B, 3)
    counts = []
    with funcgrad.per_example(model) as pe:
        for check in (True, False):  # checked, then not (the same signature)
            before = model[0].calls.item()
            losses = model(x).squeeze(1).exp()
            state = torch.random.get_rng_state()
            pe.backward(losses, check=check)
            assert torch.equal(torch.random.get_rng_state(), state)
            counts.append(model[0].calls.item() - before)
    # The check adds no count (the rest: the user's forward, and the module's per-example
    # rule, which calls it on each example where torch.func refuses its in-place write).
    assert counts[0] == counts[1]

    mixed = between(lambda h: h - h.mean(0))
    preset = [torch.full_like(p, 7.0) for p in mixed.parameters()]
    for p, g in zip(mixed.parameters(), preset):
        p.grad = g.clone()
    with funcgrad.per_example(mixed) as pe, pytest.raises(ValueError, match=MIXED):
        pe.backward(mixed(x).squeeze(1).pow(2), weighting=lambda g: g.diagonal())
    for p, g in zip(mixed.parameters(), preset):
        assert torch.equal(p.grad, g)  # nothing written on refusal


# -- the check with user hooks: held back in its backward ------------------------------------


def loop_jacobian(model, losses_fn):
    """(B, P): rows of torch.autograd.grad(losses[b], params), a fresh forward each (so that
    the hooks that losses_fn registers apply to each example's backward)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for b in range(B):
        grads = torch.autograd.grad(losses_fn(model)[b], params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)]
            )
        )
    return torch.stack(rows)


def clamp(calls):
    def hook(g):
        calls.append(1)
        return g.clamp(-0.05, 0.05)  # not linear in g: clamp(u g) != u clamp(g)

    return hook


def row_clip(calls):
    def hook(g):  # each example's row clipped to norm 0.1
        calls.append(1)
        norms = g.reshape(g.shape[0], -1).norm(dim=1).clamp_min(1e-12)
        return g * (0.1 / norms).clamp(max=1.0).view(-1, *([1] * (g.ndim - 1)))

    return hook


@pytest.mark.parametrize("make_hook", [clamp, row_clip])
@pytest.mark.parametrize("where", ["layer output", "losses"])
def test_a_clipping_hook_is_no_mixing_and_fires_once(make_hook, where):
    """A hook not linear in the gradient, on the first (checked) call: it ran in the check's
    backward too, along u (twice per call, and clamp(u g) != u clamp(g) was refused as
    mixing). Held back there, it fires once and the result is the per-example loop's with
    the same hook."""
    model, calls = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 1)), []
    x, y = torch.randn(B, 3), torch.randn(B)
    hook = make_hook(calls)

    def losses_fn(m):
        h = m[2](m[1](m[0](x)))
        if where == "layer output":
            h.register_hook(hook)
        losses = (m[3](h).squeeze(1) - y) ** 2
        if where == "losses":
            losses.register_hook(hook)
        return losses

    jac = loop_jacobian(model, losses_fn)
    assert calls, "the hook is on the way"
    counts = []
    with funcgrad.per_example(model) as pe:
        for _ in range(2):  # checked (first of the signature), then not
            calls.clear()
            gram = pe.gramian(losses_fn(model))
            counts.append(len(calls))
        calls.clear()
        weights = pe.backward(losses_fn(model), weighting=lambda g: g.diagonal(), check=True)
        counts.append(len(calls))
    assert counts == [1, 1, 1]
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads, weights @ jac, rtol=1e-9, atol=1e-11)


class HookedGRU(nn.Module):
    """Linear -> GRU (batch_first) -> head: h_n has the batch at dim 1; a full backward
    pre-hook on the GRU and a clipping tensor hook on its output."""

    def __init__(self, calls):
        super().__init__()
        self.inp = nn.Linear(3, 3)
        self.rnn = nn.GRU(3, 4, num_layers=2, batch_first=True)
        self.head = nn.Linear(4, 1)
        self.calls = calls

        def pre_hook(module, grad_output):
            calls.append("module")
            return tuple(None if g is None else 2 * g for g in grad_output)

        self.rnn.register_full_backward_pre_hook(pre_hook)

    def forward(self, x):
        out, h_n = self.rnn(self.inp(x))
        if out.requires_grad:
            out.register_hook(lambda g: self.calls.append("tensor") or g.clamp(-0.02, 0.02))
        return self.head(out).pow(2).sum((1, 2)) + h_n.sin().sum((0, 2))


def test_a_hooked_gru_passes_the_check_exactly_and_its_hooks_fire_once():
    """The check compared the rows of h_n along dim 0 (its layers) and refused an
    independent GRU; its backward ran the hooks once more, and the clipping hook along u."""
    calls = []
    model = HookedGRU(calls)
    x = torch.randn(B, 6, 3)
    jac = loop_jacobian(model, lambda m: m(x))
    calls.clear()
    torch.autograd.grad(model(x).sum(), [p for p in model.parameters()])
    once = sorted(calls)
    assert once == ["module", "tensor"]
    with funcgrad.per_example(model) as pe:
        calls.clear()
        gram = pe.gramian(model(x))  # the first call: checked
        assert sorted(calls) == once
        calls.clear()
        weights = pe.backward(model(x), weighting=lambda g: g.diagonal(), check=True)
        assert sorted(calls) == once
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads, weights @ jac, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("hook", ["tensor", "module"])
def test_a_mixing_model_with_a_hook_is_still_refused(hook):
    """Hooks held back in the check's backward: the comparison is with a backward along all
    ones with the same hooks held back, so the mixing below a hooked layer still shows."""
    model = between(lambda h: h - h.mean(0))
    x = torch.randn(B, 3)
    calls = []
    if hook == "module":
        model[3].register_full_backward_pre_hook(
            lambda m, go: calls.append(1) or tuple(g.clamp(-0.1, 0.1) for g in go)
        )

    def losses_fn(m):
        out = m(x)
        if hook == "tensor":
            out.register_hook(lambda g: calls.append(1) or g.clamp(-0.1, 0.1))
        return out.squeeze(1).pow(2)

    with funcgrad.per_example(model) as pe:
        with pytest.raises(ValueError, match=MIXED + r".*output gradient of module '0' \(Li"):
            pe.backward(losses_fn(model))
        assert calls == [1]  # in the one backward; held back in the check's
        gram = pe.gramian(losses_fn(model), inputs=list(model[3].parameters()))  # after it
    assert calls == [1, 1]
    assert all(p.grad is None for p in model.parameters())
    jac = loop_jacobian(model, losses_fn)[:, -5:]  # the last Linear's 4 + 1
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


def test_a_held_back_hook_costs_one_more_backward_on_checked_calls():
    """With a user hook held back, the check's comparison is a second hook-free backward:
    3 passes on a checked call (the check's two and the one backward), 1 on later calls;
    a hook funcgrad cannot reach (on a tensor that is no recorded call's input or output)
    runs in each of the check's backwards."""
    counter = funcgrad.PassCounter()
    model = nn.Sequential(nn.Linear(3, 4), Lambda(counter), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    calls = []

    def passes(held):
        counter.reset()
        calls.clear()
        h = model[2](model[1](model[0](x)))
        h.register_hook(lambda g: calls.append("unreached") or g)  # Tanh's output, then * 1
        h = h * 1.0
        if held:  # the last Linear's input: reached
            h.register_hook(lambda g: calls.append("held") or g)
        funcgrad.backward(model[3](h).squeeze(1).exp(), batch_dim=0)
        return counter.backward, sorted(calls)

    with funcgrad.per_example(model):
        assert [passes(False), passes(False)] == [(2, ["unreached"] * 2), (1, ["unreached"])]
    with funcgrad.per_example(model):
        assert [passes(True), passes(True)] == [
            (3, ["held", *["unreached"] * 3]),
            (1, ["held", "unreached"]),
        ]
