"""``funcgrad.compose_heads`` and ``funcgrad.stacked_heads``: many cheap heads on one slow f."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, TypedDict, TypeGuard, TypeVar, Unpack, overload

import torch

from . import _coords, _engine, _linearize, _memory, _shape, _tree
from ._config import CheckMode, resolve_check
from ._errors import InputWrittenError, describe
from ._execute import execute, observed
from ._function import FlatFunction, HookState, result_graph
from ._linearize import Linearization, RandomState
from ._plan import FIT_MIN, FIT_PROBE, Plan, Request, after_f, decide
from ._record import Observations, Record, Records, learn, signature_key
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
        self.params_bare = self.params_def.is_leaf()  # (a bool: compiled code reads it)
        self.k = sizes.pop()
        # The vmapped grad_and_value of the heads, built once per tree of y (and call).
        self._cotangent_fns: dict[tuple[Any, str], Callable[..., Any]] = {}

    def cotangent_fn(self, out_def: Any, bare: bool, call: str) -> Callable[..., Any]:
        """``(params leaves, y leaves) -> (grads w.r.t. y, values)``, for every head in one
        vmap; y's one leaf bare where f returns a tensor (``bare``). Not cached in compiled
        code, where ``out_def`` is dynamo's own tree spec (neither hashed nor compared)."""
        if torch.compiler.is_compiling():
            return self._vmapped(out_def, bare, call)
        fn = self._cotangent_fns.get((out_def, call))
        if fn is None:
            fn = self._vmapped(out_def, bare, call)
            if len(self._cotangent_fns) >= 8:  # (bounded: a few trees of y at most)
                self._cotangent_fns.clear()
            self._cotangent_fns[(out_def, call)] = fn
        return fn

    def _vmapped(self, out_def: Any, bare: bool, call: str) -> Callable[..., Any]:
        head = _stacked_head(self, out_def, bare, call)
        if bare:
            one = torch.func.grad_and_value(lambda p, y: head(p, (y,)), argnums=1)
            return torch.func.vmap(one, in_dims=(0, None))
        return torch.func.vmap(torch.func.grad_and_value(head, argnums=1), in_dims=(0, None))

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
    notes = getattr(error, "__notes__", ())
    if type(error).__module__.startswith("torch._dynamo"):
        return  # torch.compile's own failure (Unsupported, ...), not the head's

    def add(note: str) -> None:  # (once: an error raised again, nested compositions)
        if note not in notes:
            error.add_note(note)

    if where not in str(error):  # funcgrad's own messages name the head already
        add(f"{call}: raised by {where}.")
    if "used in an in-place operation" in str(error):  # (y is a leaf of the heads' graph)
        add(
            f"{call}: {where} changes y (f's output) in place; every head reads the same y, "
            "so heads must not modify it. Write the head out of place (y * 2, not y.mul_(2))."
        )


class _Naming:
    """:func:`_name_head` for what runs inside (a class, not a generator context manager:
    entered on every call of stacked heads; docs/performance.md)."""

    __slots__ = ("call", "where")

    def __init__(self, where: str, call: str) -> None:
        self.where, self.call = where, call

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if isinstance(error, Exception):  # (it propagates, with its note)
            _name_head(error, self.where, self.call)


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
    versions = _versions(y)  # (f's own output on eager autograd: a write is not refused)
    with differentiating():
        for index, head in enumerate(heads):
            try:
                value = head(_tree.unflatten(out_def, y))
                if not _real_scalar(value):
                    value = _scalar(value, _head_where(index, keys), call)
                if versions is not None and _versions(y) != versions:
                    raise RuntimeError(
                        f"{call}: y (f's output) was used in an in-place operation by "
                        f"{_head_where(index, keys)}."
                    )
            except Exception as error:
                _name_head(error, _head_where(index, keys), call)
                raise
            values.append(value)
    return values


