"""Session 7's cost changes of the per-example rules, each exact in float64 against a
per-example autograd loop and counted (never timed): a LayerNorm's x̂ from the mean and
1/std its forward saved (no second layer norm); with user hooks on the hooked layers, a
model that mixes the examples, and one ``per_example`` object reused across shapes, after a
failed call and with the graph retained."""

from __future__ import annotations

import pytest
import torch
from helpers import PER_EXAMPLE_CALLS, per_example_jacobian
from torch import nn

import funcgrad
from funcgrad._per_example import _rules


class Normed(nn.Module):
    """Linear -> LayerNorm (over the last ``dims`` dims, called ``calls`` times) -> Linear,
    on (B, T, d) rows; one loss per example."""

    def __init__(self, dims: int = 1, calls: int = 1) -> None:
        super().__init__()
        self.up = nn.Linear(6, 6)
        self.norm = nn.LayerNorm((4, 6)[-dims:])
        self.head = nn.Linear(6, 3)
        self.calls = calls
        with torch.no_grad():  # not the identity affine: the weight's gradient counts
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        for _ in range(self.calls):
            h = self.norm(h) * 1.5 + h
        return self.head(torch.tanh(h)).pow(2).sum((1, 2))


def _model(**kwargs) -> nn.Module:
    torch.manual_seed(0)
    return Normed(**kwargs).double()


def _x(batch: int = 5, length: int = 4) -> torch.Tensor:
    return torch.randn(batch, length, 6, dtype=torch.float64)


def _reference(model: nn.Module, x: torch.Tensor, call: str) -> torch.Tensor:
    """What ``call`` gives from the per-example loop: G, its diagonal's square roots, or
    the update (all-ones weights for backward; the clipped sum for clip)."""
    rows = per_example_jacobian(model, lambda m: m(x))
    if call == "gramian":
        return rows @ rows.T
    if call == "norms":
        return rows.norm(dim=1)
    if call == "backward":
        return rows.sum(0)
    factors = (1.0 / (rows.norm(dim=1) + 1e-6)).clamp(max=1.0)
    return factors @ rows


