"""Task weightings: from k per-task gradients to weights and one update, for ``backward``
and ``combine_heads``. Pure math: no collectives (the Sync policy makes those, between
these steps).

A weighting is any callable Gramian (k x k) -> weights (k,), TorchJD's ``*Weighting``
objects included; TorchJD's ``Aggregator`` objects (Jacobian -> vector) are recognised by
their class, without importing TorchJD, and run as TorchJD's ``jac_to_grad`` runs them
(see :class:`Rule`).

With G the Gramian of the rows of a Jacobian P (k x n) and w = weighting(G), the update is
``w @ P``. When P = V J (V the head cotangents on y, J f's Jacobian), ``w @ P = (w @ V) J``:
one pullback of f, once w is known. None of this runs under a caller's autocast: the
Gramian, the weighting and ``w @ P`` are in the task gradients' dtype, float32 or wider.

``keep_graph`` (``combine_heads(create_graph=True)``, or a call inside a torch.func
transform): the Gramian, the weighting's input and the weights keep their graph, so that a
gradient through the update ``w @ P`` also reaches ``w``'s dependence on the task gradients
(and on whatever else the weighting reads). Otherwise all are detached: no graph is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._errors import describe
from ._types import Tensors
from ._validate import check_level, values_readable

if TYPE_CHECKING:
    from ._sync import Sync


def _torchjd_bases(obj: object) -> set[str]:
    """The names of ``obj``'s TorchJD base classes (TorchJD is never imported)."""
    return {cls.__name__ for cls in type(obj).__mro__ if cls.__module__.startswith("torchjd")}


def _has_hooks(module: Any) -> bool:
    """Whether forward (pre-)hooks are registered on a TorchJD object, as ``jac_to_grad``
    checks before it takes the Gramian shortcut."""
    return bool(getattr(module, "_forward_hooks", None)) or bool(
        getattr(module, "_forward_pre_hooks", None)
    )


def _weighting_input(weighting: Any) -> str:
    """What a TorchJD ``Weighting`` reads: ``"gramian"`` (a ``_GramianWeighting``) or
    ``"jacobian"`` (a ``_MatrixWeighting``, or a composition such as an aggregator's
    ``weighting``); a wrapper such as ``CRMOGMWeighting`` reads what it wraps."""
    bases = _torchjd_bases(weighting)
    if "_GramianWeighting" in bases:
        return "gramian"
    if "_MatrixWeighting" in bases or "_Composition" in bases:
        return "jacobian"
    inner = getattr(weighting, "weighting", None)
    return _weighting_input(inner) if inner is not None else "gramian"


# TorchJD weightings whose input is A = J_1 J_2^T, from the task Jacobians of two independent
# mini-batches (their docs): neither the Jacobian nor the Gramian of the one batch a call has.
_CROSS_BATCH = ("MoDoWeighting", "SDMGradWeighting")


def _check_not_cross_batch(weighting: Any, call: str) -> None:
    """A clear error, before any pass, for a weighting (or an aggregator around one) that
    reads two mini-batches' product: given one batch's matrix it fails inside TorchJD (a
    size mismatch on the Jacobian) or, on the Gramian, loses its convergence guarantee."""
    inner = weighting
    while inner is not None:
        found = sorted(set(_CROSS_BATCH) & _torchjd_bases(inner))
        if found:
            name, kind = type(inner).__name__, found[0]
            around = f" (around a {name})" if inner is not weighting else ""
            raise ValueError(
                f"{call}: `weighting` {type(weighting).__name__}{around} reads A = "
                f"J_1 J_2^T, the product of the task Jacobians of two independent "
                f"mini-batches ({kind}'s TorchJD docs), but one call has one batch. Compute "
                f"A from two batches as TorchJD's example does, take weights = w(A) with w your "
                f"{name} instance (not an aggregator around it, which returns an update), "
                "and pass weighting=lambda gramian: weights."
            )
        inner = getattr(inner, "weighting", None)


