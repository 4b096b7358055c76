"""Record: the module hooks' records of a forward (`_Use`), the marks that explain a record
that is gone, and the one backward that collects every recorded call's output gradients."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .._graph import nodes

if TYPE_CHECKING:
    from ._recorder import PerExample

_BACKWARD = "funcgrad.backward(losses, batch_dim=0)"
_GRAMIAN = "funcgrad.per_example_gramian(losses)"
_MARK = "funcgrad.per_example(model)"


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
    # weak references to the call's inputs and outputs that require grad: the check's extra
    # backward restores the .grad of those that retain it (Tensor.retain_grad)
    tensors: list[Any] = dataclasses.field(default_factory=list)
    # more gradient edges inside the call whose output gradients the one backward also
    # gives (attention's q, k, v heads: _attention._Attention.inner), and those gradients
    inner_edges: list[Any] = dataclasses.field(default_factory=list)
    inner_deltas: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    inner_input: torch.Tensor | None = None  # (attention: the out-projection's input)

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


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


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
    "ended": "the thread that ran their forward has ended, and its records with it (each "
    "thread's records are its own). Call gramian / backward / per_example_norms / "
    "per_example_clip in the thread that ran the forward, before it ends",
    "copy": "they come from a copy of a hooked model (copy.deepcopy copies its modules' "
    "hooks, funcgrad's too, but a copy's are inert: they record nothing). Hook the copy "
    "itself: `with funcgrad.per_example(copy) as pe:` around its forward and call",
}


# The key, in the graph node of an Embedding's output, of what funcgrad's expansion of an
# index shared by the batch saw (`_SharedUse`, see _recorder._SharedIndex).
_SHARED_ROWS = "funcgrad.per_example.shared_rows"


@dataclasses.dataclass
class _SharedUse:
    """An Embedding call whose (1, T) index funcgrad expanded to (B, T): ``other`` names the
    first use of its output that was not a broadcast against the batch (None: none was)."""

    batch: int
    other: str | None = None


def _shared_use(use: _Use) -> _SharedUse | None:
    metadata = getattr(use.edges[0].node, "metadata", None) if use.edges else None
    found = metadata.get(_SHARED_ROWS) if isinstance(metadata, dict) else None
    return found if isinstance(found, _SharedUse) else None


def _mark(node: Any, why: str) -> None:
    metadata = getattr(node, "metadata", None)
    if isinstance(metadata, dict):  # the first reason stays (consumed, then dropped)
        metadata.setdefault(_SPENT, why)


def _explain_spent(losses: torch.Tensor, call: str, recorder: PerExample | None) -> None:
    """Raise the reason that no record of the forward of ``losses`` is left, if known: our
    mark on one of its graph nodes, or a recorder whose hooks were removed."""
    for node in nodes([get_gradient_edge(losses).node]):
        metadata = getattr(node, "metadata", None)
        why = metadata.get(_SPENT) if isinstance(metadata, dict) else None
        if why in _WHY:
            raise ValueError(
                f"{call}: no record of the forward of these losses is left: {_WHY[why]}."
            )
    if recorder is not None and recorder._removed:
        raise ValueError(f"{call}: no record of the forward of these losses: {_WHY['removed']}.")


def _refuse_reentrant_checkpoint(losses: torch.Tensor, call: str) -> None:
    """Raise naming reentrant checkpointing where the graph of ``losses`` has one: it runs the
    checkpointed function without grad (the hooks record nothing there)."""
    for node in nodes([losses.grad_fn]):
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise ValueError(
                f"{call}: the losses come from torch.utils.checkpoint with use_reentrant=True, "
                "which runs the checkpointed function without grad (so the "
                "funcgrad.per_example hooks record none of its layers) and again inside the "
                "backward. Pass use_reentrant=False (supported: its recomputation is "
                "handled), or leave the checkpoint out under funcgrad.per_example."
            )


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
    the tensor itself is gone (its node keeps the dict). Read and set with the subclasses'
    ``__torch_function__`` off: a subclass may send ``_backward_hooks`` and ``grad_fn`` to
    another tensor (`_SharedRows` sends them to its row 0, a new view), which left this
    tensor's dict unset and made ``_register_hook_dict`` read a null dict (a segfault)."""
    with torch._C.DisableTorchFunctionSubclass():
        if tensor._backward_hooks is None:
            tensor._backward_hooks = OrderedDict()
            node = tensor.grad_fn
            assert node is not None  # a non-leaf
            node._register_hook_dict(tensor)
        hooks = tensor._backward_hooks
        assert hooks is not None
        return hooks


