"""Per-example heads: funcgrad.per_example / per_example_gramian / backward(batch_dim=0)
against a per-example loop of torch.autograd.grad and TorchJD's autojac (per-example losses,
jac_to_grad), in float64: the Gramian and the .grad, on an MLP, CNNs, a transformer encoder
on padded token sequences, tied weights, frozen parameters and a parameter used twice."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import per_example_jacobian
from torch import nn
from torchjd import aggregation as tjd
from torchjd.autojac import backward as tjd_backward
from torchjd.autojac import jac_to_grad

import funcgrad

B = 6


# -- models: each returns (model, losses_fn); losses_fn(model) -> (B,) losses -------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.net(x)).squeeze(1)


def mlp():
    x, y = torch.randn(B, 5), torch.randn(B)
    return MLP(), lambda m: (m(x) - y) ** 2


def cnn():
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 3, 3, stride=2, dilation=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 2),
    )
    model[4].running_mean.uniform_(-0.5, 0.5)
    model[4].running_var.uniform_(0.5, 2.0)
    model.eval()  # BatchNorm with its running statistics
    x, y = torch.randn(B, 2, 8, 8), torch.randint(2, (B,))
    return model, lambda m: nn.functional.cross_entropy(m(x), y, reduction="none")


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=2, dilation=2)
        self.conv2 = nn.Conv1d(4, 2, 2, stride=2)
        self.norm = nn.LayerNorm(2)

    def forward(self, x):
        h = self.conv2(torch.tanh(self.conv(x)))  # (B, 2, L)
        return self.norm(h.transpose(1, 2)).pow(2).sum((1, 2))


def conv1d():
    x = torch.randn(B, 3, 9)
    return Conv1dNet(), lambda m: m(x)


class Transformer(nn.Module):
    """An embedding (padding index 0), one encoder layer in eval mode, a linear head."""

    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(
            width, nhead=2, dim_feedforward=12, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(width, 1)

    def forward(self, tokens):
        pad = tokens == 0
        h = self.layer(self.embed(tokens), src_key_padding_mask=pad)
        out = self.head(h).squeeze(-1) * (~pad)
        return out.sum(1) / (~pad).sum(1)


def transformer():
    tokens = torch.randint(1, 11, (B, 5))
    tokens[0, 3:] = 0  # padded sequences
    tokens[2, 4:] = 0
    y = torch.randn(B)
    model = Transformer().eval()
    return model, lambda m: (m(tokens) - y) ** 2


class Tied(nn.Module):
    """A language-model head tied to the embedding: one parameter in two modules."""

    def __init__(self, vocab=9, width=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        logits = self.out(torch.tanh(self.mix(self.embed(tokens))))  # (B, T, V)
        return logits


def tied():
    tokens, targets = torch.randint(9, (B, 3)), torch.randint(9, (B, 3))

    def losses(m):
        logits = m(tokens)
        return nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(1)

    return Tied(), losses


class Twice(nn.Module):
    """One Linear called twice, and a custom module (a direct parameter) called twice."""

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x * self.scale + torch.sin(x * self.scale)

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.shared = nn.Linear(4, 4)
        self.scale = Twice.Scale()

    def forward(self, x):
        h = torch.tanh(self.shared(self.scale(self.inp(x))))
        return self.shared(self.scale(h)).pow(2).sum(1)


def twice():
    x = torch.randn(B, 3)
    return Twice(), lambda m: m(x)


def frozen():
    model, losses = mlp()
    model.net[0].requires_grad_(False)
    model.head.bias.requires_grad_(False)
    return model, losses


MODELS = {
    "mlp": mlp,
    "cnn": cnn,
    "conv1d": conv1d,
    "transformer": transformer,
    "tied": tied,
    "twice": twice,
    "frozen": frozen,
}


# -- references ---------------------------------------------------------------------------


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def loop_jacobian(model, losses_fn):
    """(B, P): the rows of torch.autograd.grad(losses[b], params), one backward each."""
    return per_example_jacobian(model, losses_fn, trainable(model))


def grads_of(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def from_rows(model, vector):
    """A flat update over the trainable parameters, as per-parameter tensors (None where
    frozen)."""
    found, start = [], 0
    for p in model.parameters():
        if not p.requires_grad:
            found.append(None)
            continue
        found.append(vector[start : start + p.numel()].view_as(p))
        start += p.numel()
    return found


def assert_grads(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def native_weighting(gramian):  # a torch-native weighting: inverse gradient norms
    return 1 / (gramian.diagonal().sqrt() + 1e-3)


WEIGHTINGS = {
    "upgrad": lambda: tjd.UPGrad(),
    "mgda": lambda: tjd.MGDA(),
    "none": lambda: None,
    "native": lambda: native_weighting,
}


# -- exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_gramian_matches_per_example_loop(name):
    model, losses_fn = MODELS[name]()
    jac = loop_jacobian(model, losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = funcgrad.per_example_gramian(losses_fn(model))
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    assert all(p.grad is None for p in model.parameters())  # the Gramian alone writes nothing
    assert pe.plan is not None and str(pe.plan).count("\n") >= 1


# TorchJD's autojac vmaps the transformer's attention backward (torch's slow path warns).
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("weighting", list(WEIGHTINGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_backward_matches_loop_and_torchjd(name, weighting):
    torch.manual_seed(1)
    model, losses_fn = MODELS[name]()
    reference = copy.deepcopy(model)
    jac = loop_jacobian(reference, losses_fn)
    fn = WEIGHTINGS[weighting]()
    if fn is None:
        want_weights = torch.ones(B)
    elif callable(fn) and not isinstance(fn, nn.Module):
        want_weights = fn(jac @ jac.T)
    else:
        want_weights = fn.gramian_weighting(jac @ jac.T)
    want = from_rows(reference, want_weights @ jac)

    with funcgrad.per_example(model):
        weights = funcgrad.backward(losses_fn(model), batch_dim=0, weighting=fn)
    torch.testing.assert_close(weights, want_weights, rtol=1e-7, atol=1e-9)
    assert_grads(grads_of(model), want)

    if isinstance(fn, nn.Module) or fn is None:  # TorchJD's autojac on the same losses
        tjd_model = copy.deepcopy(reference)
        params = trainable(tjd_model)
        tjd_backward(losses_fn(tjd_model), inputs=params)
        jac_to_grad(params, tjd.Sum() if fn is None else WEIGHTINGS[weighting]())
        assert_grads(grads_of(model), grads_of(tjd_model))


def test_object_entry_point_and_accumulation():
    """pe.backward accumulates into .grad like autograd, and equals funcgrad.backward."""
    model, losses_fn = mlp()
    other = copy.deepcopy(model)
    with funcgrad.per_example(model) as pe:
        pe.backward(losses_fn(model))
        pe.backward(losses_fn(model))
    losses_fn(other).sum().backward()
    losses_fn(other).sum().backward()
    assert_grads(grads_of(model), grads_of(other))


def test_inputs_selects_parameters():
    model, losses_fn = mlp()
    chosen = [model.net[2].weight, model.head.bias]
    reference = copy.deepcopy(model)
    losses = losses_fn(reference)
    rows = torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(
                        losses[b], [reference.net[2].weight, reference.head.bias], retain_graph=True
                    )
                ]
            )
            for b in range(B)
        ]
    )
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model), inputs=chosen)
        pe.backward(losses_fn(model), inputs=chosen, weighting=native_weighting)
    torch.testing.assert_close(gram, rows @ rows.T)
    update = native_weighting(rows @ rows.T) @ rows
    torch.testing.assert_close(model.net[2].weight.grad.flatten(), update[:28])
    torch.testing.assert_close(model.head.bias.grad, update[28:])
    assert model.net[0].weight.grad is None and model.head.weight.grad is None


def test_ghost_and_materialised_rules_are_both_exercised():
    """A (B, T, d) Linear with T large goes materialised, T=1 goes ghost: both exact."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 3))
    x = torch.randn(B, 20, 2)
    losses_fn = lambda m: m(x).pow(2).sum((1, 2))  # noqa: E731
    jac = loop_jacobian(model, losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model))
    torch.testing.assert_close(gram, jac @ jac.T)
    rules = str(pe.plan)
    assert "materialised" in rules