@dataclasses.dataclass(frozen=True)
class Rule:
    """How weights (or the update) come out of the task gradients.

    ``kind``:

    - ``"sum"``: no weighting: all ones, no Gramian;
    - ``"gramian"``: ``fn(G)`` gives the weights (any callable; TorchJD's Gramian weightings;
      a Gramian-weighted aggregator without hooks, through its ``gramian_weighting``, the
      shortcut ``jac_to_grad`` takes);
    - ``"jacobian"``: ``fn(P)`` gives the weights, P the k x n Jacobian (TorchJD's matrix
      weightings: Mean, Random, ExcessMTL, ...);
    - ``"matrix"``: ``fn(P)`` gives the update and ``fn.weighting`` the weights, as TorchJD's
      ``jac_to_grad`` reads them (weighted aggregators, and Gramian-weighted ones with hooks,
      so that the hooks run);
    - ``"vector"``: ``fn(P)`` gives the update and there are no weights (GradDrop, ConFIG,
      TrimmedMean).

    At level ``"features"`` the Jacobian is V, the task gradients with respect to
    ``through``, and the Gramian is ``V V^T``.
    """

    kind: str
    fn: Any = None

    @property
    def needs_jacobian(self) -> bool:
        return self.kind in ("jacobian", "matrix", "vector")

    @property
    def update_is_weighted(self) -> bool:
        """Whether the update is known to be ``weights @ P``, so that one pull of
        ``weights @ V`` gives it: not for an aggregator without weights, nor for one with
        forward (pre-)hooks of its own, which may change its input or its output."""
        return self.kind != "vector" and not (self.kind == "matrix" and _has_hooks(self.fn))


