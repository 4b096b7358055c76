"""The planner case: how much ``strategy="auto"`` loses to the best fixed strategy.

A grid of real functions x k heads. Each cell times ``compose_heads(..., strategy="auto")``
(its first call, the warm-up, measures vmap against one unbatched call and fixes the plan)
and every fixed strategy that fits, interleaved; the regret of the cell is auto's median over
the best fixed strategy's median. The ``plan cost`` cells time ``fn.plan(*args)`` against one
eager forward of f (the Python-loop ODE simulator, where f's overhead is all Python).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, cast

import optree
import torch

import funcgrad

from ._cases import (
    MAX_DIRECTIONS,
    STRATEGIES,
    Case,
    Encoder,
    _mtl_heads,
    _scalar_heads,
    built,
    device,
    generator,
    on,
    seed_fun,
)

Heads = list[Callable[..., torch.Tensor]]
Function = tuple[Callable[..., Any], Heads, tuple[Any, ...]]
HEAD_COUNTS = {"full": (2, 8, 32), "quick": (2, 32)}
ODE_STEPS = {"full": 300, "quick": 200}
PLAN_COST_HEADS = 8


def _generator() -> torch.Generator:
    return generator()


def _vector_heads(k: int, m: int, dtype: torch.dtype) -> Heads:
    """k cheap nonlinear heads of a flattened y (m entries)."""
    weights = on(torch.randn(k, m, generator=_generator(), dtype=dtype, device="cpu") / m**0.5)
    return [
        lambda y, w=weights[i]: torch.sin(w @ y.flatten()) + (w * y.flatten()).pow(2).sum()
        for i in range(k)
    ]


def seed(k: int, quick: bool) -> Function:
    """The seed: real(trace(matrix_exp(1j x ones(N, N)))), a scalar of a scalar."""
    f = seed_fun(30 if quick else 60)
    return f, _scalar_heads(k), (torch.tensor(1.0, dtype=torch.float64, device=device()),)


def multi_output(k: int, quick: bool) -> Function:
    """4 real diagonal entries of matrix_exp(i sum_j x_j A_j), x in R^4."""
    n, gen = (20 if quick else 50), _generator()
    bases = on(torch.randn(4, n, n, generator=gen, dtype=torch.float64, device="cpu") / n**0.5)
    bases = bases + bases.transpose(1, 2)

    def f(x):
        e = torch.matrix_exp(1j * torch.einsum("j,jab->ab", x, bases))
        return torch.real(torch.diagonal(e)[:4])

    return (
        f,
        _vector_heads(k, 4, torch.float64),
        (on(torch.randn(4, generator=gen, dtype=torch.float64, device="cpu")),),
    )


def mlp(k: int, quick: bool) -> Function:
    """An MLP encoder, task losses on its features, gradients w.r.t. its parameters."""
    widths, batch = ((32, 64, 64, 32), 16) if quick else ((64, 128, 128, 64), 32)
    torch.manual_seed(0)
    encoder = built(lambda: Encoder(widths))
    inputs = on(torch.randn(batch, widths[0], device="cpu"))

    def f(p):
        return torch.func.functional_call(encoder, p, (inputs,))

    params = {name: p.detach() for name, p in encoder.named_parameters()}
    return f, _mtl_heads(k, widths[-1], batch), (params,)


def probes(k: int, quick: bool) -> Function:
    """Linear probes (softplus) on the 16-d feature of a tanh MLP, gradients w.r.t. x."""
    d_in, d_hidden, d_feature = (128, 64, 16) if quick else (256, 128, 32)
    gen = _generator()
    w1 = on(torch.randn(d_hidden, d_in, generator=gen, device="cpu") / d_in**0.5)
    w2 = on(torch.randn(d_feature, d_hidden, generator=gen, device="cpu") / d_hidden**0.5)

    def f(x):
        return torch.tanh(w2 @ torch.tanh(w1 @ x))

    w, b = (
        on(torch.randn(k, d_feature, generator=gen, device="cpu")),
        on(torch.randn(k, generator=gen, device="cpu")),
    )
    heads = [lambda y, w=w[j], b=b[j]: torch.nn.functional.softplus(w @ y + b) for j in range(k)]
    return f, heads, (on(torch.randn(d_in, generator=gen, device="cpu")),)


def lstm(k: int, quick: bool) -> Function:
    """nn.LSTM over a sequence, y its final hidden state, gradients w.r.t. the sequence."""
    torch.manual_seed(0)
    seq, hidden = (20, 16) if quick else (40, 32)
    module = built(lambda: torch.nn.LSTM(8, hidden))

    def f(x):
        return module(x)[1][0].flatten()

    return f, _vector_heads(k, hidden, torch.float32), (on(torch.randn(seq, 1, 8, device="cpu")),)


def transformer(k: int, quick: bool) -> Function:
    """A 2-layer nn.TransformerEncoder, mean-pooled, gradients w.r.t. its parameters."""
    torch.manual_seed(0)
    d_model, batch, seq = (32, 4, 16) if quick else (64, 8, 32)
    module = built(
        lambda: torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(
                d_model, 4, 2 * d_model, dropout=0.0, batch_first=True
            ),
            2,
            enable_nested_tensor=False,
        )
    )
    src = on(torch.randn(batch, seq, d_model, device="cpu"))

    def f(p):
        return torch.func.functional_call(module, p, (src,)).mean(1)

    params = {name: p.detach() for name, p in module.named_parameters()}
    return f, _mtl_heads(k, d_model, batch), (params,)


def convnet(k: int, quick: bool) -> Function:
    """A small convnet's 10 logits, gradients w.r.t. the image."""
    torch.manual_seed(0)
    side = 16 if quick else 32
    module = built(
        lambda: torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(16, 10),
        )
    )

    def f(x):
        return module(x).flatten()

    return (
        f,
        _vector_heads(k, 10, torch.float32),
        (on(torch.randn(1, 3, side, side, device="cpu")),),
    )


