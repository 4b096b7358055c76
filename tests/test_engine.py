"""The engine (``funcgrad._engine``): batched pulls through f's linearisation (one vmap,
chunks, a loop where vmap cannot batch, ``check``'s comparison with unbatched calls), and the
``Basis`` of directions already pulled back, against an independent computation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import HEADS, autograd_reference, one_input_function

import funcgrad
from funcgrad import _engine

# -- check: each batched pullback compared against unbatched calls ------------------------


POINTS = torch.randn(4, 3)


def cdist_f(x):
    return torch.cdist(x, POINTS)  # (5, 4): vmap over its backward is wrong in torch 2.13


CDIST_HEADS = [
    lambda y, i=i: (y * torch.linspace(-1, 1, 20).reshape(5, 4) ** i).sum() for i in range(6)
]


def _max_error(strategy, **kwargs):
    x = torch.randn(5, 3)
    _, grads = funcgrad.compose_heads(cdist_f, CDIST_HEADS, strategy=strategy, **kwargs)(x)
    _, reference = autograd_reference(cdist_f, CDIST_HEADS, (x,))
    return (grads - torch.stack(reference)).abs().max().item()


def test_the_cdist_bug_is_real_without_check():
    """If torch fixes its batching rule this test fails, and check becomes a safety net only."""
    assert _max_error("vjp") > 1e-3


@pytest.mark.parametrize("strategy", ["vjp", "jacrev"])
def test_check_catches_cdist_and_falls_back_to_the_loop(strategy):
    with pytest.warns(
        funcgrad.FuncgradWarning, match=r"check found that vmap computed f's pullback wrongly"
    ):
        error = _max_error(strategy, check=True)
    assert error < 1e-10


def test_check_strict_raises():
    with pytest.raises(
        funcgrad.BatchingMismatchError, match=r"vmap computed f's pullback wrongly.*strategy='loop'"
    ):
        _max_error("vjp", check="strict")


def test_check_from_set_check_and_environment(monkeypatch):
    funcgrad.set_check(True)
    with pytest.warns(funcgrad.FuncgradWarning, match="check found"):
        assert _max_error("vjp") < 1e-10
    funcgrad.set_check(None)
    monkeypatch.setenv("FUNCGRAD_CHECK", "strict")
    with pytest.raises(funcgrad.BatchingMismatchError):
        _max_error("vjp")


def test_pb_many_check_catches_cdist():
    x = torch.randn(5, 3)
    _, pb = funcgrad.pullback(cdist_f, x, reuse=False)
    cotangents = torch.randn(6, 5, 4)
    with pytest.warns(funcgrad.FuncgradWarning, match="check found"):
        (got,) = pb.many(cotangents, check=True)
    for i in range(6):
        torch.testing.assert_close(got[i], pb(cotangents[i])[0])


def test_check_is_skipped_inside_transforms():
    """check compares values, so it runs in eager mode only; vmap over x must still work."""
    w = torch.randn(4, 3)
    composed = funcgrad.compose_heads(
        lambda x: torch.tanh(w @ x), CDIST_HEADS[:1] * 3, strategy="vjp", check="strict"
    )
    xs = torch.randn(5, 3)
    _, grads = torch.func.vmap(composed)(xs)
    for i in range(5):
        torch.testing.assert_close(grads[i], composed(xs[i])[1])


def test_check_passes_silently_on_a_correct_batch():
    w = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        funcgrad.compose_heads(
            lambda x: torch.tanh(w @ x), CDIST_HEADS[:1] * 3, strategy="vjp", check=True
        )(torch.randn(3))


def test_checking_block_overrides_and_restores():
    with funcgrad.checking("strict"):
        with pytest.raises(funcgrad.BatchingMismatchError):
            _max_error("vjp")
        with funcgrad.checking(False):
            assert _max_error("vjp") > 1e-3  # the inner block turns check off
        with pytest.warns(funcgrad.FuncgradWarning, match="check found"):
            assert _max_error("vjp", check=True) < 1e-10  # the argument wins over the block
    assert _max_error("vjp") > 1e-3  # restored: off by default
    with (
        pytest.raises(ValueError, match=r"funcgrad.checking\(mode\).*'strict'"),
        funcgrad.checking("yes"),
    ):
        pass


def test_checking_is_per_thread():
    """Another thread does not see a block's mode (set_check would be process-wide)."""
    import threading

    seen = {}
    inside, release = threading.Event(), threading.Event()

    def worker():
        inside.wait()
        seen["error"] = _max_error("vjp")  # off: the main thread's block is not ours
        release.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with funcgrad.checking("strict"):
        inside.set()
        release.wait(timeout=60)
    thread.join()
    assert seen["error"] > 1e-3


# -- vmap cannot batch f's pullback: a loop of unbatched ones ---------------------------------


# Its backward leaves PyTorch: vmap cannot batch it.
NumpySin = one_input_function(
    lambda x: torch.from_numpy(np.sin(x.detach().numpy())),
    lambda x, grad: torch.from_numpy(grad.detach().numpy() * np.cos(x.detach().numpy())),
)


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev"])
def test_vmap_failure_falls_back_to_the_loop(strategy):
    f = lambda x: NumpySin.apply(x) * 2  # noqa: E731
    x = torch.randn(3)
    with pytest.warns(
        funcgrad.FuncgradWarning, match=r"vmap could not batch f's pullback .*fell back to a loop"
    ):
        _, grads = funcgrad.compose_heads(f, HEADS, strategy=strategy)(x)
    _, reference = autograd_reference(f, HEADS, (x,))
    torch.testing.assert_close(grads, torch.stack(reference))


