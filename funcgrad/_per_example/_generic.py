"""The generic rule: any other module with parameters, its per-example gradients from a
functional call of the module alone (vmap, or a loop); and the recurrent modules."""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from .._errors import describe
from .._function import _C_TYPES, _OWN, eager_function
from .._graph import _parents, nodes, walk
from .._types import Tensors
from ._layer import _add, _Layer
from ._record import _hook_name, _keys, _Use


class _Generic(_Layer):
    """Any other module with parameters: its per-example gradients, by torch.func.vmap over
    a functional call of the module alone along each example's output gradient (a loop of
    unbatched calls where vmap cannot), kept for the update."""

    grads: dict[str, torch.Tensor] | None = None

    def precheck(self) -> None:
        super().precheck()
        if any(len(use.edges) > 1 for use in self.uses):
            recorded = {
                key for top in self.run.recorder._uses for u in top.walk() for key in _keys(u)
            }
            for use in self.uses:
                self.refuse_dependent_outputs(use, recorded)

    def refuse_dependent_outputs(self, use: _Use, recorded: set[Any]) -> None:
        """Refused: an output computed from another of the call's outputs inside the forward
        (``return h, h @ V``; nn.LSTMCell on the CPU, whose h is made from its c), or the same
        tensor twice. The one backward gives that other output's gradient with the first
        one's share already in it, and the functional call would add that share again: G and
        the update off, silently (by 0.1-3 of G's norm). An input passed through is none."""
        if len(use.edges) < 2:
            return
        inputs = {(e.node, e.output_nr): i for i, e in enumerate(use.upstream)}
        targets: dict[Any, int] = {}
        for k, e in enumerate(use.edges):
            key = (e.node, e.output_nr)
            if key in targets:
                self.dependent(use, targets[key], k, "is the same tensor as")
            if key not in inputs:
                targets[key] = k
        # (stopping too at other recorded calls' outputs, which this call cannot lie below:
        # a module reading an earlier activation through an attribute is not walked past it)
        mine = {key for inner in use.walk() for key in _keys(inner)}
        stop = dict.fromkeys(recorded - mine, -1) | inputs
        own = {id(p) for p in self.params.values()}

        @functools.cache
        def reads_own(source: int) -> bool:  # counted twice: the parameters it reads
            leaves: dict[Any, torch.Tensor] = {}
            edge = use.edges[source]
            walk([(edge.node, edge.output_nr)], {}, stop, leaves)
            return any(id(t) in own for t in leaves.values())

        for k, e in enumerate(use.edges):
            found, _ = walk(_parents((e.node, e.output_nr)), targets, stop)
            for source in sorted(found):
                if reads_own(source):
                    self.dependent(use, source, k, "is computed from")

    def dependent(self, use: _Use, source: int, k: int, how: str) -> None:
        first, second = use.outputs[source][0], use.outputs[k][0]
        raise ValueError(
            f"{self.run.call}: module {self.name!r} ({type(self.module).__name__}) returns "
            f"outputs that depend on one another: its output {second} {how} its output "
            f"{first} (flat positions) inside its forward. The one backward gives output "
            f"{first}'s gradient with output {second}'s share already in it, and the "
            "per-example gradients from a functional call of the module would count that "
            "share twice. Nothing was written. Return only outputs that are not computed "
            "from one another (compute the dependent one outside the module, or in a module "
            "of its own; for nn.LSTMCell on the CPU, use nn.LSTM with batch_first=True), or "
            "leave its parameters out with inputs=."
        )

    def per_example(self) -> dict[str, torch.Tensor]:
        if self.grads is not None:
            return self.grads
        found: dict[str, torch.Tensor] = {}
        try:
            with _RefuseTensorHooks(self), _buffers_kept(self.module):
                for use in self.uses:
                    for key, g in self.one_use(use).items():
                        _add(found, key, g)
        except _PreHookChangesInput as error:  # from the loop, where vmap's was caught
            raise ValueError(
                f"{self.run.call}: module {self.name!r} ({type(self.module).__name__}) {error}"
            ) from None
        self.grads = found
        return found

    def one_use(self, use: _Use) -> dict[str, torch.Tensor]:
        bags = use.args[0] if use.args else use.kwargs.get("input")
        # (1-D: its bags lie along one flat list of indices, cut by `offsets`)
        if (
            isinstance(self.module, nn.EmbeddingBag)
            and isinstance(bags, torch.Tensor)
            and bags.ndim == 1
        ):
            self.fail(
                "takes a 1-D input with offsets (the bags lie along one flat list of "
                "indices, not along dim 0; pass them as a 2-D (B, bag size) input, "
                "padded with padding_idx): its input is",
                describe(bags),
            )
        leaves, spec, dims = self.leaf_dims(use)
        batched = [i for i, dim in enumerate(dims) if dim == 0]
        if not batched:
            self.fail("has no input batched along dim 0; its inputs are", describe(leaves))
        deltas = [self.delta(use, i) for i in range(len(use.outputs))]
        positions = [i for i, _, _ in use.outputs]
        module, params = self.module, dict(self.params)

        def one(values: list[torch.Tensor], cotangents: list[torch.Tensor]) -> Any:
            def call(p: dict[str, torch.Tensor]) -> Tensors:
                filled = list(leaves)
                for i, v in zip(batched, values):
                    filled[i] = v.unsqueeze(0)
                args, kwargs = _pytree.tree_unflatten(filled, spec)
                flat, _ = _pytree.tree_flatten(_bare_call(module, p, args, kwargs))
                return tuple(flat[i] for i in positions)

            pull = torch.func.vjp(call, params)[1]
            return pull(tuple(c.unsqueeze(0) for c in cotangents))[0]

        values = [leaves[i] for i in batched]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                grads = torch.func.vmap(one)(values, deltas)
            slow = [w for w in caught if "performance drop" in str(w.message)]
            for other in caught:  # the rest as they would have been
                if other not in slow:
                    warnings.warn_explicit(
                        other.message, other.category, other.filename, other.lineno
                    )
            self.rule = "materialised, vmap" + (" (torch's per-example fallback)" if slow else "")
        except Exception as error:  # vmap cannot run it: a loop, or the module's own error
            if "random" in str(error):
                raise ValueError(
                    f"{self.run.call}: module {self.name!r} ({type(module).__name__}) draws "
                    "random numbers in its forward (dropout?): its per-example gradients, "
                    "computed from a second call of it, would need the same draws. Set its "
                    "dropout to 0, or call .eval() on it."
                ) from error
            self.rule = "materialised, loop"
            return self.loop(use)
        return dict(grads)

    def loop(self, use: _Use) -> dict[str, torch.Tensor]:
        rows = []
        for b in range(self.batch):
            with _buffers_kept(self.module):  # each example's call sees the same buffers
                rows.append(self.eager(use, b))
        return {k: torch.stack([r[k] for r in rows]) for k in self.params}

    def eager(self, use: _Use, b: int) -> dict[str, torch.Tensor]:
        """Example b's gradients by plain autograd on a call of the module on that example
        (no torch.func: also for what its transforms refuse, e.g. an autograd.Function
        without setup_context)."""
        leaves, spec, dims = self.leaf_dims(use)
        leaves = [x if dim is None else x.narrow(dim, b, 1) for x, dim in zip(leaves, dims)]
        args, kwargs = _pytree.tree_unflatten(leaves, spec)
        with torch.enable_grad():
            flat = _pytree.tree_leaves(_bare_call(self.module, None, args, kwargs))
            outs = [flat[i] for i, _, _ in use.outputs]
            cotangents = [
                self.delta(use, k).narrow(self.out_dim(use, k), b, 1) for k in range(len(outs))
            ]
            params = list(self.params.values())
            grads = torch.autograd.grad(outs, params, cotangents, allow_unused=True)
        return {
            k: torch.zeros_like(p) if g is None else g
            for (k, p), g in zip(self.params.items(), grads)
        }

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            k: torch.tensordot(weights.to(g.dtype), g, dims=1)
            for k, g in self.per_example().items()
        }