def _nested_params(use: _Use) -> set[torch.Tensor]:
    """The parameters that the calls nested in ``use`` handle (each its module's subtree)."""
    return {p for n in use.nested for p in n.module.parameters()}


def _own_task(losses: torch.Tensor) -> tuple[list[Any], Callable[[int], bool]]:
    """Which graph task is the backward from ``losses`` about to run: a pre-hook on
    ``losses.grad_fn`` (the root: it runs first in that backward) records the engine's
    graph task id the first time it fires, and ``ours(task_id)`` says whether a firing of a
    node's pre-hook belongs to it. A node's pre-hooks fire for EVERY backward that runs it:
    a user hook that calls ``torch.autograd.grad`` itself during ours (nested, same thread),
    or another thread's backward through the same graph, runs our pre-hooks too, with
    gradients that are not the ones our backward gives that node; those firings are ignored.
    The root's first firing is ours: a backward that reached ``losses.grad_fn`` before ours
    would have to start from a hook on the losses themselves (which fires again in it: no
    end) or run in another thread through the same graph at the same moment (a race that
    funcgrad does not support: the other thread's firings would then be the ones kept).
    Returns the handles to remove with the others, and ``ours``."""
    task: list[int] = []
    root = losses.grad_fn
    if root is None:  # (no backward to run: autograd.grad refuses it)
        return [], lambda _: True

    def first(grads: Any) -> None:
        if not task:
            task.append(torch._C._current_graph_task_id())

    return [root.register_prehook(first)], lambda t: bool(task) and t == task[0]


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
    handles, ours = _own_task(losses)
    for node in {e.node: None for e in edges}:

        def read(grads: Any, node: Any = node) -> None:
            if ours(torch._C._current_graph_task_id()):
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


def _streamed_grads(
    losses: torch.Tensor,
    edges: list[Any],
    retain_graph: bool,
    arrived: Callable[[int, torch.Tensor | None], None],
) -> None:
    """The gradients of ``losses.sum()`` at ``edges`` (as `_grads_after_hooks` gives them:
    after the tensor hooks and the nodes' pre-hooks), each handed to ``arrived(i, grad)``
    as soon as the backward reaches edge i, and held by nothing of the engine's after that.

    ``torch.autograd.grad(losses, edges)`` holds every captured gradient until the backward
    ends (all the layers' Δ at once). So only the edges with no other edge below them (the
    lowest layers') are passed to it; each other edge's node lies above one of those, so the
    engine runs it, and a pre-hook on it (registered last) reads what it receives. An edge
    whose node the backward never reaches is handed nothing (its gradient stays None)."""
    nodes = {e.node: None for e in edges}
    lower = _above_another(nodes)
    by_node: dict[Any, list[int]] = {}
    for i, e in enumerate(edges):
        by_node.setdefault(e.node, []).append(i)
    handles, ours = _own_task(losses)
    for node in nodes:
        if not lower[node]:
            continue

        def read(grads: Any, node: Any = node) -> None:
            if not ours(torch._C._current_graph_task_id()):
                return  # another backward through this node (a user hook's own grad)
            for i in by_node[node]:
                arrived(i, grads[edges[i].output_nr])

        handles.append(node.register_prehook(read))
    bottom = [i for i, e in enumerate(edges) if not lower[e.node]]
    try:
        found = torch.autograd.grad(
            losses,
            [edges[i] for i in bottom],
            grad_outputs=torch.ones_like(losses),
            retain_graph=retain_graph,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    for i, grad in zip(bottom, found):
        arrived(i, grad)


def _above_another(targets: dict[Any, None]) -> dict[Any, bool]:
    """For each node of ``targets``: whether another one of them lies below it (reachable
    along ``next_functions``). From each target, a walk down that stops at the first target
    it meets (the next hooked layer, a few nodes down); the nodes found to have none below
    are remembered across the walks, so that all of them together visit each node of the
    graph below at most once more than the paths they stop on."""
    clear: set[Any] = set()  # nodes with no target at or below them
    found: dict[Any, bool] = {}
    for root in targets:
        hit = False
        # (node, its children not yet walked); a node whose children are all clear is clear
        stack: list[tuple[Any, list[Any]]] = [(root, _children(root, clear))]
        while stack and not hit:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                if node is not root:
                    clear.add(node)
                continue
            child = todo.pop()
            if child in targets:
                hit = True
            else:
                stack.append((child, _children(child, clear)))
        found[root] = hit
    return found


def _children(node: Any, clear: set[Any]) -> list[Any]:
    return [c for c, _ in node.next_functions if c is not None and c not in clear]


# -- layers: one rule each -------------------------------------------------------------------
