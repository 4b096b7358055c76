"""``funcgrad.compose_heads`` and ``funcgrad.stacked_heads``: many cheap heads on one slow f."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, TypeGuard, TypeVar, overload

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import _coords, _engine, _function, _memory, _tree
from ._config import CheckMode, resolve_check
from ._errors import describe
from ._function import FlatFunction, result_graph
from ._linearize import RandomState
from ._plan import ENGINE_MARGIN, FIT_MIN, FIT_PROBE, FORWARD_MODE_PENALTY, Plan, make_plan
from ._types import ChunkSize, Engine, Strategy, Tensors
from ._validate import (
    check_argnums_type,
    check_callable,
    check_chunk_size,
    check_flag,
    check_not_inference_mode,
    check_strategy,
    differentiating,
    normalize_argnums,
    values_readable,
)

R = TypeVar("R")
K = TypeVar("K")


class StackedHeads:
    """k heads ``y -> head_fn(params_j, y)`` that share one function; see `stacked_heads`."""

    def __init__(self, head_fn: Callable[[Any, Any], torch.Tensor], params: Any) -> None:
        call = "stacked_heads(head_fn, params)"
        if not callable(head_fn):
            raise TypeError(f"{call}: `head_fn` must be callable, got {describe(head_fn)}.")
        leaves, self.params_def = _tree.flatten(params)
        if not leaves:
            raise ValueError(f"{call}: `params` contains no tensor; give leaves with a leading k.")
        sizes = set()
        for index, leaf in enumerate(leaves):
            path = _tree.leaf_path(self.params_def, index)
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                raise ValueError(
                    f"{call}: `params` leaf {path} must be a tensor with a leading dimension k "
                    f"(one slice per head), got {describe(leaf)}."
                )
            sizes.add(leaf.shape[0])
        if len(sizes) != 1:
            raise ValueError(
                f"{call}: every `params` leaf must have the same leading size k (one per head), "
                f"got sizes {sorted(sizes)}."
            )
        self.head_fn, self.params = head_fn, tuple(leaves)
        self.k = sizes.pop()

    def __len__(self) -> int:
        return self.k

    def __repr__(self) -> str:
        return f"stacked_heads({getattr(self.head_fn, '__name__', self.head_fn)!r}, k={self.k})"


def stacked_heads(head_fn: Callable[[Any, Any], torch.Tensor], params: Any) -> StackedHeads:
    """k heads that are one function with k sets of parameters, for `compose_heads`.

    Head j is ``y -> head_fn(params_j, y)``, where ``params_j`` takes slice j of every leaf of
    ``params``. `compose_heads` evaluates all k head values and cotangents in one
    ``vmap`` instead of k Python calls.

    Args:
        head_fn: ``(p, y) -> real scalar`` for one head's parameters ``p``.
        params: a pytree whose tensor leaves all have a leading dimension k.

    Returns:
        A heads collection of length k.

    Examples:
        >>> import torch, funcgrad
        >>> w = torch.randn(512, 64)
        >>> probes = funcgrad.stacked_heads(lambda w_j, y: torch.nn.functional.softplus(w_j @ y), w)
        >>> len(probes)
        512
    """
    return StackedHeads(head_fn, params)


def _normalize_heads(heads: object, call: str) -> tuple[list[Any] | None, Any]:
    """(keys or None, heads): a list of callables, or a StackedHeads."""
    if isinstance(heads, StackedHeads):
        return None, heads
    if isinstance(heads, torch.nn.ModuleDict):  # not a Mapping, but keyed like a dict
        keys, fns = list(heads.keys()), list(heads.values())
    elif isinstance(heads, torch.nn.ModuleList):  # not a Sequence, and callable as a Module
        keys, fns = None, list(heads)
    elif isinstance(heads, Mapping):
        keys, fns = list(heads.keys()), list(heads.values())
    elif isinstance(heads, Sequence) and not isinstance(heads, (str, bytes)):
        keys, fns = None, list(heads)
    elif callable(heads):
        raise TypeError(
            f"{call}: `heads` must be a sequence or mapping of callables, got a single callable "
            f"{describe(heads)}. Wrap it in a list: heads=[head]."
        )
    else:
        raise TypeError(
            f"{call}: `heads` must be a sequence or a mapping of callables y -> scalar, or "
            f"funcgrad.stacked_heads(...), got {describe(heads)}."
        )
    if not fns:
        raise ValueError(f"{call}: `heads` is empty; give at least one head y -> scalar.")
    for index, fn in enumerate(fns):
        if not callable(fn):
            name = f"key {keys[index]!r}" if keys is not None else f"index {index}"
            raise TypeError(
                f"{call}: head at {name} must be callable y -> scalar, got {describe(fn)}."
            )
    return keys, fns


def _real_scalar(value: Any) -> TypeGuard[torch.Tensor]:
    """The usual head output, checked at once: a 0-dim real floating tensor."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _scalar(value: Any, where: str, call: str) -> torch.Tensor:
    """The head's output as a 0-dim real floating tensor, or a clear error. Only a
    one-element tensor of another shape is reshaped (a view: one node more in its backward)."""
    if _real_scalar(value):
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}: {where} must return a real scalar tensor, got {describe(value)}.")
    if value.is_complex() or not value.is_floating_point():
        raise TypeError(
            f"{call}: {where} must return a real floating-point scalar, got dtype {value.dtype}. "
            + (
                "Take .real or .abs() of a complex value."
                if value.is_complex()
                else "Use .float()."
            )
        )
    if value.numel() != 1:
        raise ValueError(
            f"{call}: {where} must return a scalar, got shape {tuple(value.shape)}. "
            "Reduce it (.sum() or .mean()), or make one head per entry."
        )
    return value.reshape(())


def _name_head(error: Exception, where: str, call: str) -> None:
    """Add which head raised to an exception from a user's head, keeping its type and text."""
    if where not in str(error):  # funcgrad's own messages name the head already
        error.add_note(f"{call}: raised by {where}.")
    if "used in an in-place operation" in str(error):  # (y is a leaf of the heads' graph)
        error.add_note(
            f"{call}: {where} changes y (f's output) in place; every head reads the same y, "
            "so heads must not modify it. Write the head out of place (y * 2, not y.mul_(2))."
        )


@contextlib.contextmanager
def _naming(where: str, call: str) -> Iterator[None]:
    """:func:`_name_head` for what runs inside."""
    try:
        yield
    except Exception as error:
        _name_head(error, where, call)
        raise