def test_retain_graph_keeps_the_forward_for_a_second_call():
    """The Gramian for attribution, then the update, from one forward."""
    model, losses_fn = mlp()
    jac = loop_jacobian(copy.deepcopy(model), losses_fn)
    with funcgrad.per_example(model) as pe:
        losses = losses_fn(model)
        gram = pe.gramian(losses, retain_graph=True)
        pe.backward(losses, weighting=native_weighting)
    torch.testing.assert_close(gram, jac @ jac.T)
    assert_grads(grads_of(model), from_rows(model, native_weighting(jac @ jac.T) @ jac))


def test_child_called_outside_a_parent_that_reads_its_parameter():
    """Nested reads unused_call's parameters without calling it; the model also calls
    unused_call itself: one parameter in two layers, its per-example gradients summed."""

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.nested = Nested()

        def forward(self, x):
            return (self.nested(x) * self.nested.unused_call(torch.cos(x))).sum(1)

    model, x = Outer(), torch.randn(B, 4)
    jac = loop_jacobian(copy.deepcopy(model), lambda m: m(x))
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(model(x))
    torch.testing.assert_close(gram, jac @ jac.T)
    assert "shares a parameter" in str(pe.plan)


def test_inplace_activation_after_a_layer():
    """An in-place ReLU on a Linear's output: Δ is taken at the Linear's own output."""
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 1))
    x = torch.randn(B, 3)
    losses_fn = lambda m: m(x).squeeze(1).exp()  # noqa: E731
    jac = loop_jacobian(model, losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model))
    torch.testing.assert_close(gram, jac @ jac.T)


