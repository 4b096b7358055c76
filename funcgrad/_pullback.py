"""``funcgrad.pullback``: f's pullback built once, reused for any number of cotangents."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
from torch.autograd.graph import GradientEdge

from . import _coords, _engine, _linearize, _tree
from ._config import CheckMode, resolve_check
from ._errors import ReleasedPullbackError, describe, first_line
from ._execute import gc_paused
from ._function import FlatFunction, HookState, module_of, result_graph
from ._linearize import MODIFIED_IN_PLACE, Linearization
from ._plan import pullback_engine, pullback_reuse
from ._record import (
    Observations,
    Record,
    Records,
    ReuseRecord,
    ReuseSeen,
    learn_reuse,
    signature_key,
)
from ._types import ChunkSize, Tensors
from ._validate import check_callable, check_chunk_size, check_flag, values_readable

# pullback's `reuse`: keep the directions pulled back (True), never (False), or where the
# first calls show that they pay ("auto", see funcgrad._plan.pullback_reuse).
ReuseOption = bool | Literal["auto"]


@dataclasses.dataclass
class PullbackStats:
    """What a `Pullback` has done so far.

    Attributes:
        calls: calls of ``pb(...)`` and ``pb.many(...)``.
        cotangents: cotangents answered (k for each ``pb.many`` of k cotangents).
        vjps: directions actually pulled back through f. Answers that are linear combinations
            of earlier directions cost none.
        kept: directions kept: the orthonormal basis, and the last call's cotangents held
            to join it (their rank is known at the next call, or when ``pb.rank`` is read),
            up to the budget; 0 once ``reuse="auto"`` chose to pull every cotangent.
        kept_bytes: memory held by the kept directions and their images.
    """

    calls: int = 0
    cotangents: int = 0
    vjps: int = 0
    kept: int = 0
    kept_bytes: int = 0


class Pullback:
    """The pullback ``v -> J_f(x)^T v`` of f at the primals, returned by `pullback`.

    It is linear, and it remembers what it has pulled back: it keeps an orthonormal basis
    ``Q`` of the directions sent through f together with their images ``Q J``, so a cotangent
    in the span of earlier ones is answered by a product, without a new pass through f. Once
    the basis spans y's whole space (m directions), every cotangent is answered that way.
    The basis is bounded by ``max_basis_bytes`` (see `pullback`).

    It reads values (a host read, a stall of the stream on a GPU) only where that can pay
    off. The first call reads nothing: its cotangents (k <= m) go through f as they are, and
    are held with their images. Each later call reads ONE value, which tells at once how the
    held cotangents extend ``Q`` (by linearity, with no pass through f), whether the new
    cotangents lie in the span, and whether they and their product are finite: in the span,
    the answer is the product; all outside, they go through f as they are and are held in
    turn. Only a call that mixes both, that brings more cotangents than ``Q`` lacks
    directions, or whose held cotangents were (nearly) dependent, detects the rank with a
    few reads more, sending through f only the new directions.

    Where that costs more than it saves (a small f, whose pull is cheaper than the
    product), ``reuse="auto"`` (`pullback`'s default) pulls every cotangent through f from
    the third call on, reading nothing and keeping nothing (docs/planning.md).
    """

    def __init__(
        self, flat: FlatFunction, lin: Linearization, reuse: ReuseOption, max_basis_bytes: int
    ) -> None:
        self._flat = flat
        self._out_def = flat.out_def
        self._lin: Linearization | None = lin
        self._out_like = lin.out
        self._basis = _engine.Basis(_coords.real_size(lin.out), max_basis_bytes)
        readable = values_readable(lin.out) if reuse or lin.engine == "torch.func" else False
        if not (reuse and readable):
            self._basis.clear(enabled=False)
        # Whether to answer from the kept directions: learnt on the first calls (reuse="auto").
        self._reuse, self._learnt = reuse, ReuseRecord()
        self.stats = PullbackStats()
        # The basis and the stats change on every call: one call at a time, whatever the
        # thread (re-entrant: f may call funcgrad, and a head this pullback).
        self._lock = threading.RLock()
        # A tensor changed in place after pullback returns is refused at the next call (see
        # _Watched): on eager autograd, f's saved tensors, taken at the first call that may
        # answer from the basis (one walk of f's graph; none for a pullback used once).
        func = lin.engine == "torch.func"
        self._watched = _Watched.of_func(flat, lin) if readable and func else None
        self._unwatched = readable and lin.edges is not None
        # chunk_size="auto": what a direction through f costs here (measured once, at the
        # first such call; the chunk follows the budget in force at each call).
        self._fit: _engine.ChunkFit | None = None

    @property
    def rank(self) -> int:
        """How many independent directions have been pulled back through f and are kept.

        Reading it turns the cotangents held from the last call into directions now (a few
        host reads), which the next call would otherwise do in its one read."""
        with self._locked():
            return self._settled_rank()

    def _settled_rank(self) -> int:
        if self._lin is not None:
            lin = self._lin

            def pull_rows(rows: torch.Tensor) -> Tensors:
                return _engine.pull(lin, _coords.from_coords(rows, lin.out), None, False)

            with torch.no_grad():
                self.stats.vjps += self._basis.settle(pull_rows, lin.x_like)
            self.stats.kept, self.stats.kept_bytes = self._basis.kept, self._basis.nbytes
        return self._basis.rank

    def _locked(self) -> contextlib.AbstractContextManager[Any]:
        """One call at a time (not in compiled code: dynamo cannot enter a lock)."""
        return contextlib.nullcontext() if torch.compiler.is_compiling() else self._lock

    @property
    def released(self) -> bool:
        return self._lin is None

    def release(self) -> None:
        """Free f's graph and the kept directions; any later call raises an error."""
        with self._locked():
            self._release()

    def _release(self) -> None:
        self._lin = None
        self._watched, self._unwatched = None, False
        self._basis.clear()
        self.stats.kept, self.stats.kept_bytes = 0, 0

    def __call__(self, cotangent: Any, *, create_graph: bool = False) -> tuple[Any, ...]:
        """``J_f(x)^T cotangent``: one tree per primal, as ``torch.func.vjp``'s ``vjp_fn``.

        Args:
            cotangent: a pytree with the structure, shapes and dtypes of f's output.
            create_graph: build the graph of the result, for a backward through it (as
                ``torch.autograd.grad``'s); by default none is built. Such a call pulls its
                cotangent through f (the kept directions carry no graph).

        Returns:
            A tuple with one entry per primal, each with that primal's structure.
        """
        call = "pb(cotangent)"
        check_flag(create_graph, "create_graph", call)
        leaves = self._check_cotangent(cotangent, call, batched=False)
        # One cotangent is one unbatched call: nothing for `check` to compare.
        grads = self._apply(tuple(leaf.unsqueeze(0) for leaf in leaves), None, False, create_graph)
        return tuple(self._flat.split_inputs([g[0] for g in grads]))

    def many(
        self,
        cotangents: Any,
        *,
        chunk_size: ChunkSize = None,
        check: CheckMode | None = None,
        create_graph: bool = False,
    ) -> tuple[Any, ...]:
        """Pull back k cotangents at once: every leaf carries a leading batch dimension k.

        Same values as ``torch.stack([pb(v) for v in cotangents])`` leaf by leaf, but
        cotangents in the span of those already pulled back cost no pass through f: at most
        ``min(k, m)`` directions go through f, in one vmapped backward (or ``chunk_size`` at
        a time). Cotangents all outside the span (a first call) go as they are, without a
        rank test; k > m, or a mix of both, send only the new directions (y's m unit
        directions on a first call with k > m).

        Args:
            cotangents: f's output structure, each leaf of shape ``(k, *leaf.shape)``.
            chunk_size: at most this many directions per vmapped backward; 1 means a loop.
            check: compare the batched pullback with unbatched calls (see
                `funcgrad.set_check`); ``None`` uses the global setting.
            create_graph: as for ``pb(cotangent)``.

        Returns:
            One tree per primal, each leaf with a leading k.
        """
        call = "Pullback.many(cotangents)"
        check_chunk_size(chunk_size, call)
        check_flag(create_graph, "create_graph", call)
        mode = resolve_check(check, call)
        leaves = self._check_cotangent(cotangents, call, batched=True)
        grads = self._apply(leaves, chunk_size, mode, create_graph)
        return tuple(self._flat.split_inputs(grads))

    # -- internals ---------------------------------------------------------------------

    def _check_cotangent(self, tree: Any, call: str, batched: bool) -> Tensors:
        lin = self._lin  # (read once: another thread may release it meanwhile)
        if lin is None:
            raise ReleasedPullbackError(
                f"{call}: this pullback was released (pb.release() freed f's graph); "
                "build a new one with funcgrad.pullback(f, *primals)."
            )
        if self._unwatched and self._basis.kept:  # (before: every call ran a pass)
            assert lin.edges is not None
            self._watched = _Watched.saved(call, self._flat, lin.edges)
            self._unwatched = False
        watched = self._watched  # (read once: another thread may release it meanwhile)
        if watched is not None:
            watched.check(call, self._flat)
        return _cotangent_leaves(tree, self._out_def, self._out_like, call, batched)

    def _apply(
        self, cotangents: Tensors, chunk_size: ChunkSize, check: CheckMode, create_graph: bool
    ) -> Tensors:
        with self._locked(), result_graph(create_graph, self._flat.leaves):
            if self._lin is None:  # (released by another thread since the arguments were checked)
                raise ReleasedPullbackError(
                    "This Pullback was released (pb.release()) by another call: pull back before "
                    "releasing it, or call funcgrad.pullback again."
                )
            self.stats.calls += 1
            self.stats.cotangents += cotangents[0].shape[0]
            fit = None
            if chunk_size == "auto" and values_readable(cotangents):
                if self._fit is None:
                    self._fit = _engine.ChunkFit()
                fit = self._fit
            lin, basis = self._lin, self._basis
            way = pullback_reuse(self._reuse, self._learnt) if basis.enabled else "pull"
            if way == "pull" and basis.enabled:  # (from now on nothing kept; the saved
                basis.clear(enabled=False)  # tensors stay watched, a change refused by name)
            if create_graph and lin.engine == "autograd":  # (one backward building its graph
                lin = dataclasses.replace(lin, can_vmap=False)  # a direction)
            # (the basis reads values: eager only; a call that reads none teaches nothing)
            timed = (
                way == "measure"
                and not create_graph
                and cotangents[0].shape[0] > 0
                and values_readable(cotangents)
            )
            pulls = _engine.Pulls(lin, cotangents, chunk_size, check, fit, timed)
            if create_graph:  # the kept images carry no graph: pull the cotangents themselves
                grads, pulled = pulls.direct()
            elif timed:
                with gc_paused(True):  # (a collection must not decide: docs/planning.md)
                    start = _engine.clock()
                    grads, pulled = _engine.by_linearity(pulls, basis)
                    seconds = _engine.clock() - start
                k = cotangents[0].shape[0]
                seen = ReuseSeen(k, pulled, pulls.seconds, pulls.setup_seconds, seconds)
                self._learnt = learn_reuse(self._learnt, seen)
            else:  # (a basis turned off pulls the cotangents through f)
                grads, pulled = _engine.by_linearity(pulls, basis)
            self.stats.vjps += pulled
            self.stats.kept, self.stats.kept_bytes = self._basis.kept, self._basis.nbytes
            return grads

    def __repr__(self) -> str:
        if self._lin is None:
            return "Pullback(released)"
        shapes = ", ".join(str(tuple(o.shape)) for o in self._out_like)
        return (
            f"Pullback(of {self._flat.call.split('(')[0]} at y of shape {shapes}: "
            f"{self.stats.vjps} direction(s) pulled through f for {self.stats.cotangents} "
            f"cotangent(s), {self.rank} kept)"
        )


_VERSION = operator.attrgetter("_version")
_Saved: Any = torch._C._autograd.SavedTensor  # (its stub lacks data and unpack_hook)


@dataclasses.dataclass
class _Watched:
    """Tensors whose in-place change after ``pullback`` returned a call must refuse, and
    their versions (Python ints: reading them is no host read).

    On eager autograd: every tensor that f's graph saved for the nodes its pulls run (those
    on a path from f's outputs to an input's gradient edge; not a graph outside f that a
    captured tensor brings). autograd refuses a pass through a changed one, but an answer
    from the kept basis runs no pass and would come from the old values. They are taken at
    the first call that may answer from the basis (a call before runs a pass, so autograd
    checks it), after torch's own check that none changed since f saved it (:meth:`saved`).
    On torch.func (an f whose backward is torch.compile'd), taken when ``pullback`` returns:
    vjp_fn reads the storage of the primals, of out, of aux and of f's own parameters and
    buffers (f a module or its bound method) with no check, mixing old values and new."""

    tensors: list[torch.Tensor]
    versions: list[int]
    names: list[str]  # what each is (torch.func), or which node saved it as what (eager)
    func: bool  # on torch.func

    @staticmethod
    def of_func(flat: FlatFunction, lin: Linearization) -> _Watched:
        named = _named(flat)
        tensors = [*flat.leaves, *lin.out, *lin.aux, *(t for _, t in named)]
        names = [f"primal leaf {i} (of the flattened primals)" for i in range(len(flat.leaves))]
        names += [f"leaf {i} of f's output" for i in range(len(lin.out))]
        names += [f"leaf {i} of aux" for i in range(len(lin.aux))]
        names += [f"f's {name!r}" for name, _ in named]
        return _Watched.built(tensors, names, func=True)

    @staticmethod
    def built(tensors: list[torch.Tensor], names: list[str], func: bool) -> _Watched:
        kept = [i for i, t in enumerate(tensors) if not t.is_inference()]  # (no version)
        tensors, names = [tensors[i] for i in kept], [names[i] for i in kept]
        return _Watched(tensors, list(map(_VERSION, tensors)), names, func)

    @staticmethod
    def saved(call: str, flat: FlatFunction, edges: tuple[tuple[Any, ...], ...]) -> _Watched:
        """The tensors f's graph saved for the pulls between ``edges`` (f's outputs, its
        inputs), each read once through its node, which raises torch's error where it
        changed since f saved it (refused here, naming it). Saved tensors with hooks (a
        non-reentrant checkpoint, ``save_on_cpu``) are left out: reading them runs the
        unpack hook."""
        tensors, names = [], []
        for node in _between(edges):
            kind = type(node).__name__
            for raw in _saved_attrs(node):
                try:
                    packed = getattr(node, raw)
                except RuntimeError:  # (freed: a pass raises its own error)
                    continue
                packed = packed if isinstance(packed, (tuple, list)) else (packed,)
                data = [p.data for p in packed if isinstance(p, _Saved) and p.unpack_hook is None]
                if not any(isinstance(t, torch.Tensor) for t in data):
                    continue
                name = raw.removeprefix("_raw_saved_")
                where = f"{kind} (as {name!r})"
                try:  # torch's check of the saved version
                    getattr(node, "saved_tensors" if raw == "_raw_saved_tensors" else raw[4:])
                except RuntimeError as error:
                    if MODIFIED_IN_PLACE not in str(error):
                        raise
                    t = next(t for t in data if isinstance(t, torch.Tensor))
                    found = re.search(r"is at version (\d+); expected version (\d+)", str(error))
                    change = (
                        first_line(error)
                        if found is None
                        else (f"version {found[2]} -> {found[1]}")
                    )
                    raise _Watched.changed(call, _which(t, flat), where, change) from None
                for t in data:
                    if isinstance(t, torch.Tensor):
                        tensors.append(t)
                        names.append(where)
        return _Watched.built(tensors, names, func=False)

    def check(self, call: str, flat: FlatFunction) -> None:
        """Refuse a call after any of the tensors changed in place (no read of values)."""
        if list(map(_VERSION, self.tensors)) == self.versions:
            return
        i = next(i for i, t in enumerate(self.tensors) if t._version != self.versions[i])
        t, change = self.tensors[i], f"version {self.versions[i]} -> {self.tensors[i]._version}"
        if not self.func:
            raise _Watched.changed(call, _which(t, flat), self.names[i], change)
        raise RuntimeError(
            f"{call}: {self.names[i]} was modified in place after funcgrad.pullback returned "
            f"({change}). This pullback runs on torch.func (f's backward is torch.compile'd), "
            "whose vjp_fn reads that storage when it runs, with no check: it would mix the old "
            f"values and the new. {_FIX}"
        )

    @staticmethod
    def changed(call: str, which: str, where: str, change: str) -> RuntimeError:
        return RuntimeError(
            f"{call}: a tensor that f's graph saved was modified in place after pullback "
            f"returned: {which}, saved by {where} ({change}). The pullback is J_f at the "
            "values f saw: autograd refuses a pass through the changed tensor, and the "
            f"directions this pullback kept would answer from the old values. {_FIX}"
        )


_FIX = (
    "Pull back before changing them, call funcgrad.pullback again after the change, or "
    "change a copy (x.clone())."
)


def _between(edges: tuple[tuple[Any, ...], ...]) -> list[Any]:
    """The autograd nodes that a pull from ``edges[0]`` (f's outputs) into ``edges[1]`` (its
    inputs: gradient edges, or leaf tensors) runs: those on a path to an input's edge."""
    leaves = {id(e) for e in edges[1] if isinstance(e, torch.Tensor)}
    stops = {e.node for e in edges[1] if isinstance(e, GradientEdge)}
    into: dict[Any, list[Any]] = {}
    todo = [e.node for e in edges[0]]
    seen, ends = set(todo), []
    while todo:  # (down from the outputs, never past an input's edge)
        node = todo.pop()
        if node in stops or id(getattr(node, "variable", None)) in leaves:
            ends.append(node)
            continue
        for parent, _ in node.next_functions:
            if parent is not None:
                into.setdefault(parent, []).append(node)
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
    runs: dict[Any, None] = {}  # (in the order found: the same error on every run)
    while ends:  # (back up from the inputs' edges)
        for node in into.get(ends.pop(), ()):
            if node not in runs:
                runs[node] = None
                ends.append(node)
    return list(runs)


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _saved_attrs(node: Any) -> tuple[str, ...]:
    """The names of a node's raw (packed, not unpacked) saved tensors, cached per type."""
    attrs = _SAVED_ATTRS.get(type(node))
    if attrs is None:
        attrs = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        _SAVED_ATTRS[type(node)] = attrs
    return attrs


def _named(flat: FlatFunction) -> list[tuple[str, torch.Tensor]]:
    """f's parameters and buffers, where f is a module or its bound method."""
    module = module_of(flat.f)
    return [] if module is None else [*module.named_parameters(), *module.named_buffers()]


def _which(t: torch.Tensor, flat: FlatFunction) -> str:
    """A changed saved tensor, named where it is a primal leaf or f's parameter or buffer
    (by storage), with its shape and dtype."""
    candidates = [(f"primal leaf {i}", p) for i, p in enumerate(flat.leaves)]
    candidates += [(f"f's {name!r}", p) for name, p in _named(flat)]
    for name, p in candidates:
        if t.layout == p.layout == torch.strided and _same_storage(t, p):
            return f"{name} of shape {tuple(p.shape)} ({p.dtype})"
    return f"a tensor of shape {tuple(t.shape)} ({t.dtype}) that f captured or computed"


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _cotangent_leaves(
    tree: Any, out_def: Any, out_like: Tensors, call: str, batched: bool
) -> Tensors:
    """The cotangent's leaves, checked against f's output (with a leading batch dim where
    ``batched``): its tree, each leaf's dtype and shape, one batch size."""
    if isinstance(tree, torch.Tensor) and out_def.is_leaf():  # (f returns a tensor)
        leaves, treedef = [tree], out_def
    else:
        leaves, treedef = _tree.flatten(tree)
    if not _tree.same(treedef, out_def):
        raise ValueError(
            f"{call}: the cotangent must have the tree structure of f's output, "
            f"expected {out_def}, got {treedef}."
        )
    batch = None
    for index, (leaf, ref) in enumerate(zip(leaves, out_like)):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.dtype == ref.dtype
            and leaf.shape[batched:] == ref.shape
            and (not batched or batch is None or leaf.shape[0] == batch)
            and leaf.dim() == ref.dim() + batched
        ):  # the usual case, checked at once; the messages below say what is wrong
            batch = leaf.shape[0] if batched else 1
            continue
        where = f"cotangent leaf {_tree.leaf_path(treedef, index)}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{call}: {where} must be a tensor, got {describe(leaf)}.")
        if leaf.dtype != ref.dtype:
            raise TypeError(
                f"{call}: {where} must have f's output dtype {ref.dtype}, got {leaf.dtype}. "
                f"Convert it with .to({ref.dtype})."
            )
        shape, expected = tuple(leaf.shape), tuple(ref.shape)
        if not batched and shape != expected:
            raise ValueError(
                f"{call}: {where} must have f's output shape {expected}, got {shape}. "
                "For k cotangents at once, stack them and call pb.many."
            )
        if batched and (len(shape) != len(expected) + 1 or shape[1:] != expected):
            hint = (
                " It has no leading batch dimension: use pb(cotangent) for one cotangent, "
                "or cotangent.unsqueeze(0)."
                if shape == expected
                else ""
            )
            raise ValueError(
                f"{call}: {where} must have shape (k, *{expected}) with a leading batch "
                f"dimension k, got {shape}.{hint}"
            )
        if batched and batch is not None and shape[0] != batch:
            raise ValueError(
                f"{call}: every cotangent leaf must have the same leading batch size; "
                f"{where} has {shape[0]}, an earlier leaf has {batch}."
            )
        batch = shape[0] if batched else 1
    return tuple(leaves)