def _head_where(index: int, keys: list[Any] | None) -> str:
    return f"head {index}" if keys is None else f"head {keys[index]!r}"


def _head_values(
    heads: list[Any], keys: list[Any] | None, out_def: Any, y: Tensors, call: str
) -> list[torch.Tensor]:
    """Every head's value on y (each checked to be a real scalar, named where it raises).
    On every call of k heads: one context manager (funcgrad differentiates the heads: a
    funcgrad call inside one counts as inside a transform) and no name built unless one
    raises."""
    values = []
    with differentiating():
        for index, head in enumerate(heads):
            try:
                value = head(_tree.unflatten(out_def, y))
                if not _real_scalar(value):
                    value = _scalar(value, _head_where(index, keys), call)
            except Exception as error:
                _name_head(error, _head_where(index, keys), call)
                raise
            values.append(value)
    return values


def _heads_eager(
    heads: list[Any], keys: list[Any] | None, out_def: Any, out: Tensors, call: str
) -> tuple[torch.Tensor, Tensors]:
    """Every head's value and gradient w.r.t. y on plain autograd, for a call that builds no
    graph of its results: the heads run once on a detached y, then one
    ``torch.autograd.grad`` per head (:func:`~funcgrad._engine.output_grads`; about 3x fewer
    µs a head than ``torch.func.grad`` on the CPU)."""
    y = tuple(leaf.detach().requires_grad_() for leaf in out)
    with torch.enable_grad():
        values = _head_values(heads, keys, out_def, y, call)
        grads = _engine.output_grads(values, y)
    return torch.stack(values).detach(), grads


def _stacked_head(heads: StackedHeads, out_def: Any, call: str) -> Callable[..., torch.Tensor]:
    """One stacked head's value on y, from its parameter leaves (for vmap over the heads)."""

    def stacked_head(p: Tensors, y: Tensors) -> torch.Tensor:
        value = heads.head_fn(_tree.unflatten(heads.params_def, p), _tree.unflatten(out_def, y))
        return _scalar(value, "stacked head_fn", call)

    return stacked_head


def _stacked_values(heads: StackedHeads, out_def: Any, y: Tensors, call: str) -> torch.Tensor:
    """The k stacked heads' values (k,) on y, in one vmap (on y's graph, where it has one)."""
    with _naming("stacked head_fn", call), differentiating():
        values: torch.Tensor = torch.func.vmap(
            _stacked_head(heads, out_def, call), in_dims=(0, None)
        )(heads.params, y)
    return values


def _head_cotangents(
    heads: Any, keys: list[Any] | None, flat: FlatFunction, out: Tensors, call: str
) -> tuple[torch.Tensor, Tensors]:
    """Each head's value and its gradient w.r.t. y: values (k,), cotangent leaves (k, ...).

    In one vmap for stacked heads. Otherwise head by head (they are cheap): on plain
    autograd where the call builds no graph of its results (eager, see
    :func:`~funcgrad._function.result_graph`), else with ``torch.func.grad``, which composes
    with transforms and keeps the cotangents' dependence on x for ``create_graph``.
    """
    out_def = flat.out_def
    if isinstance(heads, StackedHeads):
        stacked_head = _stacked_head(heads, out_def, call)
        with _naming("stacked head_fn", call):
            grads, values = torch.func.vmap(
                torch.func.grad_and_value(stacked_head, argnums=1), in_dims=(0, None)
            )(heads.params, out)
        return values, grads

    if not torch.is_grad_enabled() and values_readable(out):  # no graph of the results
        return _heads_eager(heads, keys, out_def, out, call)
    results = []
    for index, head in enumerate(heads):
        where = f"head {index}" if keys is None else f"head {keys[index]!r}"

        def one(y: Tensors, head: Callable[..., Any] = head, where: str = where) -> torch.Tensor:
            return _scalar(head(_tree.unflatten(out_def, y)), where, call)

        with _naming(where, call):
            results.append(torch.func.grad_and_value(one)(out))
    values = torch.stack([value for _, value in results])
    grads = tuple(torch.stack([g[j] for g, _ in results]) for j in range(len(out)))
    return values, grads