def ode(n: int, steps: int | None = None) -> Callable[[int, bool], Function]:
    """A Python-loop RK4 simulator of dx/dt = A(theta) x + sin(x) / 10 (x in R^4, theta in
    R^n, float64); y = the final state and the time-average (m = 8). ``steps``: default
    ``ODE_STEPS``; a short run (10 steps) is small enough for y's size to be found on fake
    tensors before f runs, which makes forward mode a candidate."""

    def build(k: int, quick: bool) -> Function:
        d, dt = 4, 0.01
        n_steps = steps or ODE_STEPS["quick" if quick else "full"]
        gen = _generator()
        basis = on(
            torch.randn(n, d, d, generator=gen, dtype=torch.float64, device="cpu") / (n * d) ** 0.5
        )
        damping = torch.eye(d, dtype=torch.float64, device=device())
        x0 = on(torch.randn(d, generator=gen, dtype=torch.float64, device="cpu"))

        def f(theta):
            a = torch.einsum("j,jab->ab", theta, basis) - damping

            def rhs(x):
                return a @ x + torch.sin(x) / 10

            x, total = x0, torch.zeros_like(x0)
            for _ in range(n_steps):
                k1 = rhs(x)
                k2 = rhs(x + dt / 2 * k1)
                k3 = rhs(x + dt / 2 * k2)
                k4 = rhs(x + dt * k3)
                x = x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
                total = total + x
            return torch.cat([x, total / n_steps])

        theta = on(torch.randn(n, generator=gen, dtype=torch.float64, device="cpu"))
        return f, _vector_heads(k, 2 * d, torch.float64), (theta,)

    return build


FUNCTIONS: dict[str, Callable[[int, bool], Function]] = {
    "seed": seed,
    "multi-output": multi_output,
    "mlp": mlp,
    "probes": probes,
    "lstm": lstm,
    "transformer": transformer,
    "convnet": convnet,
    "ode n=2": ode(2),
    "ode n=8": ode(8),
    "ode n=64": ode(64),
    "ode n=2, 10 steps": ode(2, steps=10),
}
QUICK_FUNCTIONS = (
    "seed",
    "multi-output",
    "mlp",
    "probes",
    "lstm",
    "transformer",
    "convnet",
    "ode n=2",
    "ode n=64",
    "ode n=2, 10 steps",
)
# The plan cost is also measured on the 2000-step loop (a forward of ~0.15 s), where
# the bounded shape-only run is small against the real forward.
PLAN_ONLY = {"ode n=2, 2000 steps": ode(2, steps=2000)}
PLAN_COST = ("ode n=2", "ode n=2, 2000 steps", "ode n=64", "ode n=2, 10 steps")
PLAN_COST_SUFFIX = " plan cost"


def cells(mode: str) -> list[tuple[str, int]]:
    """(variant, k) for every cell of the grid, then the plan-cost cells."""
    functions = QUICK_FUNCTIONS if mode == "quick" else tuple(FUNCTIONS)
    grid = list(itertools.product(functions, HEAD_COUNTS[mode]))
    return grid + [(name + PLAN_COST_SUFFIX, PLAN_COST_HEADS) for name in PLAN_COST]


