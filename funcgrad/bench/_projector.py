"""The projector case (issue 46): TorchJD's dual-cone projection, the QP inside UPGrad and
DualProj, for UPGrad's m rows (``U = diag(1/m)``), on m x m Gramians.

Sources of the Gramian: ``random`` (a Gaussian m x 2m Jacobian, as TorchJD's tests sample
them) and ``mlp`` (the per-example Gramian of the bench MLP at B = m, from
``funcgrad.per_example``). Methods: TorchJD 0.18's default ``QuadprogProjector`` (quadprog,
row by row on the host; TorchJD 0.18 has no other projector), ``funcgrad.DualConeProjector``
in float32 (the timed target) and in float64. The ``iwrm mlp`` cell times the whole
per-example step with UPGrad (``per_example(model).backward(losses, weighting=UPGrad...)``)
against one forward and backward, with either projector.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import funcgrad

from ._cases import Case, device
from ._per_example import _model

SIZES = (2, 4, 8, 16, 32, 128, 512)
CELLS = {
    "full": [(source, m) for source in ("random", "mlp") for m in SIZES] + [("iwrm-mlp", 128)],
    "quick": [("random", 8), ("mlp", 8), ("iwrm-mlp", 8)],
}
# (case label, method, baseline, limit), as in __main__'s TARGETS (issue 46). The absolute
# targets (m = 128 <= 10 ms, m = 512 <= 500 ms, float32) are read off the table by hand.
TARGETS = [
    ("projector iwrm-mlp k=128", "UPGrad via funcgrad projector", "one fwd+bwd", 1.5),
]
# quadprog at m = 512: 34-114 s a call (issue 46), minutes for the rounds of a full run.
QUADPROG_LIMIT = 128


def _gramian(source: str, m: int, quick: bool) -> torch.Tensor:
    if source == "random":
        gen = torch.Generator().manual_seed(m)
        J = torch.randn(m, 2 * m, generator=gen, dtype=torch.float64)
        return (J @ J.T).to(device())
    model, (inputs, targets) = _model("mlp", m, quick)
    recorder = funcgrad.per_example(model)
    losses = nn.functional.cross_entropy(model(inputs), targets, reduction="none")
    return recorder.gramian(losses).detach().double()


def projector_case(m: int, quick: bool, source: str) -> Case:
    try:
        from torchjd.aggregation import UPGradWeighting
        from torchjd.linalg import QuadprogProjector
    except ImportError:
        case = Case("projector", m, m, m, {"naive": lambda: None}, variant=source)
        case.skipped["all"] = "torchjd is not installed (pip install funcgrad[bench])"
        return case
    if source == "iwrm-mlp":
        return _iwrm_case(m, quick, UPGradWeighting)
    G64 = _gramian(source, m, quick)
    G32 = G64.float()
    U64 = torch.eye(m, dtype=torch.float64, device=G64.device) / m
    U32 = U64.float()
    fast = funcgrad.DualConeProjector()
    methods: dict[str, Any] = {
        "funcgrad projector": lambda: fast(U32, G32),
        "funcgrad projector float64": lambda: fast(U64, G64),
    }
    skipped: dict[str, str] = {}
    if m <= QUADPROG_LIMIT:
        quadprog: Any = QuadprogProjector()
        methods["quadprog (TorchJD default)"] = lambda: quadprog(U64, G64)
        reference = "quadprog (TorchJD default)"
    else:
        skipped["quadprog (TorchJD default)"] = (
            f"m = {m}: 34-114 s a call (issue 46); the float64 projector is the reference, "
            "and tests/test_projector.py checks its KKT conditions at m = 512"
        )
        reference = "funcgrad projector float64"
    eigenvalues = torch.linalg.eigvalsh(funcgrad._projector.regularized(G64, 1e-4, 1e-4))
    case = Case(
        "projector",
        m,
        m,
        m,
        methods,
        skipped=skipped,
        variant=source,
        baseline=reference,
        reference_for={name: reference for name in methods if name != reference},
        count_reads=True,
        threads=1,
        memory=False,
        extra={
            "cond": float(eigenvalues[-1] / eigenvalues[0]),
            "budget": funcgrad._projector.default_budget(m),  # MPRGP's, float64
            "admm budget": funcgrad._projector.default_admm_budget(m),  # float64's
            # (MPRGP, ADMM, active-set rounds) of the timed float32 call
            "float32 budgets": fast._budgets(m, torch.float32),
            "polish rounds": (
                funcgrad._projector._POLISH_ROUNDS
                if funcgrad._projector.EXACT_MAX < m <= funcgrad._projector.POLISH_MAX
                else 0
            ),
        },
    )
    return case


def _iwrm_case(batch: int, quick: bool, UPGradWeighting: Any) -> Case:
    """One IWRM step: B per-example losses, UPGrad's weights from their Gramian, one update
    into ``.grad``; with quadprog, then with funcgrad's projector."""
    model, (inputs, targets) = _model("mlp", batch, quick)
    plain = copy.deepcopy(model)  # per_example hooks its model for good: the floor runs plain
    params = list(model.parameters())
    recorder = funcgrad.per_example(model)

    def losses(m: nn.Module = model) -> torch.Tensor:
        return nn.functional.cross_entropy(m(inputs), targets, reduction="none")

    def step(weighting: Any) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        recorder.backward(losses(), weighting=weighting)
        return [p.grad.clone() for p in params if p.grad is not None]

    def floor() -> list[torch.Tensor]:
        for p in plain.parameters():
            p.grad = None
        losses(plain).sum().backward()
        return []

    slow = UPGradWeighting()
    fast = UPGradWeighting(projector=funcgrad.DualConeProjector())
    return Case(
        "projector",
        batch,
        batch,
        sum(p.numel() for p in params),
        {
            "one fwd+bwd": floor,
            "UPGrad via quadprog": lambda: step(slow),
            "UPGrad via funcgrad projector": lambda: step(fast),
        },
        variant="iwrm-mlp",
        baseline="one fwd+bwd",
        reference_only=("one fwd+bwd",),
        reference_for={"UPGrad via funcgrad projector": "UPGrad via quadprog"},
        threads=1,
        memory=False,
    )