def resolve(weighting: Any, level: object, call: str, *, distributed: bool = False) -> Rule:
    """The rule for ``weighting`` at ``level``, or a clear error (before any pass)."""
    check_level(level, call)
    if weighting is None:
        return Rule("sum")
    name = type(weighting).__name__
    if isinstance(weighting, type):
        raise TypeError(
            f"{call}: `weighting` must be an instance, got the class {weighting.__name__}. "
            f"Pass {weighting.__name__}() (with its arguments, if it takes any)."
        )
    bases = _torchjd_bases(weighting)
    _check_not_cross_batch(weighting, call)
    if "Aggregator" in bases:
        if "GramianWeightedAggregator" in bases and not (
            _has_hooks(weighting) or _has_hooks(weighting.weighting)
        ):
            rule = Rule("gramian", weighting.gramian_weighting)
        elif "WeightedAggregator" in bases:
            rule = Rule("matrix", weighting)
        elif level == "features":
            raise ValueError(
                f"{call}: `weighting` {name} is a TorchJD Aggregator without weights: it maps "
                "the Jacobian with respect to the parameters to an update, which "
                "level='features' never forms. Pass level='params', or a weighting (such as "
                "UPGradWeighting()) at level='features'."
            )
        else:
            rule = Rule("vector", weighting)
    elif "Weighting" in bases:
        rule = Rule(_weighting_input(weighting), weighting)
    elif callable(weighting):
        rule = Rule("gramian", weighting)
    else:
        raise TypeError(
            f"{call}: `weighting` must be None, a callable Gramian (k x k) -> weights (k,), "
            f"or a TorchJD Aggregator or Weighting, got {describe(weighting)}."
        )
    if distributed and level == "features" and rule.needs_jacobian:
        raise ValueError(
            f"{call}: `weighting` {name} reads the Jacobian, and at level='features' with a "
            "process group that is V, split across the ranks (only V V^T is reduced). Pass "
            "level='params', or a Gramian weighting (such as UPGradWeighting())."
        )
    return rule


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    # A half-precision Gramian overflows easily, and TorchJD's solvers want float32 or more.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off on ``device``: a caller's ``torch.autocast`` region is for its forward,
    and under it the Gramian ``b @ b.T``, a weighting's own products and ``w @ P`` would run
    in bf16/fp16 (which TorchJD's solvers refuse, and which loses the Gramian's accuracy).
    (A context object, not a generator: entered several times a call.)"""
    if autocast_on(device):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()  # autocast off already, or a device without it (meta)


def autocast_on(device: torch.device) -> bool:
    """Whether a ``torch.autocast`` region is active on ``device``."""
    return torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)


# A Jacobian of at most this many entries is concatenated for its Gramian: one product
# instead of one per block (a small one costs its dispatch, docs/performance.md), for at most
# this many entries more in memory.
CONCAT_ENTRIES = 1 << 18


def gramian(blocks: Sequence[torch.Tensor], keep_graph: bool = False) -> torch.Tensor:
    """``sum_b b @ b.T`` over column blocks (k, m_b) of the task gradients (detached unless
    ``keep_graph``): block by block, so that a large k x n Jacobian is never concatenated (a
    small one is: one product); in float32 or wider, also under autocast."""
    work = [_as_work(b if keep_graph or not b.requires_grad else b.detach()) for b in blocks]
    if len(work) > 1 and sum(b.numel() for b in work) <= CONCAT_ENTRIES:
        work = [torch.cat(work, dim=1)]  # (cat promotes mixed dtypes, as the sum would)
    with no_autocast(work[0].device):
        return sum((b @ b.T for b in work[1:]), work[0] @ work[0].T)


def _as_work(b: torch.Tensor) -> torch.Tensor:
    """``b`` in its work dtype (itself where that is its dtype: no op)."""
    dtype = work_dtype(b.dtype)
    return b if b.dtype == dtype else b.to(dtype)


def check_gramian(g: torch.Tensor, blocks: Sequence[torch.Tensor], what: str, call: str) -> None:
    """A NaN/inf Gramian makes every weighting's answer meaningless: a clear error, naming
    the tasks whose gradients are not finite (where values can be read)."""
    if values_readable([g]) and not bool(torch.isfinite(g).all()):
        finite = torch.stack([torch.isfinite(b).all(dim=1) for b in blocks]).all(dim=0)
        bad = (~finite).nonzero().flatten().tolist()
        why = (
            f"task(s) {bad} have NaN or inf entries"
            if bad
            else "the task gradients here are finite, so their products overflow, or (with "
            "a process group) another rank's are not finite"
        )
        raise ValueError(
            f"{call}: the Gramian of the task gradients {what} is not finite: {why}, so no "
            "weighting can be computed from it. Check those losses, or scale them down."
        )


def checked_shape(
    weights: Any, k: int, source: str, call: str, unit: str = "task", keep_graph: bool = False
) -> torch.Tensor:
    """The weights returned by a weighting: a real tensor of shape (k,), one per ``unit``
    (a task, or an example on the per-example path), detached unless ``keep_graph``. A
    copy: a stateful weighting (TorchJD's ``ExcessMTLWeighting``, ``CRMOGMWeighting``)
    returns its state tensor itself, which the caller's weights must not alias."""
    if not isinstance(weights, torch.Tensor):
        raise TypeError(
            f"{call}: `weighting` must return a tensor of k = {k} weights from {source}, got "
            f"{describe(weights)}."
        )
    if tuple(weights.shape) != (k,):
        raise ValueError(
            f"{call}: `weighting` must return weights of shape ({k},) (one per {unit}) from "
            f"{source}, got shape {tuple(weights.shape)}. A weighting maps the Gramian to "
            "weights; a function returning an update vector is an aggregator (TorchJD's "
            "Aggregator, at level='params')."
        )
    if weights.is_complex() or not weights.is_floating_point():
        raise TypeError(
            f"{call}: `weighting` must return real floating-point weights, got {weights.dtype}."
        )
    return weights.clone() if keep_graph else weights.detach().clone()


def check_finite(weights: torch.Tensor, source: str, call: str) -> torch.Tensor:
    """``weights``, or an error naming the first few non-finite indices and their count."""
    if values_readable([weights]) and not bool(torch.isfinite(weights).all()):
        bad = (~torch.isfinite(weights)).nonzero().flatten().tolist()
        shown = ", ".join(f"[{i}] = {v}" for i, v in zip(bad, weights[bad[:5]].tolist()))
        more = f", ... ({len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ValueError(
            f"{call}: `weighting` returned non-finite weights from {source}: expected "
            f"{weights.numel()} finite weights, got NaN or inf at {len(bad)} of them: "
            f"{shown}{more}; the update would be NaN. Check the weighting (a solver that "
            "failed to converge?)."
        )
    return weights


def checked_weights(
    rule: Rule,
    g: torch.Tensor,
    blocks: Sequence[torch.Tensor],
    what: str,
    call: str,
    ranks: Sync | None = None,
    keep_graph: bool = False,
) -> torch.Tensor:
    """``weighting(G)`` (with ``ranks``: the first rank's weights on every rank, or an error
    on every rank where it raised on any), with G and the weights checked for NaN/inf in ONE
    read of a device value (eager mode): a clear error naming the non-finite tasks, or the
    weighting that returned non-finite weights. Where the weighting raises, a non-finite G
    is the error to see."""

    def compute() -> torch.Tensor:
        return weights_from_gramian(rule, g, call, keep_graph=keep_graph)

    flags: torch.Tensor | None = None
    try:
        if ranks is None:
            weights = compute()
        else:
            weights, flags = ranks.first_rank_of(compute, g.shape[0], g)
    except Exception:
        check_gramian(g, blocks, what, call)
        raise
    # (One read: a sum is finite only where every entry is, and where finite entries overflow
    # it, the exact checks below find nothing to refuse; with it, how many ranks raised.)
    if values_readable([g]):
        total = g.sum() + weights.sum()
        total = total.detach() if total.requires_grad else total  # (float() warns)
        if flags is not None:  # (NaN where a rank raised)
            total = torch.where(flags.to(total.device).any(), math.nan, total)
        if not math.isfinite(float(total)):
            check_gramian(g, blocks, what, call)
            if ranks is not None:
                ranks.check_ranks(flags)
            check_finite(weights, f"the {tuple(g.shape)} Gramian", call)
    return weights


