"""funcgrad.DualConeProjector against TorchJD's QuadprogProjector (quadprog, float64), the
KKT conditions of the dual-cone QP directly, host reads counted, and UPGrad / DualProj end to
end with the projector passed to TorchJD's own weightings."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcgrad
from funcgrad._projector import (
    EXACT_MAX,
    POLISH_MAX,
    _admm,
    _polish,
    default_admm_budget,
    default_budget,
    default_tol,
    regularized,
    solve,
)

# --------------------------------------------------------------------------------------------
# Gramians


def _orthonormal(m: int, gen: torch.Generator, against: torch.Tensor | None = None) -> torch.Tensor:
    """A random orthonormal basis of the complement of ``against``'s columns (m x (m - k))."""
    q = torch.zeros(m, 0) if against is None else against
    a = torch.randn(m, m - q.shape[1], generator=gen)
    a = a - q @ (q.T @ a)
    return torch.linalg.qr(a).Q


def _spectrum(rank: int, gen: torch.Generator) -> torch.Tensor:
    return torch.diag(torch.randn(rank, generator=gen).abs())


def torchjd_matrices() -> list[tuple[str, torch.Tensor]]:
    """The kinds of matrices of TorchJD's aggregation tests (tests/unit/aggregation/_inputs.py):
    a given rank, strongly stationary (some v > 0 with v^T A = 0), weakly but not strongly
    stationary, not weakly stationary, zero, and the first kind scaled by 0 .. 1e15."""
    gen = torch.Generator().manual_seed(0)
    out: list[tuple[str, torch.Tensor]] = []
    for m, n, rank in [(1, 1, 1), (4, 3, 1), (4, 3, 2), (4, 3, 3), (9, 11, 5), (9, 11, 9)]:
        a = _orthonormal(m, gen)[:, :rank] @ _spectrum(rank, gen) @ _orthonormal(n, gen)[:rank]
        out.append((f"rank{m}x{n}r{rank}", a))
        for scale in [0.0, 1e-10, 1e3, 1e5, 1e10, 1e15]:
            out.append((f"rank{m}x{n}r{rank}*{scale:g}", scale * a))
    for m, n in [(1, 1), (4, 3), (9, 11)]:
        out.append((f"zero{m}x{n}", torch.zeros(m, n)))
    for m, n, rank in [(5, 3, 3), (9, 11, 6), (7, 13, 2)]:
        v = torch.randn(m, generator=gen).abs()
        basis = _orthonormal(m, gen, (v / v.norm())[:, None])  # orthogonal to v > 0
        a = basis[:, :rank] @ _spectrum(rank, gen) @ _orthonormal(n, gen)[:rank]
        out.append((f"strong{m}x{n}r{rank}", a))
        split = int(torch.randint(1, m, (1,), generator=gen))
        perm = torch.randperm(m, generator=gen)
        w1, w2 = torch.zeros(m), torch.zeros(m)
        w1[perm[:split]], w2[perm[split:]] = v[perm[:split]], v[perm[split:]]
        pair = torch.stack([w1 / w1.norm(), w2 / w2.norm()], 1)
        basis = torch.cat([pair, _orthonormal(m, gen, pair)], 1)
        a = basis[:, 1 : rank + 1] @ _spectrum(rank, gen) @ _orthonormal(n, gen)[:rank]
        out.append((f"weak{m}x{n}r{rank}", a))
        u1 = (v / v.norm())[:, None]
        basis = torch.cat([u1, _orthonormal(m, gen, u1)], 1)
        a = basis[:, :rank] @ _spectrum(rank, gen) @ _orthonormal(n, gen)[:rank]
        out.append((f"nonweak{m}x{n}r{rank}", a))
    return out