def _got(model: nn.Module, x: torch.Tensor, call: str) -> torch.Tensor:
    for p in model.parameters():
        p.grad = None
    found = PER_EXAMPLE_CALLS[call](model(x))
    if call in ("gramian", "norms"):
        return found
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _count_layer_norms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layer norms the rules compute again (`_rules.F.layer_norm`)."""
    count = [0]
    functional = _rules.F

    class Counting:
        def __getattr__(self, name: str):
            return getattr(functional, name)

        def layer_norm(self, *args, **kwargs):
            count[0] += 1
            return functional.layer_norm(*args, **kwargs)

    monkeypatch.setattr(_rules, "F", Counting())
    return count


@pytest.mark.parametrize("call", sorted(PER_EXAMPLE_CALLS))
@pytest.mark.parametrize("dims,calls", [(1, 1), (2, 1), (1, 2)])
def test_layer_norm_uses_the_forwards_statistics_exactly(monkeypatch, call, dims, calls):
    """x̂ from the saved mean and 1/std: no second layer norm, exact against the loop (one
    call, two normalized dims, two calls of one LayerNorm: one layer, each call its own
    statistics), on the checked first call and on a later one."""
    model = _model(dims=dims, calls=calls)
    x = _x()
    expected = _reference(model, x, call)
    count = _count_layer_norms(monkeypatch)
    with funcgrad.per_example(model):
        for _ in range(2):  # the first call of a signature is checked; the second is not
            torch.testing.assert_close(_got(model, x, call), expected, rtol=1e-10, atol=1e-12)
    assert count[0] == 0


def _tensor_hooked(out: torch.Tensor, fired: dict[str, int]) -> torch.Tensor:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        fired["tensor"] += 1
        return grad * 0.7

    out.register_hook(hook)
    return out


def test_layer_norm_hooks_are_honoured(monkeypatch):
    """A forward pre-hook that changes the LayerNorm's input (the statistics are those of
    the changed input), a forward hook that changes its output, a full backward hook that
    scales its output gradient and a tensor hook on its output: as in the loop with the same
    hooks, and each fires as often as in one backward."""
    model = _model()
    fired = {"backward": 0, "tensor": 0}

    def scale_grad(module, grad_output):
        fired["backward"] += 1
        return (grad_output[0] * 0.5,)

    norm = model.norm
    handles = [
        norm.register_forward_pre_hook(lambda m, args: (args[0] * 2 + 1,)),
        norm.register_forward_hook(lambda m, args, out: _tensor_hooked(out * 3, fired)),
        norm.register_full_backward_pre_hook(scale_grad),
    ]
    x = _x()
    expected = _reference(model, x, "gramian")
    count = _count_layer_norms(monkeypatch)
    fired["backward"] = fired["tensor"] = 0
    with funcgrad.per_example(model) as pe:
        for _ in range(2):
            got = pe.gramian(model(x))
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert count[0] == 0
    assert fired["backward"] == 2  # once per call (held back in the first call's check)
    # the tensor hook is on a tensor the forward hook made (not the module's own output):
    # once per call, and twice more in the first call's check, where another hook (the
    # backward pre-hook) was held back (docs/per_example.md, "What it cannot see")
    assert fired["tensor"] == 2 + 2
    for handle in handles:
        handle.remove()


def test_layer_norm_statistics_fall_back_where_the_node_is_not_the_forwards(monkeypatch):
    """Where the output's node is not the call's own ``native_layer_norm`` (here: every
    check failing, as for an autocast copy of the input), the layer norm is computed again:
    still exact."""
    model = _model()
    x = _x()
    expected = _reference(model, x, "gramian")
    monkeypatch.setattr(_rules, "_layer_norm_stats", lambda module, use, x: None)
    count = _count_layer_norms(monkeypatch)
    with funcgrad.per_example(model) as pe:
        torch.testing.assert_close(pe.gramian(model(x)), expected, rtol=1e-10, atol=1e-12)
    assert count[0] == 1


def test_layer_norm_statistics_are_read_before_the_backward_frees_them():
    """The statistics come from the node's saved tensors, which the one backward frees:
    with retain_graph=True then a call without, and with the graph freed by the user's own
    backward first (refused as spent, `.grad` untouched), never a stale read."""
    model = _model()
    x = _x()
    expected = _reference(model, x, "gramian")
    with funcgrad.per_example(model) as pe:
        losses = model(x)
        first = pe.gramian(losses, retain_graph=True)
        second = pe.gramian(losses)
        torch.testing.assert_close(first, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(second, expected, rtol=1e-10, atol=1e-12)
        losses = model(x)
        losses.sum().backward()  # frees the graph: the saved statistics with it
        before = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(RuntimeError):
            pe.backward(losses)
        for p, b in zip(model.parameters(), before):
            torch.testing.assert_close(p.grad, b, rtol=0, atol=0)


def test_layer_norm_in_a_model_that_mixes_examples_is_refused():
    """Mixing the examples after the LayerNorm (a batch mean) is refused as before."""

    class Mixing(Normed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.up(x))
            h = h - h.mean(0, keepdim=True)
            return self.head(torch.tanh(h)).pow(2).sum((1, 2))

    torch.manual_seed(0)
    model = Mixing().double()
    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match="mix"):
        pe.gramian(model(_x()))


def test_one_per_example_object_across_shapes_and_after_a_failure():
    """One hooked model: T = 4, then T = 7 and B = 3, a failed call (losses of the wrong
    shape), then T = 4 again; each exact."""
    model = _model()
    with funcgrad.per_example(model) as pe:
        for x in (_x(5, 4), _x(3, 7)):
            torch.testing.assert_close(
                pe.gramian(model(x)), _reference(model, x, "gramian"), rtol=1e-10, atol=1e-12
            )
        with pytest.raises(ValueError):
            pe.gramian(model(_x()).unsqueeze(1))
        x = _x(5, 4)
        torch.testing.assert_close(
            pe.gramian(model(x)), _reference(model, x, "gramian"), rtol=1e-10, atol=1e-12
        )


class TwoCalls(nn.Module):
    """One Linear with a bias called twice on (B, T, d) rows (one layer, two uses), then a
    head; the last rows of some examples read by no loss (padding). Not tiny (`_TINY`:
    its rows hold more than 2^13 elements), and its per-example gradients not kept (larger
    than half its rows), so its update is ``Aᵀ (w ⊙ Δ)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(64, 64)
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(torch.tanh(self.inner(x))))
        keep = torch.ones(x.shape[:2], dtype=x.dtype)
        keep[1, 2:] = 0  # example 1 reads its first two rows only
        return (self.head(h).pow(2).sum(-1) * keep).sum(1)


