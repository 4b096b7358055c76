"""Session 8's cost changes of the per-example rules, each exact in float64 against a
per-example autograd loop and counted (never timed): self-attention's [Δq, Δk, Δv] read as
the packed in-projection's one output gradient (no copy to join three, none held beside
it), and the update reading A and Δ as rows in their memory order (no copy of attention's
(T, B, ·) tensors); with user hooks, a model that mixes the examples, one ``per_example``
object reused across shapes and after failures."""

from __future__ import annotations

import pytest
import torch
from helpers import PER_EXAMPLE_CALLS, per_example_jacobian
from torch import nn

import funcgrad
from funcgrad._per_example import _attention

WIDTH = 8


class Encoder(nn.Module):
    """Embedding -> nn.TransformerEncoderLayer (self-attention with the packed
    in-projection, a key padding mask) -> mean over the real tokens -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, WIDTH, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True).eval()
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.layer(self.embed(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1)).pow(2).sum(1)


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return Encoder().double()


def _tokens(batch: int = 4, length: int = 6) -> torch.Tensor:
    tokens = torch.randint(1, 20, (batch, length))
    tokens[0, length // 2 :] = 0  # padding: keys masked, rows read by no loss
    return tokens


def _reference(model: nn.Module, x: torch.Tensor, call: str) -> torch.Tensor:
    rows = per_example_jacobian(model, lambda m: m(x))
    if call == "gramian":
        return rows @ rows.T
    if call == "norms":
        return rows.norm(dim=1)
    if call == "backward":
        return rows.sum(0)
    if call == "weighted":
        return _weights(rows.shape[0], rows.dtype) @ rows
    factors = (1.0 / (rows.norm(dim=1) + 1e-6)).clamp(max=1.0)
    return factors @ rows


def _weights(batch: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(0.5, 2.0, batch, dtype=dtype)


def _weighted(losses: torch.Tensor) -> torch.Tensor:
    """``.grad += w @ per-example gradients`` with fixed weights, from G (so that G forms)."""
    return funcgrad.backward(losses, batch_dim=0, weighting=lambda g: _weights(g.shape[0], g.dtype))


CALLS = {**PER_EXAMPLE_CALLS, "weighted": _weighted}


def _got(model: nn.Module, x: torch.Tensor, call: str) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    found = CALLS[call](model(x))
    if call in ("gramian", "norms"):
        return found
    return torch.cat([p.grad.flatten() for p in model.parameters()])


class _Joins(torch.utils._python_dispatch.TorchDispatchMode):
    """The copies that join three (B, T, d) tensors along their last dim (``torch.cat``
    of Δq, Δk, Δv)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.cat:
            parts = args[0]
            if len(parts) == 3 and all(p.ndim == 3 and p.shape[-1] == WIDTH for p in parts):
                self.count += 1
        return func(*args, **(kwargs or {}))


def _count_packed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[edges found, misses] of `_attention._packed_edge`."""
    counts = [0, 0]
    real = _attention._packed_edge

    def counting(*args):
        edge = real(*args)
        counts[0 if edge is not None else 1] += 1
        return edge

    monkeypatch.setattr(_attention, "_packed_edge", counting)
    return counts


@pytest.mark.parametrize("call", ["gramian", "norms", "backward", "weighted", "clip"])
def test_self_attention_reads_the_packed_gradient_exactly(monkeypatch, call):
    """Δq, Δk, Δv as the packed in-projection's output gradient: exact, found for the
    self-attention call, and never joined by a copy."""
    counts = _count_packed(monkeypatch)
    model = _encoder()
    x = _tokens()
    expected = _reference(model, x, call)
    with funcgrad.per_example(model):
        loss = model(x)
        for p in model.parameters():
            p.grad = None
        with _Joins() as joins:
            found = CALLS[call](loss)
        if call in ("backward", "weighted", "clip"):
            found = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    assert counts == [1, 0]
    assert joins.count == 0


def test_packed_gradient_with_a_retained_graph_and_the_first_call(monkeypatch):
    """The first call of a signature (its independence check, formed at the end) and a
    call with ``retain_graph=True`` (not streamed), then the same forward again: exact."""
    counts = _count_packed(monkeypatch)
    model = _encoder()
    x = _tokens()
    expected = _reference(model, x, "gramian")
    with funcgrad.per_example(model) as pe:
        losses = model(x)
        first = pe.gramian(losses, retain_graph=True)
        again = pe.gramian(losses)
    torch.testing.assert_close(first, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(again, expected, rtol=1e-10, atol=1e-12)
    assert counts[0] >= 1 and counts[1] == 0


@pytest.mark.parametrize("call", ["gramian", "weighted"])
def test_packed_gradient_falls_back_under_a_full_backward_hook(monkeypatch, call):
    """A full backward hook on the attention wraps its inputs: q, k and v are then three
    tensors, projected apart, and the three heads' own gradients are read (counted as a
    miss). The hook's rewrite of the input gradient is honoured, as in the loop."""
    counts = _count_packed(monkeypatch)
    model = _encoder()
    fired = [0]

    def halve(module, grad_input, grad_output):
        fired[0] += 1
        return tuple(None if g is None else g * 0.5 for g in grad_input)

    model.layer.self_attn.register_full_backward_hook(halve)
    x = _tokens()
    expected = _reference(model, x, call)
    fired[0] = 0
    with funcgrad.per_example(model):
        found = _got(model, x, call)
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    assert counts == [0, 1]
    assert fired[0] >= 1


