"""The recorder: `PerExample`, whose module hooks record each layer's calls during the
user's forward, and the lookup of the recorder of a batch's losses."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree

from .._config import CheckMode
from .._errors import describe
from .._validate import outside_transforms
from ._layer import PerExamplePlan
from ._record import (
    _BACKWARD,
    _GRAMIAN,
    _MARK,
    _SHARED_ROWS,
    _batch_statistics,
    _direct,
    _explain_spent,
    _hook_dict,
    _hook_name,
    _keys,
    _mark,
    _reachable_edges,
    _refuse_batch_statistics,
    _refuse_reentrant_checkpoint,
    _SharedUse,
    _Use,
)
from ._run import _Run


def _is_recorder_hook(hook: Any) -> bool:
    return getattr(hook, "__func__", None) is PerExample._post


def _is_observer(hook: Any) -> bool:
    """A recorder's hook, or torch's ModuleTracker's (FlopCounterMode's): they return None."""
    if _is_recorder_hook(hook):
        return True
    from torch.utils.module_tracker import ModuleTracker

    return isinstance(getattr(hook, "__self__", None), ModuleTracker)


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
        _, non_full = module._get_backward_hooks()  # type: ignore[no-untyped-call]
        if non_full:
            return (
                f"a non-full backward hook ({_hook_name(non_full[0])}, register_backward_hook), "
                "which rewrites the gradients of its output's node, the parameters' included"
            )
    return None


class _ThreadRecords:
    """What each thread's forwards recorded, and where a thread's hooks record (the base of
    `PerExample`): the records, the recording flag, the frames of calls in progress and the
    plan are each thread's own (`_ThreadState`)."""

    _local: threading.local
    _threads: weakref.WeakSet[_ThreadState]
    _last_plan: PerExamplePlan | None
    _copied: bool

    def __getstate__(self) -> dict[str, Any]:
        """For a copy (``copy.deepcopy`` of a hooked model copies its hooks): the threads'
        records are not copied; the copy starts with none."""
        return {k: v for k, v in self.__dict__.items() if k not in _PER_THREAD}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # a copy's hooks (copy.deepcopy of a hooked model) record nothing: no call could
        # find it (it is not among the live recorders), so its records would only pile up;
        # it marks the outputs instead, so that a call on their losses says what happened
        self._copied = True
        self._local = threading.local()
        self._threads = weakref.WeakSet()

    @property
    def _state(self) -> _ThreadState:
        """This thread's records (made on its first use)."""
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
            self._threads.add(state)
        return state

    @property
    def _uses(self) -> list[_Use]:
        return self._state.uses

    @_uses.setter
    def _uses(self, uses: list[_Use]) -> None:
        self._state.uses = uses

    @property
    def _frames(self) -> list[tuple[nn.Module, list[_Use]]]:
        return self._state.frames

    @_frames.setter
    def _frames(self, frames: list[tuple[nn.Module, list[_Use]]]) -> None:
        self._state.frames = frames

    @property
    def _recording(self) -> bool:
        return self._state.recording

    @_recording.setter
    def _recording(self, recording: bool) -> None:
        self._state.recording = recording

    def _other_threads_record(self, losses: torch.Tensor) -> bool:
        """Whether another thread's forward recorded the losses' forward."""
        mine = self._state
        others = [s for s in list(self._threads) if s is not mine and s.uses]
        if not others or losses.grad_fn is None:
            return False
        reached = _reachable_edges(losses)
        return any(e in reached for s in others for u in list(s.uses) for e in _keys(u))

    def _target(self) -> _ThreadState:
        """The thread state that this thread's hooks record into: its own, or, where this
        thread has no call of the model in progress (nor a funcgrad call) and exactly one
        other thread has, that thread's: a worker thread running submodules for that
        thread's forward (an ensemble in a thread pool) records into that forward."""
        mine = self._state
        if mine.roots or not mine.recording:
            return mine
        busy = [s for s in list(self._threads) if s is not mine and s.busy()]
        return busy[0] if len(busy) == 1 else mine


