"""The planner case: how ``strategy="auto"`` learns, against the best fixed strategy.

Per cell of a grid of real functions x k heads (``CELLS``): auto's steady-state regret (its
median call after 8 calls over the best fixed strategy's), its first-8-calls ratio (calls
1-8 of a fresh function on this signature over the best fixed strategy's), and ``plan()``'s
cost (a fresh function's, in ms and in eager forwards of f). Every method runs on a fresh
function, and the methods take their calls in turn, call by call (the order rotating), so
that a slow moment of a shared machine hits them alike (docs/benchmarks_planner.md).
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import funcgrad

from ._cases import Encoder, _mtl_heads, _scalar_heads, built, device, generator, on, seed_fun

Heads = list[Callable[..., torch.Tensor]]
Function = tuple[Callable[..., Any], Heads, tuple[Any, ...]]
ODE_STEPS = {"full": 300, "quick": 200}


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


FUNCTIONS: dict[str, Callable[[int, bool], Function]] = {
    "seed": seed,
    "mlp": mlp,
    "probes": probes,
    "lstm": lstm,
    "convnet": convnet,
    "ode n=8": ode(8),
    "gp": gp,
    "attention": attention,
    "image filter": image_filter,
}
CELLS = (
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
CALLS, STEADY = 8, 5  # the first calls summed, then the calls whose median is the steady state
SLOWER = 2.5  # a fixed strategy this much slower than the fastest on a warm call is not timed


def learning(
    cells: tuple[tuple[str, int], ...] = CELLS, quick: bool = True, reps: int = 4
) -> list[dict[str, Any]]:
    """One row per cell (see the module's docstring). A fixed strategy that warns on a
    first call (it falls back to another way), or whose second call is ``SLOWER`` than the
    fastest one's, is left out (it cannot be the best). Then ``reps`` times, every
    method gets a fresh function and its ``CALLS + STEADY`` calls, the methods in turn call
    by call, with Python's garbage collector off (as ``timeit``). Each call number's time
    is its fastest over the reps (a preempted call on a
    shared machine costs a scheduler quantum, 10 ms, which would swamp the 2 ms calls): a
    method's first-8 time sums calls 1-8, its steady state is the median of the later ones
    (``regret (all calls)``: the median of every later call instead)."""
    rows = []
    for name, k in cells:
        f, heads, args = FUNCTIONS[name](k, quick)
        probe = funcgrad.compose_heads(f, heads, strategy="vjp").plan(*args)
        warm: dict[str, float] = {}  # each fixed strategy's second call, s
        for strategy in ("vjp", "jacrev", "jacfwd", "loop"):
            if funcgrad.Plan(strategy, probe.k, probe.m, probe.n).directions > 512:
                continue
            fn = funcgrad.compose_heads(f, heads, strategy=strategy)
            with warnings.catch_warnings():
                warnings.simplefilter("error", funcgrad.FuncgradWarning)
                try:
                    fn(*args)
                except funcgrad.FuncgradWarning:
                    continue
            start = time.perf_counter()
            fn(*args)
            warm[strategy] = time.perf_counter() - start
        fastest_warm = min(warm.values())
        methods: list[Any] = ["auto", *(m for m, s in warm.items() if s <= SLOWER * fastest_warm)]
        fastest = {m: [math.inf] * (CALLS + STEADY) for m in methods}  # per call number
        every: dict[str, list[float]] = {m: [] for m in methods}  # the steady calls
        for rep in range(reps):
            fns = {m: funcgrad.compose_heads(f, heads, strategy=m) for m in methods}
            gc.collect()  # (then off while timing, as timeit does: a collection costs 4 ms)
            gc.disable()
            for call in range(CALLS + STEADY):
                turn = (rep + call) % len(methods)
                for method in methods[turn:] + methods[:turn]:
                    start = time.perf_counter()
                    fns[method](*args)
                    seconds = time.perf_counter() - start
                    fastest[method][call] = min(fastest[method][call], seconds)
                    if call >= CALLS:
                        every[method].append(seconds)
            gc.enable()
        first = {m: sum(s[:CALLS]) for m, s in fastest.items()}
        medians = {m: statistics.median(s[CALLS:]) for m, s in fastest.items()}
        medians_all = {m: statistics.median(s) for m, s in every.items()}
        fixed = methods[1:]
        best = min(fixed, key=lambda m: medians[m])
        settled = fns["auto"].plan(*args)
        forwards, plan_s = [], []
        gc.collect()
        gc.disable()
        for _ in range(3):
            start = time.perf_counter()
            f(*args)
            forwards.append(time.perf_counter() - start)
            start = time.perf_counter()
            funcgrad.compose_heads(f, heads).plan(*args)
            plan_s.append(time.perf_counter() - start)
        gc.enable()
        print(f"planner: {name}, k={k} done", file=sys.stderr)
        rows.append(
            {
                "cell": f"{name}, k={k}",
                "m": probe.m,
                "n": probe.n,
                "best fixed": best,
                "auto settles on": f"{settled.strategy} on {settled.engine}",
                "regret": medians["auto"] / medians[best],
                "regret (all calls)": medians_all["auto"] / min(medians_all[m] for m in fixed),
                "first 8 ratio": first["auto"] / min(first[m] for m in fixed),
                "auto ms": 1e3 * medians["auto"],
                "fixed ms": ", ".join(f"{m} {1e3 * medians[m]:.3g}" for m in fixed),
                "plan ms": 1e3 * min(plan_s),
                "plan forwards": min(plan_s) / min(forwards),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as a markdown table, with the worst of each figure."""
    if not rows:
        return []
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    worst = {key: max(rows, key=lambda row: row[key]) for key in ("regret", "first 8 ratio")}

    def over_bound(row: dict[str, Any]) -> float:  # plan()'s cost over 3 forwards or 50 ms
        return float(row["plan ms"] / max(50, 3 * row["plan ms"] / row["plan forwards"]))

    plan, regret, first8 = max(rows, key=over_bound), worst["regret"], worst["first 8 ratio"]
    return [
        *lines,
        "",
        f"Max regret {regret['regret']:.3g} ({regret['cell']}), max first-8 ratio "
        f"{first8['first 8 ratio']:.3g} ({first8['cell']}); plan() nearest its bound (3 "
        f"forwards or 50 ms, the larger): {plan['plan ms']:.3g} ms, "
        f"{plan['plan forwards']:.3g} forwards ({plan['cell']}).",
    ]
