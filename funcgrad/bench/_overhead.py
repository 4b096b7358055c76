"""The overhead case: tiny problems, where funcgrad's fixed cost per call is all there is.

Each entry point runs the whole job (f's forward included) on a problem whose kernels take
microseconds, against the batched recipe a torch.func expert writes by hand for the same
answer:

- ``compose_heads``, ``stacked_heads`` and ``combine_heads``: ``torch.func.vjp`` once,
  ``jacrev`` over the stacked heads (the k cotangents in one call), ``vmap(vjp_fn)``;
- ``pullback``: ``torch.func.vjp`` and its ``vjp_fn`` (``vmap(vjp_fn)`` for ``pb.many``),
  and a held Pullback called again against the held ``vjp_fn``;
- ``grads`` and ``backward(level="params")``: ``torch.autograd.grad(...,
  is_grads_batched=True)`` for the per-task cotangents and for the Jacobian;
- ``backward(level="features")``: the LibMTL recipe, batched (the per-task gradients on a
  detached copy of the features in one call, the weights, one backward of the weighted
  direction).

The bench times both per call, checks that they agree, and counts the host reads of one
steady-state call of each (``funcgrad.HostReadCounter``); ``tests/test_host_reads.py``
holds the counts to a table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import funcgrad

from ._cases import Case, device, vjp

K = 8  # heads (tasks)
DTYPE = torch.float32


def weighting(gramian: torch.Tensor) -> torch.Tensor:
    """A torch-native weighting that reads nothing on the host: the inverse gradient norms,
    normalised to sum to k (the reads counted are then funcgrad's own)."""
    inverse = gramian.diagonal().rsqrt()
    return inverse * (len(inverse) / inverse.sum())


@dataclasses.dataclass
class EntryPoint:
    """One entry point on its tiny problem: ``funcgrad()`` and ``recipe()`` each run the
    whole job and return the same quantities (a tuple of tensors)."""

    funcgrad: Callable[[], Any]
    recipe: Callable[[], Any]
    what: str  # the recipe, in words


def _linear(d_in: int, d_out: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return (torch.randn(d_out, d_in, generator=gen, dtype=DTYPE, device="cpu") / d_in**0.5).to(
        device
    )


def entry_points(device: torch.device | str = "cpu", k: int = K) -> dict[str, EntryPoint]:
    """Every entry point on its tiny problem, every tensor placed on ``device`` explicitly."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    eye = torch.eye(k, dtype=DTYPE, device=device)
    points: dict[str, EntryPoint] = {}

    # A function-style problem: x (16) -> y (8) through two tanh layers; k scalar heads.
    w1, w2 = _linear(16, 32, gen, device), _linear(32, 8, gen, device)
    x = torch.randn(16, generator=gen, dtype=DTYPE, device="cpu").to(device)
    head_w = torch.randn(k, 8, generator=gen, dtype=DTYPE, device="cpu").to(device)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w2 @ torch.tanh(w1 @ x))

    heads = [lambda y, w=head_w[i]: torch.sin(w @ y) + (w * y).pow(2).sum() for i in range(k)]

    def stacked(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.stack([h(y) for h in heads])
        return values, values

    def cotangents_of(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(V, values): the k head cotangents on y in one jacrev over the stacked heads."""
        return torch.func.jacrev(stacked, has_aux=True)(y)

    composed = funcgrad.compose_heads(f, heads)

    def compose_recipe() -> tuple[torch.Tensor, ...]:
        y, vjp_fn = vjp(f, x)
        v, values = cotangents_of(y)
        return values, torch.func.vmap(vjp_fn)(v)[0]

    points["compose_heads"] = EntryPoint(
        lambda: tuple(composed(x)), compose_recipe, "vjp + jacrev(stacked heads) + vmap(vjp_fn)"
    )

    # The seed's shape: a scalar y, where the plan pulls back y's one direction (jacrev).
    def f_scalar(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w1 @ x).pow(2).sum()

    scalar_heads = [lambda y, i=i: torch.sin(y * (i + 1)) + y ** (i % 3 + 1) for i in range(k)]
    composed_scalar = funcgrad.compose_heads(f_scalar, scalar_heads)

    def scalar_stacked(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.stack([h(y) for h in scalar_heads])
        return values, values

    def compose_scalar_recipe() -> tuple[torch.Tensor, ...]:
        y, vjp_fn = vjp(f_scalar, x)
        v, values = torch.func.jacrev(scalar_stacked, has_aux=True)(y)
        return values, torch.func.vmap(vjp_fn)(v)[0]

    points["compose_heads, scalar y"] = EntryPoint(
        lambda: tuple(composed_scalar(x)),
        compose_scalar_recipe,
        "vjp + jacrev(stacked heads) + vmap(vjp_fn)",
    )

    # Stacked heads: k linear probes (softplus) sharing one function.
    probe_params = {
        "w": torch.randn(k, 8, generator=gen, dtype=DTYPE, device="cpu").to(device),
        "b": torch.randn(k, generator=gen, dtype=DTYPE, device="cpu").to(device),
    }

    def probe(p: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(p["w"] @ y + p["b"])

    probes = funcgrad.compose_heads(f, funcgrad.stacked_heads(probe, probe_params))
    probe_grad = torch.func.vmap(torch.func.grad_and_value(probe, argnums=1), in_dims=(0, None))

    def stacked_recipe() -> tuple[torch.Tensor, ...]:
        y, vjp_fn = vjp(f, x)
        v, values = probe_grad(probe_params, y)
        return values, torch.func.vmap(vjp_fn)(v)[0]

    points["stacked_heads"] = EntryPoint(
        lambda: tuple(probes(x)), stacked_recipe, "vjp + vmap(grad(head_fn)) + vmap(vjp_fn)"
    )

    # pullback: build it and pull back one cotangent, or k at once.
    v1 = torch.randn(8, generator=gen, dtype=DTYPE, device="cpu").to(device)
    vk = torch.randn(k, 8, generator=gen, dtype=DTYPE, device="cpu").to(device)

    def pullback_one() -> tuple[torch.Tensor, ...]:
        y, pb = funcgrad.pullback(f, x)
        return y, pb(v1)[0]

    def vjp_one() -> tuple[torch.Tensor, ...]:
        y, vjp_fn = vjp(f, x)
        return y, vjp_fn(v1)[0]

    def pullback_many() -> tuple[torch.Tensor, ...]:
        y, pb = funcgrad.pullback(f, x)
        return y, pb.many(vk)[0]

    def vjp_many() -> tuple[torch.Tensor, ...]:
        y, vjp_fn = vjp(f, x)
        return y, torch.func.vmap(vjp_fn)(vk)[0]

    points["pullback + pb(v)"] = EntryPoint(pullback_one, vjp_one, "vjp + vjp_fn(v)")
    points["pullback + pb.many(V)"] = EntryPoint(pullback_many, vjp_many, "vjp + vmap(vjp_fn)")

    # One Pullback called again and again (reuse="auto", as a user gets it), as a torch.func
    # user calls the vjp_fn they hold.
    _, held = funcgrad.pullback(f, x)
    _, held_vjp_fn = vjp(f, x)
    points["pb(v), a Pullback reused"] = EntryPoint(
        lambda: held(v1), lambda: held_vjp_fn(v1), "vjp_fn(v) of a held vjp"
    )

    # combine_heads at both levels, on the same problem.
    for level in ("features", "params"):
        combined = funcgrad.combine_heads(f, heads, weighting, level=level)

        def run(combined: Any = combined) -> tuple[torch.Tensor, ...]:
            values, grad, weights = combined(x)
            return values, grad, weights

        points[f"combine_heads {level}"] = EntryPoint(
            run,
            _combine_recipe(f, x, cotangents_of, level),
            "vjp + jacrev(stacked heads)"
            + (" + vjp_fn(w @ V)" if level == "features" else " + vmap(vjp_fn), w @ P"),
        )

    # The imperative bridge: the seed-like graph built by the user's code.
    def graph() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        xr = x.detach().requires_grad_()
        y = f(xr)
        return xr, y, [h(y) for h in heads]

    def bridge() -> tuple[torch.Tensor, ...]:
        xr, y, outputs = graph()
        return funcgrad.grads(outputs, xr, through=y)

    def bridge_recipe() -> tuple[torch.Tensor, ...]:
        xr, y, outputs = graph()
        (v,) = torch.autograd.grad(
            torch.stack(outputs), y, eye, retain_graph=True, is_grads_batched=True
        )
        return torch.autograd.grad(y, xr, v, is_grads_batched=True)

    points["grads"] = EntryPoint(bridge, bridge_recipe, "autograd.grad(is_grads_batched=True) x2")

    points |= _backward_points(gen, device, k, eye)
    return points


def _combine_recipe(f: Any, x: torch.Tensor, cotangents_of: Any, level: str) -> Any:
    def features() -> tuple[torch.Tensor, ...]:
        y, vjp_fn = vjp(f, x)
        v, values = cotangents_of(y)
        weights = weighting(v @ v.T)
        return values, vjp_fn(weights @ v)[0], weights

    def params() -> tuple[torch.Tensor, ...]:
        y, vjp_fn = vjp(f, x)
        v, values = cotangents_of(y)
        rows = torch.func.vmap(vjp_fn)(v)[0]
        weights = weighting(rows @ rows.T)
        return values, weights @ rows, weights

    return features if level == "features" else params


def _backward_points(
    gen: torch.Generator, device: torch.device, k: int, eye: torch.Tensor
) -> dict[str, EntryPoint]:
    """backward at both levels: a 16-32-8 MLP encoder with its own parameters, k task heads
    (nn.Linear + MSE) with theirs; the update written into every .grad."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        encoder = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)
        ).to(device=device, dtype=DTYPE)
        task_heads = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(k)).to(
            device=device, dtype=DTYPE
        )
    inputs = torch.randn(4, 16, generator=gen, dtype=DTYPE, device="cpu").to(device)
    targets = torch.randn(k, 4, 1, generator=gen, dtype=DTYPE, device="cpu").to(device)
    shared = list(encoder.parameters())
    leaves = shared + list(task_heads.parameters())

    def losses_on(features: torch.Tensor) -> list[torch.Tensor]:
        return [
            torch.nn.functional.mse_loss(head(features), targets[t])
            for t, head in enumerate(task_heads)
        ]

    def update(run: Callable[[], Any]) -> Callable[[], tuple[torch.Tensor, ...]]:
        def method() -> tuple[torch.Tensor, ...]:
            for p in leaves:
                p.grad = None
            weights = run()
            return (weights, *(p.grad for p in leaves))

        return method

    def backward_level(level: Any) -> Callable[[], Any]:
        def run() -> Any:
            features = encoder(inputs)
            return funcgrad.backward(
                losses_on(features), through=features, weighting=weighting, level=level
            )

        return run

    def libmtl() -> torch.Tensor:
        features = encoder(inputs)
        rep = features.detach().requires_grad_()
        losses = torch.stack(losses_on(rep))
        (rows,) = torch.autograd.grad(losses, rep, eye, retain_graph=True, is_grads_batched=True)
        rows = rows.flatten(1)
        weights = weighting(rows @ rows.T)
        losses.sum().backward(inputs=list(task_heads.parameters()))
        features.backward((weights @ rows).reshape(features.shape))
        return weights

    def jacobian_descent() -> torch.Tensor:
        features = encoder(inputs)
        losses = torch.stack(losses_on(features))
        (v,) = torch.autograd.grad(losses, features, eye, retain_graph=True, is_grads_batched=True)
        jacobian = torch.autograd.grad(
            features, shared, v, retain_graph=True, is_grads_batched=True
        )
        rows = torch.cat([j.flatten(1) for j in jacobian], dim=1)
        weights = weighting(rows @ rows.T)
        losses.sum().backward(inputs=list(task_heads.parameters()))
        for p, j in zip(shared, jacobian, strict=True):
            p.grad = torch.tensordot(weights, j, dims=1)
        return weights

    return {
        "backward features": EntryPoint(
            update(backward_level("features")),
            update(libmtl),
            "LibMTL, batched: autograd.grad(is_grads_batched=True) on detached features, "
            "one backward of w @ V",
        ),
        "backward params": EntryPoint(
            update(backward_level("params")),
            update(jacobian_descent),
            "autograd.grad(is_grads_batched=True) for V and for the Jacobian, w @ P",
        ),
    }


def names() -> list[str]:
    """The entry points, in the report's order."""
    return list(entry_points("cpu", k=2))


def overhead_case(k: int, quick: bool, variant: str) -> Case:
    """One entry point (``variant``) on its tiny problem: funcgrad against the recipe,
    timed on one thread, with the host reads of one steady-state call counted."""
    point = entry_points(device(), k)[variant]
    case = Case("overhead", k, 0, 0, {"funcgrad": point.funcgrad, "recipe": point.recipe})
    case.variant = variant
    case.baseline = "recipe"
    case.reference_for = {"funcgrad": "recipe"}
    case.memory = False
    case.count_reads = True
    case.threads = 1
    case.extra = {"overhead": {"recipe": point.what}}
    return case
