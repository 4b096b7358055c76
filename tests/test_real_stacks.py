"""Real training stacks (transformers, timm, torchvision, torch.nn): every public entry point
against plain torch.autograd, and funcgrad.backward against TorchJD.

Tiny configs with random weights (tests/realstacks_models.py), nothing downloaded. Three task
heads (MSE, CE, softplus score) on each model's pooled features. The reference is a fresh
eager forward per head (per direction) and ``.backward()``: that works for every model here,
also for reentrant checkpointing (which refuses ``torch.autograd.grad``) and for compiled
modules with donated buffers (which refuse a second backward through one graph). float64
where the model allows, float32 (compiled) and bfloat16 autocast with looser tolerances.

Warnings: every funcgrad call runs under ``warnings.catch_warnings(record=True)``. A
``funcgrad.FuncgradWarning`` is allowed only for the models where funcgrad documents a
fallback (BatchNorm in training mode, gradient checkpointing); vmap's "There is a
performance drop" UserWarning is ignored in the value tests and checked on its own in
``test_compose_heads_has_no_vmap_performance_drop``. Every other warning fails the test.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from realstacks_models import CASES, Case, Tasks

import funcgrad

pytestmark = pytest.mark.slow  # transformers models, compiled encoders

tjd = pytest.importorskip("torchjd.aggregation")
autojac = pytest.importorskip("torchjd.autojac")

K = 3
PERF_DROP = "There is a performance drop"

# funcgrad may fall back here, with a FuncgradWarning, and must still give autograd's values.
FALLBACK = {
    "bert-ckpt-nonreentrant",  # requires_grad_() hook + saved-tensor hooks: torch.func refuses
    "nn-resnet-train",  # BatchNorm updates its running statistics in place
    "timm-resnet-train",
    # a compiled backward cannot run under vmap: the imperative entry points loop instead
    "compiled-aot-eager",
    "compiled-inductor",
    "compiled-mlp-aot-eager",
    "compiled-mlp-inductor",
}

# Reentrant checkpointing recomputes the forward with the module's own parameters, outside
# the call: the functional entry points refuse it with a clear ValueError, and backward
# needs the shared parameters named (inputs=), since the graph walk cannot see them.
REENTRANT = "bert-ckpt-reentrant"

_DONATED = (
    "compiled backward with donated buffers cannot be vmapped nor run k times: funcgrad "
    "raises RuntimeError (set torch._functorch.config.donated_buffer=False, or level='features')"
)
_SDPA = (
    "vmap has no batching rule for aten::_scaled_dot_product_flash_attention_for_cpu_backward "
    "(SDPA on CPU): 'There is a performance drop' UserWarning reaches the user"
)

# Known failures today: (case, entry point) -> reason. Entry points: compose, combine-params,
# combine-features, pullback, grads, backward-params, backward-features, backward-none-params,
# backward-none-features, torchjd, perf.
# (None now: training-mode dropout, where torch.func would draw another mask than eager,
# is linearised on eager autograd by every entry point, pullback included.)
XFAIL: dict[tuple[str, str], str] = {}
# Known limits: exact (vmap cannot run a compiled backward, so funcgrad loops, with one
# warning) or one of these clear funcgrad errors, before anything is written: the compiled
# backward donates its buffers and can run only once; or torch ran it a second time on the
# same graph with another answer (a torch bug, seen with inductor where the default dtype was
# float64 when it compiled, as in these tests), which funcgrad checks for.
_TWICE = "torch ran it a second time on the same graph with another answer"
REFUSED: dict[tuple[str, str], tuple[str, ...]] = {
    (c, e): ("donated buffers", _TWICE) if e != "pullback" else (_TWICE,)
    # whether a compiled backward donates its buffers, or runs wrongly twice, depends on the
    # compile (a fresh process or dynamo's caches), so every compiled case may end either way
    for c in CASES
    if c.startswith("compiled")
    for e in ("grads", "backward-params", "pullback")
}


def _allowed_refusal(name: str, entry: str, error: BaseException) -> bool:
    """Whether ``error`` is one of the clear errors REFUSED allows for this case and entry."""
    return any(message in str(error) for message in REFUSED.get((name, entry), ()))


def _case(name: str) -> Case:
    torch.manual_seed(0)
    return CASES[name]()


def _params(case: Case) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in case.model.named_parameters()}


def _tasks(case: Case) -> Tasks:
    y = case.features()
    return Tasks(y.shape[-1], y.shape[0], case.dtype)


# torch's forward-mode AD scripts its decompositions on first use (torch 2.13; pyproject
# ignores it too).
TORCH_FIRST_USE = "`torch.jit.script` is deprecated"


@contextlib.contextmanager
def _recorded(case_name: str):
    """Record every warning; afterwards allow FuncgradWarning only for fallback models,
    ignore vmap's performance-drop warning, and fail on anything else."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield record
    unexpected = []
    for w in record:
        message = str(w.message)
        if issubclass(w.category, funcgrad.FuncgradWarning) and case_name in FALLBACK:
            continue
        if PERF_DROP in message or TORCH_FIRST_USE in message:
            continue
        unexpected.append(f"{w.category.__name__}: {message.splitlines()[0][:200]}")
    assert not unexpected, unexpected