class _Recurrent(_Generic):
    """nn.RNN / nn.GRU / nn.LSTM with batch_first=True: the generic rule, with h_0 and
    h_n / c_n batched along dim 1 ((layers, B, H)). torch.func cannot vmap them, so a loop
    of plain autograd calls of ``forward`` alone on one example each (B calls)."""

    def out_dim(self, use: _Use, k: int) -> int:
        """The batch dim of recorded output k: the output (B, T, H) at 0, h_n / c_n at 1."""
        return 0 if use.outputs[k][0] == 0 else 1

    def leaf_dims(self, use: _Use) -> tuple[list[Any], Any, list[int | None]]:
        """The flat arguments, their spec and each one's batch dim (None: not batched):
        the input at 0, h_0 / c_0 at 1."""
        leaves, spec = _pytree.tree_flatten((use.args, use.kwargs))
        x = use.args[0] if use.args else use.kwargs.get("input")
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            self.fail(
                "has an input that",
                f"is {describe(x)} (per-example gradients need a (B, T, H) tensor: no "
                "unbatched input, no PackedSequence)",
            )
        dims = [
            (0 if leaf is x else 1) if isinstance(leaf, torch.Tensor) else None for leaf in leaves
        ]
        for leaf, dim in zip(leaves, dims):
            if dim is not None and leaf.shape[dim] != self.batch:
                self.fail("has an input that", f"has shape {tuple(leaf.shape)}")
        return leaves, spec, dims

    def precheck(self) -> None:
        module = self.module
        assert isinstance(module, nn.RNNBase)
        if module.training and module.dropout > 0 and module.num_layers > 1:
            # on every call, checked or not: the loop replays forward on each example alone,
            # whose dropout masks between the layers would be fresh draws, not the forward's
            raise ValueError(
                f"{self.run.call}: module {self.name!r} ({type(module).__name__}) has "
                f"dropout={module.dropout} between its {module.num_layers} layers and is in "
                "training mode: its per-example gradients come from a second call of its "
                "forward on each example alone, whose dropout masks would be new draws, not "
                "those of the forward (torch's RNNs take no mask). Nothing was written. Call "
                ".eval() on it, build it with dropout=0 (and apply nn.Dropout to its output "
                "instead), or leave its parameters out with inputs=."
            )
        self.check_layout()
        for use in self.uses:
            for k, (_, shape, _) in enumerate(use.outputs):
                dim = self.out_dim(use, k)
                if len(shape) <= dim or shape[dim] != self.batch:
                    self.fail("has an output that", f"has shape {tuple(shape)}")
            self.leaf_dims(use)

    def one_use(self, use: _Use) -> dict[str, torch.Tensor]:
        self.rule = "materialised, loop (recurrent)"
        return self.loop(use)