def test_loop_strategy_needs_no_vmap():
    f = lambda x: NumpySin.apply(x) * 2  # noqa: E731
    x = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, grads = funcgrad.compose_heads(f, HEADS, strategy="loop")(x)
    torch.testing.assert_close(grads, torch.stack(autograd_reference(f, HEADS, (x,))[1]))


# -- Basis: orthonormal directions of y's space, kept with their pullbacks ---------------------


def _units(rows):
    return rows / rows.norm(dim=1, keepdim=True)


def _assert_orthonormal(q):
    torch.testing.assert_close(q @ q.T, torch.eye(q.shape[0], dtype=q.dtype))


def _assert_spans(q, rows):
    """Every row is its own projection onto the rows of q."""
    torch.testing.assert_close((rows @ q.T) @ q, rows, rtol=0, atol=1e-12)


def test_basis_new_directions_are_orthonormal_and_span_the_rows_at_their_rank():
    basis = _engine.Basis(6)
    r0, r1 = torch.randn(2, 6)
    units = _units(torch.stack([r0, r1, 2 * r0 - 3 * r1]))  # rank 2
    new = basis.new_directions(units)
    assert new.shape == (2, 6) == (torch.linalg.matrix_rank(units), 6)
    _assert_orthonormal(new)
    _assert_spans(new, units)
    assert basis.rank == 0  # new_directions keeps nothing; add does
    images = (torch.randn(2, 3),)
    basis.add(new, images)
    assert basis.rank == 2 and basis.images[0] is images[0]
    assert basis.new_directions(units[1:]) is None  # nothing outside the span
    assert basis.new_directions(torch.zeros(2, 6)) is None  # zero rows are never new


def test_basis_adds_only_what_is_outside_its_span_and_at_most_m_directions():
    basis = _engine.Basis(5)
    first = _units(torch.randn(2, 5))
    basis.add(basis.new_directions(first), (torch.randn(2, 4),))
    later = _units(torch.cat([first[:1], torch.randn(1, 5)]))  # one kept row, one new
    new = basis.new_directions(later)
    assert new.shape == (1, 5)
    torch.testing.assert_close(basis.q @ new.T, torch.zeros(2, 1), rtol=0, atol=1e-12)
    basis.add(new, (torch.randn(1, 4),))
    assert basis.rank == 3 and basis.images[0].shape == (3, 4)
    _assert_orthonormal(basis.q)
    _assert_spans(basis.q, torch.cat([first, later]))
    many = _units(torch.randn(4, 5))  # 4 new rows, room for m - r = 2
    new = basis.new_directions(many)
    assert new.shape == (2, 5)
    basis.add(new, (torch.randn(2, 4),))
    _assert_orthonormal(basis.q)
    _assert_spans(basis.q, many)  # the whole space
    assert basis.new_directions(many) is None  # full rank: nothing is new


@pytest.mark.parametrize("k", [4, 7])
def test_a_fresh_basis_facing_k_at_least_m_rows_takes_the_unit_basis(k):
    units = _units(torch.randn(k, 4))
    torch.testing.assert_close(_engine.Basis(4).new_directions(units), torch.eye(4))
    assert _engine.Basis(4).new_directions(units[:3]).shape == (3, 4)


def test_basis_fits_a_budget_of_bytes_and_clears():
    x_like = (torch.empty(3), torch.empty(2, dtype=torch.float32))
    per_row = 4 * 8 + 3 * 8 + 2 * 4  # a direction of y (m = 4) and its image
    basis = _engine.Basis(4, max_bytes=2 * per_row)
    assert basis.nbytes == 0
    out_like = (torch.empty(4),)  # y: m = 4, float64
    assert basis.fits(2, out_like, x_like) and not basis.fits(3, out_like, x_like)
    basis.add(torch.eye(4)[:1], (torch.empty(1, 3), torch.empty(1, 2, dtype=torch.float32)))
    assert basis.nbytes == per_row
    assert basis.fits(1, out_like, x_like) and not basis.fits(2, out_like, x_like)
    basis.clear(enabled=False)
    assert (basis.rank, basis.nbytes, basis.images, basis.enabled) == (0, 0, (), False)
    basis.clear()
    assert basis.enabled


def test_vmaps_slow_path_warning_is_ignored_inside_funcgrad_and_the_filters_are_as_before():
    """An op without a batching rule (pdist) warns "There is a performance drop" under vmap:
    funcgrad's own vmap ignores it, even where warnings are errors, and leaves the filters
    as they were, so the same op in the user's own vmap still warns (and raises here)."""
    xs = torch.randn(3, 4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = list(warnings.filters)
        (got,) = _engine._vmap(lambda x: (torch.nn.functional.pdist(x),), [xs], None, "error")
        assert list(warnings.filters) == before
        torch.testing.assert_close(got, torch.stack([torch.nn.functional.pdist(x) for x in xs]))
        with pytest.raises(UserWarning, match="There is a performance drop"):
            torch.func.vmap(torch.nn.functional.pdist)(xs)
