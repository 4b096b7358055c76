"""Fixes from the third adversarial review of the per-example code: each against a
per-example loop of torch.autograd.grad in float64, or a clear refusal with .grad untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad

B = 4


def loop_rows(losses_fn, params):
    """(B, P): example b's gradient, from a fresh forward each."""
    rows = []
    for b in range(B):
        grads = torch.autograd.grad(losses_fn()[b], params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)]
            )
        )
    return torch.stack(rows)


# -- S1: GRU / LSTM with dropout between their layers ------------------------------------------


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM])
def test_recurrent_dropout_in_training_is_refused_on_every_call(cell):
    """The loop replays forward on each example with new dropout draws: norms were 1.5-20% off
    once the signature had been checked in eval mode (the check ran once per signature, and
    the signature ignored the training flags)."""
    rnn = cell(3, 4, num_layers=2, dropout=0.5, batch_first=True)
    x = torch.randn(B, 5, 3)

    def losses():
        return rnn(x)[0].pow(2).sum((1, 2))

    rnn.eval()
    ref = loop_rows(losses, list(rnn.parameters())).norm(dim=1)
    with funcgrad.per_example(rnn):
        torch.testing.assert_close(funcgrad.per_example_norms(losses()), ref)  # eval: exact
        rnn.train()
        for call in (funcgrad.per_example_norms, funcgrad.per_example_gramian):
            with pytest.raises(ValueError, match=rf"'<model>' \({cell.__name__}\) has dropout=0.5"):
                call(losses(), check=False)
        with pytest.raises(ValueError, match=r"dropout=0.5 between its 2 layers"):
            funcgrad.per_example_clip(losses(), 1.0)
    assert all(p.grad is None for p in rnn.parameters())


class MixesInTraining(nn.Module):
    """No parameters: mixes the examples only in training mode."""

    def forward(self, h):
        return h - h.mean(0) if self.training else h