def _grads(fn: funcgrad.ComposedHeads[Any], args: tuple[Any, ...]) -> Any:
    return fn(*args)[1]


def planner_case(k: int, quick: bool, variant: str) -> Case:
    if variant.endswith(PLAN_COST_SUFFIX):
        return _plan_cost_case(k, quick, variant)
    f, heads, args = FUNCTIONS[variant](k, quick)
    auto = funcgrad.compose_heads(f, heads, strategy="auto")
    first = auto.plan(*args)  # before the first call (which measures)
    case = Case("planner", k, first.m, first.n, {}, variant=variant, memory=False)
    case.drop_on_warning = True
    case.methods["funcgrad auto"] = functools.partial(_grads, auto, args)
    for strategy in STRATEGIES:
        directions = funcgrad.Plan(strategy, first.k, first.m, first.n).directions
        if directions > MAX_DIRECTIONS["quick" if quick else "full"]:
            case.skipped[f"funcgrad {strategy}"] = f"needs {directions} passes through f"
            continue
        fixed = funcgrad.compose_heads(f, heads, strategy=strategy)
        case.methods[f"funcgrad {strategy}"] = functools.partial(_grads, fixed, args)

    # The noise of this run: a second, separate instance of auto's planned strategy, timed
    # like the others; its ratio to the first is what two identical runs differ by here.
    for strategy in STRATEGIES:
        if strategy == first.strategy and f"funcgrad {strategy}" in case.methods:
            twin = funcgrad.compose_heads(f, heads, strategy=strategy)
            case.methods[f"twin: {strategy}"] = functools.partial(_grads, twin, args)

    def naive():  # the reference: k x torch.autograd.grad on one graph of f
        leaves, treedef = optree.tree_flatten(args[0])
        leaves = [leaf.detach().requires_grad_() for leaf in leaves]
        y = f(optree.tree_unflatten(treedef, leaves))
        rows = [torch.autograd.grad(h(y), leaves, retain_graph=True) for h in heads]
        stacked = [torch.stack([row[j] for row in rows]) for j in range(len(leaves))]
        return optree.tree_unflatten(treedef, stacked)

    case.methods["naive"] = naive
    case.untimed = ("naive",)
    case.auto = first.strategy
    case.plans = {
        "funcgrad auto (first call)": lambda: first,
        "funcgrad auto": lambda: auto.plan(*args),
    }
    case.extra = {"planner": "regret"}
    return case


def _plan_cost_case(k: int, quick: bool, variant: str) -> Case:
    name = variant.removesuffix(PLAN_COST_SUFFIX)
    f, heads, args = {**FUNCTIONS, **PLAN_ONLY}[name](k, quick)
    warm = funcgrad.compose_heads(f, heads)
    plan = warm.plan(*args)
    methods = {
        "one eager forward of f": lambda: f(*args),
        "fn.plan, fresh fn": lambda: funcgrad.compose_heads(f, heads).plan(*args),
        "fn.plan, same fn again": lambda: warm.plan(*args),
    }
    case = Case("planner", k, plan.m, plan.n, methods, variant=variant, memory=False)
    case.reference_only = tuple(methods)
    case.baseline = "one eager forward of f"
    case.plans = {"fn.plan": lambda: warm.plan(*args)}
    case.extra = {"planner": "plan-cost"}
    return case


# -- auto's learning: the first 8 calls, the steady state, plan()'s cost ----------------------


def gp(k: int, quick: bool) -> Function:
    """A GP posterior mean with a Cholesky solve: 50 test points from 200 (quick: 100)
    training points, gradients w.r.t. the 3 log-lengthscales (m = 50, n = 3)."""
    gen = _generator()
    train, test = (100 if quick else 200), 50
    points = on(torch.randn(train, 3, generator=gen, dtype=torch.float64, device="cpu"))
    targets = on(torch.randn(train, 1, generator=gen, dtype=torch.float64, device="cpu"))
    queries = on(torch.randn(test, 3, generator=gen, dtype=torch.float64, device="cpu"))

    def f(log_scales):
        scale = log_scales.exp()

        def kernel(a, b):  # (not torch.cdist: no forward-mode rule, wrong under vmap)
            return torch.exp(-0.5 * ((a / scale)[:, None] - (b / scale)[None]).pow(2).sum(-1))

        gram = kernel(points, points) + 0.1 * torch.eye(train, dtype=torch.float64)
        chol = torch.linalg.cholesky(gram)
        return (kernel(queries, points) @ torch.cholesky_solve(targets, chol)).flatten()

    return f, _vector_heads(k, test, torch.float64), (on(torch.zeros(3, dtype=torch.float64)),)