# -- errors -------------------------------------------------------------------------------


def test_batchnorm_in_training_is_refused_before_any_pass():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\).*batch's statistics"):
        funcgrad.per_example(model)
    model.eval()
    with funcgrad.per_example(model):
        model.train()
        with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\).*model.eval\(\)"):
            model(torch.randn(B, 3))
    assert model[1].num_batches_tracked.item() == 0  # refused before its forward ran


def test_losses_must_be_one_dimensional():
    model, _ = mlp()
    x = torch.randn(B, 5)
    with funcgrad.per_example(model) as pe:
        out = model.head(model.net(x))  # (B, 1)
        with pytest.raises(ValueError, match=r"`losses` must be a 1-D tensor.*\(6, 1\)"):
            pe.backward(out)
        with pytest.raises(ValueError, match=r"`losses` must be a 1-D tensor"):
            funcgrad.backward(out.sum(), batch_dim=0)
    assert all(p.grad is None for p in model.parameters())


def test_module_whose_batch_dim_is_not_zero():
    """Tokens flattened into the batch (B*T rows): the Linear's rows are not examples."""
    model = nn.Linear(3, 2)
    x = torch.randn(B, 4, 3)
    with funcgrad.per_example(model) as pe:
        losses = model(x.reshape(-1, 3)).view(B, 4, 2).pow(2).sum((1, 2))
        with pytest.raises(
            ValueError, match=r"module '<model>' \(Linear\).*shape \(24, 2\).*B = 6"
        ):
            pe.backward(losses)
    assert model.weight.grad is None


def test_transformer_batch_first_false_is_refused():
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=False).eval()
    x = torch.randn(5, B, 4)  # (T, B, E)
    with funcgrad.per_example(layer) as pe:
        losses = layer(x).pow(2).sum((0, 2))
        with pytest.raises(ValueError, match=r"batched along dim 0"):
            pe.backward(losses)
    assert all(p.grad is None for p in layer.parameters())


def test_functional_use_of_a_parameter_is_refused():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)

        def forward(self, tokens):
            h = self.embed(tokens)
            return nn.functional.linear(h, self.embed.weight).pow(2).sum((1, 2))

    model = Functional()
    with funcgrad.per_example(model) as pe:
        losses = model(torch.randint(5, (B, 2)))
        with pytest.raises(
            ValueError, match=r"parameter 'embed.weight' reaches the losses outside"
        ):
            pe.backward(losses)
    assert model.embed.weight.grad is None


def test_without_hooks_names_the_fix():
    model, losses_fn = mlp()
    with pytest.raises(ValueError, match=r"funcgrad.per_example\(model\)"):
        funcgrad.backward(losses_fn(model), batch_dim=0)
    with pytest.raises(TypeError, match=r"`through` is missing.*batch_dim=0"):
        funcgrad.backward(losses_fn(model))