# pullback's records: one Records per f, held weakly (an f that takes no weak reference,
# a builtin, is not cached).
_records: weakref.WeakKeyDictionary[Any, Records] = weakref.WeakKeyDictionary()


def _threads_of(f: Any) -> bool:
    """Whether an earlier eager call saw part of f run in another thread (never adds f).
    Not looked up in compiled code: dynamo would guard on the weak dictionary's keys, which
    a garbage collection changes while it builds the guard (torch raised IndexError)."""
    if torch.compiler.is_compiling():
        return False
    try:
        records = _records.get(f)
    except TypeError:
        return False
    return records is not None and records.facts.threads


def _records_of(f: Any) -> Records | None:
    try:
        records = _records.get(f)
        if records is None:
            records = _records.setdefault(f, Records())
            records.hooks = HookState(f)
        elif records.hooks.changed():  # a hook registered since: watched again
            records.rewatch()
        return records
    except TypeError:
        return None


@overload
def pullback(
    f: Callable[..., Any],
    *primals: Any,
    has_aux: Literal[False] = False,
    reuse: ReuseOption = "auto",
    max_basis_bytes: int = ...,
) -> tuple[Any, Pullback]: ...
@overload
def pullback(
    f: Callable[..., Any],
    *primals: Any,
    has_aux: Literal[True],
    reuse: ReuseOption = "auto",
    max_basis_bytes: int = ...,
) -> tuple[Any, Pullback, Any]: ...
def pullback(
    f: Callable[..., Any],
    *primals: Any,
    has_aux: bool = False,
    reuse: ReuseOption = "auto",
    max_basis_bytes: int = _engine.DEFAULT_BASIS_BYTES,
) -> Any:
    """Run f once and return its reusable pullback, like ``torch.func.vjp``.

    ``pb(v)`` equals ``torch.func.vjp(f, *primals)[1](v)``; f's graph is built once and
    every later cotangent reuses it. Because ``pb`` is linear, a cotangent that is a linear
    combination of directions already pulled back costs a small product and no pass through
    f: on a scalar y any number of cotangents costs one backward of f.

    In eager mode f runs once on plain autograd (its random draws, running statistics and
    in-place updates are those of one forward; no op pays torch.func's wrapping) and the
    cotangents are pulled back through its graph, vmapped. Inside torch.func transforms, and
    under ``torch.compile``, in inference mode, it is ``torch.func.vjp``. Either way ``out``
    is linked to the graph outside exactly where ``torch.func.vjp``'s would be: through an
    input or a captured tensor that requires grad, in grad mode. On eager autograd such a
    linked ``out`` shares f's graph with ``pb``: a backward through ``out`` without
    ``retain_graph=True`` frees it, and ``pb`` then raises a clear error (pull back first).

    Args:
        f: a function of the primals returning a pytree of floating/complex tensors (and,
            with ``has_aux=True``, a pair ``(output, aux)``).
        *primals: f's arguments, pytrees of floating or complex tensors (flattened with
            optree: dicts, tuples, lists, namedtuples, ``None`` as an empty node).
        has_aux: f returns ``(output, aux)``; aux is returned unchanged, not differentiated.
        reuse: keep the pulled-back directions to answer later cotangents by linearity:
            ``True`` on every call, ``False`` never (each cotangent through f, no host
            read), ``"auto"`` (default) as ``True``, except that from the third call on
            every call pulls its cotangents through f and nothing is kept where the second
            call's answers from the kept directions saved less thread time than the
            basis's own work (its ops and its one host read) cost (docs/planning.md).
            Turned off automatically inside torch.func transforms, where it is data-dependent.
        max_basis_bytes: the most memory the kept directions and their images may hold
            (default 64 MiB). Once full, cotangents outside the kept span are pulled back as
            they are and not kept; ``pb.stats.kept_bytes`` says what is held.

    Returns:
        ``(out, pb)`` or ``(out, pb, aux)``: f's output and a `Pullback`.

    Examples:
        >>> import torch, funcgrad
        >>> x = torch.tensor(0.5)
        >>> y, pb = funcgrad.pullback(torch.sin, x)
        >>> pb(2 * y)[0], pb(3 * y)[0]
        (tensor(0.8415), tensor(1.2622))
        >>> pb.stats.vjps  # the second cotangent is a multiple of the first
        1

    Notes:
        Costs one forward of f with its saved tensors kept alive until ``pb`` is released or
        dropped, then one backward of f per cotangent outside the span of those already
        pulled back, batched; once ``m = numel(y)`` independent directions are kept, none.
        Memory: the kept basis holds ``r`` images, one per direction, each the size of the
        primals, up to ``max_basis_bytes``; what it keeps of a call (its cotangents and
        answers) are copies of its own (copy-on-write on the CPU), so the caller may change
        them in place. A tensor that f's graph saved (a primal, ``out``, a captured weight or
        buffer) changed in place is refused at the next call, on every path (see
        docs/reliability.md). Host reads: none on the first call, one on each later call in
        the usual cases while the directions are kept (see `Pullback`), none once
        ``reuse="auto"`` has chosen to pull every cotangent. Rank detection is invariant to
        each cotangent's scale and runs in float32 for half-precision cotangents; non-finite
        cotangents, images or products are answered by pulling the cotangents themselves
        back, so NaN and inf come out as in autograd. Host work beyond f's forward, on eager
        autograd: one walk of f's graph per call (whether ``out`` is linked outside, a
        reentrant checkpoint, a compiled backward, whose second pass is then checked), and
        one more at the first call that may answer from the kept directions (the saved
        tensors to watch).
    """
    call = "pullback(f, *primals)"
    check_callable(f, "f", call)
    if not primals:
        raise ValueError(f"{call}: give at least one primal to differentiate f at.")
    if reuse is not True and reuse is not False and reuse != "auto":
        raise ValueError(f"{call}: `reuse` must be True, False or 'auto', got {reuse!r}.")
    if not isinstance(max_basis_bytes, int) or max_basis_bytes < 0:
        raise ValueError(
            f"{call}: `max_basis_bytes` must be a non-negative int, got {max_basis_bytes!r}."
        )
    flat = FlatFunction(
        f, primals, tuple(range(len(primals))), has_aux, call, hint="pass it through a closure"
    )
    # (Inference mode records no graph, and an inference tensor cannot join one: torch.func.)
    records = None
    if (
        flat.readable
        and not torch.is_inference_mode_enabled()
        and not any(leaf.is_inference() for leaf in flat.leaves)
    ):
        records = _records_of(f)
    key = None if records is None else signature_key(flat.has_aux, flat.in_defs, flat.leaves)
    record = Record() if records is None else records.get(key)
    if not flat.readable and _threads_of(f):
        raise ValueError(
            f"{call}: f computes part of its output in another thread (a thread pool, "
            "threading.Thread), seen on an earlier call. torch.func's transforms (yours, "
            "around this call) do not follow f into other threads, so that part would be "
            "taken for a constant, a wrong gradient. Keep f's differentiable work on the "
            "calling thread, or call funcgrad.pullback outside transforms."
        )
    engine = pullback_engine(records is not None, record)
    # On eager autograd f runs once, never re-run (nothing to replay), without torch.func's
    # wrapping of every op; watched for hooks on the first call on this signature only.
    flat.watch = records is None or record.draws is None
    if engine == "autograd":
        lin = _linearize.on_autograd(flat)
    else:
        lin = _linearize.of_function(flat, _linearize.RandomState(flat))
    # (Unwatched, the call adds to the record only a hook or a compiled backward first seen:
    # adds_nothing's test for these observations, made before building them.)
    if records is not None and (
        flat.watch
        or flat.hooked > record.hooked
        or flat.custom > record.custom
        or lin.compiled > record.compiled
        or flat.threads > record.threads
        or not records.is_last(key)
    ):
        seen = Observations(
            watched=flat.watch,
            hooked=flat.hooked,
            custom=flat.custom,
            compiled=lin.compiled,
            threads=flat.threads,
        )
        records.learn(key, record, seen)
    # A tensor hook in f, or a custom autograd.Function's backward, may be nonlinear in its
    # gradient: each cotangent goes through f.
    hooked = flat.hooked or record.hooked or flat.custom or record.custom
    pb = Pullback(flat, lin, False if hooked else reuse, max_basis_bytes)
    if has_aux:
        return flat.outputs(lin.out), pb, flat.rebuild_aux(lin.aux)
    return flat.outputs(lin.out), pb