def attention(k: int, quick: bool) -> Function:
    """A bilinear self-attention softmax(x W x^T) x on 32 (quick: 16) tokens of 16 features,
    gradients w.r.t. the tokens (m = n = 512)."""
    gen, tokens = _generator(), (16 if quick else 32)
    w = on(torch.randn(16, 16, generator=gen, device="cpu") / 4)

    def f(x):
        return torch.softmax(x @ w @ x.T, dim=-1) @ x

    x = on(torch.randn(tokens, 16, generator=gen, device="cpu"))
    return f, _vector_heads(k, tokens * 16, torch.float32), (x,)


def image_filter(k: int, quick: bool) -> Function:
    """A 5 x 5 blur then tanh on a 64 x 64 (quick: 32 x 32) image: a large y (m = n)."""
    side = 32 if quick else 64
    blur = on(torch.ones(1, 1, 5, 5, device="cpu") / 25)

    def f(img):
        return torch.tanh(torch.nn.functional.conv2d(img, blur, padding=2)).flatten()

    img = on(torch.randn(1, 1, side, side, generator=_generator(), device="cpu"))
    return f, _vector_heads(k, side * side, torch.float32), (img,)


FUNCTIONS.update({"gp": gp, "attention": attention, "image filter": image_filter})
LEARNING_CELLS = (
    ("ode n=8", 32),
    ("gp", 48),
    ("lstm", 8),
    ("convnet", 2),
    ("convnet", 16),
    ("attention", 96),
    ("image filter", 8),
    ("seed", 8),
    ("mlp", 8),
    ("probes", 32),
)


def learning(
    cells: tuple[tuple[str, int], ...] = LEARNING_CELLS, quick: bool = True, reps: int = 2
) -> list[dict[str, Any]]:
    """Per cell: auto's steady-state regret (its median call after 8 calls over the best
    fixed strategy's), its first-8-calls ratio (the sum of calls 1-8 of a fresh function on
    this signature over the best fixed strategy's), and ``plan()``'s cost (a fresh
    function's, in ms and in eager forwards of f). Each method's first 8 calls are timed
    on a fresh function, ``reps`` times in turn, the smallest sum kept."""
    import statistics
    import time

    rows = []
    for name, k in cells:
        f, heads, args = FUNCTIONS[name](k, quick)
        probe = funcgrad.compose_heads(f, heads, strategy="vjp").plan(*args)
        methods = ["auto"] + [
            s
            for s in ("vjp", "jacrev", "jacfwd", "loop")
            if funcgrad.Plan(s, probe.k, probe.m, probe.n).directions <= 512
        ]
        strategies = cast(dict[str, Any], {m: m for m in methods})
        first: dict[str, float] = {}
        steady: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(reps):
            for method in methods if rep % 2 == 0 else methods[::-1]:
                fn = funcgrad.compose_heads(f, heads, strategy=strategies[method])
                seconds = []
                for _ in range(8 + 5):
                    start = time.perf_counter()
                    fn(*args)
                    seconds.append(time.perf_counter() - start)
                total = sum(seconds[:8])
                first[method] = min(first.get(method, total), total)
                steady[method] += seconds[8:]
        medians = {m: statistics.median(s) for m, s in steady.items()}
        fixed = [m for m in methods if m != "auto"]
        best = min(fixed, key=lambda m: medians[m])
        best8 = min(first[m] for m in fixed)
        forwards = []
        for _ in range(3):
            start = time.perf_counter()
            f(*args)
            forwards.append(time.perf_counter() - start)
        plan_s = []
        for _ in range(3):
            start = time.perf_counter()
            plan = funcgrad.compose_heads(f, heads).plan(*args)
            plan_s.append(time.perf_counter() - start)
        final = fn = funcgrad.compose_heads(f, heads)
        for _ in range(3):
            fn(*args)
        rows.append(
            {
                "cell": f"{name}, k={k}",
                "m": plan.m,
                "n": plan.n,
                "best fixed": best,
                "auto settles on": f"{final.plan(*args).strategy} on {final.plan(*args).engine}",
                "regret": medians["auto"] / medians[best],
                "first 8 ratio": first["auto"] / best8,
                "auto ms": 1e3 * medians["auto"],
                "best ms": 1e3 * medians[best],
                "plan ms": 1e3 * min(plan_s),
                "plan forwards": min(plan_s) / min(forwards),
            }
        )
    return rows


def learning_markdown(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
