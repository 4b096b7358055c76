"""Session 6's cost changes of the per-example rules, each exact in float64 against a
per-example autograd loop and counted (never timed): a materialised Linear's per-example
gradients formed in few, large blocks of output features; the Embedding's pairs of rows
gathered by ``index_select`` in blocks of any size; with user hooks on the hooked layers,
a model that mixes the examples, and one ``per_example`` object reused across shapes and
after a failed call."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import per_example_jacobian
from torch import nn

import funcgrad
from funcgrad._per_example import _rules


class Wide(nn.Module):
    """One Linear on (B, T, d) rows wide enough that its (B, p, d) per-example gradients
    hold 2^18-2^20 elements (the materialised rule: B·T·d·p + B²·d·p below the ghost
    products), then a small head."""

    def __init__(self, width: int = 64, out: int = 384) -> None:
        super().__init__()
        self.wide = nn.Linear(width, out)
        self.head = nn.Linear(out, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wide(x))).pow(2).sum((1, 2))


def _count_bmm(monkeypatch: pytest.MonkeyPatch, rows: int = 384) -> list[int]:
    """The number of ``torch.bmm`` calls whose first operand has ``rows`` rows (a block of
    the wide layer's per-example gradients: Δ_bᵀ (its output features) times A_b)."""
    count = [0]
    bmm = torch.bmm

    def counted(*args: torch.Tensor) -> torch.Tensor:
        count[0] += args[0].shape[1] <= rows and args[0].shape[1] > 2
        return bmm(*args)

    monkeypatch.setattr(torch, "bmm", counted)
    return count


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return per_example_jacobian(model, lambda m: m(x))


@pytest.mark.parametrize("call", ["gramian", "backward"])
def test_a_wide_linear_forms_its_per_example_gradients_in_one_product(call, monkeypatch):
    """(16, 384, 64) per-example gradients (393k elements, under `_WHOLE`): one bmm for
    the layer, where blocks of a quarter of its rows' size took 14 (28 output features
    each); exact."""
    torch.manual_seed(0)
    model = Wide().double()
    x = torch.randn(16, 16, 64, dtype=torch.float64)
    jac = _reference(model, x)
    with funcgrad.per_example(model) as pe:
        for _ in range(2):  # the first call (with its check) and a later one
            for p in model.parameters():
                p.grad = None
            losses = model(x)
            count = _count_bmm(monkeypatch)
            if call == "gramian":
                got, want = pe.gramian(losses), jac @ jac.T
            else:
                weights = pe.backward(losses, weighting=lambda g: g.diagonal().rsqrt())
                got = torch.cat([p.grad.flatten() for p in model.parameters()])
                want = weights @ jac
            monkeypatch.undo()
            assert "wide  Linear  (16, 16, 64)  materialised" in str(pe.plan)
            assert count[0] == 1  # the wide layer's one product
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("whole", [1, 5000, 1 << 30])
def test_the_materialised_blocks_of_output_features_are_exact_at_any_size(whole, monkeypatch):
    """The blocks' size follows `_WHOLE` (a floor on the elements of a block): one feature
    a block up to the whole layer, the same G, norms and update."""
    monkeypatch.setattr(_rules, "_WHOLE", whole)
    torch.manual_seed(1)
    model = Wide(width=8, out=24).double()
    x = torch.randn(5, 12, 8, dtype=torch.float64)
    jac = _reference(model, x)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(model(x))
        assert "wide  Linear  (5, 12, 8)  materialised" in str(pe.plan)
        weights = pe.backward(model(x), weighting=lambda g: g.diagonal().rsqrt())
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, weights @ jac, rtol=1e-10, atol=1e-12)


def test_user_hooks_on_the_wide_layer_fire_once_and_act(monkeypatch):
    """A forward hook that scales the wide layer's output, a tensor hook on its output
    gradient and a post-accumulate-grad hook on its weight: honoured as in one backward,
    once per call; the result is the scaled model's, exact."""
    torch.manual_seed(2)
    model = Wide().double()
    x = torch.randn(16, 16, 64, dtype=torch.float64)
    fired = {"grad": 0, "post": 0}

    def scale(module, args, out):
        out = out * 0.5
        out.register_hook(lambda g: fired.__setitem__("grad", fired["grad"] + 1))
        return out

    model.wide.register_forward_hook(scale)
    model.wide.weight.register_post_accumulate_grad_hook(
        lambda p: fired.__setitem__("post", fired["post"] + 1)
    )
    jac = _reference(model, x)
    fired.update(grad=0, post=0)
    with funcgrad.per_example(model) as pe:
        gram = pe.gramian(model(x))
        assert fired == {"grad": 2, "post": 0}  # the call and its first-call check
        pe.backward(model(x), weighting=lambda g: torch.ones(g.shape[0], dtype=g.dtype))
        assert fired == {"grad": 3, "post": 1}
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        torch.cat([p.grad.flatten() for p in model.parameters()]), jac.sum(0), rtol=1e-10, atol=0
    )


