"""nn.MultiheadAttention as its projections (q, k, v, out: the Linear rules), against a
per-example loop of torch.autograd.grad in float64: self-attention in a
TransformerEncoderLayer with a padding mask, cross-attention with kdim/vdim (separate
projection weights), the attention weights read by the loss, a causal mask, a 3-D mask,
no bias, and a subset of the parameters."""

from __future__ import annotations

import pytest
import torch
from helpers import per_example_jacobian
from torch import nn

import funcgrad

B, T, S, D = 5, 4, 3, 8


loop_jacobian = per_example_jacobian


class Attend(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.case = case
        kv = dict(kdim=5, vdim=6) if case == "cross" else {}
        bias = case != "no_bias"
        self.attention = nn.MultiheadAttention(D, 2, batch_first=True, bias=bias, **kv)
        self.head = nn.Linear(D, 1)
        self.x = torch.randn(B, T, D)
        self.memory = torch.randn(B, S, 5), torch.randn(B, S, 6)
        self.mask = torch.rand(B * 2, T, T) > 0.7  # one (T, T) mask per example and head
        self.mask[..., 0] = False

    def forward(self):
        x, case = self.x, self.case
        if case == "cross":
            out, _ = self.attention(x, *self.memory, need_weights=False)
        elif case == "weights":  # the averaged attention weights feed the loss
            out, weights = self.attention(x, x, x)
            out = out + weights.sum(-1, keepdim=True) * weights[..., :1]
        elif case == "causal":
            mask = nn.Transformer.generate_square_subsequent_mask(T)
            out, _ = self.attention(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
        elif case == "mask3d":
            out, _ = self.attention(x, x, x, attn_mask=self.mask, need_weights=False)
        else:
            pad = torch.zeros(B, T, dtype=torch.bool)
            pad[1, 2:] = True
            out, _ = self.attention(x, x, x, key_padding_mask=pad, need_weights=False)
        return self.head(torch.tanh(out)).pow(2).sum((1, 2))


CASES = ["self", "cross", "weights", "causal", "mask3d", "no_bias"]


@pytest.mark.parametrize("case", CASES)
def test_attention_takes_the_linear_rules_and_is_exact(case):
    model = Attend(case)
    params = list(model.parameters())
    jac = loop_jacobian(model, lambda m: m(), params)
    with funcgrad.per_example(model) as pe:
        gram = funcgrad.per_example_gramian(model())
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
    rule = next(layer.rule for layer in pe.plan.layers if layer.name == "attention")
    # self-attention with the packed in-projection: q, k, v as one Linear of 3·d outputs
    first = "q: " if case == "cross" else "qkv: "
    assert rule.startswith(first) and "out: " in rule and "vmap" not in rule, rule
    with funcgrad.per_example(model):
        norms = funcgrad.per_example_norms(model())
    torch.testing.assert_close(norms, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
    weighting = lambda g: 1 / (g.diagonal().sqrt() + 1e-3)  # noqa: E731
    with funcgrad.per_example(model) as pe:
        weights = pe.backward(model(), weighting=weighting)
    got = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(got, weights @ jac, rtol=1e-10, atol=1e-12)


def test_attention_with_a_subset_of_its_parameters():
    model = Attend("self")
    chosen = [model.attention.in_proj_weight, model.attention.out_proj.bias]
    jac = loop_jacobian(model, lambda m: m(), chosen)
    with funcgrad.per_example(model) as pe:
        weights = pe.backward(model(), weighting=lambda g: g.diagonal(), inputs=chosen)
    torch.testing.assert_close(weights, jac.pow(2).sum(1), rtol=1e-10, atol=1e-12)
    got = torch.cat([p.grad.flatten() for p in chosen])
    torch.testing.assert_close(got, weights @ jac, rtol=1e-10, atol=1e-12)
    assert model.attention.in_proj_bias.grad is None and model.head.weight.grad is None


def test_encoder_layer_self_attention_is_native():
    layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
    x = torch.randn(B, T, D)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 3:] = True
    losses_fn = lambda m: m(x, src_key_padding_mask=pad).pow(2).sum((1, 2))  # noqa: E731
    jac = loop_jacobian(layer, losses_fn, list(layer.parameters()))
    with funcgrad.per_example(layer) as pe:
        gram = funcgrad.per_example_gramian(losses_fn(layer))
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
    assert "vmap" not in str(pe.plan) and "loop" not in str(pe.plan), str(pe.plan)


@pytest.mark.parametrize("kind", ["bool", "float", "none"])
def test_the_recompute_without_identity_projections_equals_the_general_one(kind, monkeypatch):
    """The common call (a padding mask or none, no weights returned) recomputes the attention
    by one scaled_dot_product_attention on the projected heads; the general recompute (the
    identity projections of F.multi_head_attention_forward) gives the same G, and both the
    loop's."""
    from funcgrad._per_example import _attention

    torch.manual_seed(6)
    model = nn.MultiheadAttention(D, 2, batch_first=True).double()
    x = torch.randn(B, T, D)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 2:] = True
    pad[3, 3:] = True
    mask = {"bool": pad, "float": pad.double() * -1e4, "none": None}[kind]

    def losses_fn(m):
        return m(x, x, x, key_padding_mask=mask, need_weights=False)[0].pow(2).sum((1, 2))

    jac = loop_jacobian(model, losses_fn)
    grams = []
    for general in (False, True):
        if general:
            monkeypatch.setattr(_attention, "_attend", lambda *args: None)
        with funcgrad.per_example(model) as pe:
            grams.append(pe.gramian(losses_fn(model)))
    for gram in grams:
        torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)


class _CountAttention(torch.overrides.TorchFunctionMode):
    """Counts the attention passes (SDPA, or the general multi-head forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (
            torch.nn.functional.scaled_dot_product_attention,
            torch.nn.functional.multi_head_attention_forward,
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_attention_takes_dq_dk_dv_from_the_one_backward(dtype, bias, cross):
    """The calls that return no weights take Δq, Δk, Δv from the one backward (the
    gradients at the heads that the forward's attention node saved), where each call ran
    the attention again (one more batched forward and backward of it): no attention pass
    in the call, G and the norms exact against the loop (float64), padding included."""
    torch.manual_seed(8)
    kv = dict(kdim=5, vdim=6) if cross else {}
    attention = nn.MultiheadAttention(D, 2, batch_first=True, bias=bias, dtype=dtype, **kv)
    head = nn.Linear(D, 1, dtype=dtype)
    x = torch.randn(B, T, D, dtype=dtype)
    memory = (torch.randn(B, S, 5, dtype=dtype), torch.randn(B, S, 6, dtype=dtype))
    keys = S if cross else T
    pad = torch.zeros(B, keys, dtype=torch.bool)
    pad[0, 2:] = True

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.head = attention, head

        def forward(self):
            k, v = memory if cross else (x, x)
            out, _ = self.attention(x, k, v, key_padding_mask=pad, need_weights=False)
            return self.head(out).squeeze(-1).pow(2).sum(1)

    model = Model()
    jac = loop_jacobian(model, lambda m: m())
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    with funcgrad.per_example(model) as pe:
        losses = model()
        with _CountAttention() as counted:
            gram = pe.gramian(losses)
            norms = funcgrad.per_example_norms(model())
        assert counted.count == 1  # the forward of the second call's losses; none in the calls
    torch.testing.assert_close(gram, (jac @ jac.T).to(dtype), **tol)
    torch.testing.assert_close(norms, jac.norm(dim=1).to(dtype), **tol)
