"""Per-example weightings, norms and DP-SGD clipping: the messages of a weighting's output,
`funcgrad.per_example_norms` and the clipped update against a per-example loop of
torch.autograd.grad in float64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import per_example_jacobian
from torch import nn

import funcgrad

B = 6


def test_a_weighting_of_the_wrong_shape_is_told_one_per_example():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(B, 3)
    wrong = r"shape \(6,\) \(one per example\) from the \(6, 6\)"
    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match=wrong):
        pe.backward(model(x).squeeze(1), weighting=lambda g: g.diagonal()[:3])
    assert all(p.grad is None for p in model.parameters())


# -- models: each returns (model, losses_fn); losses_fn(model) -> (B,) losses -------------


def mlp():
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(B, 5), torch.randint(3, (B,))
    return model, lambda m: F.cross_entropy(m(x), y, reduction="none")


def cnn():
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
        nn.Conv2d(4, 3, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(27, 2),
    )  # fmt: skip
    x, y = torch.randn(B, 2, 8, 8), torch.randint(2, (B,))
    return model, lambda m: F.cross_entropy(m(x), y, reduction="none")


class Encoder(nn.Module):
    """Embedding (padding index 0), a TransformerEncoderLayer, a head; long enough sequences
    (T = 9) that some Linear layers take the materialised rule and others the ghost one."""

    def __init__(self, vocab=13, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(width, 2, 40, dropout=0.0, batch_first=True)
        self.wide = nn.Linear(width, 64)
        self.deep = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, tokens):
        pad = tokens == 0
        h = self.layer(self.embed(tokens), src_key_padding_mask=pad)
        h = torch.tanh(self.deep(torch.tanh(self.wide(h))))
        return (self.head(h).squeeze(-1) * ~pad).sum(1)


def encoder():
    tokens = torch.randint(1, 13, (B, 9))
    tokens[1, 6:] = 0
    tokens[3, 8:] = 0
    return Encoder().eval(), lambda m: m(tokens) ** 2


class Tied(nn.Module):
    def __init__(self, vocab=9, width=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens)))


def tied():
    tokens, targets = torch.randint(9, (B, 3)), torch.randint(9, (B, 3))
    loss = lambda m: F.cross_entropy(m(tokens).transpose(1, 2), targets, reduction="none")  # noqa: E731
    return Tied(), lambda m: loss(m).sum(1)


MODELS = {"mlp": mlp, "cnn": cnn, "encoder": encoder, "tied": tied}


loop_grads = per_example_jacobian


def flat_grads(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat(
        [(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params]
    )


# -- norms ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_norms_match_the_per_example_loop(name):
    model, losses_fn = MODELS[name]()
    want = loop_grads(model, losses_fn).norm(dim=1)
    with funcgrad.per_example(model) as pe:
        norms = funcgrad.per_example_norms(losses_fn(model))
    torch.testing.assert_close(norms, want, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in model.parameters())
    assert "(A Aᵀ)∘(Δ Δᵀ)" not in str(pe.plan)  # no cross-example block


def test_norms_take_the_cheaper_rule_per_layer():
    """fastDP's mixed rule: on (B, T, d) inputs the ghost <A_b A_bᵀ, Δ_b Δ_bᵀ> (B·T²·(d+p))
    where T·(d+p) <= d·p, the materialised ‖A_bᵀ Δ_b‖² (B·T·d·p) where not."""
    model, losses_fn = encoder()
    with funcgrad.per_example(model) as pe:
        funcgrad.per_example_norms(losses_fn(model))
    rules = {layer.name: layer.rule for layer in pe.plan.layers}
    assert rules["deep"].startswith("ghost <A_b A_bᵀ, Δ_b Δ_bᵀ> T=9"), rules  # 9·128 < 64·64
    assert rules["wide"].startswith("materialised ‖A_bᵀ Δ_b‖² T=9"), rules  # 9·72 > 8·64
    assert rules["head"].startswith("materialised ‖A_bᵀ Δ_b‖² T=9"), rules  # 9·65 > 64
    assert rules["embed"].startswith("materialised on the rows each example uses"), rules


def test_norms_of_a_float32_model_and_of_selected_parameters():
    model, losses_fn = mlp()
    want = loop_grads(model[2], lambda m: losses_fn(model)).norm(dim=1)
    with funcgrad.per_example(model):
        norms = funcgrad.per_example_norms(losses_fn(model), inputs=model[2])
    torch.testing.assert_close(norms, want, rtol=1e-12, atol=1e-14)


# -- a weighting that reads only G's diagonal ------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_a_diagonal_weighting_gets_the_diagonal_only(name):
    model, losses_fn = MODELS[name]()
    jac = loop_grads(model, losses_fn)
    seen = []

    def weighting(gram):
        seen.append(gram)
        return 1 / (gram.diagonal().sqrt() + 1e-3)

    weighting.reads_diagonal = True
    with funcgrad.per_example(model) as pe:
        weights = pe.backward(losses_fn(model), weighting=weighting)
    want = 1 / (jac.norm(dim=1) + 1e-3)
    torch.testing.assert_close(seen[0], torch.diag(jac.pow(2).sum(1)), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(weights, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(flat_grads(model), want @ jac, rtol=1e-10, atol=1e-12)


# -- DP-SGD: the clipped sum -----------------------------------------------------------------


def opacus_factors(norms, max_norm):
    """Opacus's per-sample clip factor (opacus/optimizers/optimizer.py, clip_and_accumulate)."""
    return (max_norm / (norms + 1e-6)).clamp(max=1.0)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("accumulate", [True, False])