class _MatVecs(torch.utils._python_dispatch.TorchDispatchMode):
    """The contracted length of each matrix-vector product (``Δᵀ w``: B·T rows of Δ)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mv, torch.ops.aten.addmv):
            matrix = args[1] if func.overloadpacket is torch.ops.aten.addmv else args[0]
            self.rows.append(matrix.shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("call", ["backward", "clip"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_update_reads_the_bias_rows_that_g_formed(call, weighted):
    """Where G (or its diagonal) formed the (B, p) per-example bias gradients, the update's
    bias is ``rowsᵀ w`` from them (no second pass over Δ's B·T rows): exact against the
    loop, for a Linear called twice (its two calls' rows summed) with unread rows."""
    torch.manual_seed(3)
    model = TwoCalls().double()
    x = torch.randn(4, 10, 64, dtype=torch.float64)
    rows = per_example_jacobian(model, lambda m: m(x))
    weights = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
    if call == "clip":
        expected = (1.0 / (rows.norm(dim=1) + 1e-6)).clamp(max=1.0) @ rows
    else:
        expected = (weights if weighted else torch.ones(4, dtype=torch.float64)) @ rows
    with funcgrad.per_example(model) as pe:
        for _ in range(2):  # checked, then not
            for p in model.parameters():
                p.grad = None
            mode = _MatVecs()
            losses = model(x)
            with mode:
                if call == "clip":
                    funcgrad.per_example_clip(losses, 1.0)
                else:
                    pe.backward(losses, weighting=(lambda g: weights) if weighted else None)
            got = torch.cat([p.grad.flatten() for p in model.parameters()])
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
            if call == "clip" or weighted:  # G or its diagonal formed: the bias rows read
                assert max(mode.rows, default=0) < 4 * 10, mode.rows


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a call dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_ghost_norms_mask_unread_rows_in_place_and_exactly():
    """The ghost diagonal of a layer formed during the backward masks the kernel's unread
    rows and columns in place (no (B, T, T) mask: no ``bitwise_or``), and an inf in an
    unread row of its input adds nothing: the norms equal the loop's on the finite input."""

    class Padded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wide = nn.Linear(64, 96)  # ghost: T (d + p) = 1280 below d·p = 6144
            self.head = nn.Linear(96, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = torch.ones(x.shape[:2], dtype=torch.bool)
            keep[0, 5:] = False  # example 0 reads its first 5 rows only
            h = torch.where(keep.unsqueeze(-1), self.wide(x), 0.0)
            return self.head(torch.tanh(h)).pow(2).sum((1, 2))

    torch.manual_seed(5)
    model = Padded().double()
    x = torch.randn(6, 8, 64, dtype=torch.float64)
    expected = per_example_jacobian(model, lambda m: m(x)).norm(dim=1)
    poisoned = x.clone()
    poisoned[0, 6, 3] = float("inf")  # a row no loss reads
    with funcgrad.per_example(model):
        for _ in range(3):  # checked, then formed during the backward
            losses = model(poisoned)
            mode = _Ops()
            with mode:
                got = funcgrad.per_example_norms(losses)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
        assert "bitwise_or" not in mode.names


@pytest.mark.parametrize("how", ["hooks", "checkpoint"])
def test_layer_norm_statistics_are_not_read_through_saved_tensor_hooks(monkeypatch, how):
    """Where the forward ran under saved-tensor hooks (the user's, or non-reentrant
    checkpointing's), reading the node's saved statistics would run their unpack once more:
    they are not read (the layer norm computed again), the hook unpacks no more than in a
    plain backward, and G is exact."""

    class Checkpointed(Normed):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.up(x)
            h = torch.utils.checkpoint.checkpoint(
                lambda z: self.norm(z) * 1.5 + z, h, use_reentrant=False
            )
            return self.head(torch.tanh(h)).pow(2).sum((1, 2))

    torch.manual_seed(0)
    model = (Checkpointed() if how == "checkpoint" else Normed()).double()
    x = _x()
    expected = _reference(model, x, "gramian")
    counts = {"pack": 0, "unpack": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts["pack"] += 1
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        counts["unpack"] += 1
        return t

    def forward() -> torch.Tensor:
        if how == "checkpoint":
            return model(x)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return model(x)

    forward().sum().backward()  # the plain backward's count
    plain = counts["unpack"]
    count = _count_layer_norms(monkeypatch)
    with funcgrad.per_example(model) as pe:
        pe.gramian(forward())  # the checked call
        counts["unpack"] = 0
        torch.testing.assert_close(pe.gramian(forward()), expected, rtol=1e-10, atol=1e-12)
    assert count[0] == 2  # computed again, on each call
    if how == "hooks":  # no more than a plain backward's (which also unpacks what only
        assert counts["unpack"] <= plain  # the weight gradients read: funcgrad's does not)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_all_zero_rows_are_those_torch_finds_without_forming_abs(dtype):
    """`_all_zero` (the rows no loss reads) equals ``(d == 0).all(-1)`` with NaN, ±inf,
    -0.0 and subnormal entries, on strided views too, and forms no |Δ| (no ``abs`` op)."""
    from funcgrad._per_example._layer import _all_zero

    torch.manual_seed(2)
    d = torch.randn(40, 7, 5).to(dtype)
    d[:, 3:] = 0
    d[2, 1] = 0
    d[3, 3, 2] = float("nan")
    d[4, 4, 0] = float("-inf")
    d[5, 5] = -0.0
    d[6, 6, 1] = torch.finfo(dtype).smallest_normal / 4  # subnormal
    d[7, 3, 4] = -torch.finfo(dtype).smallest_normal / 4
    for view in (d, d.transpose(0, 1), d[:, :, ::2]):
        mode = _Ops()
        with mode:
            found = _all_zero(view)
        assert torch.equal(found, (view == 0).all(-1))
        assert "abs" not in mode.names
