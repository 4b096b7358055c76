"""The seed demo behind ``python -m funcgrad``: the question that started the project.

``y = slow_fun(x)`` is ``real(trace(matrix_exp(1j * x * ones(N, N))))``, whose backward is
slow; heads ``z_i = g_i(y)`` are cheap. In closed form ``y = (N - 1) + cos(N x)`` and
``dy/dx = -N sin(N x)``, so every gradient can be checked exactly.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

import funcgrad

from ._counting import PassCounter

# The seed's two heads, then a few more; each with its derivative g'(y) for the closed form.
HEADS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[float], float]]] = {
    "y**2": (lambda y: y**2, lambda y: 2 * y),
    "sqrt(y)": (lambda y: torch.sqrt(y), lambda y: 0.5 / math.sqrt(y)),
    "log(y)": (lambda y: torch.log(y), lambda y: 1 / y),
    "sin(y)": (lambda y: torch.sin(y), lambda y: math.cos(y)),
    "exp(-y/100)": (lambda y: torch.exp(-y / 100), lambda y: -math.exp(-y / 100) / 100),
    "y**3/3": (lambda y: y**3 / 3, lambda y: y**2),
    "1/y": (lambda y: 1 / y, lambda y: -1 / y**2),
    "tanh(y/100)": (lambda y: torch.tanh(y / 100), lambda y: (1 - math.tanh(y / 100) ** 2) / 100),
}


def make_slow_fun(n: int, counter: PassCounter) -> Callable[[torch.Tensor], torch.Tensor]:
    def slow_fun(x: torch.Tensor) -> torch.Tensor:
        x = counter(x)  # counts the backward passes through f, nothing else
        a = x * torch.ones((n, n), dtype=x.dtype)
        b = torch.matrix_exp(1j * a)
        return torch.real(torch.trace(b))

    return slow_fun


def timed(label: str, fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    bar = sys.stderr.isatty()  # tqdm's bar on a terminal; nothing from it in a pipe or a log
    for _ in tqdm(range(repeats), desc=label, unit="run", leave=False, disable=not bar):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def progress(line: str) -> None:
    """A plain progress line where tqdm shows nothing (stderr not a terminal), flushed."""
    if not sys.stderr.isatty():
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m funcgrad",
        description="The seed problem: many cheap heads on one slow matrix_exp, naive "
        "autograd against funcgrad, with every gradient checked against the closed form.",
    )
    size_help = "N of the N x N matrix_exp (default 300; the seed used 1000)"
    parser.add_argument("-n", "--size", type=int, default=300, help=size_help)
    k_max = len(HEADS)
    parser.add_argument(
        "-k", "--heads", type=int, default=8, choices=range(1, k_max + 1),
        metavar=f"{{1..{k_max}}}", help="number of heads (default 8)",
    )  # fmt: skip
    parser.add_argument("-x", type=float, default=1.0, help="the point x (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    n, names = args.size, list(HEADS)[: args.heads]
    counter = PassCounter()
    slow_fun = make_slow_fun(n, counter)
    x0 = torch.tensor(args.x, dtype=dtype)

    print(
        f"funcgrad {funcgrad.__version__}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.dtype}"
    )
    print(
        f"f(x) = real(trace(matrix_exp(1j * x * ones({n}, {n})))) at x = {args.x}, "
        f"{len(names)} heads\n"
    )

    def naive() -> list[torch.Tensor]:
        # The seed's code: every head's backward runs f's backward again.
        x = x0.clone().requires_grad_()
        y = slow_fun(x)
        grads = []
        for name in names:
            (g,) = torch.autograd.grad(HEADS[name][0](y), x, retain_graph=True)
            grads.append(g)
        return grads

    def one_pass() -> torch.Tensor:
        x = x0.clone().requires_grad_()
        return torch.autograd.grad(slow_fun(x), x)[0]

    composed = funcgrad.compose_heads(slow_fun, {name: HEADS[name][0] for name in names})

    runs: dict[str, tuple[float, int, Any]] = {}
    for label, fn in [
        ("one forward+backward of f", one_pass),
        ("naive autograd, per head", naive),
        ("funcgrad.compose_heads", lambda: composed(x0)),
    ]:
        progress(f"{label}: a warm-up call, then {args.repeats} timed run(s)...")
        counter.reset()
        fn()  # warm-up, and count the passes of one call
        passes = counter.backward
        seconds, result = timed(label, fn, args.repeats)
        runs[label] = (seconds, passes, result)
        progress(f"{label}: median {seconds:.3f} s")

    _, grads = runs["funcgrad.compose_heads"][2]
    naive_grads = runs["naive autograd, per head"][2]
    y = (n - 1) + math.cos(n * args.x)
    dy_dx = -n * math.sin(n * args.x)
    print(f"\ny = {y:.6f}, dy/dx = {dy_dx:.6f} (closed form)\n")
    columns = ("funcgrad dz/dx", "closed form", "naive autograd")
    print(f"{'head':<12} " + " ".join(f"{c:>18}" for c in columns) + f" {'rel. error':>11}")
    worst = 0.0
    for index, name in enumerate(names):
        exact = HEADS[name][1](y) * dy_dx
        got = grads[name].item()
        error = abs(got - exact) / max(abs(exact), 1e-300)
        worst = max(worst, error)
        numbers = (got, exact, naive_grads[index].item())
        print(f"{name:<12} " + " ".join(f"{v:>18.8g}" for v in numbers) + f" {error:>11.2e}")

    plan = composed.plan(x0)
    print(
        f"\nplan: strategy={plan.strategy!r}, k={plan.k}, m={plan.m}, n={plan.n}: "
        f"{plan.directions} direction(s) through f\n"
    )
    base = runs["one forward+backward of f"][0]
    print(
        f"{'method':<28} {'median time':>12} {'x f fwd+bwd':>12} {'backward passes through f':>27}"
    )
    for label, (seconds, passes, _) in runs.items():
        print(f"{label:<28} {seconds:>11.3f}s {seconds / base:>12.2f} {passes:>27}")
    speedup = runs["naive autograd, per head"][0] / runs["funcgrad.compose_heads"][0]
    print(f"\nfuncgrad is {speedup:.1f}x faster than the naive loop on {len(names)} heads.")
    tolerance = 1e-8 if dtype == torch.float64 else 1e-3
    if worst > tolerance:
        print(f"ERROR: a gradient is off the closed form by {worst:.2e} (relative).")
        return 1
    return 0