def _shape_key(flat: FlatFunction) -> Any:
    """A call signature: the trees, and every leaf's shape, dtype, device and requires_grad
    (or its value, for a hashable non-tensor leaf of an argument not differentiated). The
    differentiated arguments' leaves and trees are ``flat``'s own (flattened once a call)."""
    others = [arg for a, arg in enumerate(flat.args) if a not in flat.argnums]
    other_leaves, other_def = _tree.flatten(others) if others else ((), None)

    def of(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return (leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad)
        try:
            hash(leaf)
        except TypeError:
            return type(leaf)
        return (type(leaf), leaf)

    return (
        flat.argnums,
        tuple(flat.in_defs),
        tuple(of(leaf) for leaf in flat.leaves),
        other_def,
        tuple(of(leaf) for leaf in other_leaves),
    )


# A fake run of f (shapes only) costs ~75 us an op: a Python loop of thousands of small ops
# (an ODE simulator) would cost many eager forwards. Past this many ops it stops, unknown
# (about 8 ms), and plan() takes y's size from one real forward instead.
FAKE_RUN_OPS = 100

# auto's engine trial: this many timed calls on each engine, in turn (see _time_engine):
# two that time vmap against an unbatched call, then one that runs the plan they chose.
TRIAL_CALLS = 3


class _Stop(Exception):
    """Internal: a shape-only run of f went past its budget."""


class _OpBudget(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Stops f after ``limit`` ops."""

    def __init__(self, limit: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.left = limit

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _Stop
        return func(*args, **(kwargs or {}))


class _NoMutation(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every op that would write into a tensor f did not create (a buffer's running
    statistics, a captured state) on a copy of it instead: a forward run under it leaves no
    trace (its values may differ from a real forward's; its shapes do not)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: set[int] = set()

    def _foreign(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and (
            value.untyped_storage().data_ptr() not in self.made
        )

    def _own(self, value: Any) -> Any:
        """``value`` to write into: a copy where it is foreign (each of a list's tensors, for
        ``Tensor(a!)[]``: the ``_foreach_*_`` ops)."""
        if isinstance(value, (list, tuple)):
            return type(value)(self._own(v) for v in value)
        return value.clone() if self._foreign(value) else value

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = list(args), dict(kwargs or {})
        if "batch_norm" in func.__name__:  # updates the running statistics (args 3 and 4)
            # in training mode without saying so in its schema
            for i in (3, 4):
                if i < len(args) and self._foreign(args[i]):
                    args[i] = args[i].clone()
        if func._schema.is_mutable:
            for i, argument in enumerate(func._schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                if argument.kwarg_only:
                    if argument.name in kwargs:
                        kwargs[argument.name] = self._own(kwargs[argument.name])
                elif i < len(args):
                    args[i] = self._own(args[i])
        out = func(*args, **kwargs)
        # A view (select, for x[i] = v) shares its input's storage: it is made only where
        # that input was.
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage().data_ptr()
                if storage not in given:
                    self.made.add(storage)
        return out


def _output_size(flat: FlatFunction, limit: int | None = FAKE_RUN_OPS) -> int | None:
    """m = real numel of f's output without running f's ops for real: f on fake tensors
    (shapes only, no data; no tensor written, since torch.func refuses in-place updates of
    captured buffers, and no generator advanced), for at most ``limit`` ops. f's Python body
    does run (up to the limit): Python state it changes changes. None where that cannot
    tell (data-dependent Python in f, a long Python loop, ...). Eager mode only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    watch, flat.watch = flat.watch, False  # fake draws: nothing for RandomState to restore
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(leaf) for leaf in flat.leaves]
            with contextlib.ExitStack() as stack:
                if limit is not None:
                    stack.enter_context(_OpBudget(limit))
                stack.enter_context(_function.Random(flat))  # does f draw? (random ops)
                out = torch.func.vjp(flat, *fakes, has_aux=flat.has_aux)[0]
        return _coords.real_size(out)
    except Exception:  # any failure only means the shape is not known in advance
        return None
    finally:
        flat.watch = watch


def _forward_size(flat: FlatFunction) -> int:
    """m from one real forward of f that leaves no trace, the random number generators
    restored (the default ones and every ``torch.Generator`` f draws from). First in
    inference mode, f stopped before it writes into a tensor it did not make (a buffer, a
    counter: :class:`~funcgrad._function.NoOutsideWrites`): inference mode records no graph,
    so it costs ~2 eager forwards on a Python loop of small ops (the mode's ~1 us an op),
    and less on larger ops. Where f writes such a tensor, every such write made on a copy
    (BatchNorm's running statistics in training mode) at ~4 eager forwards; where f needs
    gradients inside, the vjp of f (it refuses most such writes, and then that copy)."""
    rng = RandomState(flat)

    def output(*leaves: torch.Tensor) -> Any:
        # Only the explicit generators f draws from are watched (for rng.restore), not
        # which ops draw: nothing here records that, and a dispatch mode on every op cost
        # 4x f's forward on a Python loop of small ops (plan() on the ODE simulator).
        watch, flat.watch = flat.watch, False
        try:
            with _function._Draws(flat.generators) if watch else contextlib.nullcontext():
                result = flat(*leaves)
        finally:
            flat.watch = watch
        return result[0] if flat.has_aux else result

    def in_inference_mode() -> Any:
        watch, flat.watch = flat.watch, False
        try:
            with torch.inference_mode(), _function.NoOutsideWrites(flat.generators, flat.leaves):
                result = flat(*flat.leaves)
        finally:
            flat.watch = watch
        return result[0] if flat.has_aux else result

    def on_copies() -> Any:
        rng.restore()
        with torch.no_grad(), _NoMutation():
            return output(*flat.leaves)

    try:
        try:
            out = in_inference_mode()
        except _function.Writes:  # (torch.func lets some writes through: x[i] = 1.0)
            out = on_copies()
        except RuntimeError:  # f needs gradients inside
            rng.restore()
            try:
                out = torch.func.vjp(output, *flat.leaves)[0]
            except RuntimeError:
                out = on_copies()
    finally:
        rng.restore()
    return _coords.real_size(out)


@dataclasses.dataclass
class Batching:
    """auto's timing of a batched call against one unbatched call on one engine, over two
    calls (:meth:`Composition._remember`): measured, and ``unbatched`` None where vmap was
    faster (or nothing was batched), else why unbatched calls were."""

    measured: bool = False
    unbatched: str | None = None
    tentative: _engine.Timing | None = None  # the first timed call's: the next decides
    timing: _engine.Timing | None = None  # both calls' fastest, once measured


@dataclasses.dataclass
class Signature:
    """What a :class:`Composition` has learnt of one call signature (every argument's tree,
    shapes, dtypes, devices and requires_grad: :func:`_shape_key`), from calls and
    ``plan()``: read by every later call with that signature. It holds no tensor."""

    fake_tried: bool = False
    fake_size: int | None = None  # y's size from f on fake tensors (None: not told that way)
    size: int | None = None  # y's size from the output of an earlier call
    forward_size: int | None = None  # y's size from one real forward, for plan() alone
    # auto's timing of a batched call against an unbatched one, per engine the calls run on
    # (both batch by the same rules, but not equally well: vmap over eager autograd loops
    # inside for the fused RNN backward, torch.func's decomposed one batches).
    batchings: dict[Engine, Batching] = dataclasses.field(default_factory=dict)
    # Where auto chose forward mode: one call in forward mode is timed (forward_s), the next
    # in reverse mode, each running f once; then not_forward is None where forward mode was
    # faster, else why reverse mode was (then planned).
    forward_s: float | None = None
    forward_timed: bool = False
    not_forward: str | None = None
    fit: _engine.ChunkFit | None = None  # chunk_size="auto": a direction's measured cost
    # Whether f drew from an explicit torch.Generator on the first call (None: no call yet):
    # later calls watch f's ops for one (for RandomState) only where it did.
    draws: bool | None = None
    # Whether f draws random numbers (seen in a watched run): then it is linearised on eager
    # autograd (same draws as one eager forward), and forward mode is no candidate.
    random: bool = False
    # Whether f registered a tensor hook (seen in a watched run): then only the cotangents
    # themselves go through f (a hook may be nonlinear in its gradient).
    hooked: bool = False
    # auto, no graph of the results: what f's linearisation runs on (None: not decided yet;
    # the trial runs the first calls on torch.func and eager autograd in turn, and keeps
    # each call's seconds, without its measuring, by engine, with whether it ran vmap to
    # time it against an unbatched call).
    engine: Engine | None = None
    trial_s: dict[Engine, list[tuple[float, bool]]] = dataclasses.field(default_factory=dict)
    engine_why: str | None = None
    # f's eager graph held a torch.compile'd backward, which torch may run wrongly twice on
    # one graph: later calls stay on torch.func.
    compiled: bool = False

    def batching(self, engine: Engine) -> Batching:
        """The batching record of calls on ``engine``."""
        record = self.batchings.get(engine)
        if record is None:
            record = self.batchings[engine] = Batching()
        return record

    def trial_next(self) -> Engine:
        """The engine the next call of the trial runs: torch.func and eager autograd in
        turn, torch.func first."""
        func, eager = (len(self.trial_s.get(e, ())) for e in ("torch.func", "autograd"))
        return "torch.func" if func <= eager else "autograd"


class Signatures:
    """The :class:`Signature` records of one Composition, least recently used dropped past
    ``size`` (a jit cache's bound: a loop over ever new shapes keeps at most this many)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._records: collections.OrderedDict[Any, Signature] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def __call__(self, key: Any) -> Signature:
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = Signature()
            if len(self._records) > self.size:
                self._records.popitem(last=False)
        else:
            self._records.move_to_end(key)
        return record


class Composition:
    """f and its heads, as one call of :func:`compose_heads` or :func:`combine_heads` needs
    them: validation, the plan, the per-head pass through the engine, and packaging."""

    def __init__(
        self,
        f: Any,
        heads: Any,
        argnums: Any,
        has_aux: bool,
        strategy: Any,
        chunk_size: Any,
        check: Any,
        call: str,
    ) -> None:
        self.call = call
        check_callable(f, "f", call)
        check_strategy(strategy, call)
        check_chunk_size(chunk_size, call)
        check_argnums_type(argnums, call)
        self.keys, self.heads = _normalize_heads(heads, call)
        self.f, self.argnums, self.has_aux = f, argnums, has_aux
        self.strategy: Strategy = strategy
        self.chunk_size: ChunkSize = chunk_size
        self.check = resolve_check(check, call) if check is not None else None
        # What calls and plan() learnt, one record per call signature. A stale y size (f's
        # shapes changed by outside state) only costs speed: the size picks a strategy, and
        # every strategy computes on the real output.
        self._signatures = Signatures()

    @property
    def k(self) -> int:
        return len(self.heads)

    def flat(self, args: Sequence[Any]) -> FlatFunction:
        argnums = normalize_argnums(self.argnums, len(args), self.call)
        return FlatFunction(self.f, args, argnums, self.has_aux, self.call)

    def signature(self, flat: FlatFunction) -> Signature | None:
        """The record of this call's signature (its key computed once per call); None
        inside transforms and compiled code, which plan from shapes alone."""
        if flat.signature is None and flat.readable:
            flat.signature = self._signatures(_shape_key(flat))
        record: Signature | None = flat.signature
        return record

    def resolved_check(self) -> CheckMode:
        return resolve_check(self.check, self.call)

    def output_size(self, flat: FlatFunction) -> int | None:
        """y's size from f on fake tensors, remembered per argument shapes; None inside
        transforms and compiled code (no fake run there)."""
        record = self.signature(flat)
        if record is None:
            return None
        if not record.fake_tried:
            record.fake_size, record.fake_tried = _output_size(flat), True
            record.random = record.random or flat.drew
        return record.fake_size

    def before_f(self, flat: FlatFunction, planning: bool = False) -> tuple[bool, int | None]:
        """(forward mode first?, y's size where it had to be known before f runs).

        Forward mode runs f's forward itself, so it must be chosen before f runs: only when
        it can win (``2 n < k``, all n tangents in one batch) does the planner need m. A call
        takes it from an earlier call's output on these shapes (or from ``plan()``), never from
        a run of its own: f runs once per call, so the first call on new shapes runs reverse
        mode. ``plan()`` (``planning``) may run f on fake tensors to know it.
        """
        n = flat.n
        if self.strategy == "jacfwd":
            make_plan("jacfwd", self.k, 0, n, self.chunk_size, call=self.call)  # checks chunks
            return n > 0, None
        chunk = self.chunk_size
        one_batch = chunk is None or chunk == "auto" or chunk >= n
        if self.strategy != "auto" or not (n and one_batch and FORWARD_MODE_PENALTY * n < self.k):
            return False, None
        record = self.signature(flat)
        if record is None or record.not_forward:  # (reverse mode measured faster)
            return False, None
        if self._reverse_timed_here(record):  # the call after forward mode's timed one
            return False, None
        m = record.size if record.size is not None else record.fake_size
        if m is None and planning:
            m = self.output_size(flat)
        if m is None or record.random or record.hooked:  # (forward mode draws its own; it
            return False, None  # runs no backward hook)
        return self.planner(flat, m)(m, False).strategy == "jacfwd", m

    def planner(self, flat: FlatFunction, m_before: int | None) -> _engine.Planner:
        """The plan for y's real size; forward mode is a candidate only where y's size was
        known before f ran (or jacfwd was requested)."""
        n = flat.n
        record = self.signature(flat)
        engine = self._planned_engine(flat)
        unbatched = record.batching(engine).unbatched if record is not None else None
        measure = self._measured_here(flat)
        chunk = self._chunk(flat)
        not_forward = record.not_forward if record is not None else None
        trial = self._engine_trial(flat)
        why = record.engine_why if record is not None else None

        def plan(m: int, instead_of_forward: bool) -> Plan:
            # (read when the plan is made: after f ran, on a call that watched it)
            linear = not (flat.hooked or (record is not None and record.hooked))
            if instead_of_forward:
                return self._measuring(
                    flat,
                    make_plan("auto", self.k, m, n, chunk, forward=False, linear=linear),
                    chunk,
                )
            forward = m_before is not None
            return self._measuring(
                flat,
                make_plan(
                    self.strategy,
                    self.k,
                    m,
                    n,
                    chunk,
                    forward=forward,
                    unbatched=unbatched,
                    measure=measure,
                    not_forward=not_forward,
                    call=self.call,
                    engine=engine,
                    engine_trial=trial,
                    engine_why=why,
                    linear=linear,
                ),
                chunk,
            )

        return plan

    def _engines_timed(self, flat: FlatFunction) -> Signature | None:
        """The record where auto weighs torch.func against eager autograd for this call: no
        graph of the results wanted (the call's grad mode is off), values readable, f known
        not to draw random numbers (else it is on eager autograd anyway), and eager autograd
        able to win (``ENGINE_MARGIN > 0``); else None."""
        if self.strategy != "auto" or torch.is_grad_enabled() or not ENGINE_MARGIN > 0:
            return None
        record = self.signature(flat)
        if record is None or record.random or record.compiled:
            return None  # (a compiled backward may run wrongly twice on eager autograd)
        return record

    def _engine_trial(self, flat: FlatFunction) -> bool:
        """Whether this call is one of the trial's, which time the engines (the first six
        on its shapes, on torch.func and eager autograd in turn)."""
        record = self._engines_timed(flat)
        return record is not None and record.engine is None

    def _on_autograd(self, flat: FlatFunction) -> bool:
        """Whether this call linearises f on eager autograd by the timing (decided, or the
        trial's turn); draws and torch.func's failures take it there too (see _linearize)."""
        record = self._engines_timed(flat)
        if record is None:
            return False
        if record.engine is not None:
            return record.engine == "autograd"
        return record.trial_next() == "autograd"

    def _planned_engine(self, flat: FlatFunction) -> Engine:
        """The engine this call is planned on (and whose batching record it plans with and
        fills): the trial's or the timing's choice, or eager autograd where f is known to
        draw random numbers and no graph of the results is wanted (see _linearize)."""
        record = self.signature(flat)
        drawing = record is not None and record.random and not torch.is_grad_enabled()
        return "autograd" if drawing or self._on_autograd(flat) else "torch.func"

    @staticmethod
    def _time_engine(
        record: Signature, ran: Engine, seconds: float, measured: bool, directions: int
    ) -> None:
        """Record a call of the trial (``seconds`` without its measuring; ``measured``: it
        timed vmap against an unbatched call). The trial runs torch.func and eager autograd
        in turn, TRIAL_CALLS calls each: the first two on an engine time vmap against an
        unbatched call (each side's fastest decides how that engine batches), the third
        runs the plan they chose, warm. Every engine's first call pays its one-time costs
        (torch.func's transforms; eager autograd's walk of f's graph, its first vmap), so
        each engine is weighed by its fastest call, like with like; where an engine's plan
        turned unbatched, its vmapped calls count at the loop's estimated cost (each of the
        ``directions`` at the unbatched call's time instead of its share of the vmap).
        Eager autograd is kept where it is faster by ENGINE_MARGIN. Where torch.func fell
        back to eager autograd (it cannot differentiate f), eager autograd it is."""
        if ran != record.trial_next():  # torch.func fell back to eager autograd
            record.engine = "autograd"
            return
        record.trial_s.setdefault(ran, []).append((seconds, measured))
        if any(len(record.trial_s.get(e, ())) < TRIAL_CALLS for e in ("torch.func", "autograd")):
            return
        costs: dict[Engine, float] = {}
        looped: list[str] = []
        for engine in ("torch.func", "autograd"):
            batching = record.batching(engine)
            timing = batching.timing if batching.unbatched is not None else None
            if timing is not None:
                looped.append("eager autograd" if engine == "autograd" else engine)
            loop_s = 0.0 if timing is None else directions * (timing.single - timing.batched)
            costs[engine] = min(
                max(s + loop_s, 0.0) if vmapped else s for s, vmapped in record.trial_s[engine]
            )
        faster = costs["autograd"] < ENGINE_MARGIN * costs["torch.func"]
        record.engine = "autograd" if faster else "torch.func"
        if faster:
            loops = f"; {' and '.join(looped)} as a loop of unbatched calls" if looped else ""
            record.engine_why = (
                f"eager autograd {1e3 * costs['autograd']:.3g} ms a call, torch.func "
                f"{1e3 * costs['torch.func']:.3g} ms (fastest of {TRIAL_CALLS} calls each{loops})"
            )

    def _fit(self, flat: FlatFunction) -> _engine.ChunkFit:
        """chunk_size="auto": the record of this call signature (every input's tree, shape,
        dtype and device)."""
        record = self.signature(flat)
        assert record is not None  # the callers check that values can be read
        if record.fit is None:
            record.fit = _engine.ChunkFit()
        return record.fit

    def _chunk(self, flat: FlatFunction) -> ChunkSize:
        """The chunk size a call on these arguments runs: for "auto", the fitted chunk under
        the budget in force; None where values cannot be read (compiled code, transforms:
        the engine runs unchunked there); "auto" while not measured (the call measures)."""
        if self.chunk_size != "auto":
            return self.chunk_size
        record = self.signature(flat)  # None where dynamo may be tracing
        if record is None:
            return None
        fit = record.fit
        if fit is not None and fit.measured:
            return fit.chunk()
        _memory.setting()  # (a bad budget string is refused here too)
        return "auto"

    def _measuring(self, flat: FlatFunction, plan: Plan, chunk: ChunkSize) -> Plan:
        """``plan`` with ``chunk_size="auto"`` where the call measures again: a record fitted
        on one direction alone, whose fit on two vmapped chunks the budget now allows.
        ``chunk``: the fitted chunk the plan was made with (:meth:`_chunk`)."""
        if not isinstance(chunk, int) or self.chunk_size != "auto" or plan.chunk_size != chunk:
            return plan  # (not fitted, or measured unbatched calls faster: no vmapped chunk)
        record = self.signature(flat)
        fit = record.fit if record is not None else None
        if fit is None or plan.strategy not in ("vjp", "jacrev"):
            return plan
        return (
            dataclasses.replace(plan, chunk_size="auto") if fit.measures(plan.directions) else plan
        )

    def _measure_fit(self, flat: FlatFunction, plan: Plan) -> bool:
        """For plan(): measure the chunk as the call would (f's pullback of direction 0
        alone, then where they fit of directions 1-2 and 3-5), so that the plan reports the
        passes the call runs. f runs once more, its random draws replayed (the generators end
        where they were). False where that cannot be done without side effects (torch.func
        refuses f): the call measures then."""
        if plan.chunk_size != "auto" or plan.strategy not in ("vjp", "jacrev"):
            return False
        if plan.directions <= 1:
            return False
        rng = RandomState(flat)
        try:
            with torch.enable_grad():  # as of_function runs it
                out, pull = torch.func.vjp(flat, *flat.leaves, has_aux=flat.has_aux)[:2]
            # As the call: vjp pulls back cotangents that exist (here y's first unit rows,
            # repeated where y has fewer), jacrev makes its unit rows.
            made = None
            if plan.strategy == "vjp":
                rows = _coords.unit_rows(out, 0, min(plan.m, FIT_PROBE[1] + FIT_MIN))
                again = torch.arange(FIT_PROBE[1] + FIT_MIN) % rows[0].shape[0]
                made = tuple(row[again.to(row.device)] for row in rows)

            def run(start: int, stop: int) -> Tensors:
                return _engine.batched(
                    lambda *row: pull(row),
                    _coords.unit_rows(out, start, stop)
                    if made is None
                    else tuple(row[start:stop] for row in made),
                    chunk_size=None,
                    check=False,
                    what="f's pullback",
                )

            _engine.measure_fit(self._fit(flat), run, out[0].device, plan.directions)
        except Exception:  # any failure only means the call measures instead
            return False
        finally:
            rng.restore()
        return True

    def plan(self, flat: FlatFunction, weighted: bool = False) -> Plan:
        """The plan that a call on these arguments runs, from shapes only (in the grad mode
        the call runs in: see `result_graph`)."""
        forward, m_before = self.before_f(flat, planning=True)
        m = m_before if m_before is not None else self.output_size(flat)
        if m is None:  # a long or data-dependent f: one real forward that leaves no trace
            # (remembered for plan() alone: the call still plans as without it)
            record = self.signature(flat)
            if record is None:
                m = _forward_size(flat)
            else:
                if record.forward_size is None:
                    record.forward_size = _forward_size(flat)
                m = record.forward_size
        plan = self.planner(flat, m_before)(m, False)
        if not weighted and self._measure_fit(flat, plan):
            plan = self.planner(flat, m_before)(m, False)
        if weighted:
            engine: Engine = "autograd" if self.one_pullback_on_autograd(flat) else "torch.func"
            return make_plan(
                self.strategy, self.k, m, plan.n, self.chunk_size, weighted=True, engine=engine
            )
        return dataclasses.replace(plan, f_runs=self.f_runs(flat, forward, plan.n))

    @staticmethod
    def one_pullback_on_autograd(flat: FlatFunction) -> bool:
        """One pullback of ``w @ V`` (combine_heads) with no graph of the results: on eager
        autograd, whose forward and backward are the floor (one direction: nothing to
        batch); torch.func where a graph of the results is wanted or inside transforms."""
        return not torch.is_grad_enabled() and flat.readable

    def f_runs(self, flat: FlatFunction, forward: bool, n: int) -> int:
        """How many times a call on these arguments runs f's Python body, as planned (a
        fallback runs it once more): once, plus ``check``'s unbatched JVP calls in forward
        mode (they run f). ``plan()``'s own shape-only run on fake tensors is not counted:
        the call runs none."""
        check = forward and flat.readable and self.resolved_check()
        return 1 + (len({0, n // 2, n - 1}) if check else 0)

    @staticmethod
    def _reverse_timed_here(record: Signature) -> bool:
        """Whether this call runs reverse mode, timed against the forward-mode call before it
        (auto chose forward mode on these shapes, and one call has timed it)."""
        return record.forward_s is not None and not record.forward_timed

    def cotangents_of(self, flat: FlatFunction) -> _engine.CotangentsOf:
        return lambda out: _head_cotangents(self.heads, self.keys, flat, out, self.call)

    def values_of(self, flat: FlatFunction) -> _engine.ValuesOf:
        """The heads' values on f's output, on its autograd graph: list heads one by one,
        stacked heads in one vmap."""
        heads, call = self.heads, self.call
        if isinstance(heads, StackedHeads):
            return lambda out: _stacked_values(heads, flat.out_def, out, call)
        return lambda out: _head_values(heads, self.keys, flat.out_def, out, call)

    def per_head(
        self, flat: FlatFunction, check: CheckMode
    ) -> tuple[torch.Tensor, Tensors, Tensors]:
        """(values (k,), per-head gradient leaves (k, ...), aux tensors), by the plan."""
        return self.watching(flat, lambda: self._per_head(flat, check))

    def watching(self, flat: FlatFunction, run: Callable[[], R]) -> R:
        """``run()``, with f's ops watched for explicit ``torch.Generator`` draws (so that
        RandomState restores them before a re-run of f) on the first call on these shapes,
        and on later calls only where f drew from one then: the watch costs ~1-2 us an op."""
        record = self.signature(flat)  # None inside transforms: always watched there
        if record is not None and record.draws is not None:
            flat.watch = record.draws
            flat.eager = flat.drew = record.random
        elif record is not None and record.random:  # plan()'s shape-only run saw f draw:
            flat.eager = flat.drew = True  # on eager autograd at once, as plan() said
        result = run()
        if record is not None and record.draws is None:
            record.draws = bool(flat.generators)
            record.random = record.random or flat.eager
            record.hooked = record.hooked or flat.hooked
        return result

    def _per_head(
        self, flat: FlatFunction, check: CheckMode
    ) -> tuple[torch.Tensor, Tensors, Tensors]:
        forward, m_before = self.before_f(flat)
        planner = self.planner(flat, m_before)
        signature = self.signature(flat)
        record = signature if self._measured_here(flat) else None
        batching = record.batching(self._planned_engine(flat)) if record is not None else None
        timed = None if forward else self._engines_timed(flat)
        if timed is not None and timed.engine is not None:
            timed = None  # decided
        # Forward mode against reverse mode: one call each, f once per call.
        forward_trial = forward and record is not None and not record.forward_timed
        reverse_trial = signature is not None and self._reverse_timed_here(signature)
        flat.autograd = self._on_autograd(flat)
        with contextlib.ExitStack() as stack:
            if self.chunk_size == "auto" and flat.readable:
                stack.enter_context(_engine.remembering_chunks(self._fit(flat)))
            log = stack.enter_context(_engine.measuring()) if record is not None else None
            clock = timed is not None or forward_trial or reverse_trial
            start = time.perf_counter() if clock else 0.0  # (not in compiled code)
            plan, values, grads, aux = _engine.per_head(
                flat, planner, forward, self.cotangents_of(flat), check, self.values_of(flat)
            )
            seconds = time.perf_counter() - start if clock else 0.0
        if signature is not None:
            signature.size = plan.m
        # The call's own cost: without the unbatched calls that time vmap.
        measuring_s = sum(timing.single for timing in log) if log else 0.0
        seconds = max(seconds - measuring_s, 0.0)
        if forward_trial:
            assert record is not None
            self._time_forward(record, plan, seconds)
            return values, grads, aux
        if reverse_trial:
            assert signature is not None
            self._time_reverse(signature, plan, seconds)
        if log and batching is not None and not batching.measured:  # a batched call measured
            self._remember(batching, log[0])
        if timed is not None:
            self._time_engine(timed, plan.engine, seconds, bool(log), plan.directions)
        return values, grads, aux

    @staticmethod
    def _time_forward(record: Signature, plan: Plan, seconds: float) -> None:
        """The first call where auto chose forward mode on these shapes: its time is kept
        for the next call, which runs reverse mode (:meth:`_time_reverse`). Where forward
        mode could not run f (its fallback has run reverse mode), reverse mode it is."""
        if plan.strategy != "jacfwd":
            record.forward_timed = True
            record.not_forward = "forward mode could not run f on an earlier call"
            return
        record.forward_s = seconds

    @staticmethod
    def _time_reverse(record: Signature, plan: Plan, seconds: float) -> None:
        """The call after forward mode's timed one ran reverse mode: the faster mode (by
        LOOP_MARGIN for reverse mode) is planned from the next call on."""
        assert record.forward_s is not None
        forward_s, record.forward_timed = record.forward_s, True
        if seconds < _engine.LOOP_MARGIN * forward_s:
            record.not_forward = (
                f"reverse mode ({plan.strategy}) {1e3 * seconds:.2g} ms, forward mode "
                f"{1e3 * forward_s:.2g} ms on earlier calls"
            )

    @staticmethod
    def _remember(record: Batching, timing: _engine.Timing) -> None:
        """Decide from two timed calls on one engine: the first call's timing is kept, the
        next call on that engine is timed as well, and each side's fastest decides. One call
        alone is biased either way: its vmapped call pays vmap's warm-up (spread over the
        directions), its unbatched call the one-time costs of the unbatched shapes (a
        convnet's kernels), so neither a first-call win of the loop nor one of vmap is
        trusted alone."""
        if record.tentative is None:
            record.tentative = timing
            return
        timing, record.tentative = timing.merged(record.tentative), None
        record.measured, record.timing = True, timing
        record.unbatched = timing.why() if timing.unbatched_faster else None

    def _measured_here(self, flat: FlatFunction) -> bool:
        """Whether this call is timed under auto (the first two calls on these shapes on the
        engine it runs on: each times its first batched call against one unbatched call)."""
        if self.strategy != "auto":
            return False
        record = self.signature(flat)
        return record is not None and not record.batching(self._planned_engine(flat)).measured

    def grad_tree(self, flat: FlatFunction, leaves: Tensors) -> Any:
        """Gradient leaves back into the structure of the differentiated argument(s)."""
        trees = flat.split_inputs(leaves)
        return trees[0] if isinstance(self.argnums, int) else tuple(trees)

    def keyed(self, values: torch.Tensor | None) -> Any:
        """A (k,) tensor as a dict by head name for a mapping of heads."""
        if values is None or self.keys is None:
            return values
        return {key: values[i] for i, key in enumerate(self.keys)}

    def describe(self, name: str) -> str:
        f = getattr(self.f, "__name__", None) or type(self.f).__name__
        heads = (
            repr(self.heads)
            if isinstance(self.heads, StackedHeads)
            else f"[{', '.join(map(repr, self.keys))}]"
            if self.keys is not None
            else f"{self.k} heads"
        )
        options = f"strategy={self.strategy!r}"
        if self.chunk_size is not None:
            options += f", chunk_size={self.chunk_size}"
        if self.argnums != 0:
            options += f", argnums={self.argnums!r}"
        if self.has_aux:
            options += ", has_aux=True"
        return f"{name}({f}, {heads}, {options})"


class ComposedHeads(Generic[R]):
    """The function returned by `compose_heads`: call it with f's arguments.

    ``fn(*args)`` returns ``(values, grads)`` (``(values, grads, aux)`` with
    ``has_aux=True``); ``fn.plan(*args)`` returns the `funcgrad.Plan` that the call
    runs, without running f for real.

    Examples:
        >>> import torch, funcgrad
        >>> fn = funcgrad.compose_heads(torch.sin, [lambda y: y.sum(), lambda y: y[0]])
        >>> fn
        compose_heads(sin, 2 heads, strategy='auto')
        >>> values, grads = fn(torch.zeros(3))
        >>> grads
        tensor([[1., 1., 1.],
                [1., 0., 0.]])
    """

    def __init__(self, composition: Composition, create_graph: bool = False) -> None:
        self._composition = composition
        self._create_graph = create_graph
        functools.update_wrapper(self, composition.f, updated=())

    @property
    def k(self) -> int:
        """The number of heads."""
        return self._composition.k

    def plan(self, *args: Any) -> Plan:
        """The plan that ``fn(*args)`` runs, from shapes only.

        Costs f on fake tensors, once per new shapes (shapes, no data: a few ms after the
        first use in a process, which takes about a second to initialise); where that cannot
        tell y's shape (data-dependent Python in f, more than 100 ops), one real forward
        without gradients as well. Neither writes a buffer or advances a generator, but f's
        Python body runs in both. ``Plan.f_runs`` counts the runs of f's body that the call
        after it makes. With ``chunk_size="auto"``, where the call would measure (these
        argument shapes never measured, or measured on one direction alone and the budget
        now allowing more), f and the pullbacks the call would measure run once (one
        direction alone, then two and three in a vmap where they fit; random draws
        restored), as the call would; the call then uses that measurement, so ``passes``
        is its count.
        """
        composition = self._composition
        flat = composition.flat(args)
        with result_graph(self._create_graph, flat.leaves):
            return composition.plan(flat)

    def __call__(self, *args: Any) -> R:
        c = self._composition
        check_not_inference_mode(c.call)
        flat = c.flat(args)
        with result_graph(self._create_graph, flat.leaves):
            values, grads, aux = c.per_head(flat, c.resolved_check())
        grad_tree = c.grad_tree(flat, grads)
        if c.keys is not None:
            grad_out: Any = {key: _tree_index(grad_tree, i) for i, key in enumerate(c.keys)}
        else:
            grad_out = grad_tree
        if c.has_aux:
            return c.keyed(values), grad_out, flat.rebuild_aux(aux)  # type: ignore[return-value]
        return c.keyed(values), grad_out  # type: ignore[return-value]

    def __repr__(self) -> str:
        return self._composition.describe("compose_heads")


def _tree_index(tree: Any, i: int) -> Any:
    leaves, treedef = _tree.flatten(tree)
    return _tree.unflatten(treedef, [leaf[i] for leaf in leaves])


# The return types by the kind of heads (a mapping or a ModuleDict gives dicts keyed like
# it; a sequence, a ModuleList or stacked_heads a (k,) tensor of values) and by has_aux.
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Mapping[K, Callable[[Any], torch.Tensor]],
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[False] = False,
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    create_graph: bool = False,
) -> ComposedHeads[tuple[dict[K, torch.Tensor], dict[K, Any]]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Mapping[K, Callable[[Any], torch.Tensor]],
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[True],
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    create_graph: bool = False,
) -> ComposedHeads[tuple[dict[K, torch.Tensor], dict[K, Any], Any]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]] | torch.nn.ModuleList | StackedHeads,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[False] = False,
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    create_graph: bool = False,
) -> ComposedHeads[tuple[torch.Tensor, Any]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]] | torch.nn.ModuleList | StackedHeads,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[True],
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    create_graph: bool = False,
) -> ComposedHeads[tuple[torch.Tensor, Any, Any]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: torch.nn.ModuleDict,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[False] = False,
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    create_graph: bool = False,
) -> ComposedHeads[tuple[dict[str, torch.Tensor], dict[str, Any]]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: torch.nn.ModuleDict,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: Literal[True],
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    create_graph: bool = False,
) -> ComposedHeads[tuple[dict[str, torch.Tensor], dict[str, Any], Any]]: ...
def compose_heads(
    f: Callable[..., Any],
    heads: Any,
    *,
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    strategy: Strategy = "auto",
    chunk_size: ChunkSize = None,
    check: CheckMode | None = None,
    create_graph: bool = False,
) -> Any:
    """Values and gradients of many cheap heads on one slow f, with f run once.

    ``compose_heads(f, heads)(*args)`` returns ``(values, grads)`` with the same values as

    ```python
    values = torch.stack([h(f(*args)) for h in heads])
    grads = [torch.func.grad(lambda *a: h(f(*a)), argnums)(*args) for h in heads]  # stacked
    ```

    but f's forward runs once and its backward as few times as the shapes allow. By the
    chain rule each head only contributes a cotangent ``v_i = grad h_i(y)``, and
    ``grads_i = J_f(x)^T v_i``; the strategy decides how these k products are formed.

    Args:
        f: ``f(*args) -> y``, a pytree of floating/complex tensors (``(y, aux)`` with
            ``has_aux=True``).
        heads: a sequence of callables ``y -> real scalar``, a mapping ``name -> callable``,
            or `stacked_heads`.
        argnums: which positional arguments to differentiate (int or tuple, as torch.func).
        has_aux: f returns ``(y, aux)``; aux is returned as a third output.
        strategy: how to pull the k cotangents back (m = real numel of y, n = of the inputs):

            - ``"vjp"``: one vmapped backward over the k cotangents: k directions.
            - ``"jacrev"``: pull back the m unit directions of y (the rows of J), then
              ``V @ J``: m directions plus a (k, m) @ (m, n) product.
            - ``"jacfwd"``: n JVPs (the columns of J) in one vmapped forward pass with n
              tangents, then ``V @ J``. f's forward runs once, in that pass, so
              ``chunk_size`` must be None or at least n (a ValueError otherwise).
            - ``"loop"``: one unbatched backward per head: k passes, lowest memory, no vmap.
            - ``"auto"``: the cheapest by ``k`` vs ``m`` vs ``2 n`` (forward mode must be
              clearly cheaper); shapes only, so the same under vmap, grad and compile.
        chunk_size: at most this many directions per vmapped call (None: all at once,
            1: a loop), as torch.func's. Bounds memory at the price of more passes.
        check: compare batched results with unbatched ones on a sample (see
            `funcgrad.set_check`); None uses the global setting.
        create_graph: build the graph of the results (values, grads and aux), for a
            backward through them, as ``torch.autograd.grad``'s. By default (False) no graph
            is built, so the results hold no memory of f and ``chunk_size`` bounds the peak
            (the values too are detached: ``values.sum().backward()`` needs
            ``create_graph=True``).
            Inside ``torch.func`` transforms the graph is always built (they differentiate
            through it).

    Returns:
        A function of f's arguments returning ``(values, grads)`` or ``(values, grads, aux)``.
        For a sequence of k heads ``values`` has shape ``(k,)`` and every grad leaf a leading
        k; for a mapping both are dicts keyed by the head names. ``grads`` has the structure
        of the differentiated argument (a tuple of them when ``argnums`` is a tuple).

    Examples:
        >>> import torch, funcgrad
        >>> def slow_fun(x):
        ...     return torch.real(torch.trace(torch.matrix_exp(1j * x * torch.ones(30, 30))))
        >>> heads = [lambda y: y**2, lambda y: torch.sqrt(y)]
        >>> fn = funcgrad.compose_heads(slow_fun, heads)
        >>> x = torch.tensor(1.0)
        >>> values, grads = fn(x)
        >>> grads.shape, fn.plan(x).strategy, fn.plan(x).directions
        (torch.Size([2]), 'jacrev', 1)

    Notes:
        Cost: one forward of f, the k heads and their gradients (head by head, or one vmap
        for stacked heads), then ``Plan.directions`` passes through f, batched with vmap.
        The returned function composes with ``torch.func.vmap`` (per-sample gradients),
        ``torch.func.grad`` (second order) and ``torch.compile``.

        Side effects: buffers are written and random numbers drawn (from the default
        generators and every ``torch.Generator`` f passes to a random op) as in one eager
        forward per call, whatever re-runs f. f's Python body runs ``fn.plan(*args).f_runs``
        times: once, on every call (``"auto"`` times forward against reverse mode on two
        separate calls), plus ``check``'s unbatched JVP calls in forward mode, and once more
        per fallback; no call runs it on fake tensors (only ``plan()`` does). Python state
        it changes changes that often.

        NaN/inf come out as autograd's in eager mode: where ``V @ J`` went non-finite, the
        cotangents themselves are pulled back. That recompute reads values, so inside
        vmap/grad/compile ``"jacrev"``/``"jacfwd"`` (and ``"auto"`` choosing them) can give
        NaN where autograd gives a finite entry, if a cotangent or J holds an inf (``0 * inf``);
        use ``strategy="vjp"`` there.
    """
    call = "compose_heads(f, heads)"
    check_flag(create_graph, "create_graph", call)
    composition = Composition(f, heads, argnums, has_aux, strategy, chunk_size, check, call)
    return ComposedHeads(composition, create_graph)