def test_signature_depends_on_training_flags():
    """A signature checked in eval mode was taken as checked in training mode, where the
    model mixes the examples: the norms came out silently wrong."""
    model = nn.Sequential(nn.Linear(3, 4), MixesInTraining(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    with funcgrad.per_example(model):
        model.eval()
        funcgrad.per_example_norms(model(x).squeeze(1))
        model.train()
        with pytest.raises(ValueError, match="do not treat the examples independently"):
            funcgrad.per_example_norms(model(x).squeeze(1))


# -- S3: ghost norms rounding below 0 ----------------------------------------------------------


def _cancelling(width=64):
    """Two nearly equal rows per example with opposite output gradients: the ghost rule's
    <A Aᵀ, Δ Δᵀ> cancels to about eps·‖A‖²‖Δ‖², and rounded below 0 (NaN norms)."""
    model = nn.Linear(width, width)
    a = torch.randn(B, 1, width).repeat(1, 2, 1)
    a[:, 1] += 1e-9 * torch.randn(B, width)
    c = torch.randn(B, width)

    def losses():
        out = model(a)
        return ((out[:, 0] - out[:, 1]) * c).sum(1)

    return model, a, c, losses


def test_ghost_norms_are_clamped_not_nan():
    model, a, c, losses = _cancelling()
    params = list(model.parameters())
    ref = loop_rows(losses, params).norm(dim=1)
    with funcgrad.per_example(model) as pe:
        norms = funcgrad.per_example_norms(losses())
        assert "ghost" in str(pe.plan)
    # the bound stated in docs/per_example.md: |error of ‖g_b‖²| <~ eps·‖A_b‖²‖Δ_b‖²
    eps = torch.finfo(torch.float64).eps
    bound = 16 * eps * a.flatten(1).pow(2).sum(1) * 2 * c.pow(2).sum(1)  # Δ_b's rows: c_b, -c_b
    assert torch.isfinite(norms).all() and (norms >= 0).all()
    assert ((norms.pow(2) - ref.pow(2)).abs() <= bound).all()
    with funcgrad.per_example(model):
        clip_norms = funcgrad.per_example_clip(losses(), 1.0)
    assert torch.isfinite(clip_norms).all()
    factors = (1.0 / (ref + 1e-6)).clamp(max=1.0)  # 1 here: the norms are tiny
    expected = factors @ loop_rows(losses, params)
    got = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)


# -- S2: an Embedding's index shared by the batch, (1, T) ------------------------------------


class Positions(nn.Module):
    """Token embeddings plus position embeddings from a (1, T) index; ``use`` says how the
    (1, T, d) position output is used."""

    def __init__(self, use="broadcast"):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(7, 3), nn.Embedding(5, 3), nn.Linear(3, 1)
        self.use = use

    def forward(self, ids):
        ids1t = torch.arange(ids.shape[1])[None]
        h, p = self.tok(ids), self.pos(ids1t)
        if self.use == "broadcast":
            h = h + p.to(h.dtype)
        elif self.use == "sum0":
            h = h + p.sum(0).mean(0)
        elif self.use == "squeeze":
            h = h * p.squeeze(0)
        elif self.use == "index":
            h = h - p[0]
        elif self.use == "slices":  # one example at a time, each with the (1, T, d) output
            h = torch.cat([h[b : b + 1] + p[:1] for b in range(h.shape[0])])
        return self.head(h).pow(2).sum((1, 2))


IDS = torch.randint(7, (B, 5))


@pytest.mark.parametrize("use", ["sum0", "squeeze", "index", "slices"])
def test_shared_index_forward_and_backward_are_the_models_own(use):
    """The (1, T) index was expanded to (B, T) for every use: .sum(0) summed B rows instead of
    one (outputs off by 0.6, a plain backward's .grad too), a loop over examples got B times
    the losses; the per-example call then blamed the model as "mixing"."""
    model = Positions(use)
    outside = model(IDS)
    grads = torch.autograd.grad(outside.sum(), list(model.parameters()))
    with funcgrad.per_example(model):
        inside = model(IDS)
        torch.testing.assert_close(inside, outside, rtol=0, atol=0)
        torch.testing.assert_close(
            torch.autograd.grad(inside.sum(), list(model.parameters())), grads
        )
        with pytest.raises(
            ValueError, match=r"'pos' \(Embedding\) was called with an index shared"
        ):
            funcgrad.per_example_norms(model(IDS))
        # without the position table, the rest is exact
        params = [model.tok.weight, *model.head.parameters()]
        norms = funcgrad.per_example_norms(model(IDS), inputs=params)
    torch.testing.assert_close(norms, loop_rows(lambda: model(IDS), params).norm(dim=1))


def test_shared_index_broadcast_is_exact():
    model = Positions("broadcast")
    params = list(model.parameters())
    jac = loop_rows(lambda: model(IDS), params)
    with funcgrad.per_example(model):
        out = model(IDS)
        gram = funcgrad.per_example_gramian(out)
    torch.testing.assert_close(gram, jac @ jac.T)


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.head = Positions("broadcast"), nn.Linear(1, 1)

    def forward(self, ids):
        return self.head(self.net(ids)[:, None])[:, 0]


def test_shared_index_batch_is_that_of_the_models_own_call():
    """R3: the batch size set by the model's call was kept: a submodule called directly
    later with another B broke in the user's forward (3 vs 6)."""
    model = Wrapped()
    ids = torch.randint(7, (6, 5))
    with funcgrad.per_example(model):
        funcgrad.per_example_norms(model(ids))
        out = model.net(ids[:3])  # the model's own forward, as outside
        torch.testing.assert_close(out, Positions.forward(model.net, ids[:3]))
        with pytest.raises(ValueError, match=r"'net.pos' \(Embedding\) has an output of shape"):
            funcgrad.per_example_norms(out)


def test_shared_index_under_non_reentrant_checkpoint():
    """R4: the recomputation in the backward was not expanded (CheckpointError)."""
    from torch.utils.checkpoint import checkpoint

    inner = Positions("broadcast")

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return checkpoint(self.inner, ids, use_reentrant=False)

    model = Checkpointed()
    params = list(model.parameters())
    ref = loop_rows(lambda: model(IDS), params).norm(dim=1)
    with funcgrad.per_example(model):
        torch.testing.assert_close(funcgrad.per_example_norms(model(IDS)), ref)


class Keywords(nn.Module):
    """HF-style keyword arguments: a (1, T) mask before the (B, T) ids."""

    def __init__(self):
        super().__init__()
        self.net = Positions("broadcast")

    def forward(self, mask=None, ids=None):
        return self.net(ids) * mask.sum()


def test_shared_index_batch_from_any_argument_not_the_first():
    """The batch was dim 0 of the first tensor argument: (1, T) attention_mask first, then
    nothing was expanded and the call refused the (1, T, d) output."""
    model = Keywords()
    mask = torch.ones(1, 5)
    params = list(model.parameters())
    ref = loop_rows(lambda: model(mask=mask, ids=IDS), params).norm(dim=1)
    with funcgrad.per_example(model):
        torch.testing.assert_close(funcgrad.per_example_norms(model(mask=mask, ids=IDS)), ref)


# -- S4: retain_grad on checked calls ---------------------------------------------------------


@pytest.mark.parametrize("call", ["clip", "backward", "norms"])
def test_retained_grads_are_a_plain_backwards_on_checked_calls(call):
    """The check's extra backward of sum_b u_b L_b fired torch's retains-grad hooks: h.grad
    came out (1 + u_b) times a plain backward's, losses.grad u + 1."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    h = model[0](x)
    h.retain_grad()
    losses = model[2](model[1](h)).squeeze(1)
    losses.retain_grad()
    losses.sum().backward()
    want_h, want_losses = h.grad.clone(), losses.grad.clone()
    with funcgrad.per_example(model) as pe:
        h = model[0](x)
        h.retain_grad()
        losses = model[2](model[1](h)).squeeze(1)
        losses.retain_grad()
        if call == "clip":
            funcgrad.per_example_clip(losses, 1.0, check=True)
        elif call == "backward":
            pe.backward(losses, check=True)
        else:
            funcgrad.per_example_norms(losses, check=True)
    torch.testing.assert_close(h.grad, want_h)
    torch.testing.assert_close(losses.grad, want_losses)


# -- R1 / R2: no examples, no rows -------------------------------------------------------------


def test_empty_batch_gives_the_loops_answer():
    """R1: B = 0 raised "cannot reshape tensor of 0 elements" in the bias rows."""
    model = nn.Linear(3, 2)
    with funcgrad.per_example(model):
        assert funcgrad.per_example_norms(model(torch.randn(0, 3)).sum(1)).shape == (0,)
    with funcgrad.per_example(model):
        assert funcgrad.per_example_clip(model(torch.randn(0, 3)).sum(1), 1.0).shape == (0,)
    for p in model.parameters():  # the sum over no examples
        torch.testing.assert_close(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("both", [False, True])
def test_calls_without_rows_give_the_loops_answer(both):
    """R2: a call on (B, 0, d) raised a size mismatch in the update (weights not spread)."""
    model = nn.Linear(3, 2)
    empty, x = torch.randn(B, 0, 3), torch.randn(B, 3)

    def losses():
        out = model(empty).sum((1, 2))
        return out + model(x).pow(2).sum(1) if both else out

    params = list(model.parameters())
    jac = loop_rows(losses, params)
    norms = jac.norm(dim=1)
    with funcgrad.per_example(model):
        got = funcgrad.per_example_clip(losses(), 1.0)
    torch.testing.assert_close(got, norms)
    want = (1.0 / (norms + 1e-6)).clamp(max=1.0) @ jac
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in params]), want)
    # the Gramian and a weighted update too (the ghost rule's reshape of no rows raised)
    with funcgrad.per_example(model):
        torch.testing.assert_close(funcgrad.per_example_gramian(losses()), jac @ jac.T)
    for p in params:
        p.grad = None
    with funcgrad.per_example(model) as pe:
        pe.backward(losses(), weighting=lambda g: 1.0 / (1.0 + g.diagonal()))
    want = (1.0 / (1.0 + norms**2)) @ jac
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in params]), want)


# -- unclear errors -----------------------------------------------------------------------------


class FrozenTemperature(nn.Module):
    """A parent with a frozen direct parameter: its call is not recorded, its children's were
    dropped with it ("no funcgrad.per_example hooks recorded the forward")."""

    def __init__(self):
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x):
        return self.body(x).squeeze(1) / self.temp


def test_frozen_parameter_on_a_parent_keeps_its_childrens_records():
    model = FrozenTemperature()
    x = torch.randn(B, 3)
    params = [p for p in model.parameters() if p.requires_grad]
    jac = loop_rows(lambda: model(x).pow(2), params)
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(model(x).pow(2))
    torch.testing.assert_close(gram, jac @ jac.T)


def test_reentrant_checkpoint_is_named():
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(B, 3, requires_grad=True)
    with funcgrad.per_example(model):
        losses = checkpoint(model, x, use_reentrant=True).squeeze(1)
        with pytest.raises(ValueError, match=r"use_reentrant=True.*use_reentrant=False"):
            funcgrad.per_example_norms(losses)


class FrozenTable(nn.Module):
    """A frozen (1, T, d) table fed to a Linear: refused for the shared output, not as "no
    hooks recorded the forward"."""

    def __init__(self):
        super().__init__()
        self.tab = nn.Parameter(torch.randn(1, 4, 3), requires_grad=False)
        self.p = nn.Linear(3, 3)

    def forward(self, h):
        return (h + self.p(self.tab)).sum((1, 2))


def test_frozen_shared_table_into_a_linear_is_refused_for_its_shape():
    model = FrozenTable()
    match = r"'p' \(Linear\) has an output that has shape"
    with funcgrad.per_example(model), pytest.raises(ValueError, match=match):
        funcgrad.per_example_norms(model(torch.randn(B, 4, 3)))


def test_two_hooks_on_one_forward_say_what_to_do():
    """The message pointed norms / clip users to a .backward / .gramian they do not have."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with funcgrad.per_example(model), funcgrad.per_example(model[2]):
        losses = model(torch.randn(B, 3)).squeeze(1)
        with pytest.raises(ValueError, match=r"2 funcgrad.per_example hooks.*Hook the model once"):
            funcgrad.per_example_norms(losses)


class TableFirst(nn.Module):
    """A first argument whose dim 0 (7) is not the batch: funcgrad's guess of B is wrong."""

    def __init__(self):
        super().__init__()
        self.net = Positions("broadcast")

    def forward(self, table, ids):
        return self.net(ids) + table.sum()


def test_a_wrong_batch_guess_keeps_the_forward_and_is_refused():
    model = TableFirst()
    table = torch.randn(7, 2)
    outside = model(table, IDS)
    with funcgrad.per_example(model):
        inside = model(table, IDS)
        torch.testing.assert_close(inside, outside, rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"'net.pos' \(Embedding\).*\(B, ...\) = \(7, ...\)"):
            funcgrad.per_example_norms(inside)


class Cls(nn.Module):
    """A class token from a (1, 1) index, expanded to the batch (ViT-style), then joined."""

    def __init__(self):
        super().__init__()
        self.cls, self.proj, self.head = nn.Embedding(2, 3), nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        token = self.cls(torch.zeros(1, 1, dtype=torch.long))
        h = torch.cat([token.expand(x.shape[0], -1, -1), self.proj(x)], 1)
        return self.head(h.tanh()).pow(2).sum((1, 2))


def test_shared_index_expanded_to_the_batch_is_exact():
    model = Cls()
    x = torch.randn(B, 5, 3)
    params = list(model.parameters())
    jac = loop_rows(lambda: model(x), params)
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(model(x))
    torch.testing.assert_close(gram, jac @ jac.T)