def _call(rule: Rule, stat: torch.Tensor, given: str, call: str, keep_graph: bool) -> Any:
    """``rule.fn(stat)`` on ``stat`` detached (unless ``keep_graph``), outside autocast, with
    grad mode on (a weighting may differentiate inside itself, also under a caller's
    ``torch.no_grad``)."""
    with no_autocast(stat.device), torch.enable_grad():
        try:
            return rule.fn(stat if keep_graph else stat.detach())
        except Exception as error:
            name = type(rule.fn).__name__
            error.add_note(f"{call}: raised by the weighting {name}, given {given}.")
            if keep_graph and stat.requires_grad and values_readable([stat]):
                error.add_note(
                    f"{call}: with create_graph=True the weighting is given {given} with its "
                    "graph, so that the gradient through the update reaches the weights; a "
                    "weighting that reads it outside torch (.numpy(), a QP solver) must take "
                    "its .detach() itself, which makes its weights constants there."
                )
            if not values_readable([stat]) and not torch.compiler.is_compiling():
                error.add_note(
                    f"{call}: the weighting ran inside a torch.func transform (vmap, grad, "
                    "jacrev), whose tensors have no data that code outside torch can read: a "
                    "weighting that solves with NumPy or a QP solver (TorchJD's UPGrad, "
                    "DualProj, NashMTL, CAGrad) cannot run there. Call funcgrad outside the "
                    "transform, or pass a weighting written in torch operations."
                )
            raise


def weights_from_gramian(
    rule: Rule, g: torch.Tensor, call: str, unit: str = "task", keep_graph: bool = False
) -> torch.Tensor:
    """``rule.fn(G)``, checked for shape (finiteness is checked once the ranks share them)."""
    assert rule.fn is not None
    given = f"the {tuple(g.shape)} Gramian"
    tag = None
    if keep_graph and g.grad_fn is not None and not torch.compiler.is_compiling():
        tag = next(_GRAMIANS)
        node: Any = g.grad_fn
        node.metadata[_TAG] = tag
    found = _call(rule, g, given, call, keep_graph)
    if tag is not None and isinstance(found, torch.Tensor) and found.grad_fn is not None:
        _refuse_freed_state(found.grad_fn, tag, type(rule.fn).__name__, call)
    return checked_shape(found, g.shape[0], given, call, unit, keep_graph)


# Under keep_graph each call's Gramian node is tagged (its `metadata`), so that weights whose
# graph reaches an EARLIER call's Gramian (state the weighting keeps across calls: an EMA of
# G.diagonal()) are found at the call, where that graph is freed
_TAG = "funcgrad.gramian"
_GRAMIANS = itertools.count()
_WALK = 10_000  # nodes of the weights' graph walked, at most


def _refuse_freed_state(root: Any, tag: int, name: str, call: str) -> None:
    """Raise, before anything is written, where the weights' graph (from ``root``) reaches
    the Gramian of an earlier call whose graph a backward has freed: a backward through
    this call's results would fail there with torch's "Trying to backward through the
    graph a second time", which names neither the weighting nor the fix. A graph still
    held (``retain_graph=True``) chains the calls as asked: nothing is raised."""
    seen: dict[int, Any] = {}
    stack = [root]
    while stack and len(seen) < _WALK:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        held = node.metadata.get(_TAG) if hasattr(node, "metadata") else None
        if held == tag:
            continue  # this call's Gramian: its graph is f's, fresh
        if held is not None:
            error = _freed(node)
            if error is not None:
                raise RuntimeError(
                    f"{call}: the weights of the weighting {name} depend on the Gramian of an "
                    "earlier call, whose graph a backward has freed (torch: "
                    f"{str(error).split('.')[0]}). With create_graph=True the weighting is "
                    "given G with its graph, so state it keeps across calls (an EMA of "
                    "G.diagonal()) chains each call's graph to the earlier ones': state kept "
                    "across calls must be detached (`self.ema = d.detach()`), or the earlier "
                    "graphs kept with retain_graph=True."
                ) from error
            continue
        stack.extend(edge for edge, _ in node.next_functions)