def random_gramian(i: int, m: int) -> torch.Tensor:
    """The i-th random Gramian of size m, in six kinds: Gaussian, random rank, aligned tasks,
    duplicate tasks, zero tasks, tasks scaled by 1e-8 .. 1e8."""
    gen = torch.Generator().manual_seed(7919 * m + i)
    n = int(torch.randint(1, 3 * m + 2, (1,), generator=gen))
    kind = i % 6
    J = torch.randn(m, n, generator=gen)
    if kind == 1:
        r = int(torch.randint(1, m + 1, (1,), generator=gen))
        J = torch.randn(m, r, generator=gen) @ torch.randn(r, n, generator=gen)
    elif kind == 2:
        J = torch.randn(1, n, generator=gen) + 0.7 * J
    elif kind == 3:
        J = J[torch.randint(max(1, m // 3), (m,), generator=gen)]
    elif kind == 4:
        J = J * (torch.rand(m, 1, generator=gen) > 0.3)
    elif kind == 5:
        J = J * 10 ** (16 * torch.rand(m, 1, generator=gen) - 8)
    return J @ J.T


def _sizes(count: int, high: int, seed: int) -> list[int]:
    """``count`` sizes from 2 to ``high``, log-uniform, the extremes included."""
    gen = torch.Generator().manual_seed(seed)
    logs = torch.rand(count - 2, generator=gen) * math.log(high / 2) + math.log(2)
    return [2, high, *[round(math.exp(x)) for x in logs.tolist()]]


def _rows(m: int, seed: int) -> torch.Tensor:
    """UPGrad's rows (the diagonal of its preference weights) and rows of both signs."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.eye(m) / m, torch.randn(3, m, generator=gen)])


# --------------------------------------------------------------------------------------------
# References


def _quadprog(U: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    pytest.importorskip("quadprog")
    linalg = pytest.importorskip("torchjd.linalg")
    return linalg.QuadprogProjector()(U, G)


def _optimal_rows_on_rank_two(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """20 rows already optimal (v = u: each its own answer) on a rank-2 Gramian of size m,
    float64: multipliers within rounding of 0 at the optimum."""
    g = torch.Generator().manual_seed(m)
    J = torch.randn(m, 2, generator=g, dtype=torch.float64) @ torch.randn(
        2, 40, generator=g, dtype=torch.float64
    )
    G = J @ J.T
    rows = torch.randn(20, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return _quadprog(rows, G), G


def _relative(W: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().amax().clamp_min(1e-300)
    return float((W - reference).abs().amax() / scale)


def _kkt(
    W: torch.Tensor, U: torch.Tensor, G: torch.Tensor, reg_eps: float = 1e-4
) -> tuple[float, float, float]:
    """(dual feasibility, primal feasibility, complementarity) violations of W for
    ``min v^T G v s.t. v >= u`` (G regularised), relative to the rows' scale."""
    Gr = regularized(G, 1e-4, reg_eps)
    scale = float(W.abs().amax() + U.abs().amax())
    grad = W @ Gr
    gscale = float(Gr.abs().amax()) * scale
    return (
        float((U - W).clamp_min(0).amax()) / scale,
        float((-grad).clamp_min(0).amax()) / gscale,
        float(((W - U) * grad).abs().sum(1).amax()) / (scale * gscale),
    )


# --------------------------------------------------------------------------------------------
# Against quadprog, float64


@pytest.mark.parametrize(("name", "matrix"), torchjd_matrices(), ids=lambda x: x)
def test_torchjd_test_matrices(name: str, matrix: torch.Tensor) -> None:
    G = matrix @ matrix.T
    U = _rows(G.shape[0], seed=1)
    W = funcgrad.DualConeProjector()(U, G)
    assert _relative(W, _quadprog(U, G)) <= 1e-8, name


@pytest.mark.parametrize("m", _sizes(60, 32, seed=0))
def test_random_gramians_fast(m: int) -> None:
    i = m * 13 % 600  # every kind appears (i % 6)
    G = random_gramian(i, m)
    U = _rows(m, seed=i)
    W = funcgrad.DualConeProjector()(U, G)
    assert _relative(W, _quadprog(U, G)) <= 1e-8, (m, i % 6)


# --------------------------------------------------------------------------------------------
# Few tasks (m <= EXACT_MAX): every face at once, exact, no iteration


@pytest.mark.parametrize("m", range(2, EXACT_MAX + 1))
@pytest.mark.parametrize("kind", range(6))
def test_few_tasks_exact_without_any_iteration(m: int, kind: int) -> None:
    """Every kind of random Gramian, UPGrad's rows and rows of both signs: exact against
    quadprog in float64 with no ADMM and no MPRGP iteration at all (before the enumeration,
    a zero budget left the start ``max(u, 0)``: unconverged rows)."""
    i = 6 * m + kind
    G = random_gramian(i, m).double()
    U = _rows(m, seed=i).double()
    W, converged = solve(regularized(G, 1e-4, 1e-4), U, max_iter=0, admm_iter=0)
    assert bool(converged.all())
    assert _relative(W, _quadprog(U, G)) <= 1e-10, (m, kind)


@pytest.mark.parametrize("m", range(2, EXACT_MAX + 1))
@pytest.mark.parametrize("kind", range(6))
def test_few_tasks_float32_within_conditioning(m: int, kind: int) -> None:
    i = 6 * m + kind
    G = random_gramian(i, m).double()
    U = _rows(m, seed=i).double()
    Gr = regularized(G, 1e-4, 1e-4)
    eigenvalues = torch.linalg.eigvalsh(Gr)
    cond = float(eigenvalues[-1] / eigenvalues[0])
    W = funcgrad.DualConeProjector()(U.float(), G.float())
    assert _relative(W.double(), _quadprog(U, G)) <= 100 * 2**-23 * cond, (m, kind)


def test_few_tasks_many_rows_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many rows: the (2^m, rows, m) intermediate is bounded, the rows solved in chunks (a
    chunk of 3 rows here), with the same answer."""
    m = EXACT_MAX
    G = random_gramian(5, m).double()
    U = torch.randn(7, m, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    monkeypatch.setattr(funcgrad._projector, "_EXACT_CHUNK", 3 * 2**m * m)
    W = funcgrad.DualConeProjector()(U, G)
    assert _relative(W, _quadprog(U, G)) <= 1e-10


class _OpCount(TorchDispatchMode):
    """Counts aten calls: the fixed cost of a solve on few tasks is the number of ops."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("m", [2, 4, EXACT_MAX])
def test_few_tasks_cost_about_a_hundred_ops(m: int) -> None:
    """The ADMM and MPRGP budgets ran about 3,000 tensor ops whatever m (12.8 ms at m = 8,
    against quadprog's 0.25 ms); the enumeration runs about a hundred, the whole call
    included."""
    G = random_gramian(3, m)
    project = funcgrad.DualConeProjector(check=False)
    with _OpCount() as ops:
        project(torch.eye(m) / m, G)
    assert ops.count <= 150, ops.count  # 95 at m = 4, views included; 5,000+ before


@pytest.mark.slow
def test_500_random_gramians() -> None:
    """500 random Gramians, m from 2 to 128 (quadprog takes seconds per Gramian beyond)."""
    worst = 0.0
    for i, m in enumerate(_sizes(500, 128, seed=1)):
        G = random_gramian(i, m)
        U = torch.eye(m) / m
        worst = max(worst, _relative(funcgrad.DualConeProjector()(U, G), _quadprog(U, G)))
    assert worst <= 1e-8


@pytest.mark.slow
@pytest.mark.parametrize("m", [256, 512])
def test_large_gramians_kkt(m: int) -> None:
    """Beyond quadprog's reach (minutes): the KKT conditions, which certify the optimum."""
    for i in (0, 1):  # Gaussian, random rank
        G = random_gramian(i, m)
        U = torch.eye(m) / m
        W = funcgrad.DualConeProjector()(U, G)
        assert max(_kkt(W, U, G)) <= 1e-10


# --------------------------------------------------------------------------------------------
# The review's families (review 4): low-rank J with task scales spread by 1e2-1e3, rank 1 plus
# noise, clusters of aligned tasks. A Jacobi scaling of the problem left NaN rows on them with
# the default settings (14/14 at m = 32); the scalar scale converges on all.


def spread_low_rank(m: int, rank: int, spread: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    J = torch.randn(m, rank, generator=gen, dtype=torch.float64)
    J = J @ torch.randn(rank, 40, generator=gen, dtype=torch.float64)
    return J * 10 ** (-spread * torch.rand(m, 1, generator=gen, dtype=torch.float64))


def rank_one_noise(m: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    J = torch.randn(m, 1, generator=gen, dtype=torch.float64)
    J = J @ torch.randn(1, 64, generator=gen, dtype=torch.float64)
    return J + 1e-5 * torch.randn(m, 64, generator=gen, dtype=torch.float64)


def clusters(m: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(m, 50, generator=gen, dtype=torch.float64)
    centres = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    which = torch.randint(3, (m,), generator=gen)
    return centres[which] * torch.rand(m, 1, generator=gen, dtype=torch.float64) + 0.01 * noise


def _review_jacobians() -> list[Any]:
    """The families at m = 16, 32 (fast tier) and 64 (slow tier: quadprog takes seconds),
    three seeds each, and the review's own three repros."""
    out: list[Any] = []
    for m in (16, 32, 64):
        for seed in range(3):
            for rank, spread in ((1, 2.0), (2, 2.0), (1, 3.0), (3, 3.0)):
                out.append(
                    (
                        f"spread1e{spread:g}-r{rank}-m{m}-s{seed}",
                        spread_low_rank(m, rank, spread, seed),
                    )
                )
            out.append((f"rank1noise-m{m}-s{seed}", rank_one_noise(m, seed)))
            out.append((f"clusters-m{m}-s{seed}", clusters(m, seed)))
    # the review's own repros, with the global generator
    torch.manual_seed(0)
    J = torch.randn(32, 2, dtype=torch.float64) @ torch.randn(2, 40, dtype=torch.float64)
    out.append(("review-S1", J * 10 ** (-2 * torch.rand(32, 1, dtype=torch.float64))))
    torch.manual_seed(8)
    J = torch.randn(32, 1, dtype=torch.float64) @ torch.randn(1, 64, dtype=torch.float64)
    out.append(("review-R1", J + 1e-5 * torch.randn(32, 64, dtype=torch.float64)))
    gen = torch.Generator().manual_seed(64014)
    n = int(torch.randint(1, 194, (1,), generator=gen))
    J = torch.randn(64, n, generator=gen, dtype=torch.float64)
    c = torch.randn(3, n, generator=gen, dtype=torch.float64)
    which = torch.randint(3, (64,), generator=gen)
    J = c[which] * torch.rand(64, 1, generator=gen, dtype=torch.float64) + 0.01 * J
    out.append(("review-R2", J))
    slow = pytest.mark.slow
    return [pytest.param(*case, marks=slow) if "-m64-" in case[0] else case for case in out]


@pytest.mark.parametrize(
    ("name", "J"), _review_jacobians(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_review_families_default_settings(name: str, J: torch.Tensor) -> None:
    G = J @ J.T
    U = _rows(G.shape[0], seed=3)
    W = funcgrad.DualConeProjector(check=False)(U, G)
    assert bool(torch.isfinite(W).all()), name
    assert _relative(W, _quadprog(U, G)) <= 1e-8, name
    dual, primal, slack = _kkt(W, U, G)
    assert dual == 0.0
    assert primal <= 1e-12
    assert slack <= 1e-12


def test_upgrad_on_a_review_family_is_finite() -> None:
    """TorchJD's UPGrad with this projector gave an all-NaN update on the review's case."""
    tjd = _tjd()
    J = spread_low_rank(32, 2, 2.0, seed=0)
    fast = tjd.UPGrad(projector=funcgrad.DualConeProjector(check=False))(J)
    assert _relative(fast, tjd.UPGrad()(J)) <= 1e-8


# --------------------------------------------------------------------------------------------
# Review 5's families, float32 with the default budgets: aligned tasks (one direction plus
# noise) with rows of both signs, and clusters at m = 256 and 512. The float32 budget cut of
# session 5 (160 ADMM + 32 MPRGP iterations) left NaN rows on the first (13 of 90), session
# 4's budget (144 ADMM at m = 512 + 64 MPRGP) on the second (17 of 42 at m = 512).


def aligned(m: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, G) in float32: J is one direction plus noise, U 16 rows of both signs."""
    gen = torch.Generator().manual_seed(seed)
    J = torch.randn(1, 20, generator=gen, dtype=torch.float64)
    J = J + noise * torch.randn(m, 20, generator=gen, dtype=torch.float64)
    gen = torch.Generator().manual_seed(100 + seed)
    U = torch.randn(16, m, generator=gen, dtype=torch.float32)  # drawn in float32
    return U, (J @ J.T).float()


def centred_clusters(m: int, k: int, noise: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(k, 20, generator=gen, dtype=torch.float64)
    which = torch.randint(0, k, (m,), generator=gen)
    return centres[which] + noise * torch.randn(m, 20, generator=gen, dtype=torch.float64)


def _assert_float32_kkt(
    W: torch.Tensor, U: torch.Tensor, G: torch.Tensor, name: str, slack_max: float = 1e-5
) -> None:
    assert bool(torch.isfinite(W).all()), (name, W.isnan().any(1).nonzero().flatten().tolist())
    dual, primal, slack = _kkt(W.double(), U.double(), G.double())
    assert dual == 0.0, name
    assert primal <= 1e-5, name
    assert slack <= slack_max, name


@pytest.mark.parametrize(("m", "noise", "seed"), [(64, 1e-3, 3), (96, 1e-2, 5), (256, 1e-2, 1)])
def test_float32_aligned_tasks_rows_of_both_signs(m: int, noise: float, seed: int) -> None:
    """The review's repros: NaN rows (row 4, row 9) with the cut budget; row 15 at m = 256
    also with session 4's budget (160 ADMM + 64 MPRGP iterations there)."""
    U, G = aligned(m, noise, seed)
    W = funcgrad.DualConeProjector(check=False)(U, G)
    _assert_float32_kkt(W, U, G, f"m={m}")


@pytest.mark.slow
def test_float32_aligned_tasks_family() -> None:
    """The review's whole family (hunt4.py): 90 Gramians, m = 64..256, noise 1e-2..1e-4."""
    for m in (64, 96, 128, 200, 256):
        for noise in (1e-2, 1e-3, 1e-4):
            for seed in range(6):
                U, G = aligned(m, noise, seed)
                W = funcgrad.DualConeProjector(check=False)(U, G)
                # the slack sums m products: 1.6e-5 at m = 256 (noise 1e-3, seed 5)
                _assert_float32_kkt(W, U, G, f"m={m} noise={noise} seed={seed}", 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("m", [256, 512])
def test_float32_clusters_at_large_m(m: int) -> None:
    """Clusters at m = 256 and 512, with UPGrad's rows: the tests' `clusters` on seeds 0-9
    (testclusters.py) and centres plus noise (hunt5.py), the cases that failed with a budget
    and more; every row converges."""
    cases = [(f"clusters-s{seed}", clusters(m, seed)) for seed in range(10)]
    for noise, k, seed in ((0.03, 3, 1), (0.03, 4, 3), (0.03, 6, 1), (0.01, 3, 2), (0.01, 4, 1)):
        cases.append((f"centred-{noise}-{k}-s{seed}", centred_clusters(m, k, noise, seed)))
    for name, J in cases:
        G = (J @ J.T).float()
        gen = torch.Generator().manual_seed(3)  # `_rows`, drawn in float32 as the review's
        U = torch.cat([torch.eye(m) / m, torch.randn(3, m, generator=gen, dtype=G.dtype)])
        U = U.float()
        W = funcgrad.DualConeProjector(check=False)(U, G)
        _assert_float32_kkt(W, U, G, name)


def test_float32_active_set_rounds_finish_a_short_admm() -> None:
    """float32 above POLISH_MAX: 64 ADMM iterations, then `_active_set`'s rounds (face
    solves by conjugate gradients) instead of 256 ADMM and 64 MPRGP iterations. On aligned
    tasks with rows of both signs (the review's repro at m = 64), the short ADMM alone
    leaves rows unconverged (9 of 16), the rounds finish them, and the default gives quadprog's
    answer within float32's conditioning, with no MPRGP iteration and no host read."""
    U, G = aligned(64, 1e-3, 3)
    Gr = regularized(G.double(), 1e-4, 1e-4).float()
    _, converged = solve(Gr, U, max_iter=0, admm_iter=64)
    assert not bool(converged.all())
    _, converged = solve(Gr, U, max_iter=0, admm_iter=64, rounds=11)
    assert bool(converged.all())
    assert funcgrad.DualConeProjector()._budgets(64, torch.float32) == (0, 64, 11)
    assert funcgrad.DualConeProjector()._budgets(64, torch.float64)[2] == 0  # MPRGP there
    with funcgrad.HostReadCounter() as reads:
        W = funcgrad.DualConeProjector(check=False)(U, G)
    assert reads.count == 0
    reference = _quadprog(U.double(), G.double())
    assert _relative(W.double(), reference) <= 1e-3
    _assert_float32_kkt(W, U, G, "aligned m=64")


def test_float32_active_set_rounds_need_admm_iterations_first() -> None:
    """A random-rank Gramian at m = 49 (of the held-out sweep): after 16 ADMM iterations 11
    rounds leave rows unconverged (13 of 52 here); after the default 64 none. (Whether 32
    would do is a matter of rounding on this Gramian, 1 of 393 borderline there, so not
    asserted: docs/benchmarks_projector.md, session 11.)"""
    m = 49
    torch.set_default_dtype(torch.float32)  # drawn as the sweep drew it (the fixture resets)
    G, U = random_gramian(1081, m), _rows(m, 1081)
    assert G.dtype == U.dtype == torch.float32
    Gr = regularized(G, 1e-4, 1e-4)
    _, converged = solve(Gr, U, max_iter=0, admm_iter=16, rounds=11)
    assert not bool(converged.all())
    W = funcgrad.DualConeProjector(check=False)(U, G)
    _assert_float32_kkt(W, U, G, "random-rank m=49")


def test_float32_default_above_polish_max_costs_fewer_ops() -> None:
    """The rounds' conjugate-gradient steps are one product and about 10 small ops each,
    where an MPRGP iteration is about 45: about 2,300 ops at m = 128 (session 9's 256 ADMM
    and 64 MPRGP iterations: 4,864), with every row converged."""
    m = 128
    G = random_gramian(0, m).float()
    project = funcgrad.DualConeProjector(check=False)
    with _OpCount() as ops:
        W = project(torch.eye(m) / m, G)
    assert bool(torch.isfinite(W).all())
    assert ops.count <= 2600, ops.count


class _ProductCount(TorchDispatchMode):
    """Counts the (m, m) products and factors: at m = 128 they are most of a call's time."""

    def __init__(self) -> None:
        super().__init__()
        self.products = 0
        self.inverses = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        self.products += name in ("aten.mm", "aten.matmul", "aten.addmm")
        self.inverses += name in ("aten.linalg_inv_ex", "aten.linalg_lu_factor_ex")
        return func(*args, **(kwargs or {}))


def test_float32_rounds_cost_one_product_a_round_besides_their_cg_steps() -> None:
    """Each round of `_active_set` costs its CG steps and one more product, ``A y`` at the
    round's end (its KKT residual and the next round's start): the CG steps keep the whole
    gradient, so the multipliers need none. ADMM's penalties are factored by Cholesky, not
    LU. Session 10's rounds took three products besides the CG steps: 221 at m = 128."""
    m = 128
    G = random_gramian(0, m).float()
    with _ProductCount() as count:
        W = funcgrad.DualConeProjector(check=False)(torch.eye(m) / m, G)
    assert bool(torch.isfinite(W).all())
    # ADMM: 64, its 2 checks, 3 rebalances and 4 factors; the candidates 2; the rounds
    # 116 CG steps + 11; the final check 1
    assert count.products <= 203, count.products
    assert count.inverses == 0, count.inverses


@pytest.mark.parametrize("seed", [5, 6])
def test_active_set_rounds_keep_each_rows_best_on_degenerate_rows(seed: int) -> None:
    """Rows already optimal on a rank-2 Gramian (multipliers within rounding of 0), float32
    above POLISH_MAX: `y = low` is a candidate and each row keeps its best round."""
    m = 64
    U, G = _optimal_rows_on_rank_two(m, seed)
    W = funcgrad.DualConeProjector(check=False)(U.float(), G.float())
    assert bool(torch.isfinite(W).all())
    assert _relative(W.double(), _quadprog(U, G)) <= 1e-3


def test_convergence_of_a_row_depends_on_the_others() -> None:
    """ADMM's penalty is shared by the rows (docs/projector.md): with fixed budgets, row 15
    converges alone and not in its batch; the rows that converge in both agree."""
    U, G = aligned(256, 1e-2, 1)
    projector = funcgrad.DualConeProjector(check=False, admm_iter=160, max_iter=64, rounds=0)
    W = projector(U, G)
    alone = torch.cat([projector(U[i : i + 1], G) for i in range(16)])
    assert W[15].isnan().all()
    assert bool(torch.isfinite(alone).all())
    both = torch.isfinite(W).all(1)
    assert int(both.sum()) == 15
    assert _relative(W[both].double(), alone[both].double()) <= 1e-4


# --------------------------------------------------------------------------------------------
# reg_eps below the default: the budget grows as sqrt(1e-4 / reg_eps); below 1e-8, refused


def _small_reg_eps_cases() -> list[Any]:
    """m = 32 at reg_eps = 1e-8 takes seconds (a budget of 100 (4 m + 64)): slow tier."""
    cases = [(reg_eps, m) for reg_eps in (1e-5, 1e-6, 1e-7, 1e-8) for m in (16, 32)]
    return [
        pytest.param(*case, seed, marks=pytest.mark.slow) if case == (1e-8, 32) else (*case, seed)
        for case in cases
        for seed in (0, 1)
    ]


@pytest.mark.parametrize(("reg_eps", "m", "seed"), _small_reg_eps_cases())
def test_small_reg_eps(reg_eps: float, m: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rank = m // 3
    J = torch.randn(m, rank, generator=gen, dtype=torch.float64)
    J = J @ torch.randn(rank, 2 * m, generator=gen, dtype=torch.float64)
    G = J @ J.T
    U = _rows(m, seed=seed)
    W = funcgrad.DualConeProjector(reg_eps=reg_eps, check=False)(U, G)
    assert bool(torch.isfinite(W).all())
    linalg = pytest.importorskip("torchjd.linalg")
    pytest.importorskip("quadprog")
    reference = linalg.QuadprogProjector(reg_eps=reg_eps)(U, G)
    # quadprog itself is accurate to about eps * cond(G) ~ 1e-16 / reg_eps here
    assert _relative(W, reference) <= max(1e-8, 1e-15 / reg_eps)
    dual, primal, slack = _kkt(W, U, G, reg_eps=reg_eps)
    assert dual == 0.0
    assert primal <= 1e-12
    assert slack <= 1e-12


def test_default_budget_grows_with_the_conditioning() -> None:
    assert default_budget(64) == 4 * 64 + 64
    assert default_budget(64, 1e-4) == default_budget(64)
    assert default_budget(64, 1e-2) == default_budget(64)
    assert default_budget(64, 1e-6) == 10 * default_budget(64)
    assert default_budget(64, 1e-8) == 100 * default_budget(64)
    assert default_budget(POLISH_MAX) == 0  # the polish rounds finish there
    assert default_admm_budget(POLISH_MAX, 1e-6) == 10 * default_admm_budget(POLISH_MAX)


# --------------------------------------------------------------------------------------------
# Very large or very small rows: the answer is homogeneous in u


@pytest.mark.parametrize("scale", [1e160, 1e-160, 1e300, 1e-300])
def test_extreme_row_scales_float64(scale: float) -> None:
    G = random_gramian(0, 4).double()
    U = torch.cat([torch.eye(4), torch.randn(2, 4, generator=torch.Generator().manual_seed(0))])
    U = U.double()
    W1 = funcgrad.DualConeProjector(check=False)(U, G)
    W = funcgrad.DualConeProjector(check=False)(scale * U, G)
    assert bool(torch.isfinite(W).all())
    assert bool((scale * U <= W).all())
    torch.testing.assert_close(W / scale, W1, rtol=1e-12, atol=0)


@pytest.mark.parametrize("scale", [1e-18, 1e-30, 1e30])
def test_extreme_row_scales_float32(scale: float) -> None:
    G = random_gramian(0, 4).float()
    U = torch.eye(4)
    W1 = funcgrad.DualConeProjector(check=False)(U, G)
    W = funcgrad.DualConeProjector(check=False)(scale * U, G)
    assert W.dtype == torch.float32
    assert bool(torch.isfinite(W).all())
    assert bool((scale * U <= W).all())
    torch.testing.assert_close(W / scale, W1, rtol=1e-5, atol=0)


def test_mixed_row_scales_are_independent() -> None:
    G = random_gramian(1, 8).double()
    U = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    scales = torch.tensor([[1e150], [1.0], [1e-150]], dtype=torch.float64)
    W = funcgrad.DualConeProjector(check=False)(scales * U, G)
    torch.testing.assert_close(
        W / scales, funcgrad.DualConeProjector()(U, G), rtol=1e-10, atol=1e-12
    )


# --------------------------------------------------------------------------------------------
# The KKT conditions, directly


@pytest.mark.parametrize("i", range(12))
def test_kkt_conditions(i: int) -> None:
    m = 24
    G = random_gramian(i, m)
    U = _rows(m, seed=i)
    W = funcgrad.DualConeProjector()(U, G)
    dual, primal, slack = _kkt(W, U, G)
    assert dual == 0.0  # v >= u exactly: the iterates stay feasible
    assert primal <= 1e-12
    assert slack <= 1e-12


def test_kkt_check_fails_on_a_wrong_answer() -> None:
    """The KKT check itself can fail: the unprojected rows violate it."""
    G = random_gramian(0, 24)
    U = torch.eye(24) / 24
    assert max(_kkt(U, U, G)) > 1e-3


# --------------------------------------------------------------------------------------------
# float32: within the problem's conditioning


@pytest.mark.parametrize("i", range(12))
def test_float32_within_conditioning(i: int) -> None:
    m = 32
    G = random_gramian(i, m)
    U = torch.eye(m) / m
    reference = _quadprog(U, G)
    W = funcgrad.DualConeProjector()(U.float(), G.float())
    assert W.dtype == torch.float32
    eigenvalues = torch.linalg.eigvalsh(regularized(G, 1e-4, 1e-4))
    cond = float(eigenvalues[-1] / eigenvalues[0])
    assert _relative(W.double(), reference) <= 100 * torch.finfo(torch.float32).eps * cond


# --------------------------------------------------------------------------------------------
# Host reads


@pytest.mark.parametrize("m", [16, 64])  # the polish rounds, ADMM + MPRGP
@pytest.mark.parametrize("check", [False, None])
def test_no_host_read(check: bool | None, m: int) -> None:
    G = random_gramian(1, m)
    project = funcgrad.DualConeProjector(check=check)
    with funcgrad.HostReadCounter() as counter:
        W = project(torch.eye(m) / m, G)
    assert counter.count == 0, counter.reads
    assert bool(torch.isfinite(W).all())


def test_check_reads_once() -> None:
    G = random_gramian(1, 16)
    with funcgrad.HostReadCounter() as counter:
        funcgrad.DualConeProjector(check=True)(torch.eye(16) / 16, G)
    assert counter.count == 1
    with funcgrad.checking("strict"), funcgrad.HostReadCounter() as counter:
        funcgrad.DualConeProjector()(torch.eye(16) / 16, G)
    assert counter.count == 1


# --------------------------------------------------------------------------------------------
# Not converged: NaN, a fallback, or an error


def _hard() -> tuple[torch.Tensor, torch.Tensor]:
    G = random_gramian(1, 32)
    return torch.eye(32) / 32, G


def test_unconverged_rows_are_nan_without_check() -> None:
    U, G = _hard()
    # MPRGP alone (no ADMM first, no polish rounds): 11 of 32 rows converge in 60 iterations
    W, _ = solve(regularized(G, 1e-4, 1e-4), U, max_iter=60, admm_iter=0, polish_max=0)
    bad = torch.isnan(W).any(1)
    assert bool(bad.any())
    assert bool(torch.isfinite(W[~bad]).all())
    reference = _quadprog(U, G)
    assert _relative(W[~bad], reference[~bad]) <= 1e-8  # the converged rows are exact


def test_unconverged_rows_fall_back_to_quadprog_with_check() -> None:
    U, G = _hard()
    with pytest.warns(funcgrad.FuncgradWarning, match="did not reach the tolerance"):
        W = funcgrad.DualConeProjector(max_iter=2, admm_iter=0, check=True)(U, G)
    assert _relative(W, _quadprog(U, G)) <= 1e-8


def test_unconverged_rows_raise_with_strict() -> None:
    U, G = _hard()
    with pytest.raises(funcgrad.DualConeProjector.ConvergenceError, match="max_iter=2"):
        funcgrad.DualConeProjector(max_iter=2, admm_iter=0, check="strict")(U, G)


def test_default_budget_converges_where_a_short_one_does_not() -> None:
    U, G = _hard()
    _, converged = solve(regularized(G, 1e-4, 1e-4), U)
    assert bool(converged.all())
    # the iterative method alone (no polish rounds): its own default budget is needed
    _, converged = solve(regularized(G, 1e-4, 1e-4), U, max_iter=2, admm_iter=0, polish_max=0)
    assert not bool(converged.all())
    _, converged = solve(regularized(G, 1e-4, 1e-4), U, max_iter=0, admm_iter=8, polish_max=0)
    assert not bool(converged.all())
    admm_alone = solve(regularized(G, 1e-4, 1e-4), U, max_iter=0, admm_iter=256, polish_max=0)
    assert bool(admm_alone[1].all())


def test_admm_keeps_converged_rows() -> None:
    """float32 ADMM iterates wander at rounding level once converged: a row within tol at a
    check keeps that iterate. (Without the checks, 1 or 2 of these 60 Gramians end with a
    row outside tol, depending on the rounding: measured on 1 thread.)"""
    for i in range(60):
        G = regularized(random_gramian(i, 8), 1e-4, 1e-4).float()
        U = torch.eye(8, dtype=torch.float32) / 8
        _, converged = solve(G, U, max_iter=0, admm_iter=384, exact_max=0)  # ADMM at m = 8
        assert bool(converged.all()), i


def test_admm_unconverged_rows_leave_with_their_last_iterate() -> None:
    """A row that ADMM did not finish hands MPRGP its progress, not ADMM's start point
    (which it did until session 5: MPRGP then restarted the hardest rows from scratch)."""
    m = 36
    G = regularized(random_gramian(7, m), 1e-4, 1e-4)  # random rank: ADMM's slow tail
    A = G / G.diagonal().mean()
    low = _rows(m, seed=7).double() * G.diagonal().mean().sqrt()
    tol = default_tol(m, torch.float64)

    def residual(gap: torch.Tensor) -> torch.Tensor:
        return torch.minimum(gap, (low + gap) @ A).abs().amax(1)

    start = low.clamp_min(0) - low
    gap = _admm(A, low, 48, tol)
    assert bool((gap >= 0).all())
    unfinished = residual(gap) > tol * ((low + gap).abs().amax(1) + low.abs().amax(1))
    assert bool(unfinished.any())
    assert bool((residual(gap)[unfinished] < 0.1 * residual(start)[unfinished]).all())


def test_mprgp_finishes_admm_tail() -> None:
    """Duplicate tasks, UPGrad's rows and rows of both signs: ADMM's slow tail (3 rows
    unconverged after 256 iterations); MPRGP from ADMM's answer finishes it (the float32
    default), exact against quadprog."""
    m = _sizes(100, 128, 11)[63]
    G = random_gramian(63, m).double()
    gen = torch.Generator().manual_seed(63)
    U = torch.cat([torch.eye(m) / m, torch.randn(3, m, generator=gen)]).float()
    G32 = regularized(G, 1e-4, 1e-4).float()
    assert m <= POLISH_MAX  # the iterative method alone, without the polish rounds
    _, converged = solve(G32, U, max_iter=0, admm_iter=256, polish_max=0)
    assert not bool(converged.all())
    _, converged = solve(G32, U, max_iter=64, admm_iter=256, polish_max=0)
    assert bool(converged.all())
    W32 = funcgrad.DualConeProjector(check=False)(U, G.float())  # the float32 default
    W = funcgrad.DualConeProjector(check=False)(U.double(), G)
    reference = _quadprog(U.double(), G)
    assert _relative(W, reference) <= 1e-8
    assert _relative(W32.double(), reference) <= 1e-3


def _admm_tail() -> tuple[torch.Tensor, torch.Tensor]:
    """Duplicate tasks at m = 23, UPGrad's rows and 3 rows of both signs: ADMM's slow tail."""
    m = _sizes(100, 128, 11)[63]
    G = random_gramian(63, m).double()
    gen = torch.Generator().manual_seed(63)
    U = torch.cat([torch.eye(m) / m, torch.randn(3, m, generator=gen)])
    return U, G


def test_polish_finishes_where_admm_alone_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """For EXACT_MAX < m <= POLISH_MAX a short ADMM then `_polish`'s exact face solves
    replace the long budgets: ADMM's default 96 iterations alone leave 3 rows unconverged
    here, one polish round leaves 2, and the default rounds give quadprog's answer (float64
    within 1e-8, float32 within conditioning), with no MPRGP iteration at all."""
    U, G = _admm_tail()
    m = G.shape[0]
    assert EXACT_MAX < m <= POLISH_MAX and default_budget(m) == 0
    for dtype in (torch.float32, torch.float64):
        Gr = regularized(G, 1e-4, 1e-4).to(dtype)
        _, converged = solve(Gr, U.to(dtype), max_iter=0, polish_max=0)
        assert not bool(converged.all()), dtype
        _, converged = solve(Gr, U.to(dtype))
        assert bool(converged.all()), dtype
    reference = _quadprog(U, G)
    assert _relative(funcgrad.DualConeProjector(check=False)(U, G), reference) <= 1e-8
    W32 = funcgrad.DualConeProjector(check=False)(U.float(), G.float())
    assert _relative(W32.double(), reference) <= 1e-3
    monkeypatch.setattr("funcgrad._projector._POLISH_ROUNDS", 1)
    _, converged = solve(regularized(G, 1e-4, 1e-4), U)
    assert not bool(converged.all())


def test_polish_keeps_admm_rows_where_its_rounds_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row keeps ADMM's iterate where it is better than the rounds' answer (here: a
    factorisation that returns NaN): a row that ADMM had finished is never made worse."""
    U, G = _admm_tail()
    A = regularized(G, 1e-4, 1e-4)
    A = A / A.diagonal().mean()
    low = U * A.diagonal().mean().sqrt() / U.abs().amax(1, keepdim=True)
    gap = _admm(A, low, 256, default_tol(G.shape[0], torch.float64))
    assert bool(torch.isfinite(_polish(A, low, gap)).all())

    def broken(K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full_like(K, math.nan), torch.zeros(K.shape[:-2], dtype=torch.int32)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", broken)
    assert torch.equal(_polish(A, low, gap), gap)


@pytest.mark.parametrize("m", [EXACT_MAX + 1, 40, POLISH_MAX])
@pytest.mark.parametrize("kind", range(6))
def test_polish_range_against_quadprog(m: int, kind: int) -> None:
    """The six kinds at the polish range's ends, UPGrad's rows and rows of both signs:
    float64 within 1e-8 of quadprog, float32 within conditioning, KKT, no host read."""
    G = random_gramian(kind + 6 * m, m).double()
    U = _rows(m, seed=kind).double()
    reference = _quadprog(U, G)
    project = funcgrad.DualConeProjector(check=False)
    with funcgrad.HostReadCounter() as reads:
        W = project(U, G)
        W32 = project(U.float(), G.float())
    assert reads.count == 0
    assert _relative(W, reference) <= 1e-8
    assert max(_kkt(W, U, G)[1:]) <= 1e-12 and _kkt(W, U, G)[0] == 0.0
    cond = float(torch.linalg.cond(regularized(G, 1e-4, 1e-4)))
    error = float((W32.double() - reference).abs().amax() / reference.abs().amax())
    assert error <= 100 * torch.finfo(torch.float32).eps * cond


def _adversarial_for_a_fixed_start(m: int) -> torch.Tensor:
    """Mean diagonal 1, top eigenvector orthogonal to the old power-iteration start
    (ones + 0.5 sin(arange)), second eigenvalue half the top one."""
    old = torch.ones(m) + 0.5 * torch.sin(torch.arange(m, dtype=torch.float64))
    gen = torch.Generator().manual_seed(1)
    Q = torch.linalg.qr(torch.cat([old[:, None], torch.randn(m, m - 1, generator=gen)], 1)).Q
    spectrum = torch.full((m,), 0.5)
    spectrum[0], spectrum[1] = 5.0, 10.0  # Q[:, 1], the top one, is orthogonal to old
    A = Q @ torch.diag(spectrum) @ Q.T
    return A * m / A.trace()


def test_lambda_max_estimate_keeps_the_expansion_step_safe() -> None:
    """MPRGP's expansion step 1.9 / estimate must stay <= 2 / lambda_max: on an adversarial
    Gramian for a structured start (which gave lambda_max / 2) and on 300 random ones."""
    from funcgrad._projector import _lambda_max

    cases = [_adversarial_for_a_fixed_start(32)]
    for i in range(300):
        m = (2, 5, 16, 32, 64)[i % 5]
        G = regularized(random_gramian(i, m), 1e-4, 1e-4)
        cases.append(G * m / G.trace())
    for A in cases:
        top = torch.linalg.eigvalsh(A)[-1]
        assert 1.9 / float(_lambda_max(A)) <= 2 / float(top)
        assert float(_lambda_max(A)) <= float(torch.linalg.matrix_norm(A)) + 1e-12


# --------------------------------------------------------------------------------------------
# TorchJD's weightings with this projector


def _tjd():  # type: ignore[no-untyped-def]
    pytest.importorskip("quadprog")
    return pytest.importorskip("torchjd.aggregation")


@pytest.mark.parametrize("i", range(6))
def test_upgrad_weighting_end_to_end(i: int) -> None:
    tjd = _tjd()
    G = random_gramian(i, 20)
    fast = tjd.UPGradWeighting(projector=funcgrad.DualConeProjector())(G)
    assert _relative(fast, tjd.UPGradWeighting()(G)) <= 1e-8
    fast = tjd.DualProjWeighting(projector=funcgrad.DualConeProjector())(G)
    assert _relative(fast, tjd.DualProjWeighting()(G)) <= 1e-8


def test_upgrad_aggregator_and_preference_vector() -> None:
    tjd = _tjd()
    J = torch.randn(6, 40)
    pref = torch.rand(6)
    fast = tjd.UPGrad(pref_vector=pref, projector=funcgrad.DualConeProjector())(J)
    assert _relative(fast, tjd.UPGrad(pref_vector=pref)(J)) <= 1e-8


def test_funcgrad_backward_with_the_fast_projector() -> None:
    tjd = _tjd()
    torch.manual_seed(0)
    encoder = torch.nn.Linear(5, 8)
    x = torch.randn(16, 5)

    def run(projector: object) -> tuple[torch.Tensor, torch.Tensor]:
        encoder.zero_grad()
        features = encoder(x)
        losses = [(features[:, i] - i).pow(2).mean() for i in range(4)]
        kwargs = {} if projector is None else {"projector": projector}
        weights = funcgrad.backward(
            losses, through=features, weighting=tjd.UPGradWeighting(**kwargs), level="params"
        )
        assert encoder.weight.grad is not None
        return weights, encoder.weight.grad.clone()

    w_ref, g_ref = run(None)
    w_fast, g_fast = run(funcgrad.DualConeProjector())
    assert _relative(w_fast, w_ref) <= 1e-8
    assert _relative(g_fast, g_ref) <= 1e-8


def test_registered_as_torchjd_projector() -> None:
    linalg = pytest.importorskip("torchjd.linalg")
    assert isinstance(funcgrad.DualConeProjector(), linalg.DualConeProjector)


_BUILT_BEFORE_TORCHJD = """
import sys
import funcgrad
early = funcgrad.DualConeProjector()
assert "torchjd" not in sys.modules
import torch
import torchjd.linalg
import torchjd.aggregation
weights = torchjd.aggregation.UPGradWeighting(projector=early)(torch.eye(3))
assert isinstance(early, torchjd.linalg.DualConeProjector), "built before torchjd, used"
"""

_TORCHJD_FIRST = """
import torchjd.linalg
import funcgrad
assert isinstance(funcgrad.DualConeProjector(), torchjd.linalg.DualConeProjector)
"""


@pytest.mark.parametrize("script", [_BUILT_BEFORE_TORCHJD, _TORCHJD_FIRST])
def test_registered_whatever_the_import_order(script: str) -> None:
    """A fresh interpreter: a projector built before TorchJD is imported is an instance of
    TorchJD's ABC once it has been called (registration on each call, a dict lookup), and
    one built after TorchJD's import is one at once."""
    pytest.importorskip("torchjd.linalg")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(funcgrad.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------------------------
# Shapes, dtypes, degenerate inputs, errors


@pytest.mark.parametrize("name", ["UPGradWeighting", "UPGrad", "DualProjWeighting", "DualProj"])
def test_plan_advises_the_fast_projector_never_swaps(name: str) -> None:
    """combine_heads' plan() says how to pass funcgrad's projector where the weighting uses
    TorchJD's default (quadprog), and nothing where it already uses another; the user's
    object is not changed."""
    tjd = _tjd()
    m = funcgrad._projector.CPU_ADVICE_FROM  # tasks: from here the projector is faster
    f = torch.nn.Linear(3, m)
    heads = [lambda y, i=i: y[..., i].sum() for i in range(m)]
    default = getattr(tjd, name)()
    plan = funcgrad.combine_heads(f, heads, default).plan(torch.zeros(2, 3))
    assert plan.advice is not None
    assert f"{name}(projector=funcgrad.DualConeProjector())" in plan.advice
    assert "advice:" in repr(plan)
    inner = getattr(default, "gramian_weighting", default)
    assert type(inner.projector).__name__ == "QuadprogProjector"  # not swapped
    fast = getattr(tjd, name)(projector=funcgrad.DualConeProjector())
    assert funcgrad.combine_heads(f, heads, fast).plan(torch.zeros(2, 3)).advice is None
    mean = funcgrad.combine_heads(f, heads, tjd.MeanWeighting()).plan(torch.zeros(2, 3))
    assert mean.advice is None
    assert "advice" not in repr(mean)


@pytest.mark.parametrize("m", [2, 8, 32])
def test_plan_gives_no_advice_for_few_tasks_on_the_cpu(m: int) -> None:
    """quadprog is faster on the CPU below CPU_ADVICE_FROM tasks (the bench): no advice."""
    tjd = _tjd()
    f = torch.nn.Linear(3, m)
    heads = [lambda y, i=i: y[..., i].sum() for i in range(m)]
    plan = funcgrad.combine_heads(f, heads, tjd.UPGradWeighting()).plan(torch.zeros(2, 3))
    assert plan.advice is None
    advice = funcgrad._projector.projector_advice(tjd.UPGrad(), m, torch.device("meta"))
    assert advice is not None  # another device: quadprog syncs, advised whatever m


def test_one_projector_reused_across_shapes_dtypes_threads_and_mutation() -> None:
    """The user's side: one projector object for several shapes and dtypes, from two threads
    at once, with the returned weights and the inputs mutated between calls; every answer
    equals a fresh projector's on fresh copies (no state kept, no aliasing)."""
    import threading

    project = funcgrad.DualConeProjector(check=False)
    problems = [(_rows(m, seed=m), random_gramian(m, m)) for m in (4, 16, 24, 40)]
    expected = [funcgrad.DualConeProjector(check=False)(U.clone(), G.clone()) for U, G in problems]
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def work(slot: int) -> None:
        for _ in range(2):
            for U, G in problems[slot::2] + problems[1 - slot :: 2]:
                W = project(U, G)
                results[slot].append(W.clone())
                W.fill_(7.0)  # mutating the answer must not reach the next call

    threads = [threading.Thread(target=work, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    order = {0: [0, 2, 1, 3] * 2, 1: [1, 3, 0, 2] * 2}
    for slot in (0, 1):
        for W, k in zip(results[slot], order[slot], strict=True):
            torch.testing.assert_close(W, expected[k], rtol=1e-12, atol=1e-15)
    for (U, G), reference in zip(problems, expected, strict=True):
        W32 = project(U.float(), G.float())  # the same object, float32 next
        assert W32.dtype == torch.float32
        assert _relative(W32.double(), reference) <= 1e-2
        U_before, G_before = U.clone(), G.clone()
        W = project(U, G)
        assert W.data_ptr() not in (U.data_ptr(), G.data_ptr())
        torch.testing.assert_close(U, U_before, rtol=0, atol=0)  # inputs untouched
        torch.testing.assert_close(G, G_before, rtol=0, atol=0)
        U.mul_(2.0)  # the caller mutates its input: the next call sees the new rows
        torch.testing.assert_close(project(U, G), 2 * reference, rtol=1e-9, atol=1e-15)


def test_batched_shapes_equal_rows() -> None:
    G = random_gramian(0, 7)
    U = torch.randn(2, 3, 7)
    project = funcgrad.DualConeProjector()
    W = project(U, G)
    assert W.shape == U.shape
    torch.testing.assert_close(W.reshape(6, 7), project(U.reshape(6, 7), G), rtol=0, atol=0)
    w = project(U[0, 0], G)
    assert w.shape == (7,)
    torch.testing.assert_close(w, W[0, 0], rtol=1e-12, atol=1e-15)


def test_dtype_and_device_follow_g() -> None:
    G = random_gramian(0, 5)
    W = funcgrad.DualConeProjector()(torch.eye(5, dtype=torch.float32), G)
    assert W.dtype == torch.float64
    assert W.device == G.device


def test_degenerate_gramians() -> None:
    """A zero Gramian (trace below norm_eps): G becomes reg_eps * I and v = max(u, 0)."""
    U = torch.tensor([[1.0, -2.0, 0.5], [-1.0, -1.0, -1.0]])
    W = funcgrad.DualConeProjector()(U, torch.zeros(3, 3))
    torch.testing.assert_close(W, U.clamp_min(0), rtol=0, atol=0)
    W = funcgrad.DualConeProjector()(U, torch.ones(3, 3))  # three identical tasks
    # float32: within its resolution (an exact 0 there before m <= EXACT_MAX was enumerated
    # was luck: the enumeration's 1e-12 is far below float32's 6e-8 at 1)
    torch.testing.assert_close(W, _quadprog(U, torch.ones(3, 3)), rtol=1e-6, atol=1e-7)
    U64, ones = U.double(), torch.ones(3, 3, dtype=torch.float64)
    W = funcgrad.DualConeProjector()(U64, ones)
    torch.testing.assert_close(W, _quadprog(U64, ones), rtol=1e-10, atol=1e-12)


class _TensorKinds(TorchDispatchMode):
    """Counts the new tensors that aten calls make (views of their inputs left out):
    ordinary ones (through autograd's dispatch, with version counters) and inference ones
    (``torch.inference_mode``: neither)."""

    def __init__(self) -> None:
        super().__init__()
        self.ordinary = 0
        self.inference = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view (detach, diagonal, reshape) of an input: no new tensor
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.inference += t.is_inference()
                self.ordinary += not t.is_inference()
        return out


@pytest.mark.parametrize("m", [8, 16, 64])  # all faces, the polish rounds, ADMM + MPRGP
def test_the_solve_runs_in_inference_mode(m: int) -> None:
    """The solve's hundreds to thousands of small ops skip autograd's dispatch (no graph is
    wanted: the weights are not differentiable); only the answer's final copy is an
    ordinary tensor. (Under no_grad every op made an ordinary tensor.)"""
    G, U = random_gramian(1, m), torch.eye(m) / m
    with _TensorKinds() as kinds:
        funcgrad.DualConeProjector(check=False)(U, G)
    assert kinds.ordinary == 1, (kinds.ordinary, kinds.inference)
    assert kinds.inference >= 50, (kinds.ordinary, kinds.inference)


@pytest.mark.parametrize("m", [8, 16, 64])
def test_the_answer_is_an_ordinary_tensor(m: int) -> None:
    """Whatever mode the solve ran in, the caller gets an ordinary tensor: writable in
    place, usable by autograd (saved for backward); under torch.func.grad, which cannot
    hold inference tensors, the projector runs as before; under the caller's own inference
    mode it works too."""
    G, U = random_gramian(2, m), torch.eye(m) / m
    project = funcgrad.DualConeProjector(check=False)
    W = project(U, G)
    assert not W.is_inference()
    x = torch.ones(m, requires_grad=True)
    (W @ x * W.sum()).sum().backward()  # W is saved for the backward of the products
    assert x.grad is not None
    W.add_(1)  # in place: an inference tensor would refuse

    J = torch.randn(m, 3 * m, dtype=torch.float64)

    def loss(J: torch.Tensor) -> torch.Tensor:
        weights = project(torch.eye(m, dtype=J.dtype), J @ J.T).sum(0)
        return (weights @ J).square().sum()

    leaf = J.clone().requires_grad_()
    expected = torch.autograd.grad(loss(leaf), leaf)[0]  # eager: caches (`_faces`) made here
    assert not expected.is_inference()
    torch.testing.assert_close(torch.func.grad(loss)(J), expected)
    with torch.inference_mode():
        assert bool(torch.isfinite(project(U, G)).all())


def test_not_differentiable_and_detached() -> None:
    G = random_gramian(0, 4).requires_grad_()
    U = torch.eye(4).requires_grad_()
    W = funcgrad.DualConeProjector()(U, G)
    assert not W.requires_grad


@pytest.mark.parametrize(
    ("U", "G", "error", "match"),
    [
        (torch.eye(3), torch.zeros(3, 4), ValueError, r"`G` must be a square \(m, m\)"),
        (torch.eye(3), torch.zeros(3), ValueError, r"`G` must be a square"),
        (torch.eye(4), torch.eye(3), ValueError, r"`U` must have shape \(\.\.\., m\) with m = 3"),
        (torch.tensor(1.0), torch.eye(3), ValueError, r"`U` must have shape"),
        (torch.eye(3), torch.eye(3, dtype=torch.int64), TypeError, r"`G` must be float32"),
        (torch.eye(3, dtype=torch.bfloat16), torch.eye(3), TypeError, r"`U` must be float32"),
    ],
)
def test_call_errors(U: torch.Tensor, G: torch.Tensor, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        funcgrad.DualConeProjector()(U, G)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"norm_eps": -1.0}, "`norm_eps` must be a finite number >= 0"),
        ({"norm_eps": math.inf}, "`norm_eps` must be a finite number >= 0"),
        ({"reg_eps": math.nan}, "`reg_eps` must be a finite number >= 1e-08"),
        ({"reg_eps": math.inf}, "`reg_eps` must be a finite number >= 1e-08"),
        ({"reg_eps": 0.0}, "`reg_eps` must be a finite number >= 1e-08"),
        ({"reg_eps": 1e-10}, "use TorchJD's QuadprogProjector there"),
        ({"max_iter": -1}, "`max_iter` must be an int >= 0"),
        ({"max_iter": True}, "`max_iter` must be an int >= 0"),
        ({"max_iter": 2.0}, "`max_iter` must be an int >= 0"),
        ({"admm_iter": -1}, "`admm_iter` must be an int >= 0"),
        ({"admm_iter": False}, "`admm_iter` must be an int >= 0"),
        ({"rounds": -1}, "`rounds` must be an int >= 0"),
        ({"rounds": 2.0}, "`rounds` must be an int >= 0"),
        ({"tol": 0.0}, "`tol` must be a finite number > 0"),
        ({"tol": math.inf}, "`tol` must be a finite number > 0"),
        ({"check": "full"}, "`check` must be None, True, False or 'strict'.*re-solves"),
    ],
)
def test_constructor_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        funcgrad.DualConeProjector(**kwargs)  # type: ignore[arg-type]
    # The same check on a later assignment (as TorchJD's setters): the projector keeps its
    # last good value and its answer.
    projector = funcgrad.DualConeProjector()
    ((name, value),) = kwargs.items()
    before = getattr(projector, name)
    with pytest.raises(ValueError, match=rf"DualConeProjector\(\.\.\.\)\.{name}: .*{match}"):
        setattr(projector, name, value)
    assert getattr(projector, name) == before
    G = random_gramian(0, 4)
    torch.testing.assert_close(
        projector(torch.eye(4), G), funcgrad.DualConeProjector()(torch.eye(4), G)
    )


def _invalid_inputs() -> list[tuple[str, torch.Tensor, torch.Tensor, str]]:
    G = random_gramian(0, 4)
    U = torch.eye(4)
    inf_off = G.clone()
    inf_off[0, 1] = inf_off[1, 0] = math.inf
    nan = G.clone()
    nan[1, 2] = math.nan
    u_inf = U.clone()
    u_inf[0, 0] = math.inf
    return [
        ("G inf", U, inf_off, "`G` has non-finite entries"),
        ("G nan", U, nan, "`G` has non-finite entries"),
        ("U inf", u_inf, G, "`U` has non-finite entries"),
    ]


@pytest.mark.parametrize(("name", "U", "G", "match"), _invalid_inputs(), ids=lambda x: "")
@pytest.mark.parametrize("check", [True, "strict"])
def test_non_finite_input_is_an_error_under_check(
    name: str, U: torch.Tensor, G: torch.Tensor, match: str, check: object
) -> None:
    with pytest.raises(ValueError, match=match):
        funcgrad.DualConeProjector(check=check)(U, G)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "U", "G", "match"), _invalid_inputs(), ids=lambda x: "")
def test_non_finite_input_gives_nan_without_check(
    name: str, U: torch.Tensor, G: torch.Tensor, match: str
) -> None:
    """Documented: without check nothing is read, and the bad input shows as NaN rows."""
    with funcgrad.HostReadCounter() as counter:
        W = funcgrad.DualConeProjector(check=False)(U, G)
    assert counter.count == 0
    assert bool(torch.isnan(W).any())


def test_indefinite_gramian_under_check_names_g() -> None:
    pytest.importorskip("quadprog")
    pytest.importorskip("torchjd.linalg")
    G = random_gramian(0, 4)
    G[0, 0] = -G[0, 0]
    with (
        pytest.warns(funcgrad.FuncgradWarning, match="re-solving"),
        pytest.raises(ValueError, match="`G` must be a symmetric positive semi-definite"),
    ):
        funcgrad.DualConeProjector(check=True)(torch.eye(4), G)
    with pytest.raises(funcgrad.DualConeProjector.ConvergenceError, match="positive semi-def"):
        funcgrad.DualConeProjector(check="strict")(torch.eye(4), G)


def test_repr() -> None:
    expected = "DualConeProjector(norm_eps=0.0001, reg_eps=0.0001)"
    assert repr(funcgrad.DualConeProjector()) == expected
    assert "max_iter=5" in repr(funcgrad.DualConeProjector(max_iter=5))
    assert "rounds=0" in repr(funcgrad.DualConeProjector(rounds=0))


def test_no_warning_on_the_steady_path() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        funcgrad.DualConeProjector(check=True)(torch.eye(6), random_gramian(2, 6))


def test_funcgrad_backward_refuses_unconverged_weights() -> None:
    """The NaN of an unconverged row meets funcgrad's own finiteness read: a clear error,
    and ``.grad`` untouched."""
    tjd = _tjd()
    encoder = torch.nn.Linear(5, 8)
    features = encoder(torch.randn(16, 5))
    # conflicting tasks: one iteration does not solve them (m = 12 > EXACT_MAX: iterated)
    directions = torch.randn(12, 8)
    losses = [(features @ c).mean() for c in directions]
    projector = funcgrad.DualConeProjector(max_iter=1, admm_iter=0, check=False)
    weighting = tjd.UPGradWeighting(projector=projector)
    with pytest.raises(ValueError, match="non-finite weights"):
        funcgrad.backward(losses, through=features, weighting=weighting, level="params")
    assert encoder.weight.grad is None


# --------------------------------------------------------------------------------------------
# MGDA without host reads


def _mgda_cases() -> list[Any]:
    cases = [
        pytest.param(random_gramian(i, m).double(), id=f"m{m}-kind{i % 6}")
        for m, i in [(2, 0), (3, 1), (5, 2), (8, 3), (8, 4), (13, 5), (32, 6), (64, 7), (64, 9)]
    ]
    cases += [pytest.param(J @ J.T, id=name) for name, J in torchjd_matrices()[::5]]
    return cases


@pytest.mark.parametrize("G", _mgda_cases())
@pytest.mark.parametrize(("epsilon", "max_iters"), [(1e-3, 100), (1e-6, 300), (0.05, 7)])
def test_mgda_equals_torchjd(G: torch.Tensor, epsilon: float, max_iters: int) -> None:
    """The same Frank-Wolfe iterates as TorchJD's MGDAWeighting, stop included: equal to
    the last bits in float64, with no host read."""
    tjd = _tjd()
    G = G.double()
    reference = tjd.MGDAWeighting(epsilon=epsilon, max_iters=max_iters)(G)
    with funcgrad.HostReadCounter() as reads:
        w = funcgrad.MGDAWeighting(epsilon=epsilon, max_iters=max_iters)(G)
    assert reads.count == 0
    torch.testing.assert_close(w, reference, rtol=1e-12, atol=1e-15)


def test_mgda_stop_is_the_device_side_mask() -> None:
    """TorchJD stops early (gamma < epsilon) on these Gramians: iterating on would give
    other weights, so the equality above checks the frozen mask, not only the iteration."""
    tjd = _tjd()
    stopped = 0
    for G in _mgda_cases():
        G = G.values[0].double()
        early = funcgrad.MGDAWeighting()(G)
        on = funcgrad.MGDAWeighting(epsilon=1e-300)(G)  # never stops: all 100 iterations
        torch.testing.assert_close(early, tjd.MGDAWeighting()(G), rtol=1e-12, atol=1e-15)
        stopped += not torch.allclose(early, on, rtol=1e-9, atol=0)
    assert stopped >= 2, stopped


def test_mgda_float32_and_backward() -> None:
    """float32 as TorchJD's (a tie in argmin could part them: not on these), and as
    funcgrad.backward's weighting the same weights and .grad as TorchJD's."""
    tjd = _tjd()
    G = random_gramian(3, 16)
    torch.testing.assert_close(funcgrad.MGDAWeighting()(G), tjd.MGDAWeighting()(G))
    encoder = torch.nn.Linear(5, 8)
    x = torch.randn(16, 5)
    directions = torch.randn(4, 8)
    grads = []
    for weighting in (funcgrad.MGDAWeighting(), tjd.MGDAWeighting()):
        encoder.zero_grad(set_to_none=True)
        features = encoder(x)
        losses = [(features @ c).mean() for c in directions]
        funcgrad.backward(losses, through=features, weighting=weighting, level="params")
        grads.append(encoder.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": 0.0}, "`epsilon` must be a finite number > 0"),
        ({"epsilon": math.nan}, "`epsilon` must be"),
        ({"max_iters": 0}, "`max_iters` must be an int >= 1"),
        ({"max_iters": 2.0}, "`max_iters` must be"),
    ],
)
def test_mgda_constructor_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        funcgrad.MGDAWeighting(**kwargs)


def test_mgda_call_errors_and_nan() -> None:
    with pytest.raises(ValueError, match="must be \\(m, m\\)"):
        funcgrad.MGDAWeighting()(torch.ones(2, 3))
    with pytest.raises(TypeError, match="must be floating"):
        funcgrad.MGDAWeighting()(torch.ones(2, 2, dtype=torch.int64))
    G = random_gramian(0, 4)
    G[1, 2] = G[2, 1] = math.nan
    assert bool(torch.isnan(funcgrad.MGDAWeighting()(G)).any())  # as TorchJD's
    assert repr(funcgrad.MGDAWeighting()) == "MGDAWeighting(epsilon=0.001, max_iters=100)"


# --------------------------------------------------------------------------------------------
# The review's findings (proj4 review)


def _review_gramian() -> torch.Tensor:
    return torch.tensor(
        [
            [2.31199, -0.16474, 0.74524],
            [-0.16474, 0.23635, 0.80577],
            [0.74524, 0.80577, 3.52438],
        ]
    )


@pytest.mark.parametrize(
    ("dtype", "epsilon"),
    [
        (torch.bfloat16, 1.001),
        (torch.float16, 1.0001),
        (torch.float32, 1.0 + 1e-9),
        (torch.float64, 1.0 + 1e-9),
    ],
)
def test_mgda_stops_as_torchjd_with_epsilon_just_above_one(
    dtype: torch.dtype, epsilon: float
) -> None:
    """TorchJD's full step is the Python float 1.0, compared with epsilon in double: with
    epsilon just above 1 it stops after that step, even where epsilon rounds to 1.0 in G's
    dtype (the review's repro: [0, 1, 0], not [0.14, 0.86, 0])."""
    tjd = _tjd()
    G = _review_gramian().to(dtype)
    reference = tjd.MGDAWeighting(epsilon, 10)(G)
    w = funcgrad.MGDAWeighting(epsilon, 10)(G)
    torch.testing.assert_close(w, reference, rtol=0, atol=0)
    assert w.tolist() == [0.0, 1.0, 0.0]


def test_mgda_float32_epsilon_above_one_random_gramians() -> None:
    """float32, epsilon = 1 + 1e-9 (1.0 in float32): equal to TorchJD's on 300 random 3 x 3
    Gramians (before the fix about 6% differed)."""
    tjd = _tjd()
    gen = torch.Generator().manual_seed(0)
    epsilon = 1.0 + 1e-9
    for _ in range(300):
        J = torch.randn(3, 3, generator=gen, dtype=torch.float32)
        G = J @ J.T
        reference = tjd.MGDAWeighting(epsilon, 10)(G)
        torch.testing.assert_close(funcgrad.MGDAWeighting(epsilon, 10)(G), reference)


def test_no_task_gives_the_empty_answer() -> None:
    """m = 0: no weight, no error (nothing to project)."""
    G = torch.zeros(0, 0, dtype=torch.float64)
    for U in (torch.zeros(0, 0, dtype=torch.float64), torch.zeros(3, 0), torch.zeros(2, 4, 0)):
        with funcgrad.HostReadCounter() as reads:
            W = funcgrad.DualConeProjector()(U, G)
        assert W.shape == U.shape
        assert W.dtype == torch.float64
        assert reads.count == 0
    w = funcgrad.MGDAWeighting()(G)
    assert w.shape == (0,)
    assert w.dtype == torch.float64


@pytest.mark.parametrize("reg_eps", [1e-8, 1e-6, 9e-6])
def test_float32_refuses_reg_eps_it_cannot_resolve(reg_eps: float) -> None:
    """float32 cannot resolve reg_eps below 1e-5 (the review's repro: [-0.30, 3.15, -2.00]
    where quadprog gives [-0.20, 1.00, -0.60]): refused, naming the argument and the fix;
    float64 solves the same problem within quadprog's accuracy."""
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32)
    G = torch.outer(v, v)
    U = torch.tensor([[-0.3, 1.0, -2.0]], dtype=torch.float32)
    project = funcgrad.DualConeProjector(reg_eps=reg_eps)
    with pytest.raises(ValueError, match=r"`reg_eps` = .* is below 1e-05.*float64"):
        project(U, G)
    W = project(U.double(), G.double())
    linalg = pytest.importorskip("torchjd.linalg")
    pytest.importorskip("quadprog")
    reference = linalg.QuadprogProjector(reg_eps=reg_eps)(U.double(), G.double())
    assert _relative(W, reference) <= max(1e-8, 1e-15 / reg_eps)


def test_float32_at_the_smallest_reg_eps_is_near_quadprog() -> None:
    """At reg_eps = 1e-5, float32 is within 1% of quadprog (float64) on rank-1 and rank-2
    Gramians, the hardest for the conditioning."""
    linalg = pytest.importorskip("torchjd.linalg")
    pytest.importorskip("quadprog")
    gen = torch.Generator().manual_seed(0)
    project = funcgrad.DualConeProjector(reg_eps=1e-5)
    reference = linalg.QuadprogProjector(reg_eps=1e-5)
    v = torch.tensor([1.0, 2.0, 3.0])
    cases = [(torch.tensor([[-0.3, 1.0, -2.0]]), torch.outer(v, v))]
    for m in (3, 8, 11):
        J = torch.randn(m, 2, generator=gen)
        cases.append((torch.randn(4, m, generator=gen), J @ J.T))
        r = torch.randn(m, generator=gen)
        cases.append((torch.randn(4, m, generator=gen), torch.outer(r, r)))
    for U, G in cases:
        U, G = U.float(), G.float()
        W = project(U, G).double()
        assert _relative(W, reference(U.double(), G.double())) <= 1e-2


def test_plan_advice_uses_the_device_of_the_work() -> None:
    """A CPU scalar first (the review's repro) beside inputs on another device: advice as
    for that device (quadprog would copy G to the host there), not as for the CPU."""
    tjd = _tjd()
    weight = torch.zeros(2, 3, device="meta")

    def f(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight) * t

    heads = [lambda y, i=i: y[..., i].sum() for i in range(2)]
    combined = funcgrad.combine_heads(f, heads, tjd.UPGradWeighting())
    plan = combined.plan(torch.tensor(2.0), torch.zeros(2, 3, device="meta"))
    assert plan.advice is not None
    assert "DualConeProjector()" in plan.advice
    cpu = combined.plan(torch.tensor(2.0), torch.zeros(2, 3))  # all on the CPU, m = 2
    assert cpu.advice is None


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_polish_keeps_each_rows_best_round_on_degenerate_rows(seed: int) -> None:
    """Rows already optimal (v = u) on a rank-2 Gramian: multipliers within rounding of 0
    at the optimum, where the active set switches those bounds from round to round. The
    last of 4 rounds left such rows NaN (the review of session 6: 222 of 7,360 draws where
    ADMM + MPRGP had none); each row now keeps its best round. Seed 6 still left row 5 NaN
    (no round landed on v = u: fails on main at eaba9aa); v = u is now a candidate too."""
    m = 16
    U, G = _optimal_rows_on_rank_two(m, seed)
    W = funcgrad.DualConeProjector(check=False)(U, G)
    assert bool(torch.isfinite(W).all())
    assert _relative(W, _quadprog(U, G)) <= 1e-8
