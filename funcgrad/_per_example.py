"""Per-example heads: the Gramian of the per-example gradients of a batch's losses, and the
weighted update, from ONE backward of ``losses.sum()`` (ghost products).

Loss b reads only example b, so one backward of the losses, along all ones, gives every
example's output gradient at every layer: row b of the layer's output gradient, ``Δ_b``.
With the layer's input rows ``A_b`` (recorded by a forward hook), the per-example gradient
of a Linear weight is ``Δ_bᵀ A_b``, so the Gramian is ``(A Aᵀ) ∘ (Δ Δᵀ)`` layer by layer and
the weighted update ``Aᵀ (w ⊙ Δ)``: one matmul, as a plain backward's weight gradient.

It reads top to bottom as its stages: record (module hooks, during the user's forward) ->
validate (the losses, the weighting, the recorded layers; before any pass) -> collect (the
one backward, to every recorded layer's output) -> layers (each layer's rule: its Gramian
block and its update) -> weigh -> apply (``.grad`` written in one place, at the end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import math
import re
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree

from . import _sync, _weighting
from ._config import CheckMode, resolve_check
from ._errors import describe
from ._types import Tensors
from ._validate import named_inputs, outside_transforms

_BACKWARD = "funcgrad.backward(losses, batch_dim=0)"
_GRAMIAN = "funcgrad.per_example_gramian(losses)"
_MARK = "funcgrad.per_example(model)"
# Bound on the elements of one transient block (ghost T x T products, unfolded inputs).
_BLOCK = 1 << 22


# -- record --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Use:
    """One call of a hooked module during a recorded forward."""

    module: nn.Module
    args: tuple[Any, ...]  # detached tensors (the storage autograd saves anyway)
    kwargs: dict[str, Any]
    edges: list[Any]  # gradient edges of the outputs that require grad, taken at the call
    outputs: list[tuple[int, torch.Size, torch.dtype]]  # (position in the flat output, ...)
    nested: list[_Use]  # uses of hooked modules inside this call
    upstream: list[Any]  # gradient edges of the inputs that require grad
    deltas: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    hooked: str | None = None  # a user hook that the rules cannot honour (see _foreign_hooks)
    # the tensor-hook dicts of the call's inputs and outputs (see _hook_dict)
    hook_dicts: list[Any] = dataclasses.field(default_factory=list)
    # (tensor, its version at the call): the inputs and the module's own parameters, which
    # the rules read at the call; one changed in place since then gives wrong rows
    versions: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)

    def walk(self) -> Iterator[_Use]:
        yield self
        for use in self.nested:
            yield from use.walk()


def _direct(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def _batch_statistics(module: nn.Module) -> bool:
    """Whether a BatchNorm normalises with the batch's statistics (training mode, or no
    running statistics): they mix the examples."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or not module.track_running_stats or module.running_mean is None
    )


def _refuse_batch_statistics(name: str, module: nn.Module, call: str) -> None:
    raise ValueError(
        f"{call}: module {name!r} ({type(module).__name__}) normalises with the batch's "
        "statistics (training mode, or track_running_stats=False), which mix the examples: "
        "loss b then depends on every example, and there are no per-example gradients. "
        "Call model.eval() on it (running statistics), or replace it by GroupNorm / "
        "LayerNorm / InstanceNorm."
    )


def _is_recorder_hook(hook: Any) -> bool:
    return getattr(hook, "__func__", None) is PerExample._post


def _is_observer(hook: Any) -> bool:
    """A recorder's hook, or torch's ModuleTracker's (FlopCounterMode's): they return None."""
    if _is_recorder_hook(hook):
        return True
    from torch.utils.module_tracker import ModuleTracker

    return isinstance(getattr(hook, "__self__", None), ModuleTracker)


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


def _foreign_hooks(module: nn.Module, recorder: PerExample) -> str | None:
    """The user hooks of ``module`` that the rules cannot honour, described, or None.

    The rules differentiate ``forward`` itself, from the recorded input (what forward got,
    after any forward pre-hook) to the recorded output (what forward returned) along the
    output gradients (after any full backward pre-hook). So pre-hooks, module forward hooks
    that run after ours and full backward hooks are exact. Not so a forward hook that runs
    before ours (a global one, or one registered later with prepend=True: the output we see
    may be its rescaled one) nor a non-full backward hook (it rewrites the gradients that
    the node of the output computes, parameters' included)."""
    before = list(nn.modules.module._global_forward_hooks.values())
    for hook in module._forward_hooks.values():
        if _is_recorder_hook(hook) and getattr(hook, "__self__", None) is recorder:
            break
        before.append(hook)
    before = [h for h in before if not _is_observer(h)]
    if before:
        return (
            f"a forward hook that runs before funcgrad's ({_hook_name(before[0])}: a global "
            "one, torch.nn.modules.module.register_module_forward_hook, or one registered "
            "with prepend=True after funcgrad.per_example), which may change the output that "
            "the rules differentiate"
        )
    if module._backward_hooks or nn.modules.module._global_backward_hooks:
        _, non_full = module._get_backward_hooks()
        if non_full:
            return (
                f"a non-full backward hook ({_hook_name(non_full[0])}, register_backward_hook), "
                "which rewrites the gradients of its output's node, the parameters' included"
            )
    return None