def _freed(node: Any, depth: int = 3) -> RuntimeError | None:
    """torch's error where ``node`` or a node below it (``depth`` levels) has its saved
    tensors freed by a backward, else None."""
    for attr in dir(type(node)):
        if attr.startswith("_raw_saved_"):
            try:
                getattr(node, attr[len("_raw") :])
            except RuntimeError as error:
                return error
    if depth:
        for edge, _ in node.next_functions:
            if edge is not None:
                found = _freed(edge, depth - 1)
                if found is not None:
                    return found
    return None


def aggregate(
    rule: Rule,
    rows: torch.Tensor,
    call: str,
    ranks: Sync | None = None,
    keep_graph: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weights or None, update or None) from the k x n Jacobian, as TorchJD's
    ``jac_to_grad`` aggregates it: an aggregator is called on the Jacobian, its hooks
    included, and its output is the update (a weighted one's weights are read as its
    weighting returns them, after that weighting's own hooks); a Jacobian weighting gives
    weights only. With ``ranks``, each result is the first rank's on every rank (an error on
    every rank where the aggregator raised on any), then checked to be finite."""
    k, n = rows.shape
    given = f"the ({k}, {n}) Jacobian"
    work = _as_work(rows)
    if rule.kind == "jacobian":  # a weighting of the Jacobian: weights, no update

        def weigh() -> torch.Tensor:
            found = _call(rule, work, given, call, keep_graph)
            return checked_shape(found, k, given, call, keep_graph=keep_graph)

        if ranks is None:
            return check_finite(weigh(), given, call), None
        found, flags = ranks.first_rank_of(weigh, k, work)
        ranks.check_ranks(flags)
        return check_finite(found, given, call), None
    results: list[torch.Tensor | None] = []

    def run() -> torch.Tensor:
        results.extend(_aggregated(rule, work, given, call, keep_graph))
        return work.new_zeros(0)

    if ranks is None:
        run()
    else:  # every rank learns whether it raised on any (then its results are sent)
        ranks.check_ranks(ranks.first_rank_of(run, 0, work)[1])
    weights, vector = results
    assert vector is not None
    if ranks is not None:
        weights = None if weights is None else ranks.from_first_rank(weights)
        vector = ranks.from_first_rank(vector)
    if weights is not None:
        weights = check_finite(weights, given, call)
    if values_readable([vector]) and not bool(torch.isfinite(vector).all()):
        name = type(rule.fn).__name__
        raise ValueError(f"{call}: the aggregator {name} returned a non-finite update.")
    return weights, vector


def _aggregated(
    rule: Rule, work: torch.Tensor, given: str, call: str, keep_graph: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """An aggregator's (weights or None, update) on this rank, checked for shape."""
    k, n = work.shape
    captured: list[Any] = []
    hook = None
    if rule.kind == "matrix":  # the last hook on its weighting, as jac_to_grad's capture
        # (this thread's calls only: another thread's call of a shared aggregator fires
        # this hook too, and its weights were taken for this call's)
        me = threading.get_ident()

        def capture(_module: Any, _inputs: Any, out: Any) -> None:
            if threading.get_ident() == me:
                captured.append(out)

        hook = rule.fn.weighting.register_forward_hook(capture)
    try:
        vector = _call(rule, work, given, call, keep_graph)
    finally:
        if hook is not None:
            hook.remove()
    if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (n,):
        raise ValueError(
            f"{call}: the aggregator {type(rule.fn).__name__} must map the ({k}, {n}) "
            f"Jacobian to a vector of shape ({n},), got {describe(vector)}."
        )
    weights = (
        checked_shape(captured[-1], k, given, call, keep_graph=keep_graph) if captured else None
    )
    return weights, vector if keep_graph else vector.detach()


def weighted_sum(weights: torch.Tensor, grads: Sequence[torch.Tensor]) -> Tensors:
    """``sum_i w_i grads_i`` leaf by leaf, for per-task gradient leaves (k, ...), in their
    dtype (also under autocast)."""
    k = weights.shape[0]  # (a vector-matrix product per leaf: cheaper than tensordot's)
    with no_autocast(weights.device):
        return tuple(
            (
                (weights if weights.dtype == g.dtype else weights.to(g.dtype)) @ g.reshape(k, -1)
            ).view(g.shape[1:])
            for g in grads
        )