def test_a_wide_model_that_mixes_examples_is_refused_before_grad_is_written():
    """The wide layer's output centred over the batch: refused naming the module, .grad
    untouched."""

    class Mixing(Wide):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.wide(x))
            return self.head(h - h.mean(0)).pow(2).sum((1, 2))

    model = Mixing().double()
    x = torch.randn(16, 16, 64, dtype=torch.float64)
    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match="wide"):
        pe.backward(model(x), weighting=lambda g: torch.ones(g.shape[0], dtype=g.dtype))
    assert all(p.grad is None for p in model.parameters())


def test_one_object_reused_across_shapes_and_after_a_failed_call():
    """B and T change between calls, one call fails (a weighting of the wrong shape), the
    next ones are exact; returned tensors mutated in place change nothing later."""
    torch.manual_seed(3)
    model = Wide(width=8, out=24).double()
    with funcgrad.per_example(model) as pe:
        for batch, rows in [(5, 12), (3, 7), (6, 12)]:
            x = torch.randn(batch, rows, 8, dtype=torch.float64)
            jac = _reference(model, x)
            with pytest.raises(ValueError, match="per example"):
                pe.backward(model(x), weighting=lambda g: torch.ones(g.shape[0] + 1))
            gram = pe.gramian(model(x))
            torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
            gram.fill_(float("nan"))
            norms = funcgrad.per_example_norms(model(x))
            torch.testing.assert_close(norms, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
            norms.fill_(float("nan"))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("call", ["gramian", "backward"])
def test_the_embedding_pairs_are_gathered_by_index_select(call, monkeypatch):
    """The Embedding's pair rows gathered by ``index_select`` (advanced indexing is several
    times slower on the CPU), accumulated with ``index_add_``, exact; a frequent index and
    the padding index in the batch."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Embedding(30, 6, padding_idx=0), nn.Tanh(), nn.Linear(6, 2))
    model = model.double()
    tokens = torch.randint(0, 30, (9, 11))
    tokens[:, 2] = 7
    tokens[3:, 8:] = 0
    jac = per_example_jacobian(model, lambda m: m(tokens).pow(2).sum((1, 2)))
    with funcgrad.per_example(model) as pe:
        pe.gramian(model(tokens).pow(2).sum((1, 2)))  # the first call's check, uncounted
        losses = model(tokens).pow(2).sum((1, 2))
        index = [0]
        getitem = torch.Tensor.__getitem__

        def counted(self, key):
            if isinstance(key, torch.Tensor) and key.dtype == torch.long:
                index[0] += 1
            return getitem(self, key)

        monkeypatch.setattr(torch.Tensor, "__getitem__", counted)
        if call == "gramian":
            got, want = pe.gramian(losses), jac @ jac.T
        else:
            pe.backward(losses, weighting=lambda g: torch.ones(g.shape[0], dtype=g.dtype))
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            want = jac.sum(0)
        monkeypatch.undo()
    assert "pairs of rows with one index" in str(pe.plan)
    assert index[0] == 0  # no advanced indexing by a long tensor
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_bench_linear_transformer_agrees_with_opacus_and_vmap():
    """The bench's Opacus-supported transformer (Embedding, Linear attention, LayerNorm,
    Linear feed-forward; quick size): funcgrad's clipped sum, Opacus's ghost clipping and
    torch.func's vmap(grad) clipping write the same update; Opacus's norms agree with
    funcgrad's."""
    pytest.importorskip("torchjd")
    pytest.importorskip("opacus")
    from funcgrad.bench import _per_example

    case = _per_example.per_example_case(8, True, "linear-transformer")
    assert "opacus ghost clip" in case.methods and "opacus ghost norms" in case.methods
    ours = case.methods["funcgrad clip (DP-SGD)"]()
    for other in ("opacus ghost clip", "vmap(grad) clip"):
        theirs = case.methods[other]()
        for name, grad in ours.items():
            torch.testing.assert_close(theirs[name], grad, rtol=1e-4, atol=1e-6, msg=other)
    model, (tokens, targets) = _per_example._model("linear-transformer", 8, True)
    copied = copy.deepcopy(model).train()
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    criterion = nn.CrossEntropyLoss(reduction="none")
    with warnings.catch_warnings():  # torch's full-backward-hook note on Opacus's Embedding
        warnings.simplefilter("ignore")
        module = GradSampleModuleFastGradientClipping(
            copied, max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="sum"
        )
        criterion(module(tokens), targets).sum().backward()
    with funcgrad.per_example(model):
        norms = funcgrad.per_example_norms(criterion(model(tokens), targets))
    torch.testing.assert_close(module.get_norm_sample(), norms, rtol=1e-4, atol=1e-6)