class PerExample(_ThreadRecords):
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
        _check_model(model, batch_dim)
        self.model = model
        self.batch_dim = batch_dim
        self._copied = False  # a copy made by copy.deepcopy of the hooked model
        self._independent: set[tuple[Any, ...]] = set()  # signatures checked independent
        self._names = {module: name or "<model>" for name, module in model.named_modules()}
        # What a forward records, and whether the hooks record, is each thread's own: two
        # threads sharing the hooks (a forward and a call each) never see each other's calls.
        # A thread with no call of the model in progress records into the one thread that
        # has one (a worker of a thread pool running submodules of that forward); where
        # several have, into its own (and a call on those losses refuses: another thread).
        self._local = threading.local()
        self._threads: weakref.WeakSet[_ThreadState] = weakref.WeakSet()
        self._last_plan: PerExamplePlan | None = None
        self._removed = False
        self._handles: list[Any] = []  # torch.utils.hooks.RemovableHandle
        self._direct = {module: tuple(_direct(module)) for module in model.modules()}
        # the parameters a module's call reads itself: its own, and for attention its
        # out-projection's too (read by F.multi_head_attention_forward, not a call of it)
        self._reads = {
            module: (*params, *_functional_children(module))
            for module, params in self._direct.items()
        }
        self._batchnorms = {
            m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
        }
        # A module with children gets a frame (its pre-hook) that collects the calls nested
        # in it; a leaf module needs only its forward hook.
        self._parents = {m for m in model.modules() if next(m.children(), None) is not None}
        self._shared = _SharedIndex(self)
        _install_hooks(self, model)
        if any(_compiled(module) for module in model.modules()):
            _hooks_outside_compile(self)
        _RECORDERS.add(self)

    # Hooks ---------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._state.roots += 1  # a call of the model in progress in this thread

    def _leave(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        state = self._state
        state.roots = max(state.roots - 1, 0)

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._copied or module not in self._direct or not self._target().recording:
            return  # (not in _direct: a generic rule's private copy, _generic._private_tree)
        if module in self._batchnorms and _batch_statistics(module):  # before its forward
            _refuse_batch_statistics(self._names[module], module, "funcgrad.per_example")
        if module in self._parents and self._direct[module]:
            self._frames.append((module, []))

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._copied:
            _mark_copy(module, output)
            return
        if module not in self._direct:  # a generic rule's private copy of one of its modules
            return
        target = self._target()
        if not target.recording:
            return
        nested: list[_Use] = []
        if module in self._parents:
            frame = self._frames.pop() if self._frames else (module, [])
            while frame[0] is not module and self._frames:  # a call that raised left its frame
                frame = self._frames.pop()
            nested = frame[1] if frame[0] is module else []
        if not self._frames and target is not self._state:  # a worker's: into that forward
            enclosing = target.frames[-1][1] if target.frames else target.uses
        else:
            enclosing = self._frames[-1][1] if self._frames else self._uses
        # where this call is not recorded itself (its own parameters frozen), the calls
        # nested in it are kept, as calls of the enclosing frame
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in self._reads[module]):
            enclosing.extend(nested)
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
            enclosing.extend(nested)
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
                use.tensors.append(weakref.ref(x))
        enclosing.append(use)

    # Public --------------------------------------------------------------------------

    @property
    def plan(self) -> PerExamplePlan | None:
        """The rule each layer took in this thread's last call (None before any call; from
        another thread's last call where this thread made none)."""
        return self._state.plan or self._last_plan

    @plan.setter
    def plan(self, plan: PerExamplePlan | None) -> None:
        self._state.plan = self._last_plan = plan

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
        for state in list(self._threads):  # every thread's records
            for top in state.uses:
                for use in top.walk():
                    for edge in use.edges:
                        _mark(edge.node, "removed")
            state.uses, state.frames = [], []
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