class _RefuseTensorHooks(torch.overrides.TorchFunctionMode):
    """Around the second call of a module's forward (the generic rule): a tensor hook that
    forward registers fired in the one backward already, and would fire again there (on
    per-example gradients, under vmap), which torch's backward never does."""

    def __init__(self, layer: _Layer) -> None:
        super().__init__()
        self.layer = layer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if type(func) not in _C_TYPES and id(func) not in _OWN:  # (a replaced torch function)
            func = eager_function(func, sys._getframe(1), args, kwargs)
        if func is torch.Tensor.register_hook:
            layer = self.layer
            raise ValueError(
                f"{layer.run.call}: module {layer.name!r} ({type(layer.module).__name__}) "
                "registers a tensor hook inside its forward. Its per-example gradients come "
                "from a second call of that forward alone, where the hook would fire again "
                "(on per-example gradients), not once as in torch's backward. Nothing was "
                "written. Register the hook on the module's output instead (hooks between "
                "modules are honoured), or leave its parameters out with inputs=."
            )
        if _batch_counts(func, args, kwargs or {}):
            layer = self.layer
            raise ValueError(
                f"{layer.run.call}: module {layer.name!r} ({type(layer.module).__name__}) "
                f"calls {func.__name__} with scale_grad_by_freq=True or sparse=True: its "
                "gradient is scaled by counts over the whole batch (or sparse), which "
                "per-example gradients do not sum to. Nothing was written. Call it without "
                "those options, or leave its parameters out with inputs=."
            )
        return func(*args, **(kwargs or {}))


# where an embedding lookup's scale_grad_by_freq and sparse are, by position
_COUNTED: dict[Any, tuple[int, int]] = {
    torch.nn.functional.embedding: (5, 6),
    torch.nn.functional.embedding_bag: (5, 7),
    torch.embedding: (3, 4),
    torch.embedding_bag: (3, 5),
}


