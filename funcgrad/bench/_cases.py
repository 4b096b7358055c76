"""The benchmark cases, and for each the methods that compute the same gradients.

A method is a callable that runs the whole job from the inputs (f's forward included) and
returns the per-head gradients stacked along a leading k, as a tensor or a dict of them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

import funcgrad

STRATEGIES: tuple[Literal["vjp", "jacrev", "jacfwd", "loop"], ...] = (
    "vjp",
    "jacrev",
    "jacfwd",
    "loop",
)
# A fixed strategy needing more passes through f than this is skipped (it would take minutes).
MAX_DIRECTIONS = {"full": 4096, "quick": 256}

# Where the cases live (``--device``). Every tensor and module of a case is placed there
# explicitly with ``on(...)``, never through ``torch.set_default_device``: its
# TorchFunctionMode would tax every torch call (funcgrad's more than the raw methods').
# Random values are drawn on the CPU, so that every device computes the same problem.
_DEVICE = [torch.device("cpu")]

T = TypeVar("T", torch.Tensor, torch.nn.Module)


def device() -> torch.device:
    """The device the cases are built on."""
    return _DEVICE[0]


def set_device(where: str | torch.device) -> None:
    _DEVICE[0] = torch.device(where)


def on(value: T) -> T:
    """A tensor or module moved to the bench's device."""
    return value.to(device())


def built(make: Callable[[], T]) -> T:
    """``make()`` run on the CPU (a module's initial weights drawn there), then placed."""
    with torch.device("cpu"):
        return on(make())


def vjp(f: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., Any]]:
    """``torch.func.vjp`` without aux: ``(out, vjp_fn)``."""
    out, vjp_fn = torch.func.vjp(f, *primals)[:2]
    return out, vjp_fn


def generator() -> torch.Generator:
    """A seeded CPU generator: draw with it, then place the tensor with ``on``."""
    return torch.Generator().manual_seed(0)


class SkipCase(Exception):
    """Raised by a builder whose case cannot run here (a missing extra): the one-line why."""


@dataclasses.dataclass
class Case:
    name: str
    k: int
    m: int
    n: int
    methods: dict[str, Callable[[], Any]]
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    reference_only: tuple[str, ...] = ()  # timed for scale, not a way to get the grads
    # The method each one must agree with, where it is not "naive" (another quantity).
    reference_for: dict[str, str] = dataclasses.field(default_factory=dict)
    auto: str = ""  # the strategy "funcgrad auto" chose
    variant: str = ""  # which of the case's functions or settings (in the label)
    baseline: str = "naive"  # the method that the table's ratios divide by
    # Run once with the others for the agreement check (as a reference), but not timed.
    untimed: tuple[str, ...] = ()
    memory: bool = True  # peak memory measured per method (full runs)
    # A method that warns (FuncgradWarning) in its warm-up call, falling back to another way
    # of computing, is dropped (reported as skipped) rather than timed under a wrong name.
    drop_on_warning: bool = False
    # Plans to report, read after the timed rounds (auto's plan is final from call 3).
    plans: dict[str, Callable[[], funcgrad.Plan]] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # copied into the report
    # Count the host reads of one steady-state call of each method (HostReadCounter).
    count_reads: bool = False
    threads: int | None = None  # torch threads while timed, where the case fixes them

    @property
    def label(self) -> str:
        return (
            f"{self.name} {self.variant} k={self.k}" if self.variant else f"{self.name} k={self.k}"
        )


def _add_torchjd(case: Case, graph: Callable[[], tuple[Any, Any]], package=lambda j: j[0]) -> None:
    """TorchJD's ``autojac.jac(outputs, inputs)`` on the graph that ``graph()`` builds."""
    try:
        from torchjd.autojac import jac
    except ImportError:  # the `bench` extra is not installed
        case.skipped["torchjd jac"] = "torchjd is not installed (pip install funcgrad[bench])"
        return

    def run():
        outputs, inputs = graph()
        return package(jac(outputs, inputs))

    case.methods["torchjd jac"] = run


def _naive(f, heads, x):
    outputs, xr = _head_graph(f, heads, x)
    return torch.stack([torch.autograd.grad(z, xr, retain_graph=True)[0] for z in outputs])