def _install_hooks(recorder: PerExample, model: nn.Module) -> None:
    """The recorder's hooks on ``model`` and its modules (their handles in
    ``recorder._handles``): the record of each call of a module with parameters, the frames
    of parents, the model's own call in progress, and the expansion of a (1, T) index."""
    for module, params in recorder._direct.items():
        if type(module) is nn.Embedding:  # after the recorder's hook (prepended next)
            recorder._handles.append(
                module.register_forward_hook(
                    recorder._shared.wrap, with_kwargs=True, prepend=True, always_call=True
                )
            )
        if params or module in recorder._batchnorms:
            recorder._handles.append(
                module.register_forward_pre_hook(recorder._pre, with_kwargs=True)
            )
        if params:
            # First of the module's forward hooks, so that it sees the output of forward
            # itself (what the rules differentiate), before any user hook rescales it; and
            # called when forward raises, so that the call's frame is closed.
            recorder._handles.append(
                module.register_forward_hook(
                    recorder._post, with_kwargs=True, prepend=True, always_call=True
                )
            )
    # first of the model's pre-hooks, so that its own record (a model with parameters of
    # its own) sees the call in progress; last of its forward hooks
    recorder._handles.append(
        model.register_forward_pre_hook(recorder._enter, with_kwargs=True, prepend=True)
    )
    recorder._handles.append(
        model.register_forward_hook(recorder._leave, with_kwargs=True, always_call=True)
    )
    embeddings = [module for module in recorder._direct if type(module) is nn.Embedding]
    if not embeddings:  # no index to expand: the model's call needs no B (a module added
        return  # later is not hooked at all, `_direct` being fixed here)
    recorder._handles.append(
        model.register_forward_pre_hook(recorder._shared.root, with_kwargs=True)
    )
    recorder._handles.append(
        model.register_forward_hook(recorder._shared.root_done, with_kwargs=True, always_call=True)
    )
    for module in embeddings:
        recorder._handles.append(
            module.register_forward_pre_hook(recorder._shared.expand, with_kwargs=True)
        )


def _check_model(model: Any, batch_dim: int) -> None:
    """`per_example`'s refusals, before anything is hooked: not a module, a batch dim other
    than 0, a distributed model, batch statistics in training, parametrizations."""
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


def _mark_copy(module: nn.Module, output: Any) -> None:
    """The output of a call of a copied module marked as such (for the message of a call on
    its losses), unless a live recorder hooks that module too (the copy hooked itself)."""
    for hook in module._forward_hooks.values():
        owner: Any = getattr(hook, "__self__", None)
        if _is_recorder_hook(hook) and not owner._copied and not owner._removed:
            return
    for out in [output] if isinstance(output, torch.Tensor) else _pytree.tree_leaves(output):
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            _mark(out.grad_fn, "copy")


_PER_THREAD = ("_local", "_threads")  # not copied with a PerExample


class _ThreadState:
    """One thread's share of a `PerExample`: its forwards' records, the frames of its calls
    in progress, whether its hooks record (not during its own calls' functional calls), and
    its last plan."""

    def __init__(self) -> None:
        self.uses: list[_Use] = []
        self.frames: list[tuple[nn.Module, list[_Use]]] = []
        self.recording = True
        self.plan: PerExamplePlan | None = None
        self.roots = 0  # calls of the hooked model in progress

    def __del__(self) -> None:
        """The thread ended (its thread-local state freed): the graphs of the records it
        still held are marked, so that a call on their losses says so."""
        try:
            for top in self.uses:
                for use in top.walk():
                    for edge in use.edges:
                        _mark(edge.node, "ended")
        except Exception:  # (at interpreter shutdown)
            pass

    def busy(self) -> bool:
        """A call of the model (a forward) or a funcgrad call in progress."""
        return self.roots > 0 or not self.recording


