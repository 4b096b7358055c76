"""f's linearisation, the one thing the engine pulls directions through, in whatever form:

- :func:`of_function`: ``torch.func.vjp`` of a flat f; where torch.func cannot differentiate
  f but autograd can, the same on one eager autograd graph, with one warning;
- :func:`of_graph`: an autograd graph the user already built (``grads``, ``backward``);
- :func:`forward_columns`: J's n columns by forward mode, in one vmapped JVP.

Every re-run of f (the eager fallback after a failed torch.func attempt, reverse mode after
forward mode, ``check``'s unbatched calls) replays the random draws of the first run
(:class:`RandomState`: the default generators and every ``torch.Generator`` f passes to a
random op), so dropout masks, running statistics and every generator's final state are those
of one eager forward.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge
from torch.overrides import has_torch_function

from . import _graph, _tree
from ._errors import FuncgradWarning, InputWrittenError, describe, first_line
from ._function import FlatFunction
from ._types import Engine, Tensors
from ._validate import (
    UNTRACKED,
    differentiating,
    mismatch,
    outside_transforms,
    values_readable,
)


@dataclasses.dataclass(frozen=True)
class TorchLimit:
    """A failure of torch.func, vmap or forward mode on something plain autograd (or an
    unbatched call, or reverse mode) still differentiates. torch raises a plain
    RuntimeError/NotImplementedError for each, so the only way to tell them is a piece of
    the message: every such piece lives in :data:`TORCH_LIMITS`, and
    tests/test_linearize.py triggers each one on the installed torch, so that a reworded
    message in a later torch fails loudly instead of silently changing the path."""

    pattern: str
    eager: bool = False  # plain autograd differentiates f (of_function's fallback)
    loop: bool = False  # only vmap failed: an unbatched call works
    forward: bool = False  # only forward mode failed: reverse mode may work


TORCH_LIMITS: dict[str, TorchLimit] = {
    # An autograd.Function without setup_context (nn.functional.linear_cross_entropy's).
    "function without setup_context": TorchLimit(
        "In order to use an autograd.Function with functorch transforms", eager=True
    ),
    # Backward code that leaves PyTorch under vmap (tensor_split, _pdist_backward).
    "no storage": TorchLimit(
        "Cannot access data pointer of Tensor that doesn't have storage", eager=True, loop=True
    ),
    "wrapper storage": TorchLimit("Cannot access storage of TensorWrapper", eager=True, loop=True),
    # Non-reentrant torch.utils.checkpoint (saved-tensor hooks, which torch.func disables).
    "saved tensor hooks": TorchLimit("don't yet support saved tensor hooks", eager=True),
    # A forward hook calling requires_grad_() (transformers' gradient checkpointing).
    "requires_grad_": TorchLimit("You are attempting to call Tensor.requires_grad_()", eager=True),
    # f calling retain_grad() on an intermediate (a debugging habit).
    "retain_grad": TorchLimit("You are attempting to call Tensor.retain_grad()", eager=True),
    # f updates a captured tensor in place (BatchNorm's running statistics in training
    # mode): torch.func refuses it at the first in-place op, before anything is mutated.
    "mutates a captured tensor": TorchLimit("would mutate a captured Tensor", eager=True),
    # A funcgrad call inside f that pulls back to a tensor the transform does not track.
    "untracked": TorchLimit(UNTRACKED, eager=True),
    # torch.autograd.grad inside f to a tensor the transform does not track (a captured
    # parameter): eager autograd tracks it (or raises the same error, then the user's).
    "unused": TorchLimit("appears to not have been used in the graph", eager=True),
    # Forward-mode AD that cannot differentiate an op that reverse mode can.
    "no forward AD formula": TorchLimit("Trying to use forward AD with", forward=True),
    "custom Function without jvp": TorchLimit("to use it with forward mode AD", forward=True),
    "custom Function jvp": TorchLimit("jvp function for custom autograd.Function", forward=True),
    "C++ custom Function jvp": TorchLimit("jvp is not implemented", forward=True),
    "derivative not implemented": TorchLimit("the derivative for", forward=True),
    # torch.autograd.grad inside f under forward mode (jvp, jacfwd): no tensor f made there
    # has a grad_fn; reverse mode runs it (else the same error, then the user's own).
    # (The user's own misuse of autograd.grad reads the same: reverse mode then raises it.)
    "no grad_fn": TorchLimit("does not require grad and does not have a grad_fn", forward=True),
    # A torch.compile'd backward that donates its buffers runs once (not a torch.func limit).
    "donated buffers": TorchLimit("donated buffers"),
}


# autograd's error for a saved tensor changed in place since it was saved (its version).
MODIFIED_IN_PLACE = "modified by an inplace operation"


def torch_limit(error: BaseException) -> str | None:
    """The name in :data:`TORCH_LIMITS` of the limit ``error`` reports, or None (the user's
    own error, or one funcgrad has no other way around)."""
    if not isinstance(error, (RuntimeError, NotImplementedError)):
        return None
    message = str(error)
    return next((name for name, limit in TORCH_LIMITS.items() if limit.pattern in message), None)


def is_forward_mode_limit(error: BaseException) -> bool:
    """Whether forward mode itself (not vmap, torch.func as a whole or the user's code)
    failed, so that reverse mode may succeed."""
    name = torch_limit(error)
    return name is not None and TORCH_LIMITS[name].forward


def is_torch_func_limit(error: BaseException) -> bool:
    """Whether torch.func (not vmap alone) failed on f, so that only eager autograd can help."""
    name = torch_limit(error)
    return name is not None and TORCH_LIMITS[name].eager and not TORCH_LIMITS[name].loop


def _leaf_name(flat: FlatFunction, index: int) -> str:
    """Differentiated leaf ``index`` of ``flat`` as the caller wrote it: ``argument 0['w']``."""
    for argnum, treedef, count in zip(flat.argnums, flat.in_defs, flat.counts):
        if index < count:
            path = _tree.leaf_path(treedef, index)
            return f"argument {argnum}" + ("" if path == "<root>" else path)
        index -= count
    return f"primal leaf {index}"


class RandomState:
    """The random number generators f draws from, saved before f (first) runs; :meth:`restore`
    before a re-run makes it draw the same numbers, and after the last run leaves them where
    one eager forward leaves them. The default ones (the CPU one, those of the CUDA devices
    of f's inputs) are saved now; every ``torch.Generator`` f passes to a random op
    (``generator=``) as ``flat`` records it when f first draws from it (its state before that
    draw, which is its state now if f has not run yet). Inert in compiled code, where the
    state cannot be read. Where f wrote into a differentiated argument in place,
    :meth:`restore` raises instead (``inputs``)."""

    def __init__(self, flat: FlatFunction, inputs: bool = True) -> None:
        self.active = not torch.compiler.is_compiling()
        self.devices = sorted({t.device.index or 0 for t in flat.leaves if t.device.type == "cuda"})
        self.drawn = flat.generators  # filled as f runs
        self.flat = flat
        if self.active:
            self.cpu = torch.get_rng_state()
            self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
            self.now = {generator: generator.get_state() for generator in self.drawn}
        # What a re-run of f cannot restore, a write into a differentiated argument, is
        # refused (``inputs``: not for plan()'s runs, which make such writes on copies).
        # (An inference tensor has no version: torch refuses it as a primal further on.)
        watched = inputs and self.active and not any(t.is_inference() for t in flat.leaves)
        self.versions = [leaf._version for leaf in flat.leaves] if watched else []

    def restore(self) -> None:
        """The generators as saved, before a re-run of f; a clear error instead where f
        wrote into a differentiated argument in place (under ``torch.no_grad()``, through
        ``.data`` or ``.detach()``), which the re-run would write again and differentiate
        f at."""
        if not self.active:
            return
        for index, (leaf, version) in enumerate(zip(self.flat.leaves, self.versions)):
            if leaf._version != version:
                raise InputWrittenError(
                    f"{self.flat.call}: f wrote in place into the differentiated "
                    f"{_leaf_name(self.flat, index)} ({describe(leaf)}; version "
                    f"{version} -> {leaf._version}: a write under torch.no_grad(), through .data "
                    "or .detach(), or a module that renormalises its weight, such as "
                    "nn.Embedding(max_norm=...)), and this call must run f again (a fallback, "
                    "random draws replayed, or check's unbatched calls): that run would write it "
                    "again and differentiate f at the changed value. Nothing was accumulated. "
                    "Write out of place inside f (x = x * 2, not x.mul_(2)), or pass a copy "
                    "(x.clone()); strategy='auto' without check or create_graph learns from this "
                    "call to run f once, on eager autograd, from the next call on."
                )
        # Explicit generators first: an explicit default generator ends as saved below.
        for generator, first in self.drawn.items():
            generator.set_state(self.now.get(generator, first))
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, device)

    def replaying(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` that restores the generators before every call but the first."""
        calls = 0

        def replayed(*args: Any) -> Any:
            nonlocal calls
            if calls:
                self.restore()
            calls += 1
            return fn(*args)

        return replayed


@dataclasses.dataclass
class Linearization:
    """A linear map ``v -> J^T v`` at a point, and what it was taken at.

    ``vjp`` takes one cotangent (a tuple of y's leaves) and returns one gradient per input
    leaf; it can be called many times, and vmapped where ``can_vmap``. ``last_vjp`` is the
    call to use for the last pull (on an autograd graph it frees the graph unless the user
    asked to retain it); ``accumulate`` (graphs only) runs ``torch.autograd.backward``, so
    that hooks on the leaves (DDP's reducer) fire.
    """

    out: Tensors
    x_like: Tensors
    vjp: Callable[[Tensors], Tensors]
    can_vmap: bool
    what: str
    aux: Tensors = ()
    last_vjp: Callable[[Tensors], Tensors] | None = None
    accumulate: Callable[[Tensors], None] | None = None
    engine: Engine = "autograd"  # of_function's torch.func.vjp: "torch.func"
    # Eager autograd without a graph of the results: f's outputs still on the graph, and the
    # inputs it was recorded for (heads can then be pulled through f in one backward each).
    attached: Tensors = ()
    inputs: Tensors = ()
    # The graph holds a torch.compile'd backward: its pulls check a second pass against the
    # first (see repeat_checked); the heads are not pulled through f with it (one pass each).
    compiled: bool = False
    # pullback's graph: the gradient edges its pulls run between (f's outputs, its inputs).
    edges: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None


def _plain(outputs: Tensors, inputs: Tensors, cotangents: Any) -> bool:
    """Whether ``torch.autograd.grad(outputs, inputs, cotangents)`` would do nothing beyond
    the engine's call with these cotangents: outputs that require grad; no cotangents and
    real scalar outputs (their ones built as torch.autograd.grad would), or one tensor per
    output of its shape and dtype; some inputs; no ``__torch_function__`` (DTensor, a mode
    active) and not under dynamo."""
    if cotangents is None:
        fits = all(
            z.requires_grad and z.numel() == 1 and z.dtype.is_floating_point for z in outputs
        )
    else:
        fits = len(cotangents) == len(outputs) and all(
            isinstance(v, torch.Tensor)
            and z.requires_grad
            and v.shape == z.shape
            and v.dtype == z.dtype
            for z, v in zip(outputs, cotangents)
        )
    return (
        fits
        and len(inputs) > 0  # (torch.autograd.grad's own error for none)
        and not has_torch_function((*outputs, *inputs))
        and not torch.compiler.is_compiling()
    )


def autograd_grad(
    outputs: Any,
    inputs: Tensors,
    cotangents: Any,
    retain_graph: bool,
    create_graph: bool = False,
    plain: bool | None = None,
    edges: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None,
) -> Tensors:
    """``torch.autograd.grad`` with zeros, not None, for inputs the outputs do not reach.
    ``plain``: the caller's :func:`_plain` of these arguments (None: found out here).
    ``edges``: what to differentiate from and at instead of the outputs and inputs
    themselves (each a tensor or a gradient edge taken earlier)."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    if isinstance(cotangents, torch.Tensor):
        cotangents = (cotangents,)
    if plain is None:
        plain = _plain(outputs, inputs, cotangents)
    roots, targets = (outputs, inputs) if edges is None else edges  # (torch takes both)
    if plain:
        # k calls of it per call (the losses' backward, the eager per-head pulls):
        # torch.autograd.grad's own Python (argument normalisation, _make_grads) costs about
        # as much as a tiny backward (docs/performance.md), and has nothing to do here but
        # build the ones of scalar outputs.
        if cotangents is None:
            cotangents = [torch.ones_like(z, memory_format=torch.preserve_format) for z in outputs]
        grads = _engine_run_backward(
            roots,
            tuple(cotangents),
            retain_graph,
            create_graph,
            targets,
            True,
            accumulate_grad=False,
        )
    else:
        grads = torch.autograd.grad(
            roots,
            targets,
            cotangents,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=True,
        )
    if len(grads) == 1 and grads[0] is not None:  # (the usual case, without a loop)
        return tuple(grads)
    return tuple([torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)])


def losses_backward(
    outputs: Tensors,
    through: Tensors,
    own: list[Tensors],
    alone: list[bool],
    *,
    retain: bool,
    summed: bool = False,
    create_graph: bool = False,
) -> tuple[Tensors, Tensors, Tensors, bool]:
    """The cheap backward of k scalar ``outputs`` (losses, heads' values) computed from
    ``through``: ``(V, leaves, grads, all_freed)``. V: the k cotangents on ``through``, one
    stacked tensor per ``through`` tensor. ``leaves``: the outputs' own leaves (``own``, per
    output: those reached other than through ``through``, task-specific parameters), each
    once, and ``grads`` their gradients of the outputs' sum, as ``sum(outputs).backward()``
    accumulates them.

    One backward per output, each freeing its own part of the graph where no later output
    runs through it (``alone``), without ``retain``. With ``summed`` (all V is needed for is
    its sum): ONE backward of all the outputs at once, as ``sum(outputs).backward()`` (each
    its own root: nothing summed across dtypes or devices), V its one row, and without
    ``retain`` it frees the whole graph above ``through`` (``all_freed``).

    (Not one backward batched over the k unit cotangents, by ``is_grads_batched``: it
    costs what the k backwards cost on the CPU (docs/benchmarks.md), each head's nodes run
    either way, and it would need a second backward to free the graph and a host read to
    give autograd's NaN/inf, where a zero cotangent meets an infinite derivative.)"""
    ones = _ones(outputs, create_graph)
    if not summed and not any(own):  # (no output's own leaves: the usual heads, k calls)
        plain = _plain(outputs, through, None)
        pulled = [
            autograd_grad(z, through, one, retain or not free, create_graph, plain=plain)
            for z, one, free in zip(outputs, ones, alone, strict=True)
        ]
        cotangents = tuple(torch.stack([row[j] for row in pulled]) for j in range(len(through)))
        return cotangents, (), (), False
    leaves = tuple({id(x): x for mine in own for x in mine}.values())
    if summed:  # (all the outputs as roots of one backward: no sum built, on any devices)
        grads = autograd_grad(
            tuple(outputs), leaves + through, ones, retain_graph=retain, create_graph=create_graph
        )
        return tuple(g[None] for g in grads[len(leaves) :]), leaves, grads[: len(leaves)], True
    index = {id(x): i for i, x in enumerate(leaves)}
    sums: list[Any] = [None] * len(leaves)
    rows: list[Tensors] = []
    plain = _plain(outputs, through + leaves, None)  # (once for the k calls)
    for z, one, mine, free in zip(outputs, ones, own, alone, strict=True):
        row = autograd_grad(
            z,
            through + mine,
            one,
            retain_graph=retain or not free,
            create_graph=create_graph,
            plain=plain,
        )
        rows.append(row[: len(through)])
        for x, g in zip(mine, row[len(through) :]):
            i = index[id(x)]
            sums[i] = g if sums[i] is None else sums[i] + g
    cotangents = tuple(torch.stack([row[j] for row in rows]) for j in range(len(through)))
    return cotangents, leaves, tuple(sums), False


def _ones(outputs: Tensors, create_graph: bool) -> list[Any]:
    """The unit cotangent of each scalar output, as the views of one tensor of ones (two ops,
    not one per output) where all are 0-dim of one floating dtype and device; else None each
    (each then gets torch's own, or its error). The views share no element, so a backward
    that writes into its cotangent changes no other's value; but they share one version
    counter, so where a graph is built (which may save a cotangent, and a later head's
    backward may write into its own) each gets torch's own."""
    z = outputs[0] if outputs else None
    if (
        not create_graph
        and z is not None
        and z.dtype.is_floating_point
        and all(o.dim() == 0 and o.dtype == z.dtype and o.device == z.device for o in outputs)
    ):
        return list(torch.ones(len(outputs), dtype=z.dtype, device=z.device).unbind())
    return [None] * len(outputs)


def backward_grad(outputs: Any, inputs: Tensors, cotangents: Any, retain_graph: bool) -> Tensors:
    """What ``torch.autograd.grad`` gives, by ``torch.autograd.backward`` into ``.grad``: the
    only way to reach leaves inside a reentrant checkpoint. The inputs' ``.grad`` are set
    aside and restored, so only the answer is returned (one pass per call: no vmap)."""
    saved = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    try:
        torch.autograd.backward(outputs, cotangents, retain_graph=retain_graph)
        return tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in inputs)
    finally:
        for x, g in zip(inputs, saved):
            x.grad = g


def of_graph(
    outputs: Tensors,
    inputs: Tensors,
    *,
    create_graph: bool = False,
    retain_graph: bool = True,
    by_backward: bool,
    compiled: bool,
) -> Linearization:
    """The backward of an existing graph from ``outputs`` to ``inputs``. Every pull but the
    last retains the graph; the last retains it only with ``retain_graph``. Batched with
    ``torch.func.vmap`` over ``torch.autograd.grad`` (as TorchJD batches), a loop with
    ``create_graph``; by ``.backward()``, one pass per direction, through a reentrant
    checkpoint (``by_backward``: whether one lies between outputs and inputs, as the
    caller's walk of the graph found). ``compiled``: a torch.compile'd backward lies between
    them (a second pass is checked against the first: :func:`repeat_checked`)."""
    if by_backward and create_graph:
        raise ValueError(
            "funcgrad: create_graph=True cannot go through a reentrant checkpoint "
            "(torch.utils.checkpoint with use_reentrant=True); checkpoint with "
            "use_reentrant=False."
        )
    what = "the backward from `through` to the inputs"

    def pull_once(cotangent: Tensors, retain: bool) -> Tensors:
        if by_backward:
            return backward_grad(outputs, inputs, cotangent, retain)
        return autograd_grad(outputs, inputs, cotangent, retain, create_graph)

    pull = repeat_checked(pull_once, what) if compiled else pull_once

    def accumulate(cotangent: Tensors) -> None:
        torch.autograd.backward(outputs, cotangent, inputs=list(inputs), retain_graph=retain_graph)

    return Linearization(
        tuple(o.detach() for o in outputs),
        inputs,
        lambda cotangent: pull(cotangent, True),
        not (create_graph or by_backward or compiled),  # (torch refuses a compiled one)
        what + (" (by .backward(): a reentrant checkpoint)" if by_backward else ""),
        (),
        lambda cotangent: pull(cotangent, retain_graph),
        None if by_backward else accumulate,
        compiled=compiled,
    )


def repeat_checked(
    pull: Callable[[Tensors, bool], Tensors], what: str
) -> Callable[[Tensors, bool], Tensors]:
    """``pull`` (a cotangent, whether to retain the graph) through a graph that holds a
    torch.compile'd backward, which torch 2.13 may run wrongly a second time, with no error
    (see ``_graph.COMPILED_BACKWARD``): the first pull's cotangent and answer are kept, and
    before the second pull that cotangent goes through again and must give the same answer
    (within the dtype's tolerance; one pass more, once per graph), else a clear error. Pulls
    under vmap pass through: torch refuses to run a compiled backward there."""
    first: list[tuple[Tensors, Tensors]] = []
    verified = False

    def checked(cotangent: Tensors, retain: bool) -> Tensors:
        nonlocal verified
        if verified or not values_readable(cotangent):
            return pull(cotangent, retain)
        if not first:
            result = pull(cotangent, retain)
            if retain:  # (else the graph is gone: there is no second pass to check)
                first.append((_kept(cotangent), _kept(result)))
            return result
        seen, answer = first.pop()
        problem = mismatch(tuple(a[None] for a in answer), pull(seen, True), 0)
        if problem is not None:
            raise RuntimeError(
                f"funcgrad: {what} runs a torch.compile'd backward, and torch ran it a second "
                f"time on the same graph with another answer ({problem}): torch 2.13 can "
                "get a compiled backward wrong when it runs twice (seen with inductor where "
                "the default dtype was float64 when it compiled). Nothing was written. Compile "
                "with the default dtype float32 (torch.set_default_dtype before the first call), "
                "compile the layers inside rather than the module whose backward runs several "
                "times, or use one backward (combine_heads, level='features')."
            )
        verified = True
        return pull(cotangent, retain)

    return checked


def _kept(tensors: Tensors) -> Tensors:
    return tuple(t.detach().clone() for t in tensors)


def _edge(x: torch.Tensor) -> torch.Tensor | GradientEdge:
    """The gradient edge of a view of a primal (a C++ node: none of get_gradient_edge's
    work), else ``x`` (a leaf: its edge stays)."""
    node = x.grad_fn if x._is_view() else None
    return x if node is None else GradientEdge(node, x.output_nr)


def _eager(flat: FlatFunction, what: str, *, linked: bool = False) -> Linearization:
    """The contract of ``torch.func.vjp``, on plain autograd (one retained graph). Where
    grad mode is on (the caller wants the graph of the results: ``create_graph=True``), the
    results keep it, as torch.func's ``vjp_fn`` builds it then: the inputs that require grad
    are differentiated as they are (their graph goes on), and vjp builds its own graph (then
    one call a direction, not vmapped).

    ``linked`` (``pullback``, in grad mode or not): f's output is linked to the graph outside
    exactly where torch.func's would be, and the pulls are vmapped whenever they build no
    graph. Each input that requires grad is differentiated through a view of it (its own
    edge, even where one tensor is passed twice), the others as detached leaves; the output
    is handed out detached unless something outside these leaves that requires grad (an
    input, a captured parameter) reaches it."""
    differentiable = torch.is_grad_enabled()
    inputs = tuple(
        (leaf.view_as(leaf) if linked else leaf)
        if differentiable and leaf.requires_grad
        else leaf.detach().requires_grad_()  # (f's own leaf at its value: no copy)
        for leaf in flat.leaves
    )
    with torch.enable_grad(), differentiating():
        result = flat(*inputs)
    out, aux = result if flat.has_aux else (result, ())

    # Walked on every call (one signature's graph can change: checkpointing switched on, a
    # module compiled): a reentrant checkpoint, a compiled backward, and whether the output
    # is linked to tensors outside that require grad.
    scanned = _graph.scan(out, inputs)
    if scanned.checkpoint:
        raise ValueError(
            f"{flat.call}: f runs a reentrant checkpoint (torch.utils.checkpoint with "
            "use_reentrant=True, transformers' default gradient checkpointing). Its backward "
            "recomputes the forward outside this call (with the module's own parameters, not "
            "the ones passed to f) and writes .grad as a side effect, so no gradient of f's "
            "arguments can be read from it. Checkpoint with use_reentrant=False (transformers: "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
            "False})), or build the graph yourself and use funcgrad.backward."
        )
    compiled = scanned.compiled

    # An output that does not depend on the inputs (a constant, a detached part) contributes
    # nothing, as in torch.func's vjp_fn: autograd would refuse it.
    live = [i for i, o in enumerate(out) if o.requires_grad]
    roots = tuple(out[i] for i in live)
    # The pulls run between the gradient edges taken now, where the caller can change
    # tensors in place after pullback returns. An input view's grad_fn is regenerated once
    # its base (the caller's primal) changes, and the new one is off f's graph (its
    # gradients would come out zeros); an output changed in place in grad mode (a linked
    # one) gets the caller's op as its grad_fn, which vjp_fn's does not see.
    edges = (tuple(map(get_gradient_edge, roots)), tuple(map(_edge, inputs))) if linked else None

    def pull_once(cotangents: Tensors, retain: bool) -> Tensors:
        graph = differentiable and torch.is_grad_enabled()  # at call time, as vjp_fn's
        if len(roots) < len(out):
            if not roots:
                return tuple(torch.zeros_like(x) for x in inputs)
            cotangents = tuple(cotangents[i] for i in live)
        try:
            return autograd_grad(roots, inputs, cotangents, retain, graph, edges=edges)
        except RuntimeError as error:
            if linked and MODIFIED_IN_PLACE in str(error):
                raise RuntimeError(
                    f"{flat.call}: a tensor that f's graph saved was modified in place after "
                    f"pullback returned ({first_line(error)}): a primal, f's output, or a "
                    "tensor f captured. The pullback is J_f at the values f saw, and its graph "
                    "shares their storage (torch.func.vjp would silently use the new values). "
                    "Pull back before changing them, call funcgrad.pullback again after the "
                    "change, or change a copy (x.clone())."
                ) from error
            if not (linked and _graph.FREED_GRAPH in str(error)):
                raise
            raise RuntimeError(
                f"{flat.call}: f's graph was freed, so its pullback cannot run: f ran on eager "
                "autograd, and a backward without retain_graph=True through a tensor that "
                "shares its graph freed it: f's output (linked to tensors outside that "
                "require grad), or a result pulled back with create_graph=True. Pull back "
                "before that backward, or pass retain_graph=True to it."
            ) from error

    pull = repeat_checked(pull_once, what) if compiled else pull_once

    def vjp(cotangents: Tensors) -> Tensors:
        return pull(cotangents, True)

    # (Every pass one by one through a compiled backward: torch refuses to vmap it, and each
    # pass after the first is then checked.)
    if differentiable and not linked:
        return Linearization(
            tuple(out), flat.leaves, vjp, False, what, tuple(aux), compiled=compiled
        )
    handed = (*out, *aux)
    if differentiable and (scanned.outside or aux):
        if len(handed) == 1:
            return Linearization(
                tuple(out), flat.leaves, vjp, not compiled, what, compiled=compiled, edges=edges
            )
        # Each tensor linked or not on its own, as torch.func's.
        handed = tuple(t if _graph.scan((t,), inputs).outside else t.detach() for t in handed)
    else:
        handed = tuple(t.detach() for t in handed)
    return Linearization(
        handed[: len(out)],
        flat.leaves,
        vjp,
        not compiled,
        what,
        handed[len(out) :],
        attached=tuple(out),
        inputs=inputs,
        compiled=compiled,
        edges=edges,
    )


def on_autograd(flat: FlatFunction) -> Linearization:
    """f's linearisation on eager autograd, for a caller outside torch.func transforms
    (``flat.readable``), in grad mode or not: ``pullback``'s. f runs once, eagerly (its
    random draws, running statistics and in-place updates are those of one forward, and it
    is never re-run); the pulls go through its graph with ``torch.autograd.grad``, vmapped
    where they build no graph. Same values as ``torch.func.vjp``, and its output is linked
    to the graph outside as torch.func's would be (see :func:`_eager`); without torch.func's
    wrapping of every op (docs/performance.md)."""
    return _eager(flat, "f's pullback", linked=True)


def of_function(
    flat: FlatFunction, rng: RandomState | None, engine: Engine = "torch.func", warn: bool = True
) -> Linearization:
    """f's linearisation on ``engine``: ``torch.func.vjp`` of ``flat``, or one eager
    autograd graph (the caller's plan chose it: no graph of the results wanted, outside
    transforms; f then runs once and is never re-run). Where torch.func cannot
    differentiate f but autograd can, or f drew random numbers under it (torch.func draws
    other numbers than eager for some ops), the same on eager autograd (the random draws
    replayed), with one warning for the former (``warn``: none where the caller only tried
    torch.func, as auto's timed call does, and then keeps to eager autograd)."""
    what = "f's pullback"
    if engine == "autograd":
        return _eager(flat, what)
    assert rng is not None, "torch.func may fail or draw: f's re-run needs the saved state"
    drawing = not torch.is_grad_enabled() and flat.readable
    try:
        # f's forward in grad mode whatever the caller's: some kernels decide from the global
        # grad mode whether to save what their backward needs (the CPU LSTM's workspace,
        # without which torch.func's pullback fails). Without a graph wanted, the results are
        # detached below; vjp_fn builds a graph only where the caller's grad mode is on.
        with torch.enable_grad():
            result: Any = torch.func.vjp(flat, *flat.leaves, has_aux=flat.has_aux)
    except (RuntimeError, NotImplementedError) as error:
        name = torch_limit(error)
        if name is None or not TORCH_LIMITS[name].eager or not outside_transforms(flat.leaves):
            raise
        mutates = name == "mutates a captured tensor"
        rng.restore()  # the failed attempt may have drawn random numbers (dropout)
        lin = _eager(flat, what)
        if mutates:
            why = (
                "f updates a captured tensor in place, such as BatchNorm's running statistics "
                "in training mode; torch.func refuses that before anything is mutated. funcgrad "
                "ran f once on eager autograd instead (statistics updated once, random draws as "
                "in one eager forward, gradients as autograd's, still batched with vmap where "
                "it can). To stay in torch.func: use eval mode, "
                "torch.func.replace_all_batch_norm_modules_(model), or pass the buffers to f "
                "explicitly"
            )
            if warn:
                warnings.warn(f"{flat.call}: {why}.", FuncgradWarning, stacklevel=5)
            return lin
        if warn:
            warnings.warn(
                f"{flat.call}: torch.func cannot differentiate f ({first_line(error)}); "
                "fell back to eager torch.autograd.grad, one backward pass per direction. "
                "The answer is the same as autograd's; it is not batched and not composable "
                "with torch.func transforms.",
                FuncgradWarning,
                stacklevel=5,
            )
        return dataclasses.replace(lin, can_vmap=False)
    if drawing and flat.drew:  # found out in this run: again on eager autograd, same draws
        rng.restore()
        return _eager(flat, what)
    out, vjp, aux = result if flat.has_aux else (*result, ())
    # (Inside a transform the results stay on it, grad mode or not: a forward-mode level
    # around the call, jvp or jacfwd, differentiates through them even under no_grad.)
    if not torch.is_grad_enabled() and (
        torch.compiler.is_compiling() or outside_transforms(flat.leaves)
    ):  # (dynamo cannot trace outside_transforms; compiled code as before)
        out, aux = tuple(o.detach() for o in out), tuple(a.detach() for a in aux)
    return Linearization(tuple(out), flat.leaves, vjp, True, what, tuple(aux), engine="torch.func")


def jvp_of(flat: FlatFunction) -> Callable[..., Tensors]:
    """One JVP of f along a tangent (one per input leaf): f's output, the tangent of the
    output and aux, flattened into one tuple (the engine batches it)."""
    primals = flat.leaves

    def one(*tangent: torch.Tensor) -> Tensors:
        result: tuple[Any, ...] = torch.func.jvp(flat, primals, tangent, has_aux=flat.has_aux)
        aux = result[2] if flat.has_aux else ()
        return (*result[0], *result[1], *aux)

    return one