def _versions(tensors: Tensors) -> tuple[int, ...] | None:
    """The tensors' version counters (None where they have none: inference tensors,
    transforms' wrappers)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


def _heads_eager(
    heads: list[Any], keys: list[Any] | None, out_def: Any, out: Tensors, call: str
) -> tuple[torch.Tensor, Tensors]:
    """Every head's value and gradient w.r.t. y on plain autograd, for a call that builds no
    graph of its results: the heads run once on a detached y, then one
    ``torch.autograd.grad`` per head (:func:`~funcgrad._engine.output_grads`; cheaper on
    the host than ``torch.func.grad``: docs/performance.md)."""
    y = tuple(leaf.detach().requires_grad_() for leaf in out)
    with torch.enable_grad():
        values = _head_values(heads, keys, out_def, y, call)
        grads = _engine.output_grads(values, y)
    return torch.stack(values).detach(), grads


def _stacked_head(
    heads: StackedHeads, out_def: Any, bare: bool, call: str
) -> Callable[..., torch.Tensor]:
    """One stacked head's value on y, from its parameter leaves (for vmap over the heads).
    ``bare``: f returned a tensor (y's one leaf is y)."""

    def stacked_head(p: Tensors, y: Tensors) -> torch.Tensor:
        params = p[0] if heads.params_bare else _tree.unflatten(heads.params_def, p)
        value = heads.head_fn(params, y[0] if bare else _tree.unflatten(out_def, y))
        return _scalar(value, "stacked head_fn", call)

    return stacked_head


def _stacked_values(
    heads: StackedHeads, out_def: Any, bare: bool, y: Tensors, call: str
) -> torch.Tensor:
    """The k stacked heads' values (k,) on y, in one vmap (on y's graph, where it has one)."""
    with _Naming("stacked head_fn", call), differentiating():
        values: torch.Tensor = torch.func.vmap(
            _stacked_head(heads, out_def, bare, call), in_dims=(0, None)
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
        cotangents = heads.cotangent_fn(out_def, flat.out_bare, call)
        with _Naming("stacked head_fn", call):
            if flat.out_bare:
                grad, values = cotangents(heads.params, out[0])
                return values, (grad,)
            grads, values = cotangents(heads.params, out)
        return values, grads

    if not torch.is_grad_enabled() and values_readable(out):  # no graph of the results
        return _heads_eager(heads, keys, out_def, out, call)
    results = []
    for index, head in enumerate(heads):
        where = _head_where(index, keys)

        def one(y: Tensors, head: Callable[..., Any] = head, where: str = where) -> torch.Tensor:
            return _scalar(head(_tree.unflatten(out_def, y)), where, call)

        with _Naming(where, call):
            results.append(torch.func.grad_and_value(one)(out))
    values = torch.stack([value for _, value in results])
    grads = tuple(torch.stack([g[j] for g, _ in results]) for j in range(len(out)))
    return values, grads


class Composition:
    """f and its heads, as one call of :func:`compose_heads` or :func:`combine_heads` needs
    them: validation, then for each call its record, plan, execution and what it learnt."""

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
        engine: Engine | None = None,
    ) -> None:
        self.call = call
        self.engine = engine  # (Request.engine: the caller's engine for an explicit strategy)
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
        # shapes changed by outside state) only costs speed: every strategy computes on the
        # real output.
        self._records = Records()
        self._records.hooks = HookState(f)

    @property
    def k(self) -> int:
        return len(self.heads)

    def flat(self, args: Sequence[Any]) -> FlatFunction:
        argnums = normalize_argnums(self.argnums, len(args), self.call)
        return FlatFunction(self.f, args, argnums, self.has_aux, self.call)

    def resolved_check(self) -> CheckMode:
        return resolve_check(self.check, self.call)

    def _record(self, flat: FlatFunction) -> tuple[Any, Record]:
        """This call's signature and its record; no key inside transforms and compiled
        code, which plan from the shapes alone and learn nothing (but for f's threads,
        seen on an eager call: then refused; and where forward mode fell back, on any
        call: then reverse mode)."""
        if not flat.readable:
            facts = self._records.facts
            return None, Record(threads=facts.threads, forward_lost=facts.forward_lost)
        others = [arg for a, arg in enumerate(flat.args) if a not in flat.argnums]
        key = signature_key(
            flat.argnums, flat.in_defs, flat.leaves, _tree.flatten(others) if others else ()
        )
        if self._records.hooks.changed():  # a hook registered since: watched again
            self._records.rewatch()
        return key, self._records.get(key)

    def _learn(self, key: Any, record: Record, seen: Observations) -> Record:
        if key is None:
            if seen.forward_failed:  # (remembered for the function: see _record)
                self._records.lose_forward()
            return learn(record, seen)
        return self._records.learn(key, record, seen)

    @contextlib.contextmanager
    def _refused(
        self, key: Any, record: Record, flat: FlatFunction, forward: bool
    ) -> Iterator[None]:
        """A call refused where f wrote into its input and had to run again: the next
        calls of the signature run f once, in reverse mode on eager autograd (as after
        torch.func or forward mode refused f), where it is never run again."""
        try:
            yield
        except InputWrittenError:
            seen = Observations(mutates=True, random=flat.drew, forward_failed=forward)
            self._learn(key, record, seen)
            raise

    def _fit(self, flat: FlatFunction, record: Record) -> _engine.ChunkFit | None:
        """chunk_size="auto": a working copy of the signature's fit (what the call measures
        goes back through its observations); a bad budget string is refused here."""
        if self.chunk_size != "auto" or not flat.readable:
            return None
        _memory.setting()
        return _engine.ChunkFit() if record.fit is None else dataclasses.replace(record.fit)

    def _request(
        self,
        flat: FlatFunction,
        record: Record,
        fit: Any,
        weighted: bool = False,
        check: CheckMode | None = None,
    ) -> Request:
        """What this call asks :func:`decide` (``check``: resolved already, else here)."""
        fitted = fit.chunk() if fit is not None and fit.measured else None
        if check is None:
            check = self.resolved_check()
        return Request(
            self.strategy,
            self.k,
            flat.n,
            record.m,
            self.chunk_size,
            fitted,
            fit is not None and fit.paired,
            weighted,
            eager=flat.readable,
            graph=torch.is_grad_enabled(),
            hooked=flat.hooked,
            check=bool(check),
            call=self.call,
            engine=self.engine,
        )

    def plan(self, flat: FlatFunction, weighted: bool = False) -> Plan:
        """The plan that a call on these arguments runs (in the grad mode the call runs in:
        see `result_graph`), with y's size from f on fake tensors, else one real forward
        that leaves no trace (:mod:`funcgrad._shape`), remembered for the calls."""
        key, record = self._record(flat)
        if record.m is None:
            m = None if record.shape_tried else _shape.output_size(flat)
            drew = flat.drew
            if m is None:
                m = _shape.forward_size(flat)
            record = self._learn(key, record, Observations(m=m, random=drew, shape_tried=True))
        fit = self._fit(flat, record)
        plan = decide(self._request(flat, record, fit, weighted), record)
        if not weighted and fit is not None and self._measure_fit(flat, plan, fit):
            record = self._learn(key, record, Observations(fit=fit))
            plan = decide(self._request(flat, record, fit, weighted), record)
        return plan

    def per_head(
        self, flat: FlatFunction, check: CheckMode
    ) -> tuple[torch.Tensor, Tensors, Tensors]:
        """(values (k,), per-head gradient leaves (k, ...), aux tensors): record, decide,
        execute, learn."""
        key, record = self._record(flat)
        fit = self._fit(flat, record)
        # A steady call (a final plan that the record holds, see below) asks decide nothing.
        mode = torch.is_grad_enabled(), check
        held = record.steady.get(mode) if key is not None and fit is None else None
        request = None
        if held is not None:
            plan = held[0]
        else:
            request = self._request(flat, record, fit, check=check)
            plan = decide(request, record)
        ran: list[Plan] = []

        def replan(m: int, hooked: bool) -> Plan:  # y's size known: f ran (no forward mode)
            if held is not None and m == held[1].m and not (hooked or flat.custom):
                ran.append(held[1])
            else:
                asked = request or self._request(flat, record, fit, check=check)
                ran.append(decide(after_f(asked, m, hooked, flat.custom), record))
            return ran[-1]

        flat.drew = record.random  # (known: forward mode's batched JVP would draw otherwise)
        heads = self.cotangents_of(flat), self.values_of(flat)
        # (an explicit jacfwd stays forward mode, refused on every such call)
        forward = plan.strategy == "jacfwd" and self.strategy == "auto"
        with self._refused(key, record, flat, forward=forward):
            result = execute(plan, flat, replan, *heads, check, fit)
        if held is None or result.seen != held[2] or not self._records.is_last(key):
            learnt = self._learn(key, record, result.seen)
            # Final, and it taught the record nothing: the next call with the same record
            # (and grad mode, check) runs these plans, and learns nothing if it sees the same.
            steady = plan.final and not (plan.timed or plan.watch or plan.measure)
            if learnt is record and key is not None and fit is None and steady and len(ran) == 1:
                record.steady[mode] = plan, ran[0], result.seen
        return result.values, result.grads, result.aux

    def one_pullback(self, flat: FlatFunction) -> Linearization:
        """f's linearisation for one pullback of ``w @ V`` (combine_heads), on the engine
        the plan names: eager autograd where no graph of the results is wanted."""
        key, record = self._record(flat)
        plan = decide(self._request(flat, record, None, weighted=True), record)
        flat.watch = plan.watch
        rng = None if plan.engine == "autograd" else RandomState(flat)
        with self._refused(key, record, flat, forward=False):
            lin = _linearize.of_function(flat, rng, plan.engine)
        seen = observed(flat, plan, lin.engine, m=_coords.real_size(lin.out), compiled=lin.compiled)
        self._learn(key, record, seen)
        return lin

    def _measure_fit(self, flat: FlatFunction, plan: Plan, fit: _engine.ChunkFit) -> bool:
        """For plan(): measure the chunk as the call would (f's pullback of direction 0
        alone, then where they fit of directions 1-2 and 3-5), so that the plan reports the
        passes the call runs. f runs once more, its random draws replayed (the generators end
        where they were). False where that cannot be done without side effects (torch.func
        refuses f): the call measures then."""
        if plan.chunk_size != "auto" or plan.strategy not in ("vjp", "jacrev"):
            return False
        if plan.directions <= 1:
            return False
        rng = RandomState(flat, inputs=False)
        # (on copies of the differentiated leaves: an f that writes into them writes the copies)
        leaves = [leaf.detach().clone() for leaf in flat.leaves]
        try:
            with torch.enable_grad():  # as of_function runs it
                out, pull = torch.func.vjp(flat, *leaves, has_aux=flat.has_aux)[:2]
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

            _engine.measure_fit(fit, run, out[0].device, plan.directions)
        except Exception:  # any failure only means the call measures instead
            return False
        finally:
            rng.restore()
        return True

    def cotangents_of(self, flat: FlatFunction) -> _engine.CotangentsOf:
        return lambda out: _head_cotangents(self.heads, self.keys, flat, out, self.call)

    def values_of(self, flat: FlatFunction) -> _engine.ValuesOf:
        """The heads' values on f's output, on its autograd graph: list heads one by one,
        stacked heads in one vmap."""
        heads, call = self.heads, self.call
        if isinstance(heads, StackedHeads):
            return lambda out: _stacked_values(heads, flat.out_def, flat.out_bare, out, call)
        return lambda out: _head_values(heads, self.keys, flat.out_def, out, call)

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
        tell y's shape (data-dependent Python in f, more than 50 ops), one real forward
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
            # (a copy: the plans decide memoises are shared with the calls)
            return dataclasses.replace(composition.plan(flat))

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


# The keyword arguments of compose_heads' overloads besides has_aux (one list: the
# implementation's signature below names each of them with its default).
class _Options(TypedDict, total=False):
    argnums: int | tuple[int, ...]
    strategy: Strategy
    chunk_size: ChunkSize
    check: CheckMode | None
    create_graph: bool


# The return types by the kind of heads (a mapping or a ModuleDict gives dicts keyed like
# it; a sequence, a ModuleList or stacked_heads a (k,) tensor of values) and by has_aux.
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Mapping[K, Callable[[Any], torch.Tensor]],
    *,
    has_aux: Literal[False] = False,
    **options: Unpack[_Options],
) -> ComposedHeads[tuple[dict[K, torch.Tensor], dict[K, Any]]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Mapping[K, Callable[[Any], torch.Tensor]],
    *,
    has_aux: Literal[True],
    **options: Unpack[_Options],
) -> ComposedHeads[tuple[dict[K, torch.Tensor], dict[K, Any], Any]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]] | torch.nn.ModuleList | StackedHeads,
    *,
    has_aux: Literal[False] = False,
    **options: Unpack[_Options],
) -> ComposedHeads[tuple[torch.Tensor, Any]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: Sequence[Callable[[Any], torch.Tensor]] | torch.nn.ModuleList | StackedHeads,
    *,
    has_aux: Literal[True],
    **options: Unpack[_Options],
) -> ComposedHeads[tuple[torch.Tensor, Any, Any]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: torch.nn.ModuleDict,
    *,
    has_aux: Literal[False] = False,
    **options: Unpack[_Options],
) -> ComposedHeads[tuple[dict[str, torch.Tensor], dict[str, Any]]]: ...
@overload
def compose_heads(
    f: Callable[..., Any],
    heads: torch.nn.ModuleDict,
    *,
    has_aux: Literal[True],
    **options: Unpack[_Options],
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
        times: once, on every call (``"auto"`` times its candidates on separate calls),
        plus ``check``'s unbatched JVP calls in forward mode, and once more
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