def _torch_func(f, heads, x):
    """Raw torch.func: vjp once, each head's cotangent, one vmap over the pullback."""
    y, vjp_fn = torch.func.vjp(f, x)
    cotangents = torch.stack([torch.func.grad(h)(y) for h in heads])
    return torch.func.vmap(vjp_fn)(cotangents)[0]


def _head_graph(f, heads, x):
    """The per-head outputs on a fresh graph of f at x, and the leaf they depend on."""
    xr = x.detach().requires_grad_()
    y = f(xr)
    return [h(y) for h in heads], xr


def _add_funcgrad(case: Case, f, heads, x, quick: bool) -> None:
    args = x if isinstance(x, tuple) else (x,)

    def run(strategy):
        composed = funcgrad.compose_heads(f, heads, strategy=strategy)
        return lambda: composed(*args)[1]

    auto = funcgrad.compose_heads(f, heads)
    case.methods["funcgrad auto"] = lambda: auto(*args)[1]
    case.plans["funcgrad auto"] = lambda: auto.plan(*args)  # its engine: auto's race
    plan = funcgrad.compose_heads(f, heads).plan(*args)
    case.auto = plan.strategy
    for strategy in STRATEGIES:
        directions = funcgrad.Plan(strategy, plan.k, plan.m, plan.n).directions
        if directions > MAX_DIRECTIONS["quick" if quick else "full"]:
            case.skipped[f"funcgrad {strategy}"] = f"needs {directions} passes through f"
        else:
            case.methods[f"funcgrad {strategy}"] = run(strategy)


def _standard(name, f, heads, x, m, quick) -> Case:
    case = Case(name, len(heads), m, x.numel(), {})
    case.methods["naive"] = lambda: _naive(f, heads, x)
    case.methods["torch.func vjp+vmap"] = lambda: _torch_func(f, heads, x)
    _add_torchjd(case, lambda: _head_graph(f, heads, x))
    _add_funcgrad(case, f, heads, x, quick)
    return case


# The seed's matrix_exp runs in float64: in float32 its backward differs from itself by
# ~2e-3 (relative) with the scale of the cotangent, which would hide a real disagreement.
SEED_SIZE = {"full": 200, "quick": 60}


def seed_fun(n: int, dtype=torch.float64) -> Callable[[torch.Tensor], torch.Tensor]:
    ones = torch.ones((n, n), dtype=dtype, device=device())

    def slow_fun(x):
        return torch.real(torch.trace(torch.matrix_exp(1j * x * ones)))

    return slow_fun


# Cheap scalar heads of a scalar y, as in the seed (y stays positive: (N-1) + cos(N x)).
SCALAR_HEADS = [
    lambda y: y**2,
    lambda y: torch.sqrt(y),
    lambda y: torch.log(y),
    lambda y: torch.sin(y),
    lambda y: torch.exp(-y / 100),
    lambda y: y**3 / 3,
    lambda y: 1 / y,
    lambda y: torch.tanh(y / 100),
]