def test_packed_gradient_is_not_found_for_cross_attention(monkeypatch):
    """Query and key/value from different tensors: the in-projection is not one product,
    `_packed_edge` finds nothing and the heads' edges are read: exact."""
    counts = _count_packed(monkeypatch)

    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(WIDTH, WIDTH)
            self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            memory = torch.tanh(self.up(x))
            out = self.attention(x, memory, memory, need_weights=False)[0]
            return out.pow(2).sum((1, 2))

    torch.manual_seed(1)
    model = Cross().double().eval()
    x = torch.randn(3, 5, WIDTH, dtype=torch.float64)
    expected = _reference(model, x, "gramian")
    with funcgrad.per_example(model) as pe:
        found = pe.gramian(model(x))
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    assert counts == [0, 1]


def test_packed_gradient_with_a_tensor_hook_on_the_attention_output(monkeypatch):
    """A tensor hook on the encoder layer's output rewrites every Δ below it, the packed
    one included: fired once a call, exact against the loop with the same hook."""
    _count_packed(monkeypatch)
    fired = [0]

    class Hooked(Encoder):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            pad = tokens == 0
            h = self.layer(self.embed(tokens), src_key_padding_mask=pad)
            if h.requires_grad:

                def scale(grad: torch.Tensor) -> torch.Tensor:
                    fired[0] += 1
                    return grad * torch.linspace(0.5, 2.0, grad.shape[1], dtype=grad.dtype)[:, None]

                h.register_hook(scale)
            keep = (~pad).unsqueeze(-1).to(h.dtype)
            return self.head((h * keep).sum(1) / keep.sum(1)).pow(2).sum(1)

    torch.manual_seed(0)
    model = Hooked().double()
    x = _tokens()
    expected = _reference(model, x, "clip")
    with funcgrad.per_example(model):
        fired[0] = 0
        found = _got(model, x, "clip")
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    assert fired[0] == 1


def test_packed_gradient_in_a_model_that_mixes_examples_is_refused():
    """Mixing the examples after the attention (a batch mean) is refused as before."""

    class Mixing(Encoder):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.layer(self.embed(tokens))
            h = h - h.mean(0, keepdim=True)
            return self.head(h.mean(1)).pow(2).sum(1)

    torch.manual_seed(0)
    model = Mixing().double()
    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match="mix"):
        pe.gramian(model(_tokens()))


def test_one_encoder_across_shapes_after_failures_with_post_accumulate_hooks(monkeypatch):
    """One hooked encoder: B = 4, T = 6; B = 3, T = 9; a weighting that raises (``.grad``
    untouched, no post-accumulate hook fired); losses of the wrong shape; B = 4, T = 6
    again. Each exact; the post-accumulate hook on the packed in-projection weight fires
    once a writing call, on its final ``.grad``; the returned Gramian, mutated, changes
    nothing of the next call."""
    counts = _count_packed(monkeypatch)
    model = _encoder()
    weight = model.layer.self_attn.in_proj_weight
    seen: list[torch.Tensor] = []
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    with funcgrad.per_example(model) as pe:
        for x in (_tokens(4, 6), _tokens(3, 9)):
            gram = pe.gramian(model(x))
            torch.testing.assert_close(
                gram, _reference(model, x, "gramian"), rtol=1e-10, atol=1e-12
            )
            gram.fill_(float("nan"))  # the user's copy: nothing of ours
        x = _tokens(4, 6)
        for p in model.parameters():
            p.grad = torch.full_like(p, 7.0)
        seen.clear()

        def boom(gramian: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("weighting failed")

        with pytest.raises(RuntimeError, match="weighting failed"):
            pe.backward(model(x), weighting=boom)
        assert all(bool((p.grad == 7.0).all()) for p in model.parameters())
        assert not seen
        with pytest.raises(ValueError):
            pe.gramian(model(x).unsqueeze(1))
        for p in model.parameters():
            p.grad = None
        pe.backward(model(x))
        expected = _reference(model, x, "backward")
        found = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
        assert len(seen) == 1
        torch.testing.assert_close(seen[0], weight.grad, rtol=0, atol=0)
    assert counts[1] == 0


class Rows(nn.Module):
    """One Linear (or HF Conv1D) on (B, T, d) rows, tanh, a sum per example: its per-example
    products formed whole; T long enough that they are kept for the update (`keeps`) where
    the call writes, and the layer is not tiny (`_TINY`)."""

    def __init__(self, width: int, out: int, conv1d: bool) -> None:
        super().__init__()
        if conv1d:
            transformers = pytest.importorskip("transformers")
            self.layer = transformers.pytorch_utils.Conv1D(out, width)
        else:
            self.layer = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x)).pow(2).sum((1, 2))