def _batch_counts(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` is an embedding lookup with ``scale_grad_by_freq`` or ``sparse``."""
    try:
        where = _COUNTED.get(func)
    except TypeError:  # (a user's unhashable callable)
        return False
    if where is None:
        return False
    found = [
        kwargs.get(name, args[i] if len(args) > i else False)
        for name, i in zip(("scale_grad_by_freq", "sparse"), where)
    ]
    return any(bool(x) for x in found)


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """The buffers of ``module``'s tree as they were before, after the block: a forward
    that updates one (running statistics, a counter: in place, or by assigning a new
    tensor) updates it in the user's own forward only, not once more per example in the
    rule's calls of it (the loop calls the module itself). So are its modules' plain
    attributes (a call counter, a cached tensor, a list it appends to: as after one
    forward, as Opacus and ``vmap(grad)`` leave them): each rebound one is bound back, one
    added is removed, and a list, dict, set or deque (or a subclass: OrderedDict,
    defaultdict, Counter) changed in place gets its items back, in order. Not restored:
    a plain tensor attribute (not a buffer) written in place (``self.acc += 1``), what is
    changed deeper (an object's own attributes, a list inside a dict), ``__slots__``,
    class-level and global state (a property writing to the class, a module-level list)."""
    saved = [
        (m, name, b, b._version, b.detach().clone())
        for m in module.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]
    plain = [(m, _plain_state(m)) for m in module.modules()]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, b, version, value in saved:
                m._buffers[name] = b
                if b._version != version:  # written: back (else untouched, its version too)
                    b.copy_(value)
        for m, state in plain:
            _restore_plain(m, state)


# nn.Module's own attributes (its dicts of parameters, buffers, submodules and hooks, its flags)
_MODULE_OWN = frozenset(nn.Module().__dict__)


# containers refilled in place: list, dict, set, deque and their subclasses (OrderedDict,
# defaultdict, Counter: through their own clear and extend/update, which refill exactly)
_REFILLED = (list, dict, set, collections.deque)


def _plain_state(m: nn.Module) -> dict[str, tuple[Any, Any]]:
    """``m``'s plain attributes: name -> (value, its items where it is a list, dict, set or
    deque, or a subclass of one: a list, the dict's (key, value) pairs in order, a set)."""
    return {k: (v, _items(v)) for k, v in m.__dict__.items() if k not in _MODULE_OWN}


def _items(v: Any) -> Any:
    if not isinstance(v, _REFILLED):
        return None
    if isinstance(v, dict):
        return list(v.items())
    return set(v) if isinstance(v, set) else list(v)


def _restore_plain(m: nn.Module, state: dict[str, tuple[Any, Any]]) -> None:
    """``m``'s plain attributes back to ``state`` (see :func:`_plain_state`)."""
    attrs = m.__dict__
    for k in [k for k in attrs if k not in _MODULE_OWN and k not in state]:
        del attrs[k]
    for k, (value, items) in state.items():
        attrs[k] = value
        if items is not None and _changed(value, items):
            value.clear()
            if isinstance(value, (list, collections.deque)):
                value.extend(items)
            else:  # (a mapping: Counter.update of (key, value) pairs would count the pairs)
                value.update(dict(items) if isinstance(value, dict) else items)


def _changed(now: Any, before: Any) -> bool:
    """Whether a list, dict, set or deque holds other items than ``before`` (see
    :func:`_items`), by identity (an item's ``==`` may be a tensor's), in order but for a
    set."""
    if len(now) != len(before):
        return True
    if isinstance(now, dict):
        return any(k is not k0 or v is not v0 for (k, v), (k0, v0) in zip(now.items(), before))
    if isinstance(now, set):
        return bool(now != before)  # (by hash, then identity first)
    return any(a is not b for a, b in zip(now, before))


def _bare_call(module: nn.Module, params: dict[str, Any] | None, args: Any, kwargs: Any) -> Any:
    """``forward`` after the module's forward pre-hooks, with ``params`` (if any) in place
    of its parameters, as torch.func.functional_call, but not through ``module(...)``: the
    recorded input already holds what the pre-hooks changed, and the recorded output
    gradients what its forward hooks and backward hooks did. The pre-hooks run again for
    what they set from the parameters (torch.nn.utils.weight_norm computes ``weight``
    there); one that returns a new input is refused (its change, made again from the
    recorded input, would count twice).

    ``params`` go into a private copy of the module's tree (`_private_tree`), never into
    the module itself: another thread (its forward, its per-example call, its
    ``model.parameters()``) never sees them. A forward that reaches one of the replaced
    tensors other than through the copy's attributes (a module kept in a plain list, a
    method bound to the module), or a tensor made from one before the call and kept in a
    plain attribute of the tree (a cache, a view: `_made_from`), raises `_ReadsOriginal`,
    as its use would be left out. One kept outside the tree (a global) is not seen."""
    if params is None:
        return _forward_after_pre_hooks(module, args, kwargs)
    private = _private_tree(module)
    # tie_weights as functional_call: a parameter under two names is replaced under both
    with (
        torch.nn.utils.stateless._reparametrize_module(private, params, tie_weights=True),
        _RefuseOriginals(module, params),
    ):
        return _forward_after_pre_hooks(private, args, kwargs)


def _private_tree(module: nn.Module) -> nn.Module:
    """``module`` and its submodules as new module objects with their own dicts of
    parameters, buffers and submodules (the same tensors, attributes and hooks): what a
    functional call swaps in them is seen by no one else. Shared submodules stay shared."""
    made: dict[int, nn.Module] = {}

    def copy(m: nn.Module) -> nn.Module:
        if id(m) not in made:
            new = made[id(m)] = object.__new__(type(m))
            new.__dict__.update(m.__dict__)
            new.__dict__["_parameters"] = m._parameters.copy()
            new.__dict__["_buffers"] = m._buffers.copy()
            new.__dict__["_modules"] = {
                k: None if c is None else copy(c) for k, c in m._modules.items()
            }
        return made[id(m)]

    return copy(module)


class _ReadsOriginal(RuntimeError):
    """A functional call's forward read a parameter of the module itself, not its copy's."""


class _RefuseOriginals(torch.overrides.TorchFunctionMode):
    """Around a functional call of `_private_tree`'s copy: an op on one of the module's own
    tensors that the call replaced means that the forward reached it other than through the
    copy's attributes, where the replacement is not seen (its use would be missing from
    the per-example gradients): raised, so that the rule takes its plain-autograd loop."""

    def __init__(self, module: nn.Module, params: dict[str, Any]) -> None:
        super().__init__()
        named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
        named.update(module.named_buffers(remove_duplicate=False))
        originals = [named[k] for k in params if k in named]
        # kept alive: ids stable; the originals, and the tensors made from them before the
        # call that the module's tree holds in plain attributes (a cache, a view)
        self.originals = originals + _made_from(module, originals)
        self.ids = {id(t) for t in self.originals}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if type(func) not in _C_TYPES and id(func) not in _OWN:  # (a replaced torch function)
            func = eager_function(func, sys._getframe(1), args, kwargs)
        kwargs = kwargs or {}
        for x in _pytree.tree_leaves((args, kwargs)):
            if id(x) in self.ids and any(x is t for t in self.originals):
                raise _ReadsOriginal(
                    f"its forward reads a parameter ({tuple(x.shape)}), or a tensor made from "
                    "one before the call, other than through its attributes"
                )
        return func(*args, **kwargs)


# the dicts of nn.Module's own state: the parameters, buffers, submodules and hooks
_MODULE_STATE = frozenset(
    ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training")
)
_WALK_LIMIT = 10_000  # autograd nodes looked at per attribute; beyond: taken as made from one


def _made_from(module: nn.Module, originals: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in plain attributes of ``module``'s tree (its modules' ``__dict__``,
    through lists, tuples and dicts) that require grad and were made from one of
    ``originals`` (a view of one, or a graph reaching one): a cache made by an earlier
    forward (``self._wt = self.weight.t()``) or a view made at init. A functional call's
    copy would read them as they are (the original parameter's values and graph, not the
    call's), so its gradient through them would be missing."""
    ids = {id(t) for t in originals}
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for m in module.modules():
        for key, value in m.__dict__.items():
            if key in _MODULE_STATE or key.endswith("hooks"):
                continue
            for x in _pytree.tree_leaves(value):
                if (
                    isinstance(x, torch.Tensor)
                    and x.requires_grad
                    and id(x) not in ids
                    and id(x) not in seen
                    and _reaches(x, ids)
                ):
                    seen.add(id(x))
                    found.append(x)
    return found


def _reaches(x: torch.Tensor, ids: set[int]) -> bool:
    """Whether ``x`` is a view of, or its graph reaches, a tensor whose id is in ``ids``
    (True also where the graph is too large to walk: then taken as made from one)."""
    base = x._base
    if base is not None and id(base) in ids:
        return True
    for count, node in enumerate(nodes([x.grad_fn])):
        if count >= _WALK_LIMIT:
            return True
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in ids:
            return True
    return False


def _forward_after_pre_hooks(module: nn.Module, args: Any, kwargs: Any) -> Any:
    hooks = [
        *nn.modules.module._global_forward_pre_hooks.items(),
        *module._forward_pre_hooks.items(),
    ]
    for key, hook in hooks:
        if key in module._forward_pre_hooks_with_kwargs:
            changed = hook(module, args, kwargs)
        else:
            changed = hook(module, args)
        if changed is not None:
            raise _PreHookChangesInput(
                f"has a forward pre-hook ({_hook_name(hook)}) "
                "that returns a new input. Its per-example gradients come from a second "
                "call of its forward on the recorded input, which holds that change already. "
                "Nothing was written. Change the input before the call (in the parent's "
                "forward), or leave the module's parameters out with inputs=."
            )
    return module.forward(*args, **kwargs)


class _PreHookChangesInput(ValueError):
    pass