def _seeded(case: Case):
    """Random models: every forward (funcgrad's and each reference's) from the same seed."""
    if case.random:
        torch.manual_seed(1234)


def _grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for n, p in model.named_parameters()
    }


def _zero(*modules: torch.nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _pull(case: Case, make_output, model=None) -> dict[str, torch.Tensor]:
    """Gradients of the shared parameters of one fresh eager forward, by .backward()."""
    model = case.model if model is None else model
    _zero(model)
    _seeded(case)
    y = case.features(model)
    make_output(y).backward()
    grads = _grads_of(model)
    _zero(model)
    return grads


def reference_per_head(case: Case, tasks: Tasks) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """values (k,) and per-head gradients {name: (k, ...)} of the shared parameters, one eager
    forward and one backward per head. The model runs on a deep copy so that BatchNorm's
    running statistics of the model under test stay as funcgrad leaves them."""
    model = copy.deepcopy(case.model)
    values, per_head = [], []
    for i in range(K):
        per_head.append(_pull(case, lambda y, i=i: tasks.losses(y)[i], model))
        _seeded(case)
        with torch.no_grad():
            values.append(tasks.losses(case.features(model))[i])
    grads = {n: torch.stack([g[n] for g in per_head]) for n in per_head[0]}
    return torch.stack(values), grads


def reference_cotangents(case: Case, tasks: Tasks) -> torch.Tensor:
    """V (k, *y.shape): each head's gradient with respect to the pooled features."""
    _seeded(case)
    with torch.no_grad():
        y = case.features(copy.deepcopy(case.model))
    y = y.detach().requires_grad_()
    return torch.stack([torch.autograd.grad(loss, y)[0] for loss in tasks.losses(y)])


def reference_weighted(case: Case, tasks: Tasks, weighting, level: str, per_head=None):
    """(the weights, the update of the shared parameters) that a weighting gives by hand:
    ``w @ P`` on the per-task gradients at level "params" (``per_head``, computed here where
    not given), the pull of ``w @ V`` through a copy of the model at level "features"; ``w``
    from the Gramian of the same rows."""
    if level == "params":
        if per_head is None:
            _, per_head = reference_per_head(case, tasks)
        rows = _flat(per_head)
        weights = weighting(rows @ rows.T)
        update = {
            n: torch.einsum("k,k...->...", weights.to(g.dtype), g) for n, g in per_head.items()
        }
        return weights, update
    v = reference_cotangents(case, tasks)
    flat = v.reshape(K, -1)
    weights = weighting(flat @ flat.T)
    wv = torch.einsum("k,k...->...", weights.to(v.dtype), v)
    return weights, _pull(case, lambda y: (y * wv).sum(), copy.deepcopy(case.model))


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(K, -1) for g in grads.values()], dim=1)