class _SharedIndex:
    """An Embedding's index shared by the batch, (1, T) (the position ids of GPT-2 and BERT,
    broadcast against the (B, T, d) token embeddings), expanded to (B, T) before its forward,
    so that the output gradient stays per example where a broadcast would sum it over the
    batch (losing each example's share). The forward stays the model's own: the (B, T, d)
    output is handed on as `_SharedRows`, which acts as the (B, T, d) rows only where they
    are broadcast against a (B, ...) tensor (the same values), and as the (1, T, d) output
    (its row 0) everywhere else; such another use is noted, and the call then refuses that
    Embedding's per-example gradients.

    B is the batch of the hooked model's own call, during that call only: dim 0 of its first
    tensor argument (in any position, keywords included) whose dim 0 is not 1 (none: nothing
    is expanded, and the call refuses the (1, T, d) output clearly); in a backward (a
    non-reentrant checkpoint's recomputation) the last call's. A wrong B cannot change the
    forward (the rows are used only against a tensor with B rows there, where they give the
    same values), and the call refuses an output whose dim 0 is not the losses' B."""

    def __init__(self, recorder: PerExample) -> None:
        self.recorder = weakref.ref(recorder)
        self._local = threading.local()  # each thread's model calls are its own

    def __getstate__(self) -> dict[str, Any]:
        return {"recorder": self.recorder}  # a copy: no call in progress

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.recorder = state["recorder"]
        self._local = threading.local()

    @property
    def batches(self) -> list[int | None]:
        """This thread's calls of the model in progress (nested: a stack), their B."""
        if not hasattr(self._local, "batches"):
            self._local.batches = []
        batches: list[int | None] = self._local.batches
        return batches

    @property
    def last(self) -> int | None:
        last: int | None = getattr(self._local, "last", None)
        return last

    @last.setter
    def last(self, batch: int | None) -> None:
        self._local.last = batch

    @property
    def pending(self) -> dict[nn.Module, list[tuple[int, torch.Tensor]]]:
        """Embedding -> this thread's calls in progress that got an expanded index: (B,
        that index)."""
        if not hasattr(self._local, "pending"):
            self._local.pending = {}
        pending: dict[nn.Module, list[tuple[int, torch.Tensor]]] = self._local.pending
        return pending

    def active(self) -> bool:
        recorder = self.recorder()
        return recorder is not None and not recorder._removed and torch.is_grad_enabled()

    def root(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        batch = None
        if self.active():
            leaves = _pytree.tree_leaves((args, kwargs))
            sizes = (int(x.shape[0]) for x in leaves if isinstance(x, torch.Tensor) and x.ndim)
            batch = next((size for size in sizes if size != 1), None)
            self.last = batch
        self.batches.append(batch)

    def root_done(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.batches:
            self.batches.pop()
        if not self.batches:
            self.pending.clear()

    def batch(self) -> int | None:
        if self.batches:
            return self.batches[-1]
        if torch._C._current_graph_task_id() != -1:  # a recomputation inside a backward
            return self.last
        return None

    def expand(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        batch = self.batch() if self.active() else None
        index = args[0] if args else kwargs.get("input")
        weight = getattr(module, "weight", None)
        if (
            batch is None
            or batch == 1
            or not isinstance(weight, torch.Tensor)
            or not weight.requires_grad
            or not isinstance(index, torch.Tensor)
            or index.ndim < 2
            or index.shape[0] != 1
        ):
            return None
        expanded = index.expand(batch, *index.shape[1:])
        self.pending.setdefault(module, []).append((batch, expanded))
        if args:
            return (expanded, *args[1:]), kwargs
        return args, {**kwargs, "input": expanded}

    def wrap(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """After the recorder's hook (which recorded the (B, T, d) output and its edge): the
        output handed on as `_SharedRows`."""
        calls = self.pending.get(module)
        index = args[0] if args else kwargs.get("input")
        if not calls or calls[-1][1] is not index:  # not a call whose index was expanded
            return None
        batch = calls.pop()[0]
        if type(output) is not torch.Tensor or output.ndim < 1 or output.shape[0] != batch:
            return None
        state = _SharedUse(batch)
        if output.grad_fn is not None and isinstance(output.grad_fn.metadata, dict):
            output.grad_fn.metadata[_SHARED_ROWS] = state
        return _SharedRows.wrap(output, state)


def _broadcast_ops() -> set[Any]:
    T = torch.Tensor
    names = ["add", "sub", "mul", "div", "true_divide"]
    found: set[Any] = {getattr(torch, n) for n in names}
    found |= {getattr(T, n) for n in names} | {getattr(T, n + "_") for n in names}
    for n in ("add", "sub", "mul", "truediv"):
        found |= {getattr(T, f"__{n}__"), getattr(T, f"__i{n}__")}
    return found


def _row_ops() -> set[Any]:
    T = torch.Tensor
    return {T.to, T.contiguous, T.clone, T.float, T.double, T.half, T.bfloat16, T.type_as}


_BROADCAST = _broadcast_ops()  # elementwise, broadcasting binary ops
_EXPAND = {torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to}
_ROWS = _row_ops()  # ops that keep each row as it is


class _SharedRows(torch.Tensor):
    """The (B, T, d) output of an Embedding whose (1, T) index funcgrad expanded: B equal
    rows, standing for the (1, T, d) output that the model computes outside funcgrad.

    In a broadcasting add / sub / mul / div with a tensor whose dim aligned with its dim 0
    has size B (``x + pos``, ``h += pos``), the result is the same as the (1, T, d) output's,
    and each example's output gradient stays in its own row: the rows are used. So for an
    expand to B rows (``pos.expand(B, -1, -1)``), and for ``.to`` / ``.contiguous`` /
    ``.clone`` / ``.float`` (the rows kept, still shared). Any
    other use (``pos.sum(0)``, ``pos[0]``, ``pos.squeeze(0)``, ``pos.shape``, a second
    shared tensor) gets row 0, the (1, T, d) output itself, so that the forward and a plain
    backward are the model's own; a use that carries gradient is noted in the call's
    `_SharedUse`, and per-example calls refuse that Embedding."""

    _funcgrad_shared: _SharedUse

    @staticmethod
    def wrap(tensor: torch.Tensor, state: _SharedUse) -> _SharedRows:
        with torch._C.DisableTorchFunctionSubclass():
            rows = tensor.as_subclass(_SharedRows)
        rows._funcgrad_shared = state
        return rows

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        shared = [x for x in _pytree.tree_leaves((args, kwargs)) if isinstance(x, _SharedRows)]
        state = shared[0]._funcgrad_shared
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.register_hook and args and args[0] is shared[0]:
                return _summed_hook(args[0], args[1] if len(args) > 1 else kwargs["hook"])
            if func in _BROADCAST and _broadcasts(func, args, kwargs, state.batch):
                return func(*args, **kwargs)
            if func in _EXPAND and len(shared) == 1 and _expands(args, kwargs, state.batch):
                return func(*args, **kwargs)  # to B rows: the same values as from one row
            if func in _ROWS and len(shared) == 1 and args and args[0] is shared[0]:
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.shape == args[0].shape:
                    return _SharedRows.wrap(out, state)
                return out
            rows = _pytree.tree_map(
                lambda x: x.narrow(0, 0, 1) if isinstance(x, _SharedRows) else x, (args, kwargs)
            )
            out = func(*rows[0], **rows[1])
        if state.other is None and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in _pytree.tree_leaves(out)
        ):
            state.other = getattr(func, "__name__", None) or repr(func)
        return out


def _summed_hook(rows: _SharedRows, hook: Callable[[torch.Tensor], Any]) -> Any:
    """A tensor hook on the rows (it went to row 0, a throw-away view, and never fired): on
    the (B, T, d) rows themselves, called with the (1, T, d) gradient that the model's output
    gets outside funcgrad (the rows' sum); a gradient it returns goes to row 0, the other
    rows zero (the Embedding's backward sums them: the same gradient). The hook sees the
    batch's sum, so the call then refuses that Embedding's per-example gradients (noted as
    another use)."""
    if rows._funcgrad_shared.other is None:
        rows._funcgrad_shared.other = "register_hook"

    def summed(grad: torch.Tensor) -> torch.Tensor | None:
        new = hook(grad.sum(0, keepdim=True))
        if new is None:
            return None
        return torch.cat([new, new.new_zeros((grad.shape[0] - 1, *new.shape[1:]))])

    return torch.Tensor.register_hook(rows, summed)  # type: ignore[no-untyped-call]


def _expands(args: Any, kwargs: Any, batch: int) -> bool:
    """Whether an expand of the rows (``pos.expand(B, -1, -1)``, ``expand_as(x)``,
    ``broadcast_to``) gives what it gives on the (1, ...) output: the size it asks at the dim
    of the rows' dim 0 is B."""
    rows = args[0] if args else None
    if not isinstance(rows, _SharedRows) or "out" in kwargs:
        return False
    rest = [*args[1:], *kwargs.values()]
    if len(rest) == 1 and isinstance(rest[0], torch.Tensor):
        sizes: list[Any] = list(rest[0].shape)  # expand_as
    elif len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        sizes = list(rest[0])
    else:
        sizes = list(rest)
    lead = len(sizes) - rows.ndim
    return lead >= 0 and sizes[lead] == batch and all(isinstance(n, int) for n in sizes)


def _broadcasts(func: Any, args: Any, kwargs: Any, batch: int) -> bool:
    """Whether ``func`` (an elementwise binary op) on the rows gives what it gives on the
    (1, ...) output: every shared operand meets a plain tensor operand whose dim aligned
    with its dim 0 has size B, and none is written in place."""
    if "out" in kwargs or len(args) < 2:
        return False
    operands = [*args[:2], kwargs.get("other")]
    name = getattr(func, "__name__", "")
    if (name.endswith("_") or name.startswith("__i")) and isinstance(args[0], _SharedRows):
        return False  # written in place: its rows would be the model's tensor
    plain = [x for x in operands if isinstance(x, torch.Tensor) and not isinstance(x, _SharedRows)]
    for x in operands:
        if isinstance(x, _SharedRows) and not any(
            o.ndim >= x.ndim and o.shape[o.ndim - x.ndim] == batch for o in plain
        ):
            return False
    return True


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
        if isinstance(losses, torch.Tensor) and not outside_transforms([losses]):
            raise RuntimeError(
                f"{call} was called inside a torch.func transform or an f that funcgrad "
                "differentiates, where per-example hooks record no forward. Call it outside "
                "f, or use funcgrad.compose_heads (per-example losses as heads) inside f."
            )
        if isinstance(losses, torch.Tensor) and losses.grad_fn is not None:
            for recorder in list(_RECORDERS):
                _refuse_other_thread(recorder, losses, call)
            _explain_spent(losses, call, None)
            _refuse_reentrant_checkpoint(losses, call)
        raise ValueError(
            f"{call}: no funcgrad.per_example hooks recorded the forward of these losses; "
            "per-example Gramians need each layer's input, recorded during the forward. "
            "Hook the model before the forward: `with funcgrad.per_example(model) as pe: "
            "losses = criterion(model(x), y); pe.backward(losses, weighting=...)`."
        )
    raise ValueError(
        f"{call}: {len(live)} funcgrad.per_example hooks recorded the forward of these losses "
        "(a model and one of its submodules both hooked?), so which one to use is unclear. "
        "Hook the model once (remove the other: pe.remove()), or call .gramian / .backward on "
        "the PerExample you mean (per_example_norms and per_example_clip have no such "
        "method: keep one hook for them)."
    )


def _refuse_other_thread(recorder: PerExample, losses: torch.Tensor, call: str) -> None:
    """Raise where another thread's forward recorded the forward of ``losses``: the records
    are each thread's own, so that threads sharing one `PerExample` never mix their calls."""
    if recorder._other_threads_record(losses):
        raise ValueError(
            f"{call}: the forward of these losses ran in another thread. The records of "
            "funcgrad.per_example are each thread's own (so that threads sharing the hooks "
            "never see each other's calls): call gramian / backward / per_example_norms / "
            "per_example_clip in the thread that ran the forward."
        )


def _functional_children(module: nn.Module) -> tuple[nn.Parameter, ...]:
    """The parameters of ``module``'s children that its forward reads without calling them:
    nn.MultiheadAttention's out-projection (a weight and bias read by
    F.multi_head_attention_forward); none for other modules."""
    if isinstance(module, nn.MultiheadAttention):
        return tuple(module.out_proj.parameters())
    return ()


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` is compiled: ``torch.compile(module)``'s wrapper (OptimizedModule),
    or ``module.compile()`` in place."""
    return type(module).__name__ == "OptimizedModule" or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def _hooks_outside_compile(recorder: PerExample) -> None:
    """The recorder's module hooks, each run outside torch.compile (``torch.compiler.disable``:
    a graph break around it): inside a compiled module's forward, dynamo would trace them
    (its internal error on ``torch.compile(custom_module)``'s wrapper). Only for a model that
    holds a compiled module: the wrapper costs about 2 µs a hook call."""
    for handle in recorder._handles:
        refs = handle.hooks_dict_ref
        for ref in refs if isinstance(refs, tuple) else (refs,):
            hooks = ref()
            if hooks is not None and handle.id in hooks:
                hooks[handle.id] = _OutsideCompile(hooks[handle.id])


class _OutsideCompile:
    """A recorder's hook (a bound method) run outside torch.compile. Told as that method (its
    ``__func__`` and ``__self__``: `_is_recorder_hook`), and copied as it is by
    ``copy.deepcopy`` of the hooked model: the copy's hooks then belong to the copy's
    recorder (which records nothing, and names the copy in its message), not the original's
    (a function wrapper is not copied, so its ``__self__`` stayed the original recorder)."""

    def __init__(self, hook: Any) -> None:
        self.__func__, self.__self__ = hook.__func__, hook.__self__

    @torch.compiler.disable(recursive=True)  # type: ignore[no-untyped-call, untyped-decorator]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)