def test_clipping_matches_opacus_formula(name, accumulate):
    model, losses_fn = MODELS[name]()
    jac = loop_grads(model, losses_fn)
    max_norm = float(jac.norm(dim=1).median())  # some examples clipped, some not
    factors = opacus_factors(jac.norm(dim=1), max_norm)
    assert (factors < 1).any() and (factors == 1).any()
    before = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), before):
        p.grad = g.clone()
    with funcgrad.per_example(model):
        norms = funcgrad.per_example_clip(losses_fn(model), max_norm, accumulate=accumulate)
    torch.testing.assert_close(norms, jac.norm(dim=1), rtol=1e-12, atol=1e-14)
    start = torch.cat([g.flatten() for g in before]) if accumulate else 0
    torch.testing.assert_close(flat_grads(model), start + factors @ jac, rtol=1e-10, atol=1e-12)


def test_clipping_replaces_grad_of_an_unreached_parameter_by_none():
    model = nn.ModuleDict({"used": nn.Linear(3, 1), "unused": nn.Linear(3, 1)})
    x = torch.randn(B, 3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with funcgrad.per_example(model):
        funcgrad.per_example_clip(model["used"](x).squeeze(1), 1.0, accumulate=False)
    assert model["unused"].weight.grad is None
    assert model["used"].weight.grad is not None


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_clipping_refuses_a_bad_max_norm(bad):
    model, losses_fn = mlp()
    with funcgrad.per_example(model), pytest.raises(ValueError, match="`max_norm` must be"):
        funcgrad.per_example_clip(losses_fn(model), bad)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_clipping_matches_opacus_itself():
    """Opacus's GradSampleModule + DPOptimizer without noise (loss_reduction="sum"): its
    pre_step leaves the clipped sum in .grad, replacing what was there."""
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(0)
    model, losses_fn = mlp()
    max_norm = 0.5
    theirs = opacus.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    optimizer = opacus.optimizers.DPOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=max_norm,
        expected_batch_size=B,
        loss_reduction="sum",
    )
    losses_fn(theirs).sum().backward()
    optimizer.pre_step()
    want = torch.cat([p.grad.flatten() for p in theirs.parameters()])
    with funcgrad.per_example(model):
        funcgrad.per_example_clip(losses_fn(model), max_norm, accumulate=False)
    torch.testing.assert_close(flat_grads(model), want, rtol=1e-10, atol=1e-12)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0].tanh()).flatten(1)


def _autocast_case(name, batch):
    """A float32 model and its input, for `test_a_clipped_norm_stays_at_most_c_under_autocast`."""
    if name == "linear":
        model, x = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 2)), torch.randn(batch, 7)
    elif name == "conv":
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),  # (the input as kernel)
            nn.Tanh(),
            nn.Conv2d(4, 5, 3, stride=2, padding=1),  # (the grouped weight-gradient kernel)
            nn.Flatten(),
            nn.Linear(5 * 9, 2),
        )
        x = torch.randn(batch, 3, 6, 6)
    elif name == "embedding":
        model = nn.Sequential(nn.Embedding(11, 6), nn.Flatten(), nn.Linear(6 * 5, 2))
        x = torch.randint(0, 11, (batch, 5))
    elif name == "layernorm":
        model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))
        x = torch.randn(batch, 6)
    else:
        model, x = _Attention(), torch.randn(batch, 4, 6)
    x = x.float() if x.is_floating_point() else x
    return model.float(), x  # (autocast casts float32 alone; the tests' default is float64)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", ["linear", "conv", "embedding", "layernorm", "attention"])
def test_a_clipped_norm_stays_at_most_c_under_autocast(name, batch):
    """Under a caller's CPU bf16 autocast (Δ in bf16, the parameters float32), each
    example's clipped gradient has a norm of at most C (1 + 1e-6): the clip factors and the
    update's products were rounded to bf16 (Linear at B = 1: up to 1.0046 C). Each example
    alone: the others' losses times 0 (their gradients 0, so .grad is its clipped gradient),
    at B = 4 through the same batched rules; C at half the smallest norm, 6 seeds."""
    worst = 0.0
    for seed in range(6):
        torch.manual_seed(seed)
        model, x = _autocast_case(name, batch)
        params = list(model.parameters())

        def losses(m, x=x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(x).float().pow(2).sum(1)

        with funcgrad.per_example(model):
            max_norm = 0.5 * float(funcgrad.per_example_norms(losses(model)).min())
            for b in range(batch):
                alone = torch.zeros(batch)
                alone[b] = 1
                funcgrad.per_example_clip(losses(model) * alone, max_norm, inputs=params)
                grads = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
                worst = max(worst, float(grads.double().norm()) / max_norm)
                for p in params:
                    p.grad = None
    assert 0.99 < worst <= 1 + 1e-6, worst