def test_bad_arguments_are_clear_errors():
    model, losses_fn = mlp()
    with funcgrad.per_example(model):
        losses = losses_fn(model)
        with pytest.raises(ValueError, match=r"`through` is not used with `batch_dim`"):
            funcgrad.backward(losses, batch_dim=0, through=losses)
        with pytest.raises(ValueError, match=r"`level` must be 'params'"):
            funcgrad.backward(losses, batch_dim=0, level="features")
        with pytest.raises(NotImplementedError, match=r"process group.*all-gather"):
            funcgrad.backward(losses, batch_dim=0, process_group=object())
        with pytest.raises(ValueError, match=r"reads the \(B, P\) Jacobian"):
            funcgrad.backward(losses, batch_dim=0, weighting=tjd.Mean())
        with pytest.raises(ValueError, match=r"non-finite weights"):
            funcgrad.backward(losses, batch_dim=0, weighting=lambda g: g.diagonal() * torch.nan)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match=r"`batch_dim` must be 0"):
        funcgrad.per_example(model, batch_dim=1)


def test_random_draws_inside_a_module_with_parameters_are_refused():
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.5, batch_first=True).train()
    x = torch.randn(B, 3, 4)
    with funcgrad.per_example(layer) as pe:
        losses = layer(x).pow(2).sum((1, 2))
        with pytest.raises(ValueError, match=r"'self_attn' \(MultiheadAttention\) draws random"):
            pe.backward(losses)
    assert all(p.grad is None for p in layer.parameters())


def test_nothing_recorded_without_grad_and_hooks_removed():
    model, losses_fn = mlp()
    pe = funcgrad.per_example(model)
    with torch.no_grad():
        model(torch.randn(B, 5))
    assert not pe._uses
    pe.remove()
    losses_fn(model)
    assert not pe._uses


# -- every rule, forced by shapes, against the loop ------------------------------------------


class Nested(nn.Module):
    """A module with a direct parameter and a child Linear called inside its forward, and a
    child whose parameter it reads without calling it (as nn.MultiheadAttention's
    out_proj): the child called gets its own rule, the other joins the parent's."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(4))
        self.inner = nn.Linear(4, 4)
        self.unused_call = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.inner(x * self.gain))
        return nn.functional.linear(h, self.unused_call.weight, self.unused_call.bias)


def rule_cases():
    seq, tokens = torch.randn(B, 2, 20), torch.randint(5000, (B, 3))
    tokens_long, image, x3, x4 = (
        torch.randint(50, (B, 30)),
        torch.randn(B, 2, 3, 3),
        torch.randn(B, 3),
        torch.randn(B, 4),
    )
    return {
        # (model, losses_fn, a substring of the plan)
        "linear 3-D ghost": (
            nn.Sequential(nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 1)),
            lambda m: m(seq).sum((1, 2)),
            "ghost <A_b A_b'ᵀ, Δ_b Δ_b'ᵀ> T=2",
        ),
        "embedding ghost": (
            nn.Sequential(nn.Embedding(5000, 3), nn.Linear(3, 1)),
            lambda m: m(tokens).pow(2).sum((1, 2)),
            "pairs of rows with one index (18 pairs",
        ),
        "embedding on the rows used": (
            nn.Sequential(nn.Embedding(50, 3, padding_idx=1), nn.Linear(3, 1)),
            lambda m: m(tokens_long).pow(2).sum((1, 2)),
            "pairs of rows with one index (441 pairs, 133 rows)",
        ),
        "conv ghost": (
            nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3, 1)),
            lambda m: m(image).squeeze(1).exp(),
            "ghost (A Aᵀ)∘(Δ Δᵀ)",
        ),
        "batchnorm1d eval, 2-D": (
            nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).eval(),
            lambda m: m(x3).squeeze(1).exp(),
            "materialised (B, C) affine",
        ),
        "nested generic": (
            Nested(),
            lambda m: m(x4).pow(2).sum(1),
            "materialised, vmap",
        ),
        "a Linear subclass with its own forward": (
            nn.Sequential(LoRALinear(3, 4), nn.Tanh(), nn.Linear(4, 1)),
            lambda m: m(x3).squeeze(1).exp(),
            "0  LoRALinear",
        ),
    }


class LoRALinear(nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.down = nn.Parameter(torch.randn(2, self.in_features))
        self.up = nn.Parameter(torch.randn(self.out_features, 2))

    def forward(self, x):
        return super().forward(x) + x @ self.down.T @ self.up.T


@pytest.mark.parametrize("name", list(rule_cases()))
def test_each_rule_matches_the_loop(name):
    model, losses_fn, rule = rule_cases()[name]
    reference = copy.deepcopy(model)
    jac = loop_jacobian(reference, losses_fn)
    weights = native_weighting(jac @ jac.T)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model))
        assert rule in str(pe.plan), str(pe.plan)
        got = pe.backward(losses_fn(model), weighting=native_weighting)
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got, weights)
    assert_grads(grads_of(model), from_rows(reference, weights @ jac))


class _Scale(torch.autograd.Function):
    """Old-style (no setup_context): torch.func refuses it, plain autograd runs it."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        return grad * scale, (grad * x).sum(0)


class OldStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return _Scale.apply(x, self.scale)


def test_a_module_torch_func_cannot_run_is_looped_with_autograd():
    model = nn.Sequential(OldStyle(), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(B, 3)
    losses_fn = lambda m: m(x).squeeze(1).exp()  # noqa: E731
    jac = loop_jacobian(copy.deepcopy(model), losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model))
    assert "0  OldStyle  (6, 3)  materialised, loop" in str(pe.plan)
    torch.testing.assert_close(gram, jac @ jac.T)


@pytest.mark.parametrize("block", [1, 7, 1 << 22])
def test_embedding_pairs_rule_is_exact_in_any_blocking(monkeypatch, block):
    """The Embedding's Gramian from the pairs of (example, index) rows sharing an index:
    repeated indices within an example, a frequent index, the padding index left out, and
    the pairs formed in blocks of any size (one pair per block up to all at once)."""
    from funcgrad._per_example import _rules

    formed = []

    def pairs_per_block(elements, width):
        formed.append(width)
        return block

    monkeypatch.setattr(_rules, "_pairs_per_block", pairs_per_block)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(12, 4, padding_idx=0), nn.Tanh(), nn.Linear(4, 2))
    model = model.double()
    tokens = torch.randint(0, 12, (7, 9))
    tokens[:, 0] = 5  # a frequent index: every example, several times
    tokens[:, 3] = 5
    tokens[2:, 6:] = 0  # padding

    def losses_fn(m):
        return m(tokens).pow(2).sum((1, 2))

    jac = loop_jacobian(model, losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model))
    assert "pairs of rows with one index" in str(pe.plan)
    assert formed == [4]  # the blocking asked for
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)


def _dense_ghost(a, d):
    """``sum_{t,s} <a_bt, a_cs> <d_bt, d_cs>`` from the whole (B, T, T, B) products."""
    return torch.einsum("btx,csx,bty,csy->bc", a, a, d, d)


@pytest.mark.parametrize("block", [0, 1, 50, 10**9])
def test_ghost_skips_zero_rows_forms_the_upper_triangle_in_bounded_blocks(block):
    """The ghost products of a layer on (B, T, ·) rows: the rows with Δ_bt = 0 (padding)
    left out, an example with no row left, blocks of any size, the upper triangle mirrored:
    equal to the whole (BT)² sum; the kernel formed never holds more than the budget
    (beyond one example's rows)."""
    from torch.utils.flop_counter import FlopCounterMode

    from funcgrad._per_example._layer import _ghost

    torch.manual_seed(4)
    a, d = torch.randn(6, 5, 7), torch.randn(6, 5, 3)
    lengths = torch.tensor([5, 2, 0, 4, 1, 5])
    d = d * (torch.arange(5) < lengths[:, None]).unsqueeze(-1)  # padded rows: Δ = 0
    with FlopCounterMode(display=False) as counter:
        gram = _ghost(a, d, block)
    torch.testing.assert_close(gram, _dense_ghost(a, d), rtol=1e-12, atol=1e-12)
    live = int(lengths.sum())
    full = 2 * live * live * (7 + 3)  # both kernels over all live pairs
    assert counter.get_total_flops() <= full * 0.5 + 2 * live * 5 * (7 + 3) * 2


def test_a_padded_sequence_layer_takes_the_ghost_rule_on_its_live_rows():
    """A Linear on padded sequences whose losses read the real positions alone: the ghost
    rule counts only the live rows, and is exact against the loop."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 1)).double()
    x = torch.randn(5, 6, 40)
    keep = (torch.arange(6) < torch.tensor([6, 3, 1, 4, 2])[:, None]).double()

    def losses_fn(m):
        return (m(x).squeeze(-1) * keep).pow(2).sum(1)

    jac = loop_jacobian(model, losses_fn)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(losses_fn(model))
    assert "T=6, 16 rows live" in str(pe.plan), str(pe.plan)
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