class PerExample:
    """The modules of ``model`` hooked to record each layer's input during the forward, so
    that per-example Gramians and weighted updates cost about one backward.

    Made by `funcgrad.per_example`; see there. Hooks stay until `remove` (or
    the end of a ``with`` block; a block's end is final: make a new one for the next).
    Each call of `gramian` or `backward` (without ``retain_graph``) consumes what its
    forward recorded and drops the records of older forwards that no call used; those of
    later forwards stay for their own calls. A call on losses whose records are gone says
    why. Nothing is recorded while grad is disabled.
    """

    def __init__(self, model: nn.Module, *, batch_dim: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_MARK}: `model` must be an nn.Module, got {describe(model)}.")
        if batch_dim != 0 or isinstance(batch_dim, bool):
            raise ValueError(
                f"{_MARK}: `batch_dim` must be 0 (every hooked module's inputs and outputs "
                f"batched along their first dimension), got {batch_dim!r}. For batch_first="
                "False transformers or RNNs, build them with batch_first=True."
            )
        if isinstance(model, nn.parallel.DistributedDataParallel) or any(
            type(p).__name__ == "DTensor" for p in model.parameters()
        ):
            raise ValueError(_distributed_refusal(_MARK))
        self.model = model
        self.batch_dim = batch_dim
        self.plan: PerExamplePlan | None = None
        self._independent: set[tuple[Any, ...]] = set()  # signatures checked independent
        self._names = {module: name or "<model>" for name, module in model.named_modules()}
        for name, module in model.named_modules():
            if _batch_statistics(module):
                _refuse_batch_statistics(name or "<model>", module, _MARK)
            if torch.nn.utils.parametrize.is_parametrized(module):
                raise ValueError(
                    f"{_MARK}: module {name or '<model>'!r} ({type(module).__name__}) has "
                    "parametrized tensors (torch.nn.utils.parametrize: parametrizations."
                    "weight_norm, spectral_norm, orthogonal, register_parametrization), whose "
                    "per-example gradients would go through the parametrization, which "
                    "funcgrad's rules do not do. Nothing was hooked. Use "
                    "torch.nn.utils.weight_norm (supported), remove the parametrization "
                    "(parametrize.remove_parametrizations), or leave the module out of the "
                    "model given to per_example."
                )
        self._uses: list[_Use] = []
        self._frames: list[tuple[nn.Module, list[_Use]]] = []
        self._recording = True
        self._removed = False
        self._handles = []
        self._direct = {module: tuple(_direct(module)) for module in model.modules()}
        self._batchnorms = {
            m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
        }
        # A module with children gets a frame (its pre-hook) that collects the calls nested
        # in it; a leaf module needs only its forward hook.
        self._parents = {m for m in model.modules() if next(m.children(), None) is not None}
        for module, params in self._direct.items():
            if (params and module in self._parents) or module in self._batchnorms:
                self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            if params:
                # First of the module's forward hooks, so that it sees the output of forward
                # itself (what the rules differentiate), before any user hook rescales it; and
                # called when forward raises, so that the call's frame is closed.
                self._handles.append(
                    module.register_forward_hook(
                        self._post, with_kwargs=True, prepend=True, always_call=True
                    )
                )
        _RECORDERS.add(self)

    # Hooks ---------------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self._recording:
            return
        if module in self._batchnorms and _batch_statistics(module):  # before its forward
            _refuse_batch_statistics(self._names[module], module, "funcgrad.per_example")
        if module in self._parents and self._direct[module]:
            self._frames.append((module, []))

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._recording:
            return
        nested: list[_Use] = []
        if module in self._parents:
            frame = self._frames.pop() if self._frames else (module, [])
            while frame[0] is not module and self._frames:  # a call that raised left its frame
                frame = self._frames.pop()
            nested = frame[1] if frame[0] is module else []
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in self._direct[module]):
            return
        flat = [output] if isinstance(output, torch.Tensor) else _pytree.tree_leaves(output)
        if not outside_transforms([x for x in flat if isinstance(x, torch.Tensor)]):
            return  # a call inside torch.func transforms: not a per-example forward
        outputs, edges = [], []
        for i, out in enumerate(flat):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                outputs.append((i, out.shape, out.dtype))
                edges.append(get_gradient_edge(out))
        if not edges:
            return
        if kwargs or not all(isinstance(x, torch.Tensor) for x in args):
            leaves, spec = _pytree.tree_flatten((tuple(args), dict(kwargs)))
        else:  # the common case: tensors only
            leaves, spec = list(args), None
        upstream = [
            get_gradient_edge(x) for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        leaves_before = leaves
        leaves = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
        saved_args, saved_kwargs = (
            (tuple(leaves), {}) if spec is None else _pytree.tree_unflatten(leaves, spec)
        )
        use = _Use(module, saved_args, saved_kwargs, edges, outputs, nested, upstream)
        use.hooked = _foreign_hooks(module, self)
        use.versions = [
            (x, x._version)
            for x in (*leaves, *self._direct[module])
            if isinstance(x, torch.Tensor) and not x.is_inference()
        ]
        for x in (*flat, *leaves_before):
            if isinstance(x, torch.Tensor) and x.requires_grad and x.grad_fn is not None:
                use.hook_dicts.append(_hook_dict(x))
        (self._frames[-1][1] if self._frames else self._uses).append(use)

    # Public --------------------------------------------------------------------------

    def gramian(
        self,
        losses: torch.Tensor,
        *,
        inputs: Any = None,
        retain_graph: bool = False,
        check: CheckMode | None = None,
    ) -> torch.Tensor:
        """The (B, B) Gramian ``G[b, b'] = <grad_b, grad_b'>`` of the per-example gradients
        of the selected parameters; no ``.grad`` is written. See
        `funcgrad.per_example_gramian`."""
        run = _Run(self, losses, inputs, None, _GRAMIAN, check)
        return run.execute(retain_graph, write=False)[0]

    def backward(
        self,
        losses: torch.Tensor,
        *,
        weighting: Any = None,
        inputs: Any = None,
        retain_graph: bool = False,
        check: CheckMode | None = None,
    ) -> torch.Tensor:
        """``.grad += sum_b w_b grad_b`` with ``w = weighting(G)``; returns ``w``. See
        `funcgrad.per_example`."""
        run = _Run(self, losses, inputs, weighting, _BACKWARD, check)
        return run.execute(retain_graph, write=True)[1]

    def clear(self) -> None:
        """Drop what the forwards recorded (no call consumed it)."""
        self._drop("cleared")

    def _drop(self, why: str, keep: int = 0) -> None:
        """Drop the records but the last ``keep`` top-level calls, marking the graph nodes of
        the dropped ones with ``why`` (for the message of a later call on their losses)."""
        kept = self._uses[len(self._uses) - keep :] if keep else []
        for top in self._uses[: len(self._uses) - len(kept)]:
            for use in top.walk():
                for edge in use.edges:
                    _mark(edge.node, why)
        self._uses = kept
        if not kept:
            self._frames = []

    def _consume(self, done: list[_Use] | None) -> None:
        """After a call without retain_graph: drop the records of the forward it consumed
        (``done``) and of older forwards that no call consumed, and keep those of later
        forwards (their losses may come next, as with two forwards, then two calls). A call
        that failed (``done`` None) drops every record."""
        if done is None:
            self._drop("failed")
            return
        ids = {id(use) for use in done}
        last = max((i for i, top in enumerate(self._uses) if id(top) in ids), default=-1)
        for top in self._uses[: last + 1]:
            if id(top) in ids:
                for use in top.walk():
                    for edge in use.edges:
                        _mark(edge.node, "consumed")
        self._drop("dropped", keep=len(self._uses) - last - 1)

    def remove(self) -> None:
        """Remove the hooks and the records."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._drop("removed")
        self._removed = True
        _RECORDERS.discard(self)

    def __enter__(self) -> PerExample:
        if self._removed:
            raise RuntimeError(
                f"{_MARK}: this PerExample's hooks were removed (the end of its with block, or "
                "remove()), and a block does not put them back. Make a new one for each "
                "block (`with funcgrad.per_example(model) as pe:`), or keep one without "
                "`with` and call pe.remove() once at the end."
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"PerExample({type(self.model).__name__}, batch_dim={self.batch_dim})"


_RECORDERS: weakref.WeakSet[PerExample] = weakref.WeakSet()


def per_example(model: nn.Module, *, batch_dim: int = 0) -> PerExample:
    """Hook ``model`` for per-example heads: Jacobian descent over the examples of a batch
    (instance-wise risk minimisation), per-example gradient norms and similarities, at
    about the cost of one backward.

    Per-example losses ``losses = criterion(model(x), y)`` (``reduction="none"``, shape
    (B,)) are B heads on one expensive function. Their Gramian ``G[b, b'] = <grad_b,
    grad_b'>`` (gradients with respect to the parameters) comes from ONE backward of the
    losses, layer by layer: for a Linear layer with inputs A and output gradients Δ it is
    ``(A Aᵀ) ∘ (Δ Δᵀ)`` and the weighted update is ``Aᵀ (w ⊙ Δ)``. The hooks record each
    layer's input A during the forward, so the model must be hooked before it (as TorchJD's
    ``autogram.Engine(model, batch_dim=0)``).

    Args:
        model: the module whose parameters get per-example gradients. Every module of it
            with parameters is hooked; a module with parameters must take and return tensors
            batched along dim 0 and treat the examples independently (no BatchNorm in
            training mode: refused here and at its forward, before any backward).
        batch_dim: 0, the batch dimension of every module's inputs and outputs.

    Returns:
        A `PerExample`, also a context manager that removes the hooks at its end. Its
        ``backward(losses, weighting=..., inputs=...)`` writes ``.grad += w @ grads`` with
        ``w = weighting(G)`` and returns ``w`` (the same as
        ``funcgrad.backward(losses, batch_dim=0, ...)``); its ``gramian(losses)`` returns G
        without writing ``.grad`` (as `funcgrad.per_example_gramian`); ``print(pe.plan)``
        shows the rule each layer took in the last call.

    Examples:
        >>> import torch, funcgrad
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 1))
        >>> x, y = torch.randn(16, 3), torch.randn(16, 1)
        >>> with funcgrad.per_example(model) as pe:
        ...     losses = (model(x) - y).pow(2).squeeze(1)           # (16,): one per example
        ...     weights = pe.backward(losses, weighting=lambda g: 1 / g.diagonal().sqrt())
        >>> weights.shape, model[0].weight.grad.shape
        (torch.Size([16]), torch.Size([8, 3]))
        >>> print(pe.plan)  # doctest: +NORMALIZE_WHITESPACE
        per-example plan, B=16 (flops of the Gramian per layer: ghost / materialised)
          0  Linear  (16, 3)  ghost (A Aᵀ)∘(Δ Δᵀ)  ...
          2  Linear  (16, 8)  ghost (A Aᵀ)∘(Δ Δᵀ)  ...

    Notes:
        Cost: the forward, ONE backward of the losses to every layer's output (without the
        weight-gradient products), then per layer the Gramian block and the update
        ``Aᵀ (w ⊙ Δ)`` (one matmul). Rules, chosen per layer and input shape by flops:
        Linear on (B, d) inputs: ``(A Aᵀ)∘(Δ Δᵀ)``, B²(d+p); on (B, T, d): ghost
        ``<A_b A_b'ᵀ, Δ_b Δ_b'ᵀ>`` (B²T²(d+p)) or the materialised ``A_bᵀ Δ_b`` and their
        Gram (B·T·d·p + B²·d·p); Conv1d/Conv2d: the same with T the output positions (the
        ghost products on unfolded inputs, the per-example gradients as one convolution
        backward with the examples as groups); Embedding: the Gram of one-hot rows is index
        equality (or the per-example gradients on the rows used); LayerNorm/GroupNorm/
        BatchNorm (eval) affine
        parameters: their (B, C) per-example gradients; every other module with parameters
        (nn.MultiheadAttention, custom modules, Linear subclasses with their own forward):
        its per-example gradients materialised exactly by ``torch.func.vmap`` over a
        functional call of that module alone (a loop of plain autograd calls where torch.func
        cannot run it), never skipped. A
        parameter shared by several modules (tied weights) has its per-example gradients
        summed over its uses before their Gram, so the cross terms are exact; a module
        called twice is one layer with the calls' rows concatenated. A parameter that
        reaches the losses outside any hooked module's forward (``F.linear(h, emb.weight)``)
        is refused with a clear error, before the backward. ``model.eval()`` modules with
        dropout are fine; random draws inside a module with parameters are refused (its
        per-example gradients would need the same draws). No process group: the
        cross-rank blocks of G need every rank's per-layer A and Δ (see the README).
        User hooks act as in one backward of the losses: tensor hooks, module forward
        (pre-)hooks and full backward hooks are honoured; a forward hook that runs before
        funcgrad's (a global one, or ``prepend=True``), a non-full backward hook and a tensor
        hook registered inside a generic-rule module's forward are refused before anything
        is written. Modules with ``batch_first=False`` are refused; nn.RNN/GRU/LSTM with
        ``batch_first=True`` are exact (a loop over the examples).

        Independence: loss b must read each counted layer's output through row b alone
        (mixing the inputs before the first layer is fine). It is verified on the first
        call of each signature, and on every call under ``check=True`` or ``"strict"``: one
        more backward, of ``sum_b u_b * losses[b]``, must give each layer's output
        gradients as ``u_b`` times those of the plain one, row by row (along each output's
        batch dim), and materialised modules are run on single examples against their rows.
        The user hooks it finds (tensor hooks on the losses and on hooked modules' inputs
        and outputs, the model's module backward hooks) are held back in that backward, so
        they fire once per call; the comparison is then with one more hook-free backward.
        Hooks elsewhere run in the check's backwards too (see docs/per_example.md). A
        model that mixes the examples (``h - h.mean(0)``, a softmax or batch statistics
        over dim 0, a sort, a pairwise or InfoNCE loss, a time-major layer) is refused
        naming the module and the ops, before ``.grad`` is written. A hooked module that
        reads a counted parameter not its own in its forward (``h + F.linear(h,
        self.lin.weight)`` after ``self.lin(h)``) is refused on every call.
    """
    return PerExample(model, batch_dim=batch_dim)


def per_example_gramian(
    losses: torch.Tensor,
    *,
    inputs: Any = None,
    retain_graph: bool = False,
    check: CheckMode | None = None,
) -> torch.Tensor:
    """The (B, B) Gramian of the per-example gradients, ``G[b, b'] = <grad_b, grad_b'>``,
    for per-example losses computed under `funcgrad.per_example`; no ``.grad`` is
    written.

    Same values as ``J @ J.T`` with ``J`` the (B, P) Jacobian of ``losses`` with respect to
    the parameters (the rows of ``torch.autograd.grad(losses[b], params)``, flattened), at
    the cost of one backward. Its diagonal holds the squared per-example gradient norms
    (Opacus's ghost norms); its rows the gradient similarities of data attribution
    (TracIn-style scores, In-Run Data Shapley's ghost dot-products).

    Args:
        losses: a 1-D tensor of B per-example losses, from a forward of a model hooked by
            `funcgrad.per_example` (the hooks that saw that forward are found).
        inputs: the parameters whose gradients count (tensors, a Module, a mapping or
            ``named_parameters()`` pairs); None: every parameter of the hooked model that
            requires grad.
        retain_graph: keep the graph after the backward.
        check: True or ``"strict"``: verify on this call that loss b reads example b alone
            (one more backward, see `funcgrad.per_example`); False: only on the first call
            of each signature; None: the global setting (`funcgrad.set_check`).

    Returns:
        G, shape (B, B), detached (float32 for half-precision parameters).

    Examples:
        >>> import torch, funcgrad
        >>> model = torch.nn.Linear(3, 1)
        >>> x = torch.randn(4, 3)
        >>> with funcgrad.per_example(model):
        ...     gram = funcgrad.per_example_gramian(model(x).squeeze(1))
        >>> rows = torch.stack([torch.cat([x[b], torch.ones(1)]) for b in range(4)])
        >>> torch.allclose(gram, rows @ rows.T)  # d loss_b / d(W, b) = (x_b, 1)
        True
    """
    recorder = _recorder_of(losses, _GRAMIAN)
    return recorder.gramian(losses, inputs=inputs, retain_graph=retain_graph, check=check)


def backward_from_losses(
    losses: Any,
    *,
    through: Any,
    batch_dim: Any,
    weighting: Any,
    level: Any,
    inputs: Any,
    retain_graph: bool,
    chunk_size: Any,
    check: Any,
    process_group: Any,
) -> torch.Tensor:
    """``funcgrad.backward(losses, batch_dim=0, ...)``: the per-example path, or a clear error
    for a call that gave neither ``through`` nor ``batch_dim``."""
    if batch_dim is None:
        raise TypeError(
            "funcgrad.backward(losses, through=...): `through` is missing. Pass the shared "
            "features that the k task losses are computed from, or, for per-example losses "
            "(a 1-D tensor, one loss per example), batch_dim=0 under funcgrad.per_example(model)."
        )
    if through is not None:
        raise ValueError(
            f"{_BACKWARD}: `through` is not used with `batch_dim` (every hooked layer is the "
            "shared part); remove it, or remove batch_dim for k task losses on shared features."
        )
    if batch_dim != 0 or isinstance(batch_dim, bool):
        raise ValueError(f"{_BACKWARD}: `batch_dim` must be 0, got {batch_dim!r}.")
    if level != "params":
        raise ValueError(
            f"{_BACKWARD}: `level` must be 'params' for per-example losses (the Gramian of "
            f"the per-example parameter gradients), got {level!r}: there is no `through`."
        )
    if chunk_size is not None:
        raise ValueError(
            f"{_BACKWARD}: `chunk_size` does not apply to per-example losses (one backward, "
            f"no batched pullback); got {chunk_size!r}, remove it."
        )
    if process_group is not None:
        raise NotImplementedError(_distributed_refusal(_BACKWARD))
    recorder = _recorder_of(losses, _BACKWARD)
    return recorder.backward(
        losses, weighting=weighting, inputs=inputs, retain_graph=retain_graph, check=check
    )


def _distributed_refusal(call: str) -> str:
    return (
        f"{call}: per-example Gramians with a process group are not supported. The "
        "cross-rank blocks of G need every rank's per-layer inputs A and output gradients Δ: "
        "R ranks of B_r examples would all-gather sum over layers of B_r·T·(d+p) numbers per "
        "rank (for an MLP 784-1024-10 at B_r=128, 0.36M numbers, so R x 1.4 MiB in float32 "
        "per step, against the P = 0.8M numbers of DDP's all-reduce), and each rank would "
        "then form the whole (R·B_r)² Gramian. Run it on one process (or on each rank's local "
        "batch without a process group, which gives the local Gramian), or use "
        "funcgrad.backward(losses_per_task, through=...) for task losses."
    )


def _recorder_of(losses: Any, call: str) -> PerExample:
    """The live PerExample whose hooks recorded the forward of ``losses``."""
    live = [r for r in list(_RECORDERS) if r._uses]
    if isinstance(losses, torch.Tensor) and losses.grad_fn is not None and len(live) > 1:
        mine = _reachable_edges(losses)
        live = [r for r in live if any(e in mine for u in r._uses for e in _keys(u))]
    if len(live) == 1:
        return live[0]
    if not live:
        if isinstance(losses, torch.Tensor) and losses.grad_fn is not None:
            _explain_spent(losses, call, None)
        raise ValueError(
            f"{call}: no funcgrad.per_example hooks recorded the forward of these losses; "
            "per-example Gramians need each layer's input, recorded during the forward. "
            "Hook the model before the forward: `with funcgrad.per_example(model) as pe: "
            "losses = criterion(model(x), y); pe.backward(losses, weighting=...)`."
        )
    raise ValueError(
        f"{call}: {len(live)} funcgrad.per_example hooks recorded the forward of these losses; "
        "call .backward / .gramian on the one you mean."
    )


_SPENT = "funcgrad.per_example"  # the key of our mark in a graph node's metadata

_WHY = {
    "consumed": "an earlier call (gramian or backward) on these losses consumed their "
    "forward's records, and freed its graph. Run the forward again for each call, or pass "
    "retain_graph=True to every call on it but the last",
    "dropped": "a call on the losses of a later forward dropped this forward's records (a "
    "call drops the records of older forwards that no call used). Call gramian / backward "
    "on each forward's losses in the order of the forwards, or run this forward again",
    "failed": "an earlier call on the losses of this (or a later) forward raised, which "
    "dropped the records (see that error). Run the forward again",
    "cleared": "pe.clear() dropped this forward's records. Run the forward again",
    "removed": "the hooks were removed (the end of the `with funcgrad.per_example(model)` "
    "block, or remove()), which drops their records. Call gramian / backward inside the "
    "block, before the hooks are removed",
}


def _mark(node: Any, why: str) -> None:
    metadata = getattr(node, "metadata", None)
    if isinstance(metadata, dict):  # the first reason stays (consumed, then dropped)
        metadata.setdefault(_SPENT, why)


def _explain_spent(losses: torch.Tensor, call: str, recorder: PerExample | None) -> None:
    """Raise the reason that no record of the forward of ``losses`` is left, if known: our
    mark on one of its graph nodes, or a recorder whose hooks were removed."""
    stack: list[Any] = [get_gradient_edge(losses).node]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        metadata = getattr(node, "metadata", None)
        why = metadata.get(_SPENT) if isinstance(metadata, dict) else None
        if why in _WHY:
            raise ValueError(
                f"{call}: no record of the forward of these losses is left: {_WHY[why]}."
            )
        stack.extend(nxt for nxt, _ in node.next_functions)
    if recorder is not None and recorder._removed:
        raise ValueError(f"{call}: no record of the forward of these losses: {_WHY['removed']}.")


def _keys(use: _Use) -> list[tuple[Any, int]]:
    return [(e.node, e.output_nr) for e in use.edges]


def _reachable_edges(losses: torch.Tensor) -> set[tuple[Any, int]]:
    root = get_gradient_edge(losses)
    found: set[tuple[Any, int]] = {(root.node, root.output_nr)}
    stack, seen = [losses.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, nr in node.next_functions:
            if nxt is not None:
                found.add((nxt, nr))
                stack.append(nxt)
    return found


def _hook_dict(tensor: torch.Tensor) -> Any:
    """The dict of the tensor hooks of ``tensor``, a non-leaf, made now if it has none (as
    ``Tensor.register_hook`` makes it): the hooks that the user registers on it later go
    there, where the independence check can hold them back for its own backward, even once
    the tensor itself is gone (its node keeps the dict)."""
    if tensor._backward_hooks is None:
        tensor._backward_hooks = OrderedDict()
        node = tensor.grad_fn
        assert node is not None  # a non-leaf
        node._register_hook_dict(tensor)
    return tensor._backward_hooks


def _grads_after_hooks(
    losses: torch.Tensor,
    edges: list[Any],
    retain_graph: bool,
    grad_outputs: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients along ``grad_outputs`` (all ones by default) at ``edges``, as the nodes
    there use them: after the tensor hooks on those outputs (``out.register_hook``) and the
    nodes' pre-hooks.

    torch's engine captures an input of ``autograd.grad`` before the tensor hooks when its
    node also runs (a layer with layers below it), after them when it does not. A pre-hook
    of ours on each node, registered last, sees what the node itself receives; it only
    reads, so each user hook fires once, as in one backward of ``losses.sum()``."""
    seen: dict[Any, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in {e.node: None for e in edges}:

        def read(grads: Any, node: Any = node) -> None:
            seen[node] = tuple(grads)

        handles.append(node.register_prehook(read))
    try:
        deltas = torch.autograd.grad(
            losses,
            edges,
            grad_outputs=torch.ones_like(losses) if grad_outputs is None else grad_outputs,
            retain_graph=retain_graph,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    return tuple(seen[e.node][e.output_nr] if e.node in seen else d for e, d in zip(edges, deltas))


# -- layers: one rule each -------------------------------------------------------------------


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _ghost(a: torch.Tensor, d: torch.Tensor, equal: bool = False) -> torch.Tensor:
    """``G[b, c] = sum_{t,s} K(a_bt, a_cs) <d_bt, d_cs>`` with K the dot product (or index
    equality for ``equal``), for a (B, T, ·) and d (B, T, p), in blocks of examples."""
    batch, rows = a.shape[:2]
    if rows == 1 and not equal:
        return (a[:, 0] @ a[:, 0].T) * (d[:, 0] @ d[:, 0].T)
    flat_a = a.reshape(batch * rows, -1)
    flat_d = d.reshape(batch * rows, -1)
    step = max(1, _BLOCK // max(1, batch * rows * rows))
    blocks = []
    for start in range(0, batch, step):
        stop = min(batch, start + step)
        part_a, part_d = flat_a[start * rows : stop * rows], flat_d[start * rows : stop * rows]
        kernel = (part_a == flat_a.T).to(d.dtype) if equal else part_a @ flat_a.T
        prod = kernel * (part_d @ flat_d.T)  # (n T, B T)
        blocks.append(prod.view(stop - start, rows, batch, rows).sum(dim=(1, 3)))
    return torch.cat(blocks)


def _gram(grads: torch.Tensor) -> torch.Tensor:
    flat = grads.reshape(grads.shape[0], -1)
    return flat @ flat.T


@dataclasses.dataclass
class _LayerPlan:
    name: str
    kind: str
    shape: tuple[int, ...]
    rule: str
    ghost_flops: float | None
    materialised_flops: float | None
    params: list[str]

    def line(self) -> str:
        costs = "/".join(
            "-" if c is None else f"{c / 1e6:.3g}M"
            for c in (self.ghost_flops, self.materialised_flops)
        )
        params = ", ".join(self.params)
        return f"  {self.name}  {self.kind}  {self.shape}  {self.rule}  [{costs}]  {params}"


@dataclasses.dataclass
class PerExamplePlan:
    """The rule each layer took in the last per-example call, and its cost estimates
    (flops of its Gramian block, ghost / materialised)."""

    batch: int
    layers: list[_LayerPlan]

    def __str__(self) -> str:
        head = (
            f"per-example plan, B={self.batch} (flops of the Gramian per layer: ghost / "
            "materialised)"
        )
        return "\n".join([head, *(layer.line() for layer in self.layers)])


class _Layer:
    """A hooked module and its recorded calls in one graph; its parameters ``params`` (name
    -> the selected parameter)."""

    kind = "generic"

    def __init__(self, run: _Run, module: nn.Module, uses: list[_Use], params: dict[str, Any]):
        self.run, self.module, self.uses, self.params = run, module, uses, params
        self.name = run.recorder._names.get(module, type(module).__name__)
        self.batch = run.batch
        self.rule = ""
        self.ghost_flops: float | None = None
        self.materialised_flops: float | None = None

    def fail(self, what: str, got: Any) -> None:
        raise ValueError(
            f"{self.run.call}: module {self.name!r} ({type(self.module).__name__}) {what} "
            f"{got}, but the losses have B = {self.batch} entries: per-example Gramians need "
            "every hooked module's inputs and outputs batched along dim 0 (batch_first=True "
            "for nn.MultiheadAttention / nn.Transformer*; no reshape of the batch into other "
            "dimensions, no output shared by the whole batch such as positional embeddings "
            "of shape (T, d): expand them to (B, T, d) first). Fix the module, or leave its "
            "parameters out with inputs=."
        )

    def input(self, use: _Use) -> torch.Tensor:
        """The call's first argument (the layer's input A), checked to be batched."""
        x = use.args[0] if use.args else next(iter(use.kwargs.values()), None)
        if not isinstance(x, torch.Tensor):
            self.fail("has an input that", f"is {describe(x)}")
        assert isinstance(x, torch.Tensor)
        self.check_batched(x, "has an input that")
        return x

    def check_batched(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.ndim == 0 or tensor.shape[0] != self.batch:
            self.fail(what, f"has shape {tuple(tensor.shape)}")

    def check_layout(self) -> None:
        """A module that says which dim is its batch (``batch_first``) has it at dim 0:
        time-major layouts are refused by their attribute, also where T == B."""
        if getattr(self.module, "batch_first", None) is False:
            raise ValueError(
                f"{self.run.call}: module {self.name!r} ({type(self.module).__name__}) has "
                "batch_first=False: its inputs and outputs are time-major (T, B, ...), "
                "where per-example Gramians need them batched along dim 0 (this holds even "
                "where T == B, which the shapes cannot tell). Build it with "
                "batch_first=True and pass (B, T, ...) inputs, or leave its parameters out "
                "with inputs=."
            )

    def precheck(self) -> None:
        """The batch dimension of every recorded input and output, before the backward."""
        self.check_layout()
        for use in self.uses:
            for _, shape, _ in use.outputs:
                if len(shape) == 0 or shape[0] != self.batch:
                    self.fail("has an output that", f"has shape {tuple(shape)}")
            if self.kind != "generic":
                self.input(use)

    def out_dim(self, use: _Use, k: int) -> int:
        """The batch dim of the call's recorded output k."""
        return 0

    def leaf_dims(self, use: _Use) -> tuple[list[Any], Any, list[int | None]]:
        """The call's flat arguments, their spec and each one's batch dim (None: not
        batched)."""
        leaves, spec = _pytree.tree_flatten((use.args, use.kwargs))
        shared = self.shared_arguments(use)
        dims: list[int | None] = [
            0
            if isinstance(x, torch.Tensor)
            and x.ndim >= 1
            and x.shape[0] == self.batch
            and not any(x is s for s in shared)
            else None
            for x in leaves
        ]
        return leaves, spec, dims

    def shared_arguments(self, use: _Use) -> list[torch.Tensor]:
        """Arguments that are not per example though their dim 0 may be B: an
        nn.MultiheadAttention's 2-D ``attn_mask`` (T, S), shared by the batch (T == B would
        read as batched). Every other tensor of size B along dim 0 is taken as per example."""
        if not isinstance(self.module, nn.MultiheadAttention):
            return []
        bound = inspect.signature(self.module.forward).bind_partial(*use.args, **use.kwargs)
        mask = bound.arguments.get("attn_mask")
        if not isinstance(mask, torch.Tensor):
            return []
        if mask.ndim == 3:
            self.fail(
                "has an attn_mask that",
                f"has shape {tuple(mask.shape)} (a 3-D mask holds one (T, S) mask per example "
                "and head, (B * num_heads, T, S), which per-example gradients cannot split by "
                "example here): pass a 2-D (T, S) mask shared by the batch, or key_padding_mask "
                "(B, S)",
            )
        return [mask]

    def delta(self, use: _Use, i: int = 0) -> torch.Tensor:
        d = use.deltas[i]
        if d is None:
            _, shape, dtype = use.outputs[i]
            d = torch.zeros(shape, dtype=dtype, device=self.run.device)
        self.check_batched(d, "has an output gradient that")
        return d

    def gramian(self) -> torch.Tensor:
        """This layer's block of G (its parameters alone)."""
        self.rule = "materialised"
        return sum((_gram(g) for g in self.per_example().values()), self.zero())

    def zero(self) -> torch.Tensor:
        return torch.zeros(self.batch, self.batch, dtype=self.run.dtype, device=self.run.device)

    def per_example(self) -> dict[str, torch.Tensor]:  # name -> (B, *shape)
        raise NotImplementedError

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def plan(self) -> _LayerPlan:
        shape: tuple[int, ...] = ()
        first = self.uses[0].args[0] if self.uses[0].args else None
        if isinstance(first, torch.Tensor):
            shape = tuple(first.shape)
        return _LayerPlan(
            self.name,
            type(self.module).__name__,
            shape,
            self.rule,
            self.ghost_flops,
            self.materialised_flops,
            list(self.params),
        )


class _Dense(_Layer):
    """Linear, and convolutions once unfolded: rows A (B, T, d) and Δ (B, T, p)."""

    kind = "linear"
    kept: torch.Tensor | None = None  # materialised per-example weight gradients, if small

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        a_parts, d_parts = [], []
        for use in self.uses:
            a, d = self.unfold(use)
            a_parts.append(a)
            d_parts.append(d)
        return _cat_rows(a_parts), _cat_rows(d_parts)

    def unfold(self, use: _Use) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.input(use)
        if a.ndim < 2:
            self.fail("has an input that", describe(a))
        d = self.delta(use)
        return a.reshape(self.batch, -1, a.shape[-1]), d.reshape(self.batch, -1, d.shape[-1])

    def dims(self) -> tuple[int, int, int]:
        """(T rows per example over all calls, d, p), from shapes alone."""
        weight = self.params.get("weight", self.module.weight)
        width = weight[0].numel()
        rows = sum(self.input(use).numel() // (self.batch * width) for use in self.uses)
        return rows, width, weight.shape[0]

    def bias_rows(self) -> torch.Tensor:
        """(B, p): the per-example bias gradients, Δ summed over each example's rows."""
        found = [self.delta(use) for use in self.uses]
        sums = [d.reshape(self.batch, -1, d.shape[-1]).sum(1) for d in found]
        return sum(sums[1:], sums[0])

    def flat(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, Δ) as (B, d) and (B, p) for one call on 2-D inputs (the MLP case: the
        fewest ops, as each costs microseconds of overhead at small B), else None."""
        if type(self) is not _Dense or len(self.uses) != 1:
            return None
        use = self.uses[0]
        a = use.args[0] if use.args else None
        if not isinstance(a, torch.Tensor) or a.ndim != 2 or use.deltas[0] is None:
            return None
        return a, use.deltas[0]

    def gramian(self) -> torch.Tensor:
        dtype = self.run.dtype
        flat = self.flat()
        if flat is not None and "weight" in self.params:  # ghost, T = 1
            a, d = flat
            if a.dtype != dtype or d.dtype != dtype:
                a, d = a.to(dtype), d.to(dtype)
            batch, width, out = a.shape[0], a.shape[1], d.shape[1]
            self.ghost_flops = float(batch * batch * (width + out + 1))
            self.materialised_flops = float(batch * width * out * (1 + batch))
            self.rule = "ghost (A Aᵀ)∘(Δ Δᵀ)"
            kernel = a @ a.T
            if "bias" in self.params:  # the bias's rows are Δ: (A Aᵀ + 1)∘(Δ Δᵀ)
                kernel += 1
            return kernel.mul_(d @ d.T)
        bias = self.bias_rows().to(dtype) if "bias" in self.params else None
        if "weight" not in self.params:
            self.rule = "bias only"
            assert bias is not None
            return bias @ bias.T
        batch = self.batch
        rows, width, out = self.dims()
        self.ghost_flops = float(batch * batch * rows * rows * (width + out + 1))
        self.materialised_flops = float(batch * rows * width * out + batch * batch * width * out)
        if self.ghost_flops <= self.materialised_flops:
            a, d = self.rows()
            a, d = a.to(dtype), d.to(dtype)
            if rows == 1:
                self.rule = "ghost (A Aᵀ)∘(Δ Δᵀ)"
                kernel = a[:, 0] @ a[:, 0].T
                if bias is not None:  # the bias's rows are Δ: (A Aᵀ + 1)∘(Δ Δᵀ)
                    kernel += 1
                return kernel.mul_(d[:, 0] @ d[:, 0].T)
            self.rule = f"ghost <A_b A_b'ᵀ, Δ_b Δ_b'ᵀ> T={rows}"
            g = _ghost(a, d)
        else:
            self.rule = f"materialised A_bᵀ Δ_b T={rows}"
            grads = self.weight_per_example()
            if grads.numel() <= _BLOCK:  # small: the update reads it (w @ grads)
                self.kept = grads
            g = _gram(grads.to(dtype))
        return g if bias is None else g + bias @ bias.T

    def weight_per_example(self) -> torch.Tensor:
        """(B, p, d): ``A_bᵀ Δ_b`` in blocks of examples (bounded transient memory)."""
        a, d = self.rows()
        batch, rows, width = a.shape
        step = max(1, _BLOCK // max(1, rows * width))
        return torch.cat(
            [
                torch.bmm(d[s : s + step].transpose(1, 2), a[s : s + step].to(d.dtype))
                for s in range(0, batch, step)
            ]
        )

    def per_example(self) -> dict[str, torch.Tensor]:
        found = {}
        if "weight" in self.params:
            found["weight"] = self.weight_per_example().reshape(
                self.batch, *self.params["weight"].shape
            )
        if "bias" in self.params:
            found["bias"] = self.bias_rows()
        return found

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        flat = self.flat()
        if flat is not None:  # one call on 2-D inputs: (w ⊙ Δ)ᵀ A and its column sums
            a, d = flat
            wd = d * weights.to(d.dtype).unsqueeze(1)
            if "weight" in self.params:
                found["weight"] = wd.T @ (a if a.dtype == d.dtype else a.to(d.dtype))
            if "bias" in self.params:
                found["bias"] = wd.sum(0)
            return found
        if self.kept is not None:  # w @ the per-example gradients: B·d·p
            kept = self.kept
            found["weight"] = torch.tensordot(weights.to(kept.dtype), kept, dims=1).view_as(
                self.params["weight"]
            )
            if "bias" in self.params:
                bias = self.bias_rows()
                found["bias"] = bias.T @ weights.to(bias.dtype)
            return found
        for use in self.uses:
            for key, value in self.weighted(use, weights).items():
                _add(found, key, value)
        return found

    def weighted(self, use: _Use, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """One call's share of the update: ``Aᵀ (w ⊙ Δ)``, one matmul."""
        a, d = self.unfold(use)
        w = weights.to(d.dtype)
        a, d = a.reshape(-1, a.shape[-1]).to(d.dtype), d.reshape(-1, d.shape[-1])
        if a.shape[0] > w.shape[0]:  # rows (b, t): each example's weight on its T rows
            w = w.repeat_interleave(a.shape[0] // w.shape[0])
        found = {}
        if "weight" in self.params:  # w scales the narrower of Δ and A
            if d.shape[1] <= a.shape[1]:
                found["weight"] = (d * w[:, None]).T @ a
            else:
                found["weight"] = d.T @ (a * w[:, None])
        if "bias" in self.params:
            found["bias"] = d.T @ w
        return found


class _Conv(_Dense):
    """Conv1d/Conv2d (zeros padding, groups=1): a Linear on the unfolded input for the
    ghost products; torch's own weight-gradient kernel otherwise (the per-example
    gradients as one convolution with the examples as groups, and the update along
    ``w ⊙ Δ``), with no unfolded copy."""

    kind = "conv"

    @property
    def weight(self) -> torch.Tensor:
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def geometry(self) -> tuple[int, list[int], list[int], list[int]]:
        module = self.module
        assert isinstance(module, (nn.Conv1d, nn.Conv2d))
        return (
            len(module.kernel_size),
            list(module.stride),
            list(_padding(module)),
            list(module.dilation),
        )

    def unfold(self, use: _Use) -> tuple[torch.Tensor, torch.Tensor]:
        dims, stride, padding, dilation = self.geometry()
        x = self.input(use)
        if x.ndim != dims + 2:
            self.fail("has an input that", describe(x))
        d = self.delta(use)
        kernel = list(self.weight.shape[2:])
        if dims == 1:  # as a Conv2d of height 1
            x = x.unsqueeze(2)
            kernel, dilation = [1, *kernel], [1, *dilation]
            padding, stride = [0, *padding], [1, *stride]
        a = F.unfold(
            x, tuple(kernel), dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride)
        )
        return a.transpose(1, 2), d.reshape(self.batch, d.shape[1], -1).transpose(1, 2)

    def dims(self) -> tuple[int, int, int]:
        weight = self.weight
        rows = sum(math.prod(use.outputs[0][1][2:]) for use in self.uses)
        return rows, weight[0].numel(), int(weight.shape[0])

    def bias_rows(self) -> torch.Tensor:
        sums = [self.delta(use).flatten(2).sum(2) for use in self.uses]
        return sum(sums[1:], sums[0])

    def backward_weight(self, d: torch.Tensor, x: torch.Tensor, groups: int) -> torch.Tensor:
        dims, stride, padding, dilation = self.geometry()
        weight = self.weight
        if groups > 1:
            weight = weight.repeat(groups, *([1] * (weight.ndim - 1)))
        return torch.ops.aten.convolution_backward(
            d, x, weight, None, stride, padding, dilation, False, [0] * dims, groups,
            [False, True, False],
        )[1]  # fmt: skip

    def weight_per_example(self) -> torch.Tensor:
        found = []
        for use in self.uses:  # the examples as the groups of one convolution
            x, d = self.input(use), self.delta(use)
            grads = self.backward_weight(
                d.reshape(1, -1, *d.shape[2:]), x.reshape(1, -1, *x.shape[2:]), self.batch
            )
            found.append(grads.view(self.batch, -1))
        return sum(found[1:], found[0]).view(self.batch, self.weight.shape[0], -1)

    def weighted(self, use: _Use, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        x, d = self.input(use), self.delta(use)
        wd = d * weights.to(d.dtype).view(-1, *([1] * (d.ndim - 1)))
        found = {}
        if "weight" in self.params:
            found["weight"] = self.backward_weight(wd, x, 1)
        if "bias" in self.params:
            found["bias"] = wd.flatten(2).sum((0, 2))
        return found


class _Embedding(_Layer):
    """Embedding: the Gram of one-hot rows is index equality."""

    kind = "embedding"

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        index_parts, d_parts = [], []
        module = self.module
        assert isinstance(module, nn.Embedding)
        for use in self.uses:
            index = self.input(use)
            d = self.delta(use).reshape(self.batch, -1, module.embedding_dim)
            index = index.reshape(self.batch, -1)
            if module.padding_idx is not None:  # its row gets no gradient
                d = d * (index != module.padding_idx).unsqueeze(-1).to(d.dtype)
            index_parts.append(index)
            d_parts.append(d)
        return _cat_rows(index_parts), _cat_rows(d_parts)

    def gramian(self) -> torch.Tensor:
        index, d = self.rows()
        batch, rows, width = d.shape
        used = min(self.params["weight"].shape[0], batch * rows)  # at most B·T rows are hit
        self.ghost_flops = float(batch * batch * rows * rows * (width + 2))
        self.materialised_flops = float(batch * rows * width + batch * batch * used * width)
        d = d.to(self.run.dtype)
        if self.ghost_flops <= self.materialised_flops:
            self.rule = f"ghost [i_bt = i_b't']·<Δ, Δ> T={rows}"
            return _ghost(index.unsqueeze(-1), d, equal=True)
        self.rule = f"materialised on the rows used T={rows}"
        unique, inverse = torch.unique(index, return_inverse=True)
        return _gram(self.scatter(inverse, d, unique.shape[0]))

    def scatter(self, index: torch.Tensor, d: torch.Tensor, vocab: int) -> torch.Tensor:
        """(B, vocab, width): each example's rows of Δ added at its indices."""
        batch, _, width = d.shape
        offsets = torch.arange(batch, device=index.device).unsqueeze(1) * vocab
        flat = d.new_zeros(batch * vocab, width)
        flat.index_add_(0, (index + offsets).flatten(), d.reshape(-1, width))
        return flat.view(batch, vocab, width)

    def per_example(self) -> dict[str, torch.Tensor]:
        index, d = self.rows()
        return {"weight": self.scatter(index, d, self.params["weight"].shape[0])}

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        index, d = self.rows()
        weight = self.params["weight"]
        wd = d * weights.to(d.dtype)[:, None, None]
        grad = torch.zeros(weight.shape, dtype=d.dtype, device=d.device)
        grad.index_add_(0, index.flatten(), wd.reshape(-1, d.shape[-1]))
        return {"weight": grad}


class _Norm(_Layer):
    """LayerNorm / GroupNorm / BatchNorm (eval) affine parameters: (B, C) per-example
    gradients of the scale (``Δ ⊙ x̂`` summed over positions) and the shift (``Δ`` summed)."""

    kind = "norm"

    def per_example(self) -> dict[str, torch.Tensor]:
        module = self.module
        found: dict[str, torch.Tensor] = {}
        for use in self.uses:
            x = self.input(use)
            d = self.delta(use)
            if isinstance(module, nn.LayerNorm):
                normed = F.layer_norm(x, module.normalized_shape, eps=module.eps)
                keep = len(module.normalized_shape)
                dims = tuple(range(1, x.ndim - keep))
            else:
                if isinstance(module, nn.GroupNorm):
                    normed = F.group_norm(x, module.num_groups, eps=module.eps)
                else:
                    assert isinstance(module, nn.modules.batchnorm._BatchNorm)
                    shape = (1, -1, *([1] * (x.ndim - 2)))
                    mean, var = module.running_mean, module.running_var
                    assert mean is not None and var is not None
                    normed = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + module.eps)
                dims = tuple(range(2, x.ndim))
            if "weight" in self.params:
                _add(found, "weight", (d * normed).sum(dim=dims) if dims else d * normed)
            if "bias" in self.params:
                _add(found, "bias", d.sum(dim=dims) if dims else d)
        self.rule = "materialised (B, C) affine"
        return found

    def gramian(self) -> torch.Tensor:
        self.grads = self.per_example()
        self.rule = "materialised (B, C) affine"
        return sum((_gram(g.to(self.run.dtype)) for g in self.grads.values()), self.zero())

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        grads = getattr(self, "grads", None) or self.per_example()
        return {k: torch.tensordot(weights.to(g.dtype), g, dims=1) for k, g in grads.items()}


class _Generic(_Layer):
    """Any other module with parameters: its per-example gradients, by torch.func.vmap over
    a functional call of the module alone along each example's output gradient (a loop of
    unbatched calls where vmap cannot), kept for the update."""

    def per_example(self) -> dict[str, torch.Tensor]:
        cached = getattr(self, "grads", None)
        if cached is not None:
            return cached
        found: dict[str, torch.Tensor] = {}
        try:
            with _RefuseTensorHooks(self):
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
            rows = [self.eager(use, b) for b in range(self.batch)]
            grads = {k: torch.stack([r[k] for r in rows]) for k in params}
        return dict(grads)

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

    def gramian(self) -> torch.Tensor:
        g = super().gramian()
        self.rule = self.rule or "materialised"
        return g

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
        self.check_layout()
        for use in self.uses:
            for k, (_, shape, _) in enumerate(use.outputs):
                dim = self.out_dim(use, k)
                if len(shape) <= dim or shape[dim] != self.batch:
                    self.fail("has an output that", f"has shape {tuple(shape)}")
            self.leaf_dims(use)

    def delta(self, use: _Use, i: int = 0) -> torch.Tensor:
        d = use.deltas[i]
        if d is None:
            _, shape, dtype = use.outputs[i]
            d = torch.zeros(shape, dtype=dtype, device=self.run.device)
        return d

    def one_use(self, use: _Use) -> dict[str, torch.Tensor]:
        self.rule = "materialised, loop (recurrent)"
        rows = [self.eager(use, b) for b in range(self.batch)]
        return {k: torch.stack([r[k] for r in rows]) for k in self.params}


class _RefuseTensorHooks(torch.overrides.TorchFunctionMode):
    """Around the second call of a module's forward (the generic rule): a tensor hook that
    forward registers fired in the one backward already, and would fire again there (on
    per-example gradients, under vmap), which torch's backward never does."""

    def __init__(self, layer: _Layer) -> None:
        super().__init__()
        self.layer = layer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
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
        return func(*args, **(kwargs or {}))


def _bare_call(module: nn.Module, params: dict[str, Any] | None, args: Any, kwargs: Any) -> Any:
    """``forward`` after the module's forward pre-hooks, with ``params`` (if any) in place
    of its parameters, as torch.func.functional_call, but not through ``module(...)``: the
    recorded input already holds what the pre-hooks changed, and the recorded output
    gradients what its forward hooks and backward hooks did. The pre-hooks run again for
    what they set from the parameters (torch.nn.utils.weight_norm computes ``weight``
    there); one that returns a new input is refused (its change, made again from the
    recorded input, would count twice)."""
    if params is None:
        return _forward_after_pre_hooks(module, args, kwargs)
    # tie_weights as functional_call: a parameter under two names is replaced under both
    with torch.nn.utils.stateless._reparametrize_module(module, params, tie_weights=True):
        return _forward_after_pre_hooks(module, args, kwargs)


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


def _nested_params(use: _Use) -> set[torch.Tensor]:
    """The parameters that the calls nested in ``use`` handle (each its module's subtree)."""
    return {p for n in use.nested for p in n.module.parameters()}


def _add(found: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    found[key] = found[key] + value if key in found else value


def _padding(module: nn.Conv1d | nn.Conv2d) -> tuple[int, ...]:
    """A convolution's padding as numbers ("valid" is none; "same" is never given here)."""
    if isinstance(module.padding, str):
        return (0,) * len(module.kernel_size)
    return tuple(module.padding)


def _overrides(module: nn.Module, base: type) -> bool:
    return getattr(type(module), "forward", None) is not getattr(base, "forward", None)


def _layer_class(module: nn.Module) -> type[_Layer]:
    """The rule of a module, by its class: only torch's own forward (a subclass with its
    own forward, such as a LoRA Linear, is materialised as any other module)."""
    if type(module) in (nn.RNN, nn.GRU, nn.LSTM) and module.batch_first:
        return _Recurrent
    if any(name not in ("weight", "bias") for name, _ in module.named_parameters(recurse=False)):
        # its forward reads other tensors than its parameters (torch.nn.utils.weight_norm's
        # weight_g / weight_v make `weight` in a pre-hook): the generic rule runs that
        return _Generic
    if isinstance(module, nn.Linear) and not _overrides(module, nn.Linear):
        return _Dense
    if (
        type(module) in (nn.Conv1d, nn.Conv2d)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and (not isinstance(module.padding, str) or module.padding == "valid")
    ):
        return _Conv
    if type(module) is nn.Embedding:
        return _Embedding
    if type(module) in (nn.LayerNorm, nn.GroupNorm) or (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    ):
        return _Norm
    return _Generic


# -- one call --------------------------------------------------------------------------------


class _Run:
    """One call of ``gramian`` / ``backward``: validated at construction, before any pass."""

    def __init__(
        self,
        recorder: PerExample,
        losses: Any,
        inputs: Any,
        weighting: Any,
        call: str,
        check: CheckMode | None = None,
    ) -> None:
        self.recorder, self.call = recorder, call
        self.check = resolve_check(check, call)
        self.rule = _weighting.resolve(weighting, "params", call)
        if self.rule.needs_jacobian:
            raise ValueError(
                f"{call}: `weighting` {type(weighting).__name__} reads the (B, P) Jacobian of "
                "the per-example gradients, which the per-example path never forms (it works "
                "from the Gramian). Pass a Gramian weighting (UPGradWeighting(), "
                "MGDAWeighting(), UPGrad(), a callable Gramian -> weights)."
            )
        if not isinstance(losses, torch.Tensor) or losses.ndim != 1:
            raise ValueError(
                f"{call}: `losses` must be a 1-D tensor of per-example losses (one per example, "
                f"e.g. criterion(model(x), y) with reduction='none'), got {describe(losses)}. "
                "For a (B, k) tensor of k losses per example, pass losses.sum(1) or one task "
                "at a time."
            )
        if not losses.requires_grad or losses.grad_fn is None:
            raise ValueError(
                f"{call}: `losses` does not require grad: compute it from the hooked model's "
                "forward with grad enabled."
            )
        if losses.is_complex() or not losses.is_floating_point():
            raise TypeError(f"{call}: `losses` must be real floating point, got {losses.dtype}.")
        self.losses = losses
        self.batch = losses.shape[0]
        self.device = losses.device
        self.selected = self._select(inputs)
        self._inputs_given = inputs is not None
        first = next(iter(self.selected), None)
        self.dtype = _weighting.work_dtype(first.dtype if first is not None else losses.dtype)

    def _select(self, inputs: Any) -> dict[torch.Tensor, str]:
        """Parameter -> its name, for the parameters whose gradients count."""
        model = self.recorder.model
        names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
        if inputs is None:
            return {p: n for p, n in names.items() if p.requires_grad}
        selected = {}
        for label, x in named_inputs(inputs, self.call):
            if x not in names:
                raise ValueError(
                    f"{self.call}: {label} is not a parameter of the hooked model "
                    f"({type(model).__name__}); per-example gradients exist only for the "
                    "parameters of the model given to funcgrad.per_example."
                )
            selected[x] = names[x]
        return selected

    # Validate the recorded graph, then collect -----------------------------------------

    def _uses(self) -> list[_Use]:
        """Every recorded call on the graph of the losses (nested calls included), after a
        walk that refuses a selected parameter reaching the losses outside them."""
        by_edge: dict[tuple[Any, int], _Use] = {}
        for top in self.recorder._uses:
            for key in _keys(top):
                by_edge[key] = top
        reached: dict[int, _Use] = {}
        # Edges to visit; a recorded call is stepped over, from its outputs to its inputs.
        # From the losses' own edge: they may be a recorded call's output (a module that
        # returns the per-example losses).
        root = get_gradient_edge(self.losses)
        stack: list[tuple[Any, int]] = [(root.node, root.output_nr)]
        seen: set[Any] = set()
        while stack:
            node, nr = stack.pop()
            use = by_edge.get((node, nr))
            if use is not None:
                if id(use) not in reached:
                    reached[id(use)] = use
                    stack.extend((e.node, e.output_nr) for e in use.upstream)
                continue
            if node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)
            if isinstance(leaf, torch.Tensor):
                self._check_leaf(leaf)
            stack.extend((nxt, i) for nxt, i in node.next_functions if nxt is not None)
        if not reached:
            raise ValueError(
                f"{self.call}: the losses depend on no module call that funcgrad.per_example "
                "recorded: hook the model before its forward, and compute the losses from "
                "that forward."
            )
        return [use for top in self.recorder._uses if id(top) in reached for use in top.walk()]

    def _refuse_changed(self, uses: list[_Use]) -> None:
        """An input or parameter of a recorded call changed in place since the forward (the
        next batch copied into the input buffer, an optimizer step): torch's backward would
        raise for a tensor it saved; the rules read them all, so each is checked."""
        for use in uses:
            for tensor, version in use.versions:
                if tensor._version != version:
                    name = self.recorder._names.get(use.module, type(use.module).__name__)
                    what = (
                        "a parameter"
                        if any(tensor is p for p in use.module.parameters(recurse=False))
                        else "an input"
                    )
                    raise RuntimeError(
                        f"{self.call}: {what} of module {name!r} "
                        f"({type(use.module).__name__}), shape {tuple(tensor.shape)}, was "
                        "changed in place after the forward (e.g. the next batch copied into "
                        "the input buffer, or an optimizer step), so the per-example "
                        "gradients read from it would be wrong (torch's own backward raises "
                        "there too). Nothing was written. Call gramian/backward before "
                        "changing it, or give the model a copy."
                    )

    def _refuse_hooks(self, uses: list[_Use]) -> None:
        for use in uses:
            if use.hooked is not None:
                name = self.recorder._names.get(use.module, type(use.module).__name__)
                raise ValueError(
                    f"{self.call}: module {name!r} ({type(use.module).__name__}) has "
                    f"{use.hooked}. Nothing was written. Register the hook on the module "
                    "without prepend=True (module forward hooks, pre-hooks and full backward "
                    "hooks are honoured), remove it during the per-example forward, or leave "
                    "the module's parameters out with inputs=."
                )

    def _refuse_parameter_hooks(self) -> None:
        """A tensor hook on a parameter rewrites each of its gradients in torch's per-example
        loop; the rules never form them (the ghost products) nor run the parameter's node."""
        for param, name in self.selected.items():
            if param._backward_hooks:
                hook = next(iter(param._backward_hooks.values()))
                raise ValueError(
                    f"{self.call}: parameter {name!r} has a tensor hook "
                    f"({_hook_name(hook)}, register_hook), which torch applies to each of "
                    "its gradients; the per-example rules never form that gradient (the "
                    "Gramian comes from the layer's inputs and output gradients), so they "
                    "cannot apply it. Nothing was written. Remove the hook during the call "
                    "(handle.remove()), put it on the module's output instead, or leave the "
                    "parameter out with inputs=."
                )

    def _check_leaf(self, leaf: torch.Tensor) -> None:
        name = self.selected.get(leaf)
        if name is not None:
            raise ValueError(
                f"{self.call}: parameter {name!r} reaches the losses outside the forward of "
                "the module that holds it (a functional use such as F.linear(h, "
                "emb.weight), or a parent module reading a child's parameter): the hooks "
                "cannot see its input there. Call it through a module (e.g. an nn.Linear "
                "whose weight is tied to it: head.weight = emb.weight), or leave it out with "
                "inputs=."
            )
        if isinstance(leaf, nn.Parameter) and leaf.requires_grad and self._all_selected:
            raise ValueError(
                f"{self.call}: a parameter of shape {tuple(leaf.shape)} outside the hooked "
                f"model ({type(self.recorder.model).__name__}) reaches the losses. Hook the "
                "module that holds it too (funcgrad.per_example(a module containing both)), "
                "or pass inputs= to update only the hooked model's parameters."
            )

    @property
    def _all_selected(self) -> bool:
        return not self._inputs_given

    def _layers(self, uses: list[_Use]) -> list[list[_Layer]]:
        """The layers (a module and its calls), grouped into blocks of layers that share a
        parameter: a block's parameters have their per-example gradients summed over its
        layers before their Gram."""
        by_module: dict[nn.Module, list[_Use]] = {}
        for use in uses:
            by_module.setdefault(use.module, []).append(use)
        layers: list[_Layer] = []
        for module, calls in by_module.items():
            cls = _layer_class(module)
            recurse = cls is _Generic  # its submodules' parameters that no nested call covers
            params = {
                n: p
                for n, p in module.named_parameters(recurse=recurse)
                if p in self.selected and not any(p in _nested_params(use) for use in calls)
            }
            if params:
                if isinstance(module, nn.Embedding) and (
                    module.scale_grad_by_freq or module.sparse
                ):
                    raise ValueError(
                        f"{self.call}: module {self.recorder._names[module]!r} (Embedding) has "
                        "scale_grad_by_freq=True or sparse=True: its gradient is scaled by "
                        "counts over the whole batch (or sparse), which per-example gradients "
                        "do not sum to. Build it without those options."
                    )
                layers.append(cls(self, module, calls, params))
        # Union of layers sharing a parameter.
        owner: dict[int, int] = {}
        parent = list(range(len(layers)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i, layer in enumerate(layers):
            for p in layer.params.values():
                if id(p) in owner:
                    parent[find(i)] = find(owner[id(p)])
                else:
                    owner[id(p)] = i
        blocks: dict[int, list[_Layer]] = {}
        for i, layer in enumerate(layers):
            blocks.setdefault(find(i), []).append(layer)
        return list(blocks.values())

    def _collect(self, uses: list[_Use], retain_graph: bool) -> None:
        """The ONE backward: every recorded call's output gradients Δ (no weight products)."""
        edges = [e for use in uses for e in use.edges]
        self.recorder._recording = False
        try:
            deltas = _grads_after_hooks(self.losses, edges, retain_graph)
        finally:
            self.recorder._recording = True
        start = 0
        for use in uses:
            use.deltas = list(deltas[start : start + len(use.edges)])
            start += len(use.edges)

    # Execute ---------------------------------------------------------------------------

    def execute(self, retain_graph: bool, write: bool) -> tuple[torch.Tensor, torch.Tensor]:
        recorder = self.recorder
        done: list[_Use] | None = None
        if write:  # every .grad to be written is checked before anything runs
            _sync.check_presets([(name, p) for p, name in self.selected.items()], self.call)
        try:
            try:
                uses = self._uses()
            except ValueError:  # no record of this forward: say why, if known
                _explain_spent(self.losses, self.call, recorder)
                raise
            self._refuse_changed(uses)
            self._refuse_hooks(uses)
            self._refuse_parameter_hooks()
            _refuse_foreign_reads(self, uses)
            blocks = self._layers(uses)
            for block in blocks:
                for layer in block:
                    layer.precheck()
            due = _independence_due(self, blocks)
            probe = None if due is None else _probe(self, blocks)
            self._collect(uses, retain_graph)
            if probe is not None:
                _verify_independence(self, blocks, probe)
            recorder._recording = False  # functional calls of modules record nothing
            gram, weights, update = self._weigh(
                blocks, need_gramian=not write or self.rule.kind != "sum", write=write
            )
            if due is not None:
                _verify_materialised(self, blocks)
                recorder._independent.add(due)
            done = uses
        finally:
            recorder._recording = True
            if not retain_graph:  # consumed (and older forwards dropped)
                recorder._consume(done)
        if write:  # Apply: the one place that writes .grad.
            taken: set[int] = set()
            for param, grad in update:
                _sync.accumulate(param, grad.to(param.dtype), taken)
            # Post-accumulate-grad hooks fire once per leaf, on its final .grad.
            _sync.post_accumulate(list({id(p): p for p, _ in update}.values()))
        return gram, weights

    def _weigh(
        self, blocks: list[list[_Layer]], need_gramian: bool, write: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        gram = torch.zeros(self.batch, self.batch, dtype=self.dtype, device=self.device)
        plans: list[_LayerPlan] = []
        if need_gramian:
            for block in blocks:
                if len(block) == 1:
                    gram = gram + block[0].gramian()
                else:  # shared parameters: per-example gradients summed over the layers
                    summed: dict[int, torch.Tensor] = {}
                    for layer in block:
                        for name, g in layer.per_example().items():
                            key = id(layer.params[name])
                            summed[key] = summed[key] + g if key in summed else g
                        layer.rule = "materialised, shares a parameter with " + ", ".join(
                            other.name for other in block if other is not layer
                        )
                    for g in summed.values():
                        gram = gram + _gram(g.to(self.dtype))
        for block in blocks:
            plans.extend(layer.plan() for layer in block)
        self.recorder.plan = PerExamplePlan(self.batch, plans)
        if need_gramian and not bool(torch.isfinite(gram).all()):
            bad = (~torch.isfinite(gram.diagonal())).nonzero().flatten().tolist()
            raise ValueError(
                f"{self.call}: the Gramian of the per-example gradients is not finite"
                + (f": example(s) {bad} have NaN or inf gradients" if bad else " (overflow)")
                + ", so no weighting can be computed from it. Check those losses, or scale "
                "them down."
            )
        if self.rule.kind == "sum" or not write:
            weights = torch.ones(self.batch, dtype=self.dtype, device=self.device)
        else:
            weights = _weighting.weights_from_gramian(self.rule, gram, self.call)
            weights = _weighting.check_finite(
                weights, f"the {tuple(gram.shape)} Gramian", self.call
            )
        update: list[tuple[torch.Tensor, torch.Tensor]] = []
        if write:
            for block in blocks:
                for layer in block:
                    for name, grad in layer.update(weights).items():
                        update.append((layer.params[name], grad))
        return gram.detach(), weights.detach(), update


# -- independence: loss b reads example b alone ----------------------------------------------
#
# The rules are exact when, for every layer whose parameters count, loss c depends on the
# layer's output Y only through Y[c]: then the one backward's Δ[b] is ∂L_b/∂Y[b], example b's
# own output gradient. Mixing the inputs before the first hooked layer is fine (it is data);
# mixing after a layer (h - h.mean(0), a sort, a pairwise loss...) puts ∂L_c/∂Y[b] into Δ[b].
# The check: one more backward, of Σ u_b L_b with random u, to the same outputs. For
# independent losses its Δ is u_b·Δ[b] row by row; a cross-example term shows as a row that
# differs.

_PROBE_SEED = 20260  # u comes from its own generator: the user's random streams are untouched
_ALONE = 32  # examples run alone through a materialised module, at most


def _independence_due(run: _Run, blocks: list[list[_Layer]]) -> tuple[Any, ...] | None:
    """The call's signature when the independence check runs on it (the first call of the
    signature, or every call under check=True / "strict"), else None."""
    tested = [use for block in blocks for layer in block for use in layer.uses]
    if not tested or run.batch == 0:
        return None
    losses = run.losses
    parts: list[Any] = [
        tuple(losses.shape),
        losses.dtype,
        losses.device,
        type(losses.grad_fn).__name__,
        tuple(run.selected.values()),
    ]
    for use in tested:
        leaves = _pytree.tree_leaves((use.args, use.kwargs))
        shapes = tuple((x.shape, x.dtype) for x in leaves if isinstance(x, torch.Tensor))
        parts.append((id(use.module), shapes, tuple(shape for _, shape, _ in use.outputs)))
    key = tuple(parts)
    if run.check is False and key in run.recorder._independent:
        return None
    return key


@dataclasses.dataclass
class _Probe:
    """What the check's backward of Σ u_b L_b found."""

    weights: torch.Tensor  # u, (B,)
    # each checked call, its layer, its Δ(u), and its Δ along all ones where the check ran
    # its own (user hooks held back), else None: compared with the one backward's
    deltas: list[tuple[_Use, _Layer, list[torch.Tensor | None], list[torch.Tensor | None] | None]]


@contextlib.contextmanager
def _hooks_held_back(run: _Run, uses: list[_Use]) -> Iterator[bool]:
    """Hold back, for the check's backward, the user hooks that funcgrad can find, so that
    each fires once per call, in the one backward: the tensor hooks on the losses and on the
    inputs and outputs of the recorded calls (their dicts, made at the call), and the full
    backward hooks and backward pre-hooks of the model's modules (torch's BackwardHook
    objects, found by the garbage collector's referrers, only where such hooks exist).
    Yields whether any was held back."""
    dicts = [d for use in uses for d in use.hook_dicts]
    if run.losses._backward_hooks is not None:
        dicts.append(run.losses._backward_hooks)
    saved = [(d, list(d.items())) for d in {id(d): d for d in dicts}.values() if d]
    module_hooks = []
    modules = list(run.recorder.model.modules())
    globals_ = nn.modules.module
    if (
        globals_._global_backward_hooks
        or globals_._global_backward_pre_hooks
        or any(m._backward_hooks or m._backward_pre_hooks for m in modules)
    ):
        from torch.utils.hooks import BackwardHook

        mine = {id(m) for m in modules}
        for obj in gc.get_referrers(*modules):
            held = isinstance(obj, BackwardHook) and id(obj.module) in mine
            if held and (obj.user_hooks or obj.user_pre_hooks):
                module_hooks.append((obj, obj.user_hooks, obj.user_pre_hooks))
    try:
        for d, _ in saved:
            d.clear()
        for obj, _, _ in module_hooks:
            obj.user_hooks, obj.user_pre_hooks = [], []
        yield bool(saved or module_hooks)
    finally:
        for d, items in saved:
            d.update(items)
        for obj, hooks, pre_hooks in module_hooks:
            obj.user_hooks, obj.user_pre_hooks = hooks, pre_hooks


def _probe(run: _Run, blocks: list[list[_Layer]]) -> _Probe:
    """The extra backward, of Σ u_b L_b, to the outputs of the layers whose parameters count
    (no weight products), read as the one backward reads them (after the tensor hooks on
    those outputs); the graph is kept for the one backward that follows. u_b = ±2^k: for
    independent losses each row of Δ(u) is then u_b times the row of Δ exactly, as
    scaling by a power of two commutes with rounding (a gradient that is only rounding
    noise, behind a LayerNorm, stays exactly proportional).

    The user hooks that funcgrad finds are held back (`_hooks_held_back`): they fire once
    per call, and a hook that is not linear in the gradient (clipping) is no mixing. Where
    one was held back, the comparison is with a second backward along all ones, with the
    same hooks held back (the one backward applied them): one more backward."""
    tested = [(use, layer) for block in blocks for layer in block for use in layer.uses]
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    # 2K values ±2^k, each block of 2K examples a new permutation of them: two examples in
    # one block always get different weights (a cross term between them shows), with no
    # fixed period; float16 keeps k < 4 (its range is narrow).
    cpu = torch.device("cpu")  # the generator's device, whatever the default device is
    powers = 2.0 ** torch.arange(4 if run.losses.dtype == torch.float16 else 8, device=cpu)
    values = torch.cat([powers, -powers]).to(torch.float64)
    rounds = -(-run.batch // len(values))
    index = torch.cat(
        [torch.randperm(len(values), generator=generator, device=cpu) for _ in range(rounds)]
    )
    weights = values[index[: run.batch]].to(device=run.device, dtype=run.losses.dtype)
    edges = [e for use, _ in tested for e in use.edges]
    plain: tuple[torch.Tensor | None, ...] | None = None
    run.recorder._recording = False
    try:
        # its warnings are the one backward's, given there
        with _hooks_held_back(run, [u for u, _ in tested]) as held, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = _grads_after_hooks(run.losses, edges, True, weights)
            if held:
                plain = _grads_after_hooks(run.losses, edges, True)
    finally:
        run.recorder._recording = True
    probe = _Probe(weights, [])
    start = 0
    for use, layer in tested:
        stop = start + len(use.edges)
        probe.deltas.append(
            (
                use,
                layer,
                list(found[start:stop]),
                None if plain is None else list(plain[start:stop]),
            )
        )
        start = stop
    return probe


def _verify_independence(run: _Run, blocks: list[list[_Layer]], probe: _Probe) -> None:
    """Compare the probe's Δ with u_b times the one backward's Δ, row by row (along each
    output's batch dim); raise naming the mixed layer and the ops after it, before anything
    is written."""
    weights = probe.weights
    excess, relative, owners = [], [], []
    for use, layer, scaled, own in probe.deltas:
        for k, (plain, other) in enumerate(zip(use.deltas if own is None else own, scaled)):
            if plain is None or other is None:
                continue
            work = torch.float64 if plain.dtype == torch.float64 else torch.float32
            dim = layer.out_dim(use, k)
            a = plain.detach().movedim(dim, 0).reshape(run.batch, -1).to(work)
            b = other.detach().movedim(dim, 0).reshape(run.batch, -1).to(work)
            w = weights.to(work)[:, None]
            err = torch.addcmul(b, w, a, value=-1).norm(dim=1)  # one temporary
            scale = b.norm(dim=1) + w[:, 0].abs() * a.norm(dim=1)
            # Rounding is relative to each example's own row (independent rows are computed
            # from that example alone); a cross-example term is not.
            tol = math.sqrt(torch.finfo(plain.dtype).eps)
            excess.append((err - tol * (scale + 1e-6 * scale.max())).max())
            relative.append((err / scale.clamp_min(torch.finfo(work).tiny)).max().to(torch.float64))
            owners.append(use)
    if not excess:
        return
    flags = (torch.stack(excess) > 0).tolist()  # one read of the host for every layer
    dirty = [use for use, flag in zip(owners, flags) if flag]
    if not dirty:
        return
    worst = {id(use): float(r) for use, r, flag in zip(owners, relative, flags) if flag}
    tested = [use for block in blocks for layer in block for use in layer.uses]
    mixed, top, ops = _mixing_site(run, tested, {id(use) for use in dirty})
    names = run.recorder._names
    where = f"module {names.get(mixed.module)!r} ({type(mixed.module).__name__})"
    after = (
        "the losses"
        if top is None
        else (
            f"the input of module {names.get(top.module)!r} ({type(top.module).__name__}) (or "
            "inside that module's own forward)"
        )
    )
    ops = ops[::-1]  # met from the losses back: in forward order
    listed = (", ..., " if len(ops) > 12 else "") + ", ".join(ops[-12:])
    raise ValueError(
        f"{run.call}: the losses do not treat the examples independently: the output "
        f"gradient of {where} on example b also carries other examples' losses (a backward "
        "of sum_b u_b * losses[b] with random u differs from u_b times the plain one by up "
        f"to {worst.get(id(mixed), max(worst.values())):.2g} of an example's row), so its "
        "per-example gradients, G and the update would be wrong. The examples are mixed "
        f"between the output of {where} and {after}"
        + (f", by one of these ops (in forward order): {listed}" if listed else "")
        + ". The rules need loss b to depend on every hooked layer's output through row b "
        "alone: no reduction, normalisation, sort or permutation over dim 0 after a layer "
        "whose parameters count (h - h.mean(0), softmax(dim=0), batch statistics, h[perm], "
        "roll), no loss that reads other examples (pairwise, contrastive / InfoNCE), and "
        "every hooked layer with the examples along dim 0 (not time-major); mixing the "
        "inputs before the first layer is fine. Compute loss b from example b alone, or leave "
        "the parameters of the layers before the mixing out with inputs= (those after it "
        "stay exact), or use a per-example loop of torch.autograd.grad."
    )


def _verify_materialised(run: _Run, blocks: list[list[_Layer]]) -> None:
    """A module materialised by its functional call on each example alone (vmap or a loop)
    is exact only if its own forward treats the examples independently: its outputs on each
    example alone must be the rows of its output on the batch. Seen here: a module that
    mixes the examples inside its forward (batch statistics, a sort), where no hooked
    layer before it would show the mixing in its output gradients."""
    run.recorder._recording = False
    try:
        for block in blocks:
            for layer in block:
                if isinstance(layer, _Generic):
                    for use in layer.uses:
                        _compare_rows(run, layer, use)
    finally:
        run.recorder._recording = True


def _compare_rows(run: _Run, layer: _Layer, use: _Use) -> None:
    """One call's output on the batch against calls on single examples (all of them up to
    _ALONE, else _ALONE drawn by funcgrad's own generator): eager calls, as vmap would fall
    back to a slow loop for attention."""
    worst = _rows_differ(run, layer, use, None)
    state = [*layer.module.named_parameters(), *layer.module.named_buffers()]
    if worst is not None and any(
        t.is_floating_point() and t.dtype != torch.float64 for _, t in state
    ):
        # Rounding, not mixing? A float32 forward may cancel (h - h.mean(1) on large h) where
        # a single example's call rounds otherwise than the batch's: in float64 it decides.
        double = {n: t.double() if t.is_floating_point() else t for n, t in state}
        with contextlib.suppress(Exception):  # (one that cannot run in float64: as it was)
            worst = _rows_differ(run, layer, use, double)
    if worst is not None:
        raise ValueError(
            f"{run.call}: module {layer.name!r} ({type(layer.module).__name__}) does not "
            "treat the examples independently in its own forward: its output on each example "
            f"alone differs from its row of the output on the batch (by up to {worst:.2g} of "
            "a row, relative), so its per-example gradients, computed from calls on each "
            "example alone, would be wrong. It mixes the examples (a reduction, "
            "normalisation, sort or permutation over dim 0 inside it), or it takes an "
            "argument whose dim 0 has size B but is not per example (a (T, d) table with T "
            "== B: funcgrad splits every argument of size B along dim 0; make such a table "
            "a buffer or parameter of the module, or pass it as (1, T, d)). Make its "
            "forward treat each example alone, or leave its parameters out with inputs=."
        )


def _rows_differ(
    run: _Run, layer: _Layer, use: _Use, double: dict[str, torch.Tensor] | None
) -> float | None:
    """The worst relative difference between the module's rows on the batch and on single
    examples where it exceeds rounding (``double``: float64 copies of its parameters and
    buffers, run on float64 copies of the floating-point arguments); None where none does."""
    module = layer.module
    leaves, spec, dims = layer.leaf_dims(use)
    if double is not None:
        leaves = [
            x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in leaves
        ]
    batched = [i for i, dim in enumerate(dims) if dim is not None]
    positions = [i for i, _, _ in use.outputs]

    def call(values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        filled = list(leaves)
        for i, v in zip(batched, values):
            filled[i] = v
        args, kwargs = _pytree.tree_unflatten(filled, spec)
        # forward alone, as the rule's own calls: the user's forward hooks and backward
        # hooks are not run again (their effect is in the recorded output and gradients)
        flat = _pytree.tree_leaves(_bare_call(module, double, args, kwargs))
        return tuple(flat[i].detach() for i in positions)

    values = [leaves[i] for i in batched]
    narrow = [dims[i] for i in batched]
    if run.batch <= _ALONE:
        picked = list(range(run.batch))
    else:
        generator = torch.Generator().manual_seed(_PROBE_SEED)
        drawn = torch.randperm(run.batch, generator=generator, device=torch.device("cpu"))
        picked = sorted(drawn[:_ALONE].tolist())
    # As the recorded call (grad enabled: no inference fast paths); its warnings were given
    # by the user's forward already. The re-runs leave the random generators and the
    # module's buffers as they were.
    buffers = [(b, b.clone()) for b in module.buffers()]
    devices = [run.device] if run.device.type == "cuda" else []
    with (
        torch.enable_grad(),
        warnings.catch_warnings(),
        torch.random.fork_rng(devices=devices),
    ):
        warnings.simplefilter("ignore")
        try:
            whole = call(values)
            alone = [call([v.narrow(d, b, 1) for v, d in zip(values, narrow)]) for b in picked]
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
    index = torch.tensor(picked, device=run.device)
    outs = [layer.out_dim(use, k) for k in range(len(positions))]
    rows = [torch.cat(parts, dim).movedim(dim, 0) for parts, dim in zip(zip(*alone), outs)]
    whole = tuple(
        w.index_select(dim, index.to(w.device)).movedim(dim, 0) for w, dim in zip(whole, outs)
    )
    flags, relative = [], []
    for got, want in zip(rows, whole):
        tol = math.sqrt(torch.finfo(want.dtype).eps)
        work = torch.float64 if want.dtype == torch.float64 else torch.float32
        got = got.reshape(len(picked), -1).to(work)
        want = want.reshape(len(picked), -1).to(work)
        err = (got - want).norm(dim=1)
        scale = got.norm(dim=1) + want.norm(dim=1)
        flags.append((err - tol * (scale + 1e-6 * scale.max())).max())
        relative.append((err / scale.clamp_min(torch.finfo(work).tiny)).max())
    if not flags:
        return None
    bad = (torch.stack(flags) > 0).tolist()
    if not any(bad):
        return None
    return max(float(r) for r, flag in zip(relative, bad) if flag)


def _mixing_site(
    run: _Run, tested: list[_Use], dirty: set[int]
) -> tuple[_Use, _Use | None, list[str]]:
    """Where the examples mix: the stretch of graph between a point whose output gradients
    are clean (the losses, or the input of a checked layer that is clean) and a checked
    layer's mixed output, with the ops met on the way (by the graph's node names)."""
    by_edge = {key: use for top in run.recorder._uses for use in top.walk() for key in _keys(use)}
    starts: list[tuple[_Use | None, list[tuple[Any, int]]]] = [(None, [(run.losses.grad_fn, -1)])]
    for use in reversed(tested):
        if id(use) not in dirty:
            starts.append((use, [(e.node, e.output_nr) for e in use.upstream]))
    for top, stack in starts:
        ops: list[str] = []
        seen: set[Any] = set()
        hit: _Use | None = None
        while stack:
            node, nr = stack.pop(0)
            end = by_edge.get((node, nr))
            if end is not None:  # a recorded call's output: the stretch ends there
                if id(end) in dirty and hit is None:
                    hit = end
                continue
            if node in seen:
                continue
            seen.add(node)
            if getattr(node, "variable", None) is None:
                name = _op_name(node)
                if name not in ops and name != "backward_hook_function":  # a module hook's
                    ops.append(name)
            stack.extend((nxt, i) for nxt, i in node.next_functions if nxt is not None)
        if hit is not None:
            return hit, top, ops
    first = next(use for use in tested if id(use) in dirty)
    return first, None, []


def _op_name(node: Any) -> str:
    """``MeanBackward1`` -> ``mean``, ``NativeBatchNormBackward0`` -> ``native_batch_norm``."""
    name = re.sub(r"Backward\d*$", "", type(node).__name__).strip("_")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _refuse_foreign_reads(run: _Run, uses: list[_Use]) -> None:
    """Refuse a module materialised by its functional call (a custom module, a parent with
    its own parameters) that reads, in its own forward, a counted parameter that is not
    its own: a child's that it also calls (``h + F.linear(h, self.lin.weight)`` after
    ``self.lin(h)``), or another module's. The walk from the losses steps over every
    recorded call, and the child's rule sees only its own calls, so that use would be
    missed. Only the graph inside such calls is walked (nested calls stepped over)."""
    generic = [use for use in uses if _layer_class(use.module) is _Generic]
    if not generic:
        return
    by_edge = {key: use for top in run.recorder._uses for use in top.walk() for key in _keys(use)}
    for use in generic:
        called = _nested_params(use)
        own = {p for p in use.module.parameters() if p not in called}
        inner = {key: n for n in use.nested for key in _keys(n)}
        inputs = {(e.node, e.output_nr) for e in use.upstream}
        stack: list[tuple[Any, int]] = list(_keys(use))
        seen: set[Any] = set()
        while stack:
            key = stack.pop()
            if key in inputs:
                continue
            nested = inner.get(key)
            if nested is not None:  # a child's call: its own rule covers it
                stack.extend((e.node, e.output_nr) for e in nested.upstream)
                continue
            if by_edge.get(key, use) is not use:  # another recorded call, outside this one
                continue
            node = key[0]
            if node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)
            if isinstance(leaf, torch.Tensor) and leaf not in own and leaf in run.selected:
                name = run.recorder._names.get(use.module)
                why = (
                    "a child it also calls: the hooks see that child's calls, not this use"
                    if leaf in called
                    else "a parameter of another module"
                )
                raise ValueError(
                    f"{run.call}: module {name!r} ({type(use.module).__name__}) reads "
                    f"parameter {run.selected[leaf]!r} in its own forward, outside the calls "
                    f"of the module that holds it ({why}), so that use would be missing from "
                    "the per-example gradients. Use the parameter only through calls of its "
                    "module (self.lin(h) for every use, or a module whose weight is tied to "
                    "it), or leave it out with inputs=."
                )
            stack.extend((nxt, i) for nxt, i in node.next_functions if nxt is not None)