@pytest.mark.parametrize("call", ["gramian", "norms", "weighted", "clip"])
@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4)])
@pytest.mark.parametrize("conv1d", [False, True])
def test_kept_per_example_gradients_update_exactly(call, shape, conv1d):
    """A Linear (weight (p, d)) or HF Conv1D (weight (d, p)) whose per-example gradients are
    kept for the update (``w @ grads``) beside the update that reads its rows in the
    order they have in memory: exact."""
    width, out = shape
    torch.manual_seed(2)
    model = Rows(width, out, conv1d).double()
    x = torch.randn(4, 300, width, dtype=torch.float64)
    expected = _reference(model, x, call)
    with funcgrad.per_example(model):
        found = _got(model, x, call)
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-10)


def test_joined_is_a_view_only_for_adjacent_slices():
    """`_attention._joined`: a view where the parts are side by side in one tensor (the
    packed gradient's slices), a copy otherwise; equal to ``torch.cat`` either way."""
    base = torch.randn(6, 4, 3 * WIDTH, dtype=torch.float64).transpose(0, 1)
    parts = [base[..., i * WIDTH : (i + 1) * WIDTH] for i in range(3)]
    joined = _attention._joined(parts)
    assert joined.data_ptr() == base.data_ptr()
    torch.testing.assert_close(joined, torch.cat(parts, -1), rtol=0, atol=0)
    for others in (
        [parts[0], parts[2], parts[1]],  # out of order
        [p.clone() for p in parts],  # apart
        [base[..., :WIDTH], base[..., 1 : WIDTH + 1], base[..., 2 : WIDTH + 2]],  # overlapping
    ):
        joined = _attention._joined(others)
        assert joined.data_ptr() != base.data_ptr()
        torch.testing.assert_close(joined, torch.cat(others, -1), rtol=0, atol=0)


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """The shapes of the tensors that a clone copies (a ``reshape`` that cannot view),
    outside the backward (whose own ops, the model's, are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        in_backward = torch._C._current_graph_task_id() != -1
        if func.overloadpacket is torch.ops.aten.clone and not in_backward:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("call", ["backward", "weighted", "clip"])
def test_the_update_reads_attention_rows_in_their_memory_order(call):
    """The update ``Aᵀ (w ⊙ Δ)`` of the packed q/k/v layer (Δ a (T, B, 3·d) tensor) and of
    the out-projection (A a (T, B, d) tensor) reads them as rows in the order they have in
    memory: no copy of either (w scales the other one, written in that order); exact."""
    model = _encoder()
    x = _tokens(4, 6)
    expected = _reference(model, x, call)
    with funcgrad.per_example(model):
        CALLS["gramian"](model(x))  # the signature's first call (its independence check)
        losses = model(x)
        for p in model.parameters():
            p.grad = None
        with _Copies() as copies:
            CALLS[call](losses)
    found = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    rows = [(4, 6, 3 * WIDTH), (6, 4, 3 * WIDTH), (4, 6, WIDTH), (6, 4, WIDTH)]
    assert not [shape for shape in copies.shapes if shape in rows]


@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("call", ["gramian", "norms", "weighted"])
def test_packed_gradient_of_a_bare_self_attention(monkeypatch, bias, call, input_grad):
    """nn.MultiheadAttention called on (x, x, x) with ``need_weights=False``, with and
    without the in-projection's bias (the projection's output node is then the product's
    own view), and a causal mask: exact; the packed gradient is read where x needs a
    gradient (the backward passes the in-projection's output anyway), else not (its nodes
    would run for it alone: review29)."""
    counts = _count_packed(monkeypatch)

    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True, bias=bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
            out = self.attention(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)
            return torch.tanh(out[0]).pow(2).sum((1, 2))

    torch.manual_seed(5)
    model = Bare().double().eval()
    x = torch.randn(3, 5, WIDTH, dtype=torch.float64, requires_grad=input_grad)
    expected = _reference(model, x, call)
    with funcgrad.per_example(model):
        found = _got(model, x, call)
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    assert counts == ([1, 0] if input_grad else [0, 0])