def _close(case: Case, got, want, what: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for name in want:
            _close(case, got[name], want[name], f"{what} {name}")
        return
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(
        got.to(want.dtype), want, rtol=case.rtol, atol=case.atol + case.rtol * scale, msg=what
    )


def _xfail(entry: str, variants: dict[str, tuple] | None = None):
    """Parametrize over CASES (x variants: id -> (entry suffix, *values)) with the known
    failures of each entry point marked xfail(strict=True)."""
    params = []
    for name in CASES:
        for vid, (suffix, *values) in (variants or {"": ("",)}).items():
            reason = XFAIL.get((name, entry + suffix))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            ident = f"{name}-{vid}" if vid else name
            params.append(pytest.param(name, *values, marks=marks, id=ident))
    argnames = "name" if variants is None else ",".join(["name", *_ARGNAMES[entry]])
    return pytest.mark.parametrize(argnames, params)


_ARGNAMES = {"combine": ["level"], "backward": ["level", "weighted"]}


def _refused(name: str, call):
    """The functional entry points refuse reentrant checkpointing with a clear error."""
    if name != REENTRANT:
        return False
    with pytest.raises(ValueError, match="reentrant checkpoint"):
        call()
    return True


# -- compose_heads ----------------------------------------------------------------------------


@_xfail("compose")
def test_compose_heads(name):
    case = _case(name)
    tasks = _tasks(case)
    want_values, want = reference_per_head(case, tasks)
    fn = funcgrad.compose_heads(case.functional, tasks.heads())
    if _refused(name, lambda: fn(_params(case))):
        return
    with _recorded(name):
        _seeded(case)
        values, grads = fn(_params(case))
    _close(case, values, want_values, "values")
    _close(case, grads, want, "grads")


# -- combine_heads ----------------------------------------------------------------------------


@_xfail("combine", {"params": ("-params", "params"), "features": ("-features", "features")})
def test_combine_heads(name, level):
    case = _case(name)
    tasks = _tasks(case)
    weighting = tjd.UPGradWeighting()
    want_values, per_head = reference_per_head(case, tasks)
    weights, want = reference_weighted(case, tasks, weighting, level, per_head)
    fn = funcgrad.combine_heads(case.functional, tasks.heads(), weighting, level=level)
    if _refused(name, lambda: fn(_params(case))):
        return
    with _recorded(name):
        _seeded(case)
        values, grad, got_weights = fn(_params(case))
    _close(case, values, want_values, "values")
    _close(case, got_weights, weights, "weights")
    _close(case, grad, want, "grad")


# -- pullback and pb.many ---------------------------------------------------------------------


@_xfail("pullback")
def test_pullback_and_many(name):
    case = _case(name)
    params = _params(case)
    with torch.no_grad():
        shape = case.features(copy.deepcopy(case.model)).shape
    cotangents = torch.randn(4, *shape, dtype=case.dtype)
    want = [
        _pull(case, lambda y, v=v: (y * v).sum(), copy.deepcopy(case.model)) for v in cotangents
    ]
    if _refused(name, lambda: funcgrad.pullback(lambda p: case.functional(p), params)):
        return
    try:
        with _recorded(name):
            _seeded(case)
            out, pb = funcgrad.pullback(lambda p: case.functional(p), params)
            (one,) = pb(cotangents[0])
            (many,) = pb.many(cotangents)
    except RuntimeError as error:  # exact, or this clear error
        assert _allowed_refusal(name, "pullback", error), error
        return
    assert out.shape == shape
    _close(case, one, want[0], "pb(v)")
    for i in range(4):
        _close(case, {n: g[i] for n, g in many.items()}, want[i], f"pb.many row {i}")


# -- grads (imperative) -----------------------------------------------------------------------


@_xfail("grads")
def test_grads(name):
    case = _case(name)
    tasks = _tasks(case)
    _, want = reference_per_head(case, tasks)
    names = [n for n, p in case.model.named_parameters() if p.requires_grad]
    inputs = [p for _, p in case.model.named_parameters() if p.requires_grad]
    try:
        with _recorded(name):
            _seeded(case)
            y = case.features()
            got = funcgrad.grads(tasks.losses(y), inputs, through=y, allow_unused=True)
    except RuntimeError as error:  # exact, or this clear error
        assert _allowed_refusal(name, "grads", error), error
        return
    _close(case, dict(zip(names, got)), want)


# -- backward: both levels, UPGrad and no weighting ----------------------------------------------


def _backward_reference(case: Case, tasks: Tasks, level: str, weighted: bool):
    """.grad of the shared and task parameters that funcgrad.backward must leave."""
    model = copy.deepcopy(case.model)
    task_grads = {}
    for i in range(K):  # each task-specific leaf gets its own loss's gradient
        _zero(model, tasks)
        _seeded(case)
        tasks.losses(case.features(model))[i].backward()
        task_grads.update(
            {f"task.{n}": p.grad.clone() for n, p in tasks.named_parameters() if p.grad is not None}
        )
    _zero(tasks)
    if not weighted:
        shared = _pull(case, lambda y: sum(tasks.losses(y)), model)
        _zero(tasks)
        _seeded(case)
        sum(tasks.losses(case.features(copy.deepcopy(case.model)))).backward()
        task_grads = {f"task.{n}": p.grad.clone() for n, p in tasks.named_parameters()}
        _zero(tasks)
        return shared, task_grads
    _, shared = reference_weighted(case, tasks, tjd.UPGradWeighting(), level)
    _zero(tasks)
    return shared, task_grads


def _funcgrad_backward(name: str, case: Case, tasks: Tasks, weighting, level: str) -> None:
    """funcgrad.backward on one seeded forward of the model under test (recorded)."""
    with _recorded(name):
        _seeded(case)
        y = case.features()
        funcgrad.backward(
            tasks.losses(y),
            through=y,
            weighting=weighting,
            level=level,
            # reentrant checkpointing hides the parameters inside it from the graph walk
            inputs=list(case.model.parameters()) if name == REENTRANT else None,
        )


@_xfail(
    "backward",
    {
        f"{level}-{w}": (f"-{level}" if w == "upgrad" else f"-none-{level}", level, w == "upgrad")
        for level in ("params", "features")
        for w in ("upgrad", "none")
    },
)
def test_backward(name, level, weighted):
    case = _case(name)
    tasks = _tasks(case)
    want_shared, want_tasks = _backward_reference(case, tasks, level, weighted)
    _zero(case.model, tasks)
    try:
        _funcgrad_backward(name, case, tasks, tjd.UPGradWeighting() if weighted else None, level)
    except RuntimeError as error:  # exact, or this clear error with nothing written
        assert weighted and _allowed_refusal(name, f"backward-{level}", error), error
        assert all(p.grad is None for p in [*case.model.parameters(), *tasks.parameters()])
        return
    _close(case, _grads_of(case.model), want_shared, "shared")
    got_tasks = {f"task.{n}": p.grad for n, p in tasks.named_parameters() if p.grad is not None}
    _close(case, got_tasks, want_tasks, "tasks")


@_xfail("torchjd")
def test_backward_params_equals_torchjd(name):
    """funcgrad.backward(level="params", UPGradWeighting()) against TorchJD's mtl_backward +
    jac_to_grad(model.parameters(), UPGrad()) on the same forward."""
    case = _case(name)
    tasks = _tasks(case)
    model = copy.deepcopy(case.model)
    theirs_tasks = copy.deepcopy(tasks)
    try:
        with warnings.catch_warnings():  # TorchJD vmaps autograd.grad too
            warnings.filterwarnings("ignore", PERF_DROP, UserWarning)
            _seeded(case)
            y = case.features(model)
            autojac.mtl_backward(theirs_tasks.losses(y), y)
            autojac.jac_to_grad(
                [p for p in model.parameters() if getattr(p, "jac", None) is not None],
                tjd.UPGrad(),
            )
    except RuntimeError as error:  # TorchJD's own limits: nothing to compare against
        pytest.skip(f"TorchJD itself fails here: {str(error).splitlines()[0][:150]}")
    want = _grads_of(model)
    want_tasks = {n: p.grad for n, p in theirs_tasks.named_parameters()}
    _zero(case.model, tasks)
    _funcgrad_backward(name, case, tasks, tjd.UPGradWeighting(), "params")
    _close(case, _grads_of(case.model), want, "shared")
    _close(case, {n: p.grad for n, p in tasks.named_parameters()}, want_tasks, "tasks")


def test_backward_reentrant_checkpoint_without_inputs_is_a_clear_error():
    case = _case(REENTRANT)
    tasks = _tasks(case)
    y = case.features()
    with pytest.raises(ValueError, match="reentrant checkpoint"):
        funcgrad.backward(tasks.losses(y), through=y, weighting=tjd.UPGradWeighting())
    assert all(p.grad is None for p in case.model.parameters())


# -- dropout: against one eager forward ------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "vjp", "jacrev", "jacfwd", "loop"])
def test_dropout_gradients_are_those_of_one_eager_forward(strategy):
    """Training-mode dropout: f draws random numbers, so compose_heads linearises it on eager
    autograd, whatever the strategy: values, gradients and the generator are those of one
    eager forward from the same seed (torch.func would draw another mask; pullback runs on
    eager autograd outside transforms, so test_pullback_and_many holds it to this too)."""
    case = _case("encoder-train-dropout")
    tasks = _tasks(case)
    params = _params(case)
    torch.manual_seed(1234)
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    losses = tasks.losses(case.functional(leaves))
    after = torch.get_rng_state()
    want_values = torch.stack(losses).detach()
    per_head = [
        torch.autograd.grad(loss, list(leaves.values()), retain_graph=True, allow_unused=True)
        for loss in losses
    ]
    want = {
        n: torch.stack([torch.zeros_like(leaves[n]) if g[i] is None else g[i] for g in per_head])
        for i, n in enumerate(leaves)
    }
    with _recorded("encoder-train-dropout"):
        torch.manual_seed(1234)
        fn = funcgrad.compose_heads(case.functional, tasks.heads(), strategy=strategy)
        # forward mode's batched JVP would draw other numbers: reverse mode, said once
        with (
            pytest.warns(funcgrad.FuncgradWarning, match="used reverse mode instead")
            if strategy == "jacfwd"
            else contextlib.nullcontext()
        ):
            values, grads = fn(params)
    assert torch.equal(torch.get_rng_state(), after)
    _close(case, values, want_values, "values")
    _close(case, grads, want, "grads")


# -- vmap's slow path -------------------------------------------------------------------------


@_xfail("perf")
def test_compose_heads_has_no_vmap_performance_drop(name):
    """A batched backward that hits vmap's per-example fallback warns "There is a
    performance drop ..." and can be slower than a plain loop; funcgrad should not leave
    that warning to the user (batch without the slow path, or pick the loop itself)."""
    if name == REENTRANT:
        pytest.skip("compose_heads refuses reentrant checkpointing (test_compose_heads)")
    case = _case(name)
    tasks = _tasks(case)
    fn = funcgrad.compose_heads(case.functional, tasks.heads(), strategy="vjp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _seeded(case)
        fn(_params(case))
    drops = [str(w.message).splitlines()[0] for w in record if PERF_DROP in str(w.message)]
    assert not drops, drops