def _scalar_heads(k):
    return [
        (lambda y, h=SCALAR_HEADS[i % n], s=1 + i // n: h(y) * s)
        for i, n in zip(range(k), [len(SCALAR_HEADS)] * k)
    ]


def seed_case(k: int, quick: bool) -> Case:
    f = seed_fun(SEED_SIZE["quick" if quick else "full"])
    heads = _scalar_heads(k)
    x = torch.tensor(1.0, dtype=torch.float64, device=device())
    case = _standard("seed", f, heads, x, m=1, quick=quick)

    def chain_rule():  # the seed's own "method 1": dy/dx once, times each dz/dy
        xr = x.detach().requires_grad_()
        y = f(xr)
        (dy_dx,) = torch.autograd.grad(y, xr, retain_graph=True)
        return torch.stack(
            [torch.autograd.grad(h(y), y, retain_graph=True)[0] * dy_dx for h in heads]
        )

    def one_pass():
        xr = x.detach().requires_grad_()
        return torch.autograd.grad(f(xr), xr)[0]

    case.methods["seed chain rule"] = chain_rule
    case.methods["one f fwd+bwd"] = one_pass
    case.reference_only = ("one f fwd+bwd",)
    return case


def multi_output_case(k: int, quick: bool) -> Case:
    n = 50 if quick else 200
    gen = generator()
    bases = on(torch.randn(4, n, n, generator=gen, device="cpu") / n**0.5)
    bases = bases + bases.transpose(1, 2)

    def f(x):  # y: 4 real entries of exp(i * sum_j x_j A_j)
        e = torch.matrix_exp(1j * torch.einsum("j,jab->ab", x, bases))
        return torch.real(torch.diagonal(e)[:4])

    weights = on(torch.randn(k, 4, generator=gen, device="cpu"))
    heads = [lambda y, w=weights[i]: torch.sin(w @ y) + (w * y).pow(2).sum() for i in range(k)]
    return _standard(
        "multi-output", f, heads, on(torch.randn(4, generator=gen, device="cpu")), m=4, quick=quick
    )


class Encoder(torch.nn.Module):
    def __init__(self, widths):
        super().__init__()
        layers = []
        for a, b in itertools.pairwise(widths):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


def mtl_case(k: int, quick: bool) -> Case:
    widths, batch = ((64, 128, 128, 64), 32) if quick else ((512, 1024, 1024, 512), 256)
    torch.manual_seed(0)
    encoder = built(lambda: Encoder(widths))
    inputs = on(torch.randn(batch, widths[0], device="cpu"))
    heads = _mtl_heads(k, widths[-1], batch)
    params = {name: p.detach() for name, p in encoder.named_parameters()}
    names = list(params)

    def f(p):
        return torch.func.functional_call(encoder, p, (inputs,))

    def naive():
        z = encoder(inputs)
        grads = [
            torch.autograd.grad(h(z), list(encoder.parameters()), retain_graph=True) for h in heads
        ]
        return {name: torch.stack([g[j] for g in grads]) for j, name in enumerate(names)}

    def torch_func():
        z, vjp_fn = torch.func.vjp(f, params)
        cotangents = torch.stack([torch.func.grad(h)(z) for h in heads])
        return torch.func.vmap(vjp_fn)(cotangents)[0]

    n = sum(p.numel() for p in params.values())
    case = Case(
        "mtl", k, batch * widths[-1], n, {"naive": naive, "torch.func vjp+vmap": torch_func}
    )

    def graph():
        z = encoder(inputs)
        return [h(z) for h in heads], list(encoder.parameters())

    _add_torchjd(case, graph, package=lambda jacobians: dict(zip(names, jacobians)))
    _add_funcgrad(case, f, heads, params, quick)
    return case


def mtl_weighting_case(k: int, quick: bool) -> Case:
    """The mtl encoder, k task losses, float32, UPGrad: one combined update into .grad.

    ``naive`` (k per-task backward passes, then UPGrad on the Gramian) is the reference at
    the params level; the LibMTL recipe (the losses on a detached copy of the features,
    MGDA-UB's bound V V^T, one weighted backward) is the reference at the features level.
    """
    try:
        from torchjd.aggregation import UPGrad, UPGradWeighting
        from torchjd.autogram import Engine
        from torchjd.autojac import jac_to_grad, mtl_backward
    except ImportError:
        case = Case("mtl-weighting", k, 0, 0, {"naive": lambda: None})
        case.skipped["all"] = "torchjd is not installed (pip install funcgrad[bench])"
        return case
    widths, batch = ((64, 128, 128, 64), 32) if quick else ((512, 1024, 1024, 512), 256)
    torch.manual_seed(0)
    encoder = built(lambda: Encoder(widths))
    inputs = on(torch.randn(batch, widths[0], device="cpu"))
    heads = _mtl_heads(k, widths[-1], batch)
    shared = list(encoder.parameters())
    names = [name for name, _ in encoder.named_parameters()]
    weighting = UPGradWeighting()

    def update(run, params=shared) -> dict[str, torch.Tensor]:
        """Run an imperative method from zeroed grads; the update it wrote into .grad."""
        for p in params:
            p.grad = None
        run()
        return {name: p.grad for name, p in zip(names, params)}

    def losses_on(features):
        return [h(features) for h in heads]

    def floor():
        sum(losses_on(encoder(inputs))).backward()

    def naive():
        losses = losses_on(encoder(inputs))
        grads = [torch.autograd.grad(loss, shared, retain_graph=True) for loss in losses]
        rows = torch.stack([torch.cat([g.flatten() for g in gs]) for gs in grads])
        weights = weighting(rows @ rows.T)
        for j, p in enumerate(shared):
            p.grad = torch.tensordot(weights, torch.stack([g[j] for g in grads]), dims=1)

    def torchjd_autojac():
        features = encoder(inputs)
        mtl_backward(losses_on(features), features)
        jac_to_grad(shared, UPGrad())

    # autogram hooks the modules for good: on a copy, so that the other methods run plain.
    hooked = copy.deepcopy(encoder)
    engine = Engine(hooked, batch_dim=None)

    def torchjd_autogram():
        losses = torch.stack(losses_on(hooked(inputs)))
        losses.backward(weighting(engine.compute_gramian(losses)))

    def libmtl_recipe():  # LibMTL's rep_grad: the losses on a detached representation
        features = encoder(inputs)
        rep = features.detach().requires_grad_()
        rows = torch.stack([torch.autograd.grad(h(rep), rep)[0].flatten() for h in heads])
        weights = weighting(rows @ rows.T)
        features.backward((weights @ rows).reshape(features.shape))

    def funcgrad_backward(level):
        def run():
            features = encoder(inputs)
            funcgrad.backward(
                losses_on(features), through=features, weighting=weighting, level=level
            )

        return run

    params = {name: p.detach() for name, p in encoder.named_parameters()}

    def f(p):
        return torch.func.functional_call(encoder, p, (inputs,))

    combined = {
        level: funcgrad.combine_heads(f, heads, weighting, level=level)
        for level in ("params", "features")
    }
    case = Case("mtl-weighting", k, batch * widths[-1], sum(p.numel() for p in shared), {})
    case.methods = {
        "naive": lambda: update(naive),
        "sum(losses) fwd+bwd": lambda: update(floor),
        "torchjd mtl_backward+jac_to_grad": lambda: update(torchjd_autojac),
        "torchjd autogram": lambda: update(torchjd_autogram, list(hooked.parameters())),
        "LibMTL recipe (features)": lambda: update(libmtl_recipe),
        "funcgrad backward params": lambda: update(funcgrad_backward("params")),
        "funcgrad backward features": lambda: update(funcgrad_backward("features")),
        "funcgrad combine_heads params": lambda: combined["params"](params)[1],
        "funcgrad combine_heads features": lambda: combined["features"](params)[1],
    }
    case.reference_only = ("sum(losses) fwd+bwd",)
    case.reference_for = {
        "funcgrad backward features": "LibMTL recipe (features)",
        "funcgrad combine_heads features": "LibMTL recipe (features)",
    }
    case.auto = combined["params"].plan(params).strategy
    return case


def _mtl_heads(k: int, width: int, batch: int) -> list[Callable[..., torch.Tensor]]:
    """k cheap task losses on the features: linear + MSE and linear + cross-entropy."""
    heads = []
    for t in range(k):
        if t % 2 == 0:
            w, target = (
                on(torch.randn(1, width, device="cpu") / 10),
                on(torch.randn(batch, 1, device="cpu")),
            )
            heads.append(lambda z, w=w, y=target: torch.nn.functional.mse_loss(z @ w.T, y))
        else:
            w, target = (
                on(torch.randn(10, width, device="cpu") / 10),
                on(torch.randint(0, 10, (batch,), device="cpu")),
            )
            heads.append(lambda z, w=w, y=target: torch.nn.functional.cross_entropy(z @ w.T, y))
    return heads


def linear_task_heads(
    k: int, width: int, batch: int, generator: torch.Generator | None = None
) -> tuple[list[torch.nn.Module], list[Callable[[torch.Tensor], torch.Tensor]]]:
    """k task heads on (batch, width) features, alternating ``nn.Linear`` to 1 output with MSE
    and to 5 classes with cross-entropy: the heads (built, then placed) and each task's loss
    on the features. The heads' weights come from torch's global generator, the targets from
    ``generator`` (the global one where None), drawn on the CPU after every head."""
    heads = [
        built(functools.partial(torch.nn.Linear, width, 1 if t % 2 == 0 else 5)) for t in range(k)
    ]
    targets = [
        on(
            torch.randn(batch, 1, generator=generator, device="cpu")
            if t % 2 == 0
            else torch.randint(0, 5, (batch,), generator=generator, device="cpu")
        )
        for t in range(k)
    ]

    def loss(t: int, features: torch.Tensor) -> torch.Tensor:
        out = heads[t](features)
        if t % 2 == 0:
            return torch.nn.functional.mse_loss(out, targets[t])
        return torch.nn.functional.cross_entropy(out, targets[t])

    return heads, [functools.partial(loss, t) for t in range(k)]


def probes_case(k: int, quick: bool) -> Case:
    # A 2048 -> 2048 -> 64 MLP; the ratio to raw vmap falls as f's backward gets dearer
    # relative to the fixed (k, m) @ (m, n) product: about m/k + m/hidden in flops.
    d_in, d_hidden, d_feature = (256, 64, 16) if quick else (2048, 2048, 64)
    gen = generator()
    w1 = on(torch.randn(d_hidden, d_in, generator=gen, device="cpu") / d_in**0.5)
    w2 = on(torch.randn(d_feature, d_hidden, generator=gen, device="cpu") / d_hidden**0.5)

    def f(x):  # a 64-d feature of a 2048 -> 64 MLP
        return torch.tanh(w2 @ torch.tanh(w1 @ x))

    params = {
        "w": on(torch.randn(k, d_feature, generator=gen, device="cpu")),
        "b": on(torch.randn(k, generator=gen, device="cpu")),
    }

    def probe(p, y):
        return torch.nn.functional.softplus(p["w"] @ y + p["b"])

    stacked = funcgrad.stacked_heads(probe, params)
    heads = [lambda y, j=j: probe({"w": params["w"][j], "b": params["b"][j]}, y) for j in range(k)]
    x = on(torch.randn(d_in, generator=gen, device="cpu"))

    def torch_func():  # raw vjp + vmap(pullback) over the k cotangents (heads vmapped too)
        y, vjp_fn = torch.func.vjp(f, x)
        cotangents = torch.func.vmap(torch.func.grad(probe, argnums=1), in_dims=(0, None))(
            params, y
        )
        return torch.func.vmap(vjp_fn)(cotangents)[0]

    case = Case("probes", k, d_feature, d_in, {"naive": lambda: _naive(f, heads, x)})
    case.methods["torch.func vjp+vmap"] = torch_func
    _add_torchjd(case, lambda: _head_graph(f, heads, x))
    _add_funcgrad(case, f, stacked, x, quick)
    return case


def bridge_case(k: int, quick: bool) -> Case:
    f = seed_fun(SEED_SIZE["quick" if quick else "full"])
    heads = _scalar_heads(k)
    x0 = torch.tensor(1.0, dtype=torch.float64, device=device())

    def graph():  # the seed's imperative code, up to the line that asks for the gradients
        x = x0.clone().requires_grad_()
        y = f(x)
        return x, y, [h(y) for h in heads]

    def naive():
        x, _, outputs = graph()
        return torch.stack([torch.autograd.grad(z, x, retain_graph=True)[0] for z in outputs])

    def chain_rule():
        x, y, outputs = graph()
        (dy_dx,) = torch.autograd.grad(y, x, retain_graph=True)
        return torch.stack(
            [torch.autograd.grad(z, y, retain_graph=True)[0] * dy_dx for z in outputs]
        )

    def bridge():
        x, y, outputs = graph()
        return funcgrad.grads(outputs, x, through=y)[0]

    case = Case(
        "bridge", k, 1, 1, {"naive": naive, "seed chain rule": chain_rule, "funcgrad.grads": bridge}
    )

    def outputs_and_x():
        x, _, outputs = graph()
        return outputs, x

    _add_torchjd(case, outputs_and_x)
    return case


# The memory case of issue 28: k probes on an nn.Module MLP whose parameters require grad.
CHUNK_MEMORY = {
    "full": {"d_in": 256, "hidden": 4096, "batch": 128, "chunk": 16, "budget": 512 * 2**20},
    "quick": {"d_in": 64, "hidden": 512, "batch": 32, "chunk": 8, "budget": 8 * 2**20},
}


def chunk_memory_case(k: int, quick: bool) -> Case:
    """``compose_heads(..., chunk_size="auto")`` under ``funcgrad.memory_budget`` on an
    ``nn.Module`` f with trainable parameters, against ``chunk_size=None`` and raw
    ``vmap(vjp_fn)`` in fixed chunks with ``create_graph=False``. The target: auto's peak
    within 1.5x the budget plus the answer (k gradients), by ``max_memory_allocated`` on
    CUDA, RSS on the CPU."""
    size = CHUNK_MEMORY["quick" if quick else "full"]
    torch.manual_seed(0)
    encoder = built(
        lambda: torch.nn.Sequential(
            torch.nn.Linear(size["d_in"], size["hidden"]),
            torch.nn.Tanh(),
            torch.nn.Linear(size["hidden"], 64),
        )
    )
    gen = generator()
    x = on(torch.randn(size["batch"], size["d_in"], generator=gen, device="cpu"))
    params = {
        "w": on(torch.randn(k, 64, generator=gen, device="cpu") / 8),
        "b": on(torch.randn(k, generator=gen, device="cpu")),
    }

    def probe(p: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(y @ p["w"] + p["b"]).mean()

    stacked = funcgrad.stacked_heads(probe, params)
    auto = funcgrad.compose_heads(encoder, stacked, strategy="vjp", chunk_size="auto")
    whole = funcgrad.compose_heads(encoder, stacked, strategy="vjp")

    def under_budget() -> torch.Tensor:
        with funcgrad.memory_budget(size["budget"]):
            return auto(x)[1]

    def raw() -> torch.Tensor:
        y, vjp_fn = vjp(encoder, x)
        cotangents = torch.func.vmap(torch.func.grad(probe, argnums=1), in_dims=(0, None))(
            params, y
        )
        pull = functools.partial(vjp_fn, create_graph=False)
        return torch.func.vmap(pull, chunk_size=size["chunk"])(cotangents)[0]

    reference = f"torch.func vmap(vjp_fn) create_graph=False, chunks of {size['chunk']}"
    budget_mib = size["budget"] / 2**20
    case = Case(
        "chunk-memory",
        k,
        size["batch"] * 64,
        x.numel(),
        {
            reference: raw,
            f"funcgrad chunk_size=auto, budget {budget_mib:g} MiB": under_budget,
            "funcgrad chunk_size=None": lambda: whole(x)[1],
        },
    )
    case.baseline = reference
    case.reference_for = {name: reference for name in case.methods if name != reference}
    case.extra = {
        "chunk_memory": {
            "budget_mib": budget_mib,
            "answer_mib": k * x.numel() * x.element_size() / 2**20,
            "method": f"funcgrad chunk_size=auto, budget {budget_mib:g} MiB",
        }
    }
    return case


BUILDERS: dict[str, Callable[[int, bool], Case]] = {
    "seed": seed_case,
    "multi-output": multi_output_case,
    "mtl": mtl_case,
    "mtl-weighting": mtl_weighting_case,
    "probes": probes_case,
    "bridge": bridge_case,
    "chunk-memory": chunk_memory_case,
}

HEAD_COUNTS: dict[str, dict[str, tuple[int, ...]]] = {
    "seed": {"full": (2, 8, 32), "quick": (2, 8)},
    "multi-output": {"full": (32,), "quick": (32,)},
    "mtl": {"full": (2, 8, 32), "quick": (2, 8)},
    "mtl-weighting": {"full": (2, 8, 32), "quick": (2, 8)},
    "probes": {"full": (512,), "quick": (64,)},
    "bridge": {"full": (4,), "quick": (4,)},
    "chunk-memory": {"full": (512,), "quick": (64,)},
}
