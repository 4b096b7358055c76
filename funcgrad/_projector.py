"""A batched, sync-free solver of TorchJD's dual-cone projection (the QP inside UPGrad and
DualProj): `DualConeProjector`, a drop-in for TorchJD 0.18's ``projector=`` argument.

For each row u of U it solves ``min_v v^T G v subject to v >= u`` with G normalised and
regularised as TorchJD's ``QuadprogProjector`` does it (``G / trace(G)`` where the trace is at
least ``norm_eps``, else 0; then ``+ reg_eps * I``). All rows are solved together, on G's
device: first by ADMM (OSQP's splitting for a box, one inverse of the Jacobi-scaled G shared
by every row, the penalty rebalanced on the device), then by MPRGP from ADMM's answer
(Dostal and Schoberl 2005, "Minimizing quadratic functions subject to bound
constraints with the rate of convergence and finite termination"): conjugate gradient steps
on the current face, expansion steps (a feasible half step, then a projected gradient step of
length ``abar``) when a bound is hit, and proportioning steps that release the bounds whose
multipliers are negative. It is monotone (each step lowers ``v^T G v``), converges for any
positive definite G, and terminates finitely in exact arithmetic once the optimal face is
found, so its answer is the exact one (within rounding), not an approximation. For few tasks
(m <= 10, `EXACT_MAX`) the iteration budgets would be a fixed cost of thousands of ops: all
2^m faces are solved at once instead (`_enumerate`), an exact direct method. From 11 to 48
tasks (`POLISH_MAX`), a short ADMM (96 iterations) finds the active set, and a few rounds
of a primal-dual active set method with exact face solves (`_polish`: one batched Cholesky
factor per row and round) finish it, instead of 256 ADMM and 64 MPRGP iterations.

Assumptions, and how each is checked:

- G is symmetric positive semi-definite (a Gramian). ``reg_eps > 0`` makes it definite, so
  the solution is unique and equal to quadprog's.
- The iteration count is fixed (``max_iter``): a loop that stops when every row has
  converged would read a device value every iteration. Convergence is checked once, at the
  end, on the device (the KKT conditions ``v >= u``, ``G v >= 0``, ``(v - u) * (G v) = 0``
  within ``tol``); a row that did not converge comes back as NaN (a loud failure that
  funcgrad's own finiteness check, already one read per call, turns into an error), or, with
  ``check=True``, is re-solved by quadprog with a warning (``"strict"``: an error).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from typing import Any

import torch

from ._config import CheckMode, resolve_check
from ._errors import FuncgradWarning
from ._validate import outside_transforms

# The default iteration count, (4 m + 64) * max(1, sqrt(1e-4 / reg_eps)), from the
# experiments of docs/projector.md: at the default reg_eps = 1e-4 the hardest Gramians of the
# test sets needed up to 4 m iterations; reg_eps sets the conditioning (cond(G) <= (1 +
# reg_eps) / reg_eps after TorchJD's normalisation), and conjugate gradients need
# O(sqrt(cond)) iterations, hence the factor. Below _MIN_REG_EPS the budget would be
# impractical (and float64 accuracy degrades): refused at construction.
_BUDGET_PER_ROW = 4
_BUDGET_FLOOR = 64
_BUDGET_REG_EPS = 1e-4
_MIN_REG_EPS = 1e-8
# float32 resolves reg_eps >= 1e-5 (refused below, at the call): the error of a solve is about
# cond * eps = float32's 1.2e-7 / reg_eps, 1% at 1.2e-5 (measured against quadprog: 2% at
# 1e-6, 50% at 1e-7, NaN rows at 1e-8).
_MIN_REG_EPS_FLOAT32 = 1e-5
_GAMMA = 1.0  # MPRGP's proportioning constant
_STEP = 1.9  # expansion step abar = _STEP / lambda_max, in (0, 2 / lambda_max]
_POWER_SEED = 0x5EED  # the power iteration's start: a fixed-seed Gaussian vector
_POWER_MARGIN = 0.9  # lambda_max <= quotient / it, observed (see _lambda_max)
_POWER_STEPS = 24  # power iterations for lambda_max (a Rayleigh quotient: a lower bound)
_RELAX = 1.6  # ADMM's over-relaxation
_RHO = 1.0  # ADMM's first penalty (A Jacobi-scaled: a unit diagonal, mean eigenvalue 1)
_ADAPT = (8, 16, 32, 64, 128)  # ADMM iterations after which the penalty is rebalanced
_ADAPT_LIMIT = 1e4  # at most this factor per rebalance
# Default ADMM iterations, whatever m (docs/projector.md). Session 4's 128 + min(128, 8192 //
# m) (192 at m = 128, 160 at m = 256, 144 at m = 512) left NaN rows in float32 on review 5's
# families: aligned tasks with rows of both signs at m = 256 (3 of 90 Gramians) and clusters
# at m = 512 (17 of 42, and 1 of 10 of the tests' `clusters`); with 256, none of them.
_ADMM_BUDGET = 256
# MPRGP's default budget after ADMM in float32 (float64: `default_budget`): with it, 200 of
# 200 random Gramians (m = 2..128, UPGrad's rows and rows of both signs) converged; ADMM
# alone left 6 of 100 with unconverged rows (duplicate tasks: ADMM's slow tail). Half of it
# (session 5's cut) left NaN rows on 13 of review 5's 90 aligned-task Gramians.
_FINISH_FLOAT32 = 64
# Up to this m, `_enumerate` solves exactly, trying all 2^m faces at once (no iteration): as
# fast as quadprog on the CPU up to m = 6 (0.1-0.3 ms); at m = 8-10 its 256-1024 factors
# take 0.7-3 ms, 3-10x quadprog's time but 4-15x less than the iterations below (12-14 ms
# whatever m); at m = 12, 20-30 ms (docs/benchmarks_projector.md).
EXACT_MAX = 10
_EXACT_CHUNK = 1 << 22  # elements of the (2^m, rows, m) intermediate: rows in chunks
# From EXACT_MAX + 1 up to this m, a short ADMM then `_polish`'s exact face solves replace
# the long budgets: 96 ADMM iterations and 4 rounds (each one batched Cholesky factor per
# row) solved every Gramian of the tests with m = 11..64 in float32; at m = 64 the two cost
# about the same, at m = 96 the rounds cost 1.7x more. 8 rounds, each row keeping its best:
# on rows whose multipliers are within rounding of 0 at the optimum (rows already optimal,
# nearly opposed tasks) the last of 4 rounds left 222 of the review's 7,360 draws with NaN
# rows where ADMM + MPRGP had none (docs/benchmarks_projector.md).
POLISH_MAX = 48
_POLISH_ADMM = 96
_POLISH_ROUNDS = 8
# float32 above POLISH_MAX: a short ADMM, then `_active_set`'s rounds, whose face solves are a
# few conjugate-gradient steps (one product each, no factor): 4 in rounds 1-3, 8 in 4-6, then
# 16. On 87 + 131 Gramians of the tests' families (m = 64-160, UPGrad's rows and rows of
# both signs, float32) 32 ADMM iterations and 9 rounds converged every row, 8 rounds did
# not (aligned tasks): 11 is 2 more. 32 + 11 left a row of a random-rank Gramian at m = 56
# unconverged: 64 ADMM iterations. About 0.6x the time of 256 ADMM + 64 MPRGP iterations
# at m = 128 and 512 (docs/benchmarks_projector.md).
_ROUNDS = 11
_ROUNDS_ADMM = 64
_CG_STEPS = 16
_CHECK_EVERY = 32  # ADMM iterations between the (device-side) KKT checks of the rows
_FREEZE_EVERY = 8  # iterations between the (device-side) convergence checks of the rows


class ProjectorConvergenceError(RuntimeError):
    """`funcgrad.DualConeProjector` did not reach its tolerance within ``max_iter``
    iterations on some rows, with ``check="strict"``."""


class DualConeProjector:
    """Projects onto the dual cone of a Gramian's rows, as TorchJD's ``QuadprogProjector``
    does, but for all rows at once, on G's device, and without reading any device value.

    For each row u of ``U`` it returns ``argmin_v v^T G v subject to v >= u`` (TorchJD's
    ``torchjd.linalg.DualConeProjector.__call__``), after ``G / trace(G)`` (0 where the trace
    is below ``norm_eps``) and ``G + reg_eps * I``, exactly as ``QuadprogProjector``: ADMM
    with one inverse shared by the rows, then MPRGP from its answer (docs/projector.md); in
    float32, a short ADMM then 11 rounds of an active set method with conjugate-gradient
    face solves instead; for m <= 10 tasks, all 2^m faces at once (exact, no iteration,
    about 100 ops); for 11 to 48 tasks, a short ADMM then 8 rounds of exact face solves (no
    MPRGP). Pass it as ``UPGradWeighting(projector=funcgrad.DualConeProjector())`` (also
    ``UPGrad``, ``DualProjWeighting``, ``DualProj``), or call it on its own.

    Args:
        norm_eps: G is divided by its trace where the trace is at least ``norm_eps``, and
            replaced by zeros otherwise (TorchJD's ``normalize``).
        reg_eps: added to G's diagonal after normalisation (TorchJD's ``regularize``); it
            makes G definite, hence the solution unique, and sets the conditioning, hence
            the default budget. At least 1e-8 (below it, use TorchJD's
            ``QuadprogProjector``); with a float32 G at least 1e-5 (float32 cannot resolve
            less: refused at the call; pass G and U in float64 there).
        max_iter: MPRGP iterations after ADMM, a fixed count (each one product
            ``(rows, m) @ (m, m)`` and about 30 elementwise passes); None: 64 in float32,
            ``(4 m + 64)`` in float64, times ``max(1, sqrt(1e-4 / reg_eps))``, and 0 for
            m <= 48 (the exact face solves finish there) and after ``rounds``. 0 skips
            it. Unused for m <= 10 (``admm_iter`` too): those are solved without iterating.
        admm_iter: ADMM iterations first, a fixed count (each one product with a shared
            inverse and 4 elementwise passes); None: 256 times the same factor (96 times it
            for m <= 48, 64 times it before ``rounds``).
            0 skips it (MPRGP alone, from ``max(u, 0)``). Fewer iterations
            are faster, and rows that do not converge come back as NaN (or re-solved, see
            ``check``).
        rounds: for m > 48, rounds of a primal-dual active set method after ADMM, each
            face solved by up to 16 conjugate-gradient steps (times the same factor; one
            product each, no factor); None: 11 in float32, 0 in float64 (where MPRGP
            finishes to float64's tolerance). 0 gives ADMM then MPRGP.
        tol: a row has converged when its KKT residual ``max_j |min(v_j - u_j, (G v)_j)|``
            (on the problem scaled to a mean diagonal of 1 and u to max |u| = 1) is at most
            ``tol * (max |v| + max |u|)``; None: ``16 * eps * sqrt(m)`` for G's dtype.
        check: None follows `funcgrad.checking` / `funcgrad.set_check`. False reads
            nothing: unconverged rows are NaN. True reads one boolean per call and re-solves
            unconverged rows with TorchJD's ``QuadprogProjector``, with a
            `funcgrad.FuncgradWarning` (an error if quadprog is not installed); ``"strict"``
            raises ``DualConeProjector.ConvergenceError`` (a ``RuntimeError``) instead.
            With True or ``"strict"``, a non-finite G or U, or a G that is not positive
            semi-definite, raises a ``ValueError``; with False such input gives NaN rows
            (not checked: that would read the device).

    Examples:
        >>> import torch, funcgrad
        >>> J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)  # 2 tasks
        >>> project = funcgrad.DualConeProjector()
        >>> W = project(torch.eye(2, dtype=torch.float64), J @ J.T)
        >>> W.round(decimals=3)  # row i: the least change of e_i that conflicts with no task
        tensor([[1.0000, 0.5000],
                [1.0000, 1.0000]], dtype=torch.float64)
        >>> (W @ J @ J.T).round(decimals=3)  # >= 0, up to the regularisation reg_eps
        tensor([[0.5000, -0.0000],
                [-0.0000, 1.0000]], dtype=torch.float64)

    Notes:
        With TorchJD: ``UPGradWeighting(projector=funcgrad.DualConeProjector())`` gives the
        weights of ``UPGradWeighting()`` (quadprog), to 1e-8 relative in float64 on the tests'
        Gramians, without copying G to the host. funcgrad never imports TorchJD; where
        TorchJD is already imported, this class is registered as a virtual subclass of
        ``torchjd.linalg.DualConeProjector`` (whatever the import order). The result is not
        differentiable (as TorchJD's). Cost: ``admm_iter + max_iter`` products of the rows
        with an m x m matrix (2 m^3 flops each for UPGrad's m rows), and a few elementwise
        passes per iteration; for 11 to 48 tasks, 8 batched Cholesky factors of r matrices
        m x m besides; in float32 above 48 tasks, about 64 + 11 + 116 products (ADMM, the
        rounds, their conjugate-gradient steps).
    """

    ConvergenceError = ProjectorConvergenceError

    def __init__(
        self,
        norm_eps: float = 1e-4,
        reg_eps: float = 1e-4,
        *,
        max_iter: int | None = None,
        admm_iter: int | None = None,
        tol: float | None = None,
        check: CheckMode | None = None,
        rounds: int | None = None,
    ) -> None:
        # Each option is checked where it is set (`__setattr__`), here and on later assignment.
        self.norm_eps = norm_eps
        self.reg_eps = reg_eps
        self.max_iter = max_iter
        self.admm_iter = admm_iter
        self.rounds = rounds
        self.tol = tol
        self.check = check
        _register_with_torchjd()

    def __setattr__(self, name: str, value: Any) -> None:
        """Checks an option where it is set, in ``__init__`` and on a later assignment (as
        TorchJD's projectors' setters do), so a bad value never reaches a call."""
        call = f"funcgrad.DualConeProjector(...).{name}"
        if name == "norm_eps":
            if not _is_number(value) or not 0.0 <= value < math.inf:
                raise ValueError(f"{call}: `norm_eps` must be a finite number >= 0, got {value!r}.")
            value = float(value)
        elif name == "reg_eps":
            if not _is_number(value) or not _MIN_REG_EPS <= value < math.inf:
                raise ValueError(
                    f"{call}: `reg_eps` must be a finite number >= {_MIN_REG_EPS:g}, got "
                    f"{value!r}. Below it G's conditioning (up to 1 / reg_eps) needs an "
                    "impractical iteration count; use TorchJD's QuadprogProjector there."
                )
            value = float(value)
        elif name in ("max_iter", "admm_iter", "rounds"):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{call}: `{name}` must be an int >= 0 or None, got {value!r}.")
        elif name == "tol":
            if value is not None and (not _is_number(value) or not 0.0 < value < math.inf):
                raise ValueError(
                    f"{call}: `tol` must be a finite number > 0 or None, got {value!r}."
                )
        elif name == "check" and not (
            value is None or value is True or value is False or value == "strict"
        ):
            raise ValueError(
                f"{call}: `check` must be None, True, False or 'strict', got {value!r}. "
                "True reads once per call and re-solves unconverged rows with quadprog; "
                "'strict' raises instead; False reads nothing (unconverged rows are NaN)."
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        options = {
            "max_iter": self.max_iter,
            "admm_iter": self.admm_iter,
            "rounds": self.rounds,
            "tol": self.tol,
            "check": self.check,
        }
        extra = "".join(f", {key}={value!r}" for key, value in options.items() if value is not None)
        return f"DualConeProjector(norm_eps={self.norm_eps}, reg_eps={self.reg_eps}{extra})"

    def __call__(self, U: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """The weights W (shape of ``U``, G's dtype and device): row by row,
        ``argmin_v v^T G v subject to v >= u``, G normalised and regularised."""
        call = "funcgrad.DualConeProjector(U, G)"
        _validate(U, G, call)
        _register_with_torchjd()  # (a dict lookup: TorchJD may have been imported since)
        mode = resolve_check(self.check, call)
        if G.dtype == torch.float32 and self.reg_eps < _MIN_REG_EPS_FLOAT32:
            raise ValueError(
                f"{call}: `reg_eps` = {self.reg_eps:g} is below {_MIN_REG_EPS_FLOAT32:g}, "
                "what float32 resolves: the regularised Gramian's conditioning (up to "
                "1 / reg_eps) times float32's epsilon (1.2e-7) must stay below about 1%, or "
                "the answer is wrong (singular in float32). Pass reg_eps >= "
                f"{_MIN_REG_EPS_FLOAT32:g}, or G and U in float64 (G.double(), U.double())."
            )
        if G.shape[0] == 0:  # no task: the empty answer
            return U.detach().to(device=G.device, dtype=G.dtype).clone()
        # Inference mode where no torch.func transform runs (it cannot hold inference
        # tensors): the solver's thousands of small ops skip autograd's dispatch
        # (docs/benchmarks_projector.md). W is cloned out of it below, so that the caller
        # gets an ordinary tensor (usable in autograd, writable in place).
        fast = not torch.compiler.is_compiling() and outside_transforms((U, G))
        with torch.inference_mode() if fast else torch.no_grad():
            gramian = regularized(G.detach(), self.norm_eps, self.reg_eps)
            rows = U.detach().to(device=G.device, dtype=G.dtype).reshape(-1, G.shape[0])
            mprgp, admm, rounds = self._budgets(G.shape[0], G.dtype)
            W, converged = solve(
                gramian, rows, mprgp, admm, self.tol, rounds=rounds, cg_steps=self._cg_steps()
            )
            if mode is not False:
                ok = converged.all() & torch.isfinite(G).all() & torch.isfinite(U).all()
                if not bool(ok):  # the one read, on request
                    W = self._fallback(U, G, W, converged, mode)
        return W.reshape(U.shape).clone()

    def _budgets(self, m: int, dtype: torch.dtype) -> tuple[int, int, int]:
        """(MPRGP iterations, ADMM iterations, active set rounds) for a Gramian of size m."""
        factor = max(1.0, math.sqrt(_BUDGET_REG_EPS / self.reg_eps))
        rounds = self.rounds
        if rounds is None:
            rounds = _ROUNDS if dtype != torch.float64 else 0
        rounds = rounds if m > POLISH_MAX else 0  # (exact face solves up to POLISH_MAX)
        admm = self.admm_iter
        if admm is None:
            admm = (
                math.ceil(_ROUNDS_ADMM * factor) if rounds else default_admm_budget(m, self.reg_eps)
            )
        if self.max_iter is not None:
            return self.max_iter, admm, rounds
        if dtype == torch.float64 or m <= POLISH_MAX:
            return default_budget(m, self.reg_eps), admm, rounds
        return (0 if rounds else math.ceil(_FINISH_FLOAT32 * factor)), admm, rounds

    def _cg_steps(self) -> int:
        """The conjugate-gradient steps of a full round (`_active_set`): O(sqrt(cond))."""
        return math.ceil(_CG_STEPS * max(1.0, math.sqrt(_BUDGET_REG_EPS / self.reg_eps)))

    def _fallback(
        self,
        U: torch.Tensor,
        G: torch.Tensor,
        W: torch.Tensor,
        converged: torch.Tensor,
        mode: CheckMode,
    ) -> torch.Tensor:
        for name, t in (("G", G), ("U", U)):  # further reads, on the failure path only
            if not bool(torch.isfinite(t).all()):
                raise ValueError(
                    f"funcgrad.DualConeProjector(U, G): `{name}` has non-finite entries "
                    "(NaN or inf); the projection is undefined."
                )
        bad = (~converged).nonzero().flatten()
        m = G.shape[0]
        mprgp, admm, rounds = self._budgets(m, G.dtype)
        why = (
            f"funcgrad.DualConeProjector(U, G): {bad.numel()} of {W.shape[0]} rows did not "
            f"reach the tolerance in admm_iter={admm}, rounds={rounds} and max_iter={mprgp} "
            f"iterations (m = {m}, {G.dtype})"
        )
        if mode == "strict":
            raise ProjectorConvergenceError(
                f"{why}. Raise rounds or max_iter, or pass check=True to re-solve them with "
                "quadprog; if neither helps, check that G is symmetric positive semi-definite "
                "(torch.linalg.eigvalsh(G))."
            )
        try:
            from torchjd.linalg import QuadprogProjector
        except ImportError as error:
            raise ProjectorConvergenceError(
                f"{why}, and TorchJD's QuadprogProjector, the fallback, cannot be imported "
                f"({error}). Raise rounds or max_iter, or install torchjd[quadprog_projector]."
            ) from error
        warnings.warn(
            f"{why}; re-solving them with TorchJD's QuadprogProjector (host reads). Raise "
            "rounds or max_iter to stay on the device.",
            FuncgradWarning,
            stacklevel=3,
        )
        exact: Any = QuadprogProjector(norm_eps=self.norm_eps, reg_eps=self.reg_eps)
        rows = U.detach().reshape(-1, m)[bad]
        W = W.clone()
        try:
            W[bad] = exact(rows, G.detach()).to(W.dtype)
        except Exception as error:  # qpsolvers' ProblemError: "P is not positive definite"
            raise ValueError(
                "funcgrad.DualConeProjector(U, G): TorchJD's QuadprogProjector failed on the "
                f"rows that did not converge ({type(error).__name__}: {error}): `G` must be "
                "a symmetric positive semi-definite Gramian (J @ J.T); check its "
                "eigenvalues (torch.linalg.eigvalsh(G))."
            ) from error
        return W


_SOLVERS = ("UPGradWeighting", "DualProjWeighting", "UPGrad", "DualProj")


# On the CPU, quadprog (row by row, on the host: no sync to pay there) is faster than this
# projector below about m = 64 tasks (docs/benchmarks_projector.md): no advice there.
CPU_ADVICE_FROM = 64


def projector_advice(
    weighting: object, m: int | None = None, device: torch.device | None = None
) -> str | None:
    """Where ``weighting`` is TorchJD's UPGrad or DualProj (weighting or aggregator) with
    its default ``QuadprogProjector``, how to pass this projector instead (`funcgrad.Plan`'s
    ``advice``); else None. Also None for m < `CPU_ADVICE_FROM` tasks on the CPU, where
    quadprog is the faster (on another device it copies G to the host: advised for any m).
    funcgrad never swaps a user's projector."""
    name = type(weighting).__name__
    if name not in _SOLVERS:
        return None
    on_cpu = device is None or device.type == "cpu"
    if m is not None and on_cpu and m < CPU_ADVICE_FROM:
        return None
    inner = getattr(weighting, "gramian_weighting", weighting)  # aggregators hold one
    projector = getattr(inner, "projector", getattr(inner, "_projector", None))
    if type(projector).__name__ != "QuadprogProjector":
        return None
    return (
        f"{name} solves its dual-cone QPs with TorchJD's default QuadprogProjector "
        "(quadprog, one QP per row on the host: a device sync, and slow for many rows); "
        f"{name}(projector=funcgrad.DualConeProjector()) solves them batched on the device "
        "(docs/projector.md)"
    )


_TORCHJD_MODULE = "torchjd._linalg._dual_cone"  # where torchjd.linalg.DualConeProjector lives


def _register_with_torchjd() -> bool:
    """Make ``isinstance(p, torchjd.linalg.DualConeProjector)`` true where TorchJD is
    imported (funcgrad never imports it: it takes seconds). True once registered."""
    module = sys.modules.get(_TORCHJD_MODULE)
    base: Any = getattr(module, "DualConeProjector", None)
    if base is None or not hasattr(base, "register"):
        return False
    if not issubclass(DualConeProjector, base):
        base.register(DualConeProjector)
    return True


def _validate(U: object, G: object, call: str) -> None:
    if not isinstance(G, torch.Tensor) or G.ndim != 2 or G.shape[0] != G.shape[1]:
        got = f"shape {tuple(G.shape)}" if isinstance(G, torch.Tensor) else type(G).__name__
        raise ValueError(f"{call}: `G` must be a square (m, m) Gramian, got {got}.")
    if not isinstance(U, torch.Tensor) or U.ndim == 0 or U.shape[-1] != G.shape[0]:
        got = f"shape {tuple(U.shape)}" if isinstance(U, torch.Tensor) else type(U).__name__
        raise ValueError(
            f"{call}: `U` must have shape (..., m) with m = {G.shape[0]} (G's size), got {got}."
        )
    for name, t in (("G", G), ("U", U)):
        if not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"{call}: `{name}` must be float32 or float64, got {t.dtype}. Convert it "
                f"with {name}.float() or {name}.double()."
            )


def regularized(G: torch.Tensor, norm_eps: float, reg_eps: float) -> torch.Tensor:
    """TorchJD's ``regularize(normalize(G, norm_eps), reg_eps)``, op for op."""
    trace = G.diagonal().sum()
    normalized = torch.where(trace < norm_eps, torch.zeros_like(G), G / trace)
    return normalized + reg_eps * torch.eye(G.shape[0], dtype=G.dtype, device=G.device)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def default_budget(m: int, reg_eps: float = _BUDGET_REG_EPS) -> int:
    """``(4 m + 64) * max(1, sqrt(1e-4 / reg_eps))``: reg_eps bounds the conditioning; 0 for
    m <= `POLISH_MAX` (`_polish` finishes there)."""
    if m <= POLISH_MAX:
        return 0
    factor = max(1.0, math.sqrt(_BUDGET_REG_EPS / reg_eps))
    return math.ceil((_BUDGET_PER_ROW * m + _BUDGET_FLOOR) * factor)


def default_admm_budget(m: int, reg_eps: float = _BUDGET_REG_EPS) -> int:
    """``256 * max(1, sqrt(1e-4 / reg_eps))`` ADMM iterations (96 times it for m <=
    `POLISH_MAX`, where `_polish` finishes)."""
    factor = max(1.0, math.sqrt(_BUDGET_REG_EPS / reg_eps))
    return math.ceil((_POLISH_ADMM if m <= POLISH_MAX else _ADMM_BUDGET) * factor)


def default_tol(m: int, dtype: torch.dtype) -> float:
    return 16 * torch.finfo(dtype).eps * math.sqrt(m)


def _lambda_max(A: torch.Tensor) -> torch.Tensor:
    """An estimate of the largest eigenvalue of the PSD matrix A (mean diagonal 1), meant to
    be at least it: the Rayleigh quotient after a fixed number of power iterations (at least
    1, as the largest diagonal entry is), divided by 0.9, capped by ``||A||_F``. The start is
    a fixed-seed Gaussian vector, drawn on A's device, so it is not orthogonal to the top
    eigenvector in practice: a structured start (ones plus a sine) underestimated lambda_max
    by 2x on an adversarial A, and the expansion step 1.9 / lambda then broke MPRGP's bound
    2 / lambda_max. The converged rows are certified by the KKT check either way."""
    m = A.shape[0]
    gen = torch.Generator(device=A.device).manual_seed(_POWER_SEED)
    x = torch.randn(m, generator=gen, dtype=A.dtype, device=A.device)
    for _ in range(_POWER_STEPS):
        x = A @ x
        x = x / x.norm().clamp_min(torch.finfo(A.dtype).tiny)
    quotient = torch.maximum(x @ (A @ x), torch.ones((), dtype=A.dtype, device=A.device))
    # Near-equal top eigenvalues (duplicate or clustered tasks) converge slowly: the
    # quotient was at least 0.90 lambda_max on 300 random Gramians; / _POWER_MARGIN makes
    # the step 1.9 / it safe (<= 2 / lambda_max) down to 0.855 lambda_max, and the Frobenius
    # norm (>= lambda_max) caps it.
    return torch.minimum(quotient / _POWER_MARGIN, torch.linalg.matrix_norm(A))


def _norm(a: torch.Tensor) -> torch.Tensor:
    """Row-wise max-norms (no squares: those of small residuals are subnormal, slow on the
    CPU)."""
    return a.abs().amax(1)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products, (r, 1) (``linalg.vecdot`` is slower on the CPU)."""
    return (a * b).sum(1, keepdim=True)


def solve(
    G: torch.Tensor,
    U: torch.Tensor,
    max_iter: int | None = None,
    admm_iter: int | None = None,
    tol: float | None = None,
    exact_max: int = EXACT_MAX,
    polish_max: int = POLISH_MAX,
    rounds: int = 0,
    cg_steps: int = _CG_STEPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, converged): for m <= ``exact_max``, `_enumerate`; else ADMM (``admm_iter``
    iterations, None: `default_admm_budget`), then for m <= ``polish_max`` `_polish`'s exact
    face solves, else ``rounds`` of `_active_set` (up to ``cg_steps`` CG steps each), then
    MPRGP from that answer (``max_iter``, None: `default_budget`), on every row of U (r, m)
    with the (regularised) G, no host read; unconverged rows are NaN.

    Each row is first divided by its max |u| (the problem is positively homogeneous in u:
    the answer for c * u, c > 0, is c times the one for u), so that rows of 1e160 or 1e-18
    neither overflow nor underflow; G is scaled by one scalar to a mean diagonal of 1.
    """
    rmax = U.abs().amax(1, keepdim=True)
    rmax = torch.where(rmax > 0, rmax, torch.ones_like(rmax))  # a zero row: W = 0 anyway
    m = G.shape[0]
    admm = default_admm_budget(m) if admm_iter is None else admm_iter
    increment, converged = _solve(
        G, U / rmax, max_iter, tol, admm, exact_max, polish_max, rounds, cg_steps
    )
    return U + increment * rmax, converged  # >= U exactly (the increment is >= 0 or NaN)


def _solve(
    G: torch.Tensor,
    U: torch.Tensor,
    max_iter: int | None,
    tol: float | None,
    admm_iter: int = 0,
    exact_max: int = EXACT_MAX,
    polish_max: int = POLISH_MAX,
    rounds: int = 0,
    cg_steps: int = _CG_STEPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = G.shape[0]
    budget = default_budget(m) if max_iter is None else max_iter
    tol = default_tol(m, G.dtype) if tol is None else tol
    # One scalar scale (``v = s * y``, mean diagonal of A = 1), not a per-task one: after
    # TorchJD's normalisation cond(G) <= (1 + reg_eps) / reg_eps whatever the tasks' scales,
    # and a Jacobi scaling makes it worse where reg_eps dominates small tasks' diagonals.
    s = G.diagonal().mean().clamp_min(torch.finfo(G.dtype).tiny).rsqrt()
    A = G * (s * s)
    A = (A + A.T) / 2  # exactly symmetric (the products below assume it)
    low = U / s  # the bound on y
    if m <= exact_max:  # every face at once: exact, about 15 ops (no iteration budget)
        return _checked(A, low, _enumerate(A, low), s, tol)
    gap = _admm(A, low, admm_iter, tol) if admm_iter else low.clamp_min(0) - low
    if m <= polish_max:  # exact face solves from ADMM's active set
        gap = torch.cat(
            [
                _polish(A, low_part, gap_part)
                for low_part, gap_part in zip(
                    torch.split(low, max(1, _EXACT_CHUNK // (m * m))),
                    torch.split(gap, max(1, _EXACT_CHUNK // (m * m))),
                )
            ]
        )
    elif rounds:  # inexact face solves (CG) from ADMM's active set
        gap = _active_set(A, low, gap, rounds, cg_steps)
    dtype = G.dtype
    if budget == 0:  # the ADMM answer, checked (below)
        return _checked(A, low, gap, s, tol)
    abar = _STEP / _lambda_max(A)
    inv_abar = 1 / abar
    tiny = torch.finfo(dtype).tiny
    # The state is x = y - low >= 0 (``gap``), the gradient g = A y (kept up to date
    # incrementally, recomputed after an expansion), the CG direction P. Masks are 0/1
    # floats: boolean (r, m) tensors and ``torch.where`` are slow on the CPU. The updates
    # are in place (gap and g are this function's own tensors), and phi = g * free is
    # computed once per iteration: 29 passes over (r, m), one product and about 17 small
    # (r, 1) ops an iteration, from 34 and 27 (docs/benchmarks_projector.md).
    g = (low + gap) @ A
    phi = g * torch.sign(gap)  # the free gradient (sign(gap): 1 off the bounds, 0 on them)
    P = phi
    stale = torch.zeros_like(U[:, :1])  # 1 where g is out of date (after an expansion)
    # 0 where a row has converged (checked every few iterations): it takes no more steps, so
    # that its residual does not shrink on into subnormal numbers (slow on the CPU). A stale
    # row is never frozen (the check skips it) and a frozen one never expands: 1 - stale -
    # frozen is 1 exactly on the rows that step, 0 elsewhere.
    frozen = torch.zeros_like(stale)
    fresh = 1 - frozen
    bound = tol * low.abs().amax(1, keepdim=True) / 4
    for iteration in range(budget):  # (budget may be 0: the ADMM answer, checked)
        if iteration % _FREEZE_EVERY == _FREEZE_EVERY - 1:
            residual = torch.minimum(gap, g).abs().amax(1, keepdim=True)
            scale = (low + gap).abs().amax(1, keepdim=True)
            done = (residual <= tol / 4 * scale + bound).to(dtype) * (1 - stale)
            frozen = torch.maximum(frozen, done)
            fresh = 1 - frozen - stale
        # The chopped gradient, min(g, 0) off the free set: bounds to release (g - phi is
        # g there and exactly 0 on it). phi and beta are stale on a row whose g is (the
        # row after an expansion): that row takes no step, and its D is y (below).
        beta = torch.sub(g, phi).clamp_max_(0)
        phit = torch.minimum(gap * inv_abar, phi)  # the reduced free gradient (0 on bounds)
        proportional = _dot(beta, beta) <= _GAMMA**2 * _dot(phit, phi)
        prop = proportional.to(dtype)
        cg = fresh * prop
        # The direction: the CG one where proportional, else the chopped gradient; y itself
        # where g must be recomputed (then no step is taken).
        D = torch.lerp(torch.lerp(beta, P, prop), low + gap, stale)
        Q = D @ A
        dQd = _dot(D, Q).clamp_min_(tiny)
        alpha = _dot(g, D) / dQd
        # 1 / the longest feasible step along -D (only D's positive entries meet a bound:
        # the row's largest D / gap, or 0 where none is positive)
        inv_feasible = (D / gap.clamp_min(tiny)).amax(1, keepdim=True).clamp_min_(0)
        expand = cg * (alpha * inv_feasible > 1)  # 1 where the CG step would cross a bound
        # the step: to the first bound where expanding (1 / inv_feasible, finite there),
        # else the CG (or chopped gradient) minimiser alpha; 0 on rows that do not step
        step = torch.where(expand > 0, inv_feasible.reciprocal(), alpha) * fresh
        gap.addcmul_(step, D, value=-1).clamp_min_(0)
        g.addcmul_(step, Q, value=-1).lerp_(Q, stale)  # a stale row: g = Q = A y exactly
        phi = g * torch.sign(gap)
        # expansion rows: a projected gradient step of length abar from the half step (their
        # phi is then out of date with the new bounds: the next iteration recomputes g)
        gap.addcmul_(expand * abar, phi, value=-1).clamp_min_(0)
        gamma = _dot(phi, Q) / dQd
        P = torch.addcmul(phi, (cg - expand) * gamma, P, value=-1)
        fresh = fresh + stale - expand  # the stale rows step again, the expanding ones wait
        stale = expand
    return _checked(A, low, gap, s, tol)


@functools.lru_cache(maxsize=32)
def _faces(
    m: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 2^m faces: F (2^m, m), 1 on the free variables; F F^T; the identity off F."""
    bits = torch.arange(m, device=device)
    F = (torch.arange(1 << m, device=device)[:, None].bitwise_right_shift(bits) & 1).to(dtype)
    return F, F[:, :, None] * F[:, None, :], torch.diag_embed(1 - F)


def _enumerate(A: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``y - low >= 0`` for ``min y^T A y, y >= low`` on every row of ``low`` (r, m),
    exactly, by trying every face at once: for each of the 2^m sets F of free variables (the
    others on their bound), the stationary point of the face, ``A_FF y_F = -A_FB low_B`` (y =
    low off F), from one batched Cholesky factor per face shared by the rows; each row keeps
    the face whose point violates the KKT conditions (``y >= low``, ``(A y)_j >= 0`` off F)
    the least. A is positive definite (regularised), so exactly one face holds the unique
    solution (up to faces that give the same point, where a bound is weakly active), and its
    violation is at rounding level. Cost: 2^m factors of size m and a (2^m, r, m)
    intermediate, hence m <= `EXACT_MAX`; about 15 tensor ops, no iteration, no read.
    """
    F, FF, bounds = _faces(A.shape[0], A.dtype, A.device)
    # A on F x F, the identity elsewhere: positive definite, so the factor needs no pivoting
    K = torch.addcmul(bounds, FF, A)
    L = torch.linalg.cholesky_ex(K)[0]
    rows = max(1, _EXACT_CHUNK // (F.shape[0] * F.shape[1]))  # bounded memory: row chunks
    parts = [_best_face(A, F, L, part) for part in torch.split(low, rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _best_face(
    A: torch.Tensor, F: torch.Tensor, L: torch.Tensor, low: torch.Tensor
) -> torch.Tensor:
    """`_enumerate` on some rows: the point of each face, and each row's least violating."""
    # y = low off F; on F, A_FF y_F = -(A_FB low_B): the right side is 0 where the bounds are
    # 0, so that y is exact there (solving for x = y - low left 1e-12 where v = 0)
    bound = low * (1 - F[:, None, :])  # (2^m, r, m)
    y = torch.cholesky_solve(-(bound @ A * F[:, None, :]).transpose(1, 2), L).transpose(1, 2)
    y = y + bound
    x = y - low  # >= 0 on F for the solution's face; 0 off F
    w = y @ A  # the gradient; 0 on F up to rounding
    violation = torch.maximum((-x).amax(2), (-w * (1 - F[:, None, :])).amax(2))  # (2^m, r)
    best = violation.argmin(0)  # NaN input: a NaN violation wins, and the check catches it
    gap = x.gather(0, best[None, :, None].expand(1, *x.shape[1:]))[0]
    return gap.clamp_min(0)  # exactly >= 0 (the kept face's x is >= 0 up to rounding)


def _residual(
    A: torch.Tensor, low: torch.Tensor, gap: torch.Tensor, AY: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's KKT residual relative to its scale (`_checked`'s test: <= tol), (r, 1);
    ``AY``, where given, is ``(low + gap) @ A``, already computed."""
    Y = low + gap
    residual = torch.minimum(gap, Y @ A if AY is None else AY).abs().amax(1, keepdim=True)
    scale = Y.abs().amax(1, keepdim=True) + low.abs().amax(1, keepdim=True)
    return residual / scale.clamp_min(torch.finfo(A.dtype).tiny)


def _polish(A: torch.Tensor, low: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
    """``y - low >= 0`` after `_POLISH_ROUNDS` rounds of a primal-dual active set method
    (Hintermuller, Ito and Kunisch 2003; OSQP's "polish" is one such round) from ``gap``'s
    active set: each round solves, for every row at once, the stationary point of its face
    (F = the free variables, y = low off F, ``A_FF y_F = -A_FB low_B``, one batched Cholesky
    factor of ``A ⊙ f fᵀ + diag(1 - f)``, positive definite as A is), then frees the bounds
    whose multipliers ``(A y)_j`` are negative and binds the free variables that went below
    their bound. Once the face is the optimal one, one round gives the exact answer (a
    direct solve, not an approximation). Each row keeps, of ``gap``, ``y = low`` (feasible,
    and the answer of a row already optimal) and every round's answer, the one with the
    smallest KKT residual: a row that ADMM had finished cannot be made worse. Cost:
    ``rounds`` batched factors of r matrices m x m, hence m <= `POLISH_MAX`; about 15 ops
    a round, no read."""
    free = torch.sign(gap)
    eye = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    best, least = _candidates(A, low, gap)
    for _ in range(_POLISH_ROUNDS):
        bound = low - low * free  # low off F, 0 on F
        K = torch.addcmul(eye - eye * free[:, :, None], free[:, :, None] * A, free[:, None, :])
        L = torch.linalg.cholesky_ex(K)[0]
        rhs = ((bound @ A) * free).neg_()
        y = torch.cholesky_solve(rhs[:, :, None], L)[:, :, 0] * free + bound
        x = y - low  # exactly 0 off F
        w = y @ A  # the multipliers off F (0 on F up to rounding)
        free = free * (x > 0) + (1 - free) * (w < 0)
        best, least = _keep_better(A, low, x.clamp_min(0), best, least)
    return best


def _candidates(
    A: torch.Tensor, low: torch.Tensor, gap: torch.Tensor, AY: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(best, its residual), of ``gap`` and ``y = low`` (0): on a row already optimal the
    multipliers are within rounding of 0 and an active set method can switch those bounds
    back and forth without ever landing on it. ``AY``: as `_residual`."""
    best, least = gap, _residual(A, low, gap, AY)
    stay = _residual(A, low, torch.zeros_like(gap))
    better = stay < least
    return torch.where(better, 0.0, best), torch.where(better, stay, least)


def _keep_better(
    A: torch.Tensor,
    low: torch.Tensor,
    gap: torch.Tensor,
    best: torch.Tensor,
    least: torch.Tensor,
    AY: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row keeps its best round: on degenerate rows (multipliers within rounding of 0 at
    the optimum) the active set can switch those bounds back and forth, so the last round
    need not be the converged one. (NaN compares false: never kept.) ``AY``: as `_residual`."""
    residual = _residual(A, low, gap, AY)
    better = residual < least
    return torch.where(better, gap, best), torch.where(better, residual, least)


def _active_set(
    A: torch.Tensor, low: torch.Tensor, gap: torch.Tensor, rounds: int, cg_steps: int
) -> torch.Tensor:
    """``y - low >= 0`` after ``rounds`` rounds of `_polish`'s primal-dual active set method
    from ``gap``'s active set, each face solve ``A_FF y_F = -A_FB low_B`` done inexactly by
    conjugate gradients from the current point: ``cg_steps`` // 4 steps in rounds 1-3,
    // 2 in rounds 4-6, then ``cg_steps``, each one product of the rows with A (shared, no
    factor) and about 10 elementwise ops. The face matrices of hard Gramians (clusters,
    duplicate or aligned tasks: a few large eigenvalues, the rest near reg_eps) are a
    multiple of the identity plus a low-rank term, on which CG converges in a few steps.
    Each row keeps its best round (by KKT residual, `_keep_better`); no read. The CG steps
    update the whole gradient ``g = A y`` (not only its face part), so that the multipliers
    off F come without a product; a round's one other product, ``A y`` at its clamped end
    point, serves both its KKT residual and the next round's start."""
    tiny = torch.finfo(A.dtype).tiny
    free = torch.sign(gap)
    y = low + gap  # low off F (gap is 0 there), and so at every round's start below
    g = y @ A
    best, least = _candidates(A, low, gap, g)
    for round_ in range(rounds):
        s = g * free  # the face's gradient, (A y)_F; q: minus the CG direction
        q, ss = s, _dot(s, s)
        for _ in range(cg_steps >> max(0, 2 - round_ // 3)):
            Aq = q @ A
            alpha = ss / _dot(q, Aq).clamp_min_(tiny)
            y.addcmul_(alpha, q, value=-1)
            g.addcmul_(alpha, Aq, value=-1)
            s = g * free
            ss, previous = _dot(s, s), ss
            q = torch.addcmul(s, ss / previous.clamp_min_(tiny), q)
        x = y - low
        free = free * (x > 0) + (1 - free) * (g < 0)  # g off F: the multipliers
        y = low + x.clamp_min_(0)  # 0 off the new F, as the clamp or the old bound set it
        g = y @ A
        best, least = _keep_better(A, low, x, best, least, g)
    return best


def _checked(
    A: torch.Tensor, low: torch.Tensor, gap: torch.Tensor, s: torch.Tensor, tol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(increment, converged): the rows whose KKT residual is within tol, the others NaN."""
    Y = low + gap
    g = Y @ A  # fresh, for the KKT check
    residual = torch.minimum(gap, g).abs().amax(1)
    scale = Y.abs().amax(1) + low.abs().amax(1)
    converged = residual <= tol * scale
    increment = gap * s  # W = Y * s = U + increment
    increment = torch.where(converged[:, None], increment, torch.full_like(increment, math.nan))
    return increment, converged


def _admm(A: torch.Tensor, low: torch.Tensor, iterations: int, tol: float) -> torch.Tensor:
    """``y - low >= 0`` after ``iterations`` steps of ADMM on ``min y^T A y, y >= low`` (every
    row of ``low``), with one shared inverse of the (Jacobi-scaled) A per penalty.

    The splitting is ``y = z``, ``z >= low`` (OSQP's, for a box): the y-step is one product
    of the rows with ``M = rho (A + rho I)^-1``, shared by the rows, the z-step a clamp;
    over-relaxed by ``_RELAX``. The penalty rho, one for all rows, is rebalanced after the
    iterations of ``_ADAPT`` by OSQP's rule, ``rho * sqrt(primal / dual residual)`` (the
    residuals summed over the rows), on the device. Every ``_CHECK_EVERY`` iterations and at
    the end, a row within tol of the KKT conditions keeps that iterate (float32 iterates
    wander at rounding level once converged); a row that never did returns its last iterate
    (MPRGP's start).
    """
    m = A.shape[0]
    eye = torch.eye(m, dtype=A.dtype, device=A.device)
    dh = A.diagonal().rsqrt()  # y = dh * z: At = diag(dh) A diag(dh) has a unit diagonal
    At = dh[:, None] * A * dh[None, :]
    At = (At + At.T) / 2
    lowt = low / dh
    tiny = torch.finfo(A.dtype).tiny

    def factor(rho: torch.Tensor) -> torch.Tensor:
        # At + rho I is positive definite (At is, regularised): a Cholesky factor and one
        # triangular solve give its inverse, L^-T L^-1, cheaper than inv_ex's LU
        # (docs/benchmarks_projector.md). Were the factor to fail (rounding), ADMM's
        # answer would be NaN and so every row's: check=True then warns and solves with
        # quadprog, check=False returns NaN rows, never a wrong answer (none failed in the
        # tests' or the review's families).
        L = torch.linalg.cholesky_ex(At + rho * eye)[0]  # rho ~ 1e-3..1
        root = torch.linalg.solve_triangular(L, eye, upper=False)
        inverse: torch.Tensor = root.T @ root
        return (inverse + inverse.T) * (rho / 2)  # symmetric: rows @ M is M's action

    rho = torch.full((), _RHO, dtype=A.dtype, device=A.device)
    M = factor(rho)
    z = lowt.clamp_min(0)
    q = -z  # q = w - z, w the scaled multiplier (w = 0 at the start)
    best = z
    done = torch.zeros_like(z[:, :1])
    bound = tol / 2 * low.abs().amax(1, keepdim=True)  # tol / 2: the final check agrees
    for iteration in range(1, iterations + 1):
        # t = relax * y + (1 - relax) * z + w, y = (z - w) @ M = -(q @ M): two passes
        t = torch.addmm(torch.add(q, z, alpha=2 - _RELAX), q, M, alpha=-_RELAX)
        znew = torch.maximum(lowt, t)
        if iteration in _ADAPT and iteration < iterations:  # (a last one would go unused)
            y = (t - (1 - _RELAX) * z - (q + z)) / _RELAX
            primal = _norm(y - znew) / _norm(znew).clamp_min(tiny)
            dual = _norm(znew - z) / _norm(znew @ At).clamp_min(tiny)
            ratio = primal.sum() / (rho * dual.sum()).clamp_min(tiny)
            new = rho * ratio.clamp(_ADAPT_LIMIT**-2, _ADAPT_LIMIT**2).sqrt()
            new = torch.where(torch.isfinite(new), new, rho)
            q = (t - znew) * (rho / new) - znew  # the scaled multiplier follows rho
            rho = new
            M = factor(rho)
        else:
            q = torch.add(t, znew, alpha=-2)  # w - z = (t - z) - z
        z = znew
        if iteration % _CHECK_EVERY == 0 or iteration == iterations:
            residual = torch.minimum((z - lowt) * dh, (z * dh) @ A).abs().amax(1, keepdim=True)
            now = (residual <= tol / 2 * (z * dh).abs().amax(1, keepdim=True) + bound) * (1 - done)
            best = torch.lerp(best, z, now)
            done = done + now
    # A row that never met the check leaves with its last iterate, not the start: MPRGP's
    # warm start is ADMM's progress on exactly the rows that need it.
    best = torch.lerp(best, z, 1 - done)
    return (best - lowt) * dh  # exactly 0 on the bounds (best >= lowt: a clamp)


_register_with_torchjd()  # where TorchJD is imported before funcgrad


class MGDAWeighting:
    """TorchJD's ``MGDAWeighting`` (the Frank-Wolfe solver of Sener and Koltun 2018,
    Algorithm 2) without a host read: the same iterates, a fixed iteration count.

    TorchJD's loop reads three device values an iteration (its two step-size branches and its
    stop ``gamma < epsilon``): a host sync each on a GPU. This one runs all ``max_iters``
    iterations on the device, the branches as ``torch.where`` and the stop as a device-side
    mask: once a step is below ``epsilon`` the weights are frozen, as TorchJD's loop breaks
    there. Every product is TorchJD's (``G @ alpha``, ``alpha @ (G @ e_t)``), so the answer
    is TorchJD's to the last bits, not only to its tolerance; the cost is that of TorchJD's
    loop at ``max_iters`` (about 20 small ops an iteration), where TorchJD's stops early. It
    is a Gramian weighting: pass it as ``weighting=`` to `funcgrad.backward`,
    `funcgrad.combine_heads` or ``per_example(...).backward``, or call it on a Gramian.

    Args:
        epsilon: the step ``gamma`` below which the iteration stops (TorchJD's ``epsilon``).
        max_iters: the iteration count, all run (TorchJD's ``max_iters``, its upper bound).

    Examples:
        >>> import torch, funcgrad
        >>> G = torch.tensor([[1.0, -0.5], [-0.5, 4.0]], dtype=torch.float64)
        >>> with funcgrad.HostReadCounter() as reads:
        ...     w = funcgrad.MGDAWeighting()(G)
        >>> reads.count, w.round(decimals=3)  # the min-norm point of the hull, to epsilon
        (0, tensor([0.7500, 0.2500], dtype=torch.float64))

    Notes:
        Equal to ``torchjd.aggregation.MGDAWeighting(epsilon, max_iters)(G)`` to 1e-12
        relative in float64 on the tests' Gramians (tests/test_projector.py); a NaN in G gives
        NaN weights, as TorchJD's. Not differentiable (the weights are detached).
    """

    def __init__(self, epsilon: float = 0.001, max_iters: int = 100) -> None:
        call = "funcgrad.MGDAWeighting(...)"
        if not _is_number(epsilon) or not 0.0 < epsilon < math.inf:
            raise ValueError(f"{call}: `epsilon` must be a finite number > 0, got {epsilon!r}.")
        if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 1:
            raise ValueError(f"{call}: `max_iters` must be an int >= 1, got {max_iters!r}.")
        self.epsilon = float(epsilon)
        self.max_iters = max_iters

    def __repr__(self) -> str:
        return f"MGDAWeighting(epsilon={self.epsilon}, max_iters={self.max_iters})"

    def __call__(self, gramian: torch.Tensor) -> torch.Tensor:
        """The weights (m,) on the Gramian (m, m), on its device and dtype."""
        G = gramian
        if not isinstance(G, torch.Tensor) or G.ndim != 2 or G.shape[0] != G.shape[1]:
            got = f"shape {tuple(G.shape)}" if isinstance(G, torch.Tensor) else type(G).__name__
            raise ValueError(f"funcgrad.MGDAWeighting(G): `G` must be (m, m), got {got}.")
        if not G.is_floating_point():
            raise TypeError(f"funcgrad.MGDAWeighting(G): `G` must be floating, got {G.dtype}.")
        m = G.shape[0]
        if m == 0:  # no task: no weight (TorchJD's loop fails on the empty argmin)
            return G.new_zeros(0).detach()
        with torch.no_grad():
            G = G.detach()
            indices = torch.arange(m, device=G.device)
            alpha = torch.ones(m, device=G.device, dtype=G.dtype) / m
            running = torch.ones((), dtype=torch.bool, device=G.device)
            one, zero = torch.ones_like(alpha[0]), torch.zeros_like(alpha[0])
            # TorchJD's branch steps are the Python floats 1.0 and 0.0: its stop test
            # compares them with epsilon in double, not in G's dtype (epsilon = 1.001 is 1.0
            # in bfloat16): the same here, as Python booleans.
            stop_at_one, stop_at_zero = self.epsilon > 1.0, self.epsilon > 0.0
            for _ in range(self.max_iters):
                t = torch.argmin(G @ alpha)
                e_t = (indices == t).to(G.dtype)
                a = alpha @ (G @ e_t)
                b = alpha @ (G @ alpha)
                c = e_t @ (G @ e_t)
                step = (b - a) / (b + c - 2 * a)
                gamma = torch.where(c <= a, one, torch.where(b <= a, zero, step))
                stop = torch.where(
                    c <= a,
                    stop_at_one,
                    torch.where(b <= a, stop_at_zero, step < self.epsilon),
                )
                alpha = torch.where(running, (1 - gamma) * alpha + gamma * e_t, alpha)
                running = running & ~stop  # TorchJD's break, on the device
        return alpha
