"""Walking an autograd graph by gradient edges, before any backward runs.

``funcgrad.grads`` and ``funcgrad.backward`` check here that the outputs reach the inputs
only through ``through``, and ``backward`` finds the shared and the task-specific leaves;
the same walk tells which nodes the call frees in torch's terms (:class:`Graph`), so that a
later backward through them raises as torch's would (:func:`spent`, :func:`spend`).
An op with several outputs (unbind, split, max(dim)) has one node for all of them; the
edge's output index tells them apart, so the walk reasons in edges, not nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ._types import Tensors
from ._validate import untracked

Edge = tuple[Any, int]

# The start of torch's message for a backward through saved tensors that an earlier backward
# freed (funcgrad's own, SECOND_BACKWARD, starts alike).
FREED_GRAPH = "Trying to backward through the graph a second time"


def edge(t: torch.Tensor) -> Edge:
    """The gradient edge into ``t``: (node, output index). (torch finds a leaf's node through
    a view, made here outside inference mode, which would leave it without a graph, and as
    on a plain tensor: a subclass's ``__torch_function__`` would give a new view node each
    time instead of the leaf's own.)"""
    node = t.grad_fn
    if node is not None:  # (what get_gradient_edge gives, without its view and token)
        return node, t.output_nr
    if (
        type(t) in _PLAIN
        and t.requires_grad
        and torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
    ):  # (a plain leaf, the usual input: its own node through a view, as torch finds it)
        view = t.view_as(t).grad_fn
        if view is None:  # (inside a torch.func transform that does not track t)
            raise Untracked
        leaf: Edge = view.next_functions[0]
        return leaf
    with torch.inference_mode(False), torch._C.DisableTorchFunctionSubclass():
        e = torch.autograd.graph.get_gradient_edge(t)
    return e.node, e.output_nr


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Untracked(Exception):
    """Internal: :func:`edge` of a leaf that requires grad but that the torch.func transform
    the call runs inside does not track (captured from outside it): no backward at this
    level reaches it. Callers name the tensor (:func:`funcgrad._validate.untracked`)."""


def edges_of(tensors: Tensors, name: str, call: str) -> list[Edge]:
    """:func:`edge` of each tensor, an untracked one named (``name[i]``) in a clear error."""
    found = []
    for i, t in enumerate(tensors):
        try:
            found.append(edge(t))
        except Untracked:
            raise untracked(f"`{name}`[{i}]", call) from None
    return found


def nodes(starts: Iterable[Any]) -> Iterator[Any]:
    """Each autograd node reached from ``starts`` (nodes, ``None`` skipped), once, depth
    first: for the checks that look for one kind of node below some tensors."""
    todo = list(starts)
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(parent for parent, _ in node.next_functions)


def _parents(e: Edge) -> list[Edge]:
    return [(node, nr) for node, nr in e[0].next_functions if node is not None]


def walk(
    starts: list[Edge],
    targets: dict[Edge, int],
    stop: dict[Edge, int],
    leaves: dict[Edge, torch.Tensor] | None = None,
    into: dict[Any, list[Any]] | None = None,
    nodes: set[Any] | None = None,
    ends: list[Any] | None = None,
) -> tuple[set[int], set[int]]:
    """(indices of the target edges, indices of the stop edges) reached from ``starts``,
    never past a stop edge (checked first). If given, ``leaves`` gets the leaf tensors
    reached, ``into`` each node gone past (node -> the nodes that pass gradients into it),
    ``nodes`` those nodes but leaves, ``ends`` every node where a path ends other than at a
    stop edge. Gradient entering a node by any output is taken to reach all of its inputs,
    so a dependency is never missed."""
    found: set[int] = set()
    stopped: set[int] = set()
    seen, todo = set(starts), list(starts)
    # (One read of next_functions per edge: only a leaf's AccumulateGrad node has no parents.)
    while todo:
        e = todo.pop()
        if stop and e in stop:
            stopped.add(stop[e])
            continue
        if targets and e in targets:
            found.add(targets[e])
        node = e[0]
        parents = node.next_functions
        if not parents:
            if leaves is not None and hasattr(node, "variable"):
                leaves.setdefault(e, node.variable)
            if ends is not None:
                ends.append(node)
            continue
        if nodes is not None:
            nodes.add(node)
        dead = True
        for parent in parents:
            if parent[0] is None:
                continue
            dead = False
            if into is not None:
                into.setdefault(parent[0], []).append(node)
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
        if dead and ends is not None:
            ends.append(node)
    return found, stopped


# The backward node of torch.utils.checkpoint(use_reentrant=True) (transformers' default): it
# calls .backward() on its recomputed forward, so the leaves inside are no edges of the graph
# and only .backward() accumulates their gradients (torch.autograd.grad never reaches them).
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


# The backward node of a torch.compile'd region (AOTAutograd), which torch 2.13 may run wrongly a
# second time on one graph: a second pass is checked (docs/reliability.md, _linearize).
COMPILED_BACKWARD = "CompiledFunctionBackward"


# The backward node that a module's full backward hook (register_full_backward_hook) puts on
# its inputs and outputs: the hook reads the gradients that pass through it.
MODULE_HOOK = "BackwardHookFunctionBackward"


@dataclasses.dataclass(frozen=True)
class Scan:
    """What one walk of the whole graph below some outputs found (see :func:`scan`)."""

    checkpoint: bool  # a reentrant checkpoint (see REENTRANT_CHECKPOINT)
    compiled: bool  # a torch.compile'd backward (see COMPILED_BACKWARD)
    outside: bool  # a leaf that requires grad other than the ``own`` leaves


def scan(outputs: Sequence[torch.Tensor], own: Sequence[torch.Tensor] = ()) -> Scan:
    """One walk of every node below ``outputs``: whether it holds a reentrant checkpoint, a
    torch.compile'd backward, and a leaf that requires grad other than ``own`` (leaf
    tensors): whether something else (an input that requires grad, through its view in
    ``own``; a captured parameter) links the outputs to the graph outside. A node that ends
    the walk and is not one of ``own`` counts as outside (the answer errs towards linked,
    never towards detached)."""
    mine = {id(t) for t in own}
    outside = False
    todo = []
    for t in outputs:
        if t.grad_fn is not None:
            todo.append(t.grad_fn)
        elif t.requires_grad and id(t) not in mine:  # f returned a leaf from outside
            outside = True
    seen = set(todo)
    checkpoint = compiled = False
    while todo:
        node = todo.pop()
        parents = node.next_functions
        if not parents:
            outside = outside or id(getattr(node, "variable", None)) not in mine
            continue
        kind = _kind(node)
        checkpoint, compiled = checkpoint or kind.checkpoint, compiled or kind.compiled
        for parent, _ in parents:
            if parent is not None and parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return Scan(checkpoint, compiled, outside)


def through_edges(through: Tensors, call: str) -> dict[Edge, int]:
    """The gradient edges of ``through``, checked to be distinct and independent: pulling
    back through a tensor and one computed from it would count that path twice."""
    edges: dict[Edge, int] = {}
    for j, y in enumerate(through):
        e = edge(y)
        if e in edges:
            raise ValueError(
                f"{call}: through[{j}] is the same tensor as through[{edges[e]}]; "
                "list each intermediate once."
            )
        edges[e] = j
    for j, e in enumerate(edges if len(edges) > 1 else ()):  # (one tensor: nothing to walk)
        others = {o: i for o, i in edges.items() if o != e}
        _, above = walk(_parents(e), {}, others)
        if above:
            raise ValueError(
                f"{call}: through[{j}] is computed from through[{min(above)}], so pulling "
                "back through both would count that path twice. Pass only the independent "
                f"intermediates (drop through[{min(above)}] or through[{j}])."
            )
    return edges


def check_paths(
    outputs: Tensors, inputs: Tensors, through: Tensors, allow_unused: bool, call: str
) -> Graph:
    """``through`` lists independent tensors, every output reaches ``through`` and reaches
    the inputs only through it, and ``through`` reaches every input (unless allow_unused).
    Returns the :class:`Graph` of ``torch.autograd.grad(outputs, inputs)``, from the same
    walk."""
    edges = edges_of(inputs, "inputs", call)
    input_edges: dict[Edge, int] = {}
    for i, e in enumerate(edges):
        input_edges.setdefault(e, i)  # a repeated input is answered like its first
    stops = through_edges(through, call)
    # (ends: where a path from the outputs ends other than at `through`)
    parts, bypassing, reaching, ends = _walk_outputs(outputs, input_edges, stops)
    for i in range(len(outputs)):
        bypass = bypassing.get(i)
        if not reaching[i]:
            raise ValueError(
                f"{call}: outputs[{i}] does not depend on `through`; every output must be "
                "computed from it (z = g(y)). Drop that output or compute it from `through`."
            )
        if bypass:
            raise ValueError(
                f"{call}: outputs[{i}] depends on inputs[{min(bypass)}] other than through "
                "`through`, so pulling back through `through` alone would miss that path. "
                "Add the intermediate it uses to `through`, or use torch.autograd.grad."
            )
    below: dict[Any, list[Any]] = {}
    _, reached = walk(list(stops), {}, input_edges, into=below)  # (no further than inputs)
    # (Where every path from the outputs ends at `through`, Graph.of needs no map of the
    # nodes above it: the usual case, without building one.)
    above = _into(set().union(*parts)) if ends else None
    graph = Graph.of(
        above, below, stops, {e[0] for e in input_edges}, parts, leaves_above=bool(ends)
    )
    if not allow_unused and not graph.checkpoint:
        if any(input_edges[e] not in reached for e in edges):
            # (that walk stops at the inputs: one input may be reached only through another,
            # W behind h = tanh(W @ x) in inputs=[W, h], which torch answers; walk past them)
            reached, _ = walk(list(stops), input_edges, {})
        for i, e in enumerate(edges):
            if input_edges[e] not in reached:
                raise ValueError(
                    f"{call}: `through` does not depend on inputs[{i}]; pass allow_unused=True "
                    "to get zeros for it (torch.autograd.grad would give None)."
                )
    return graph


Walked = tuple[list[set[Any]], dict[int, set[int]], list[bool], list[Any]]


def _walk_outputs(
    outputs: Tensors,
    targets: dict[Edge, int],
    stops: dict[Edge, int],
    leaves: list[dict[Edge, torch.Tensor]] | None = None,
) -> Walked:
    """:func:`walk` from each output on its own: (each output's nodes, see ``nodes`` there;
    the indices of the targets each reaches other than through a stop edge; whether each
    reaches a stop edge; ``ends`` as there), and each output's ``leaves`` if given."""
    parts: list[set[Any]] = []
    bypassing: dict[int, set[int]] = {}
    reaching: list[bool] = []
    ends: list[Any] = []
    for i, z in enumerate(outputs):
        parts.append(set())
        mine = None if leaves is None else leaves[i]
        found, stopped = walk([edge(z)], targets, stops, mine, nodes=parts[i], ends=ends)
        if found:
            bypassing[i] = found
        reaching.append(bool(stopped))
    return parts, bypassing, reaching, ends


def split_leaves(
    losses: Tensors,
    names: list[str],
    through: Tensors,
    inputs: list[tuple[str, torch.Tensor]] | None,
    call: str,
) -> tuple[dict[Edge, torch.Tensor], dict[Edge, str], list[dict[Edge, torch.Tensor]], Graph]:
    """(shared leaves, their names, each loss's task-specific leaves, the :class:`Graph` of
    the backward of the losses into them), from one walk of the graph: shared ones are those
    ``through`` depends on (or those of ``inputs``); a loss's own are those it reaches
    without passing through ``through``."""
    stops = through_edges(through, call)
    below: dict[Edge, torch.Tensor] = {}
    below_into: dict[Any, list[Any]] = {}
    walk(list(stops), {}, {}, below, below_into)
    leaf_names: dict[Edge, str] = {}
    hidden = _checkpoints(stops, below_into)  # (passed on to Graph.of)
    if hidden and inputs is None:
        raise ValueError(
            f"{call}: the graph below `through` holds a reentrant checkpoint "
            "(torch.utils.checkpoint with use_reentrant=True, transformers' default gradient "
            "checkpointing): the parameters inside it are reached only by .backward(), not by "
            "walking the graph. Pass inputs=model.parameters() (the shared parameters), or "
            "checkpoint with use_reentrant=False."
        )
    if inputs is None:
        shared = below
    else:
        shared = {}
        for name, x in inputs:
            e = edge(x)
            leaf_names.setdefault(e, name)
            # As torch.autograd.backward: an unused input is left alone (unless a reentrant
            # checkpoint hides which inputs are used).
            if e in below or hidden:
                shared.setdefault(e, x)
    if not shared:
        raise ValueError(
            f"{call}: `through` depends on no "
            + ("leaf that requires grad" if inputs is None else "tensor of `inputs`")
            + ", so there is nothing shared to update. Pass the features computed by the "
            "shared model, or use sum(losses).backward()."
        )
    per_task: list[dict[Edge, torch.Tensor]] = [{} for _ in losses]
    # (ends: where a path from the losses ends other than at `through`)
    parts, _, reaching, ends = _walk_outputs(losses, {}, stops, per_task)
    for name, own, reached in zip(names, per_task, reaching, strict=True):
        if not reached:
            raise ValueError(
                f"{call}: {name} does not depend on `through`; every loss must be computed "
                "from the shared features. Drop it, or add its features to `through`."
            )
        for e, leaf in own.items():
            if e in below:
                kind = "a parameter" if isinstance(leaf, torch.nn.Parameter) else "a leaf tensor"
                where = leaf_names.get(
                    e,
                    f"{kind} of shape {tuple(leaf.shape)} (pass inputs=model.named_parameters() "
                    "to have it named)",
                )
                raise ValueError(
                    f"{call}: {name} reaches {where} other than through `through`, so that "
                    "leaf is both shared and task-specific and its weighted gradient would "
                    "miss a path. Add the intermediate that the loss uses to `through` (or "
                    "detach it)."
                )
    targets = {e[0] for leaves in (shared, *per_task) for e in leaves}
    # (Where every path from the losses ends at `through` or at a loss's own leaf, a
    # target, Graph.of needs no map of the nodes above it.)
    above = None if all(node in targets for node in ends) else _into(set().union(*parts))
    graph = Graph.of(above, below_into, stops, targets, parts, hidden, leaves_above=bool(ends))
    return shared, leaf_names, per_task, graph


def _into(nodes: set[Any]) -> dict[Any, list[Any]]:
    """Node -> the nodes among ``nodes`` that pass gradients into it (what :func:`walk`'s
    ``into`` records of the nodes it goes past)."""
    into: dict[Any, list[Any]] = {}
    for node in nodes:
        for parent, _ in node.next_functions:
            if parent is not None:
                into.setdefault(parent, []).append(node)
    return into


def _alone(parts: list[set[Any]]) -> tuple[list[bool], set[Any]]:
    """From each output's nodes above ``through`` (in call order): whether no later output's
    backward runs any of them, so that its own backward may free them (retain_graph=False,
    as torch's would), and the nodes those backwards free."""
    union = set().union(*parts)
    if len(union) == sum(map(len, parts)):  # (disjoint, the usual case: all alone)
        return [True] * len(parts), union
    alone, later = [True] * len(parts), set[Any]()
    for i in range(len(parts) - 1, -1, -1):
        alone[i] = later.isdisjoint(parts[i])
        later |= parts[i]
    return alone, set().union(*(part for part, free in zip(parts, alone) if free))


def _runs(into: Mapping[Any, list[Any]], targets: set[Any], checkpoints: list[Any]) -> set[Any]:
    """The nodes a backward into ``targets`` runs: those that reach one of them (by ``into``,
    see :func:`walk`), and whatever a reentrant checkpoint reaches."""
    runs = set(checkpoints)
    todo = [*targets, *runs]
    while todo:
        for node in into.get(todo.pop(), ()):
            if node not in runs:
                runs.add(node)
                todo.append(node)
    return runs


def _checkpoints(stops: Mapping[Edge, int], into: Mapping[Any, list[Any]]) -> list[Any]:
    """The reentrant checkpoints among the nodes of a walk from ``stops`` (see :func:`walk`)."""
    nodes = {e[0] for e in stops} | into.keys()
    return [node for node in nodes if _kind(node).checkpoint]


@dataclasses.dataclass
class Graph:
    """What the walk of one call's graph found for the backward that the call stands for
    (from the outputs into the wanted gradients): ``freed``, the nodes it runs that save
    tensors, which torch's engine frees without ``retain_graph`` (those above a wanted
    gradient's node, as the engine prunes: where a later backward raises in torch), and
    whether a reentrant checkpoint lies between ``through`` and the wanted gradients."""

    freed: list[Any]
    checkpoint: bool
    upper: set[Any]  # the nodes above ``through`` and its own nodes
    heads: set[Any]  # the nodes above ``through`` (not its own)
    # A sparse embedding's backward runs (Embedding/EmbeddingBag with sparse=True): vmap
    # cannot batch its sparse gradient (a batched pull would fail there, after freeing the
    # nodes above it where it frees the graph), so the pulls loop.
    sparse: bool = False
    # Per output (loss), in call order: whether its nodes above ``through`` are none of a
    # later output's, so that its own backward to ``through`` may free them; and the nodes
    # those backwards free (see :func:`_alone`).
    alone: list[bool] = dataclasses.field(default_factory=list)
    freed_by_losses: set[Any] = dataclasses.field(default_factory=set)
    # A torch.compile'd backward runs (see COMPILED_BACKWARD): a second pass is checked.
    compiled: bool = False
    # The walk from the outputs met a leaf other than through ``through`` (a head's own
    # parameter): see :meth:`refusing`. (True where unknown: the full search.)
    leaves_above: bool = True
    # A module's full backward hook runs from ``through`` down (see MODULE_HOOK), or a custom
    # autograd.Function not known to be linear (see _Kind): it must see the gradients
    # torch's backward would give it, not ``through``'s unit directions.
    hooked: bool = False

    @classmethod
    def of(
        cls,
        above: dict[Any, list[Any]] | None,
        below: dict[Any, list[Any]],
        stops: Mapping[Edge, int],
        targets: set[Any],
        parts: list[set[Any]],
        checkpoints: list[Any] | None = None,
        *,
        leaves_above: bool = True,
    ) -> Graph:
        """From the walks above ``through`` (stopped at its ``stops``; ``parts``: each
        output's nodes, see :func:`walk`'s ``nodes``) and below it (see :func:`walk`'s
        ``into``), and the nodes of the wanted gradients (``targets``);
        ``checkpoints``: those of :func:`_checkpoints` below, where the caller has them. A
        reentrant checkpoint runs whatever it reaches: its own backward reaches leaves that
        the walk cannot see. ``above`` None: every path from the outputs ends at a stop edge
        or a target (the walk met no other end), so each node above runs where every node
        of ``through`` runs."""
        if checkpoints is None:
            checkpoints = _checkpoints(stops, below)
        stop_nodes = {e[0] for e in stops}
        if above is None:
            heads = set().union(*parts)
            runs = _runs(below, targets, checkpoints)
            if stop_nodes <= runs:
                runs |= heads
            else:  # (some of `through` reaches no input: the full search)
                above = _into(heads)
        else:
            heads = {node for nodes in above.values() for node in nodes}
        if above is not None:
            into = below
            for node, nodes in above.items():
                into.setdefault(node, []).extend(nodes)
            runs = _runs(into, targets, checkpoints)
        upper = heads | stop_nodes
        freed, sparse, compiled, hooked = [], False, False, False
        for node in runs:
            kind = _kind(node)
            if kind.saves or (kind.custom and _custom_saves(node)):
                freed.append(node)
            if kind.embedding and getattr(node, "_saved_sparse", False):
                sparse = True
            compiled = compiled or kind.compiled
            hooked = hooked or ((kind.hook or kind.opaque) and node not in heads)
        alone, freed_by_losses = _alone(parts)
        return cls(
            freed,
            bool(checkpoints),
            upper,
            heads,
            sparse,
            alone,
            freed_by_losses,
            compiled,
            leaves_above,
            hooked,
        )

    def refusing(self, search: bool = False) -> dict[Any, list[Any] | None]:
        """Where a later backward must refuse so that it raises before it writes anything:
        node -> None (a freed node: always) or the first freed nodes below it (a node above
        ``through``, or ``through``'s own: when the backward will run one of them). torch
        would raise only at the freed node, after accumulating into a leaf that a path
        saving nothing reaches first (a parameter added to a loss); a node none of whose
        paths reaches such a leaf needs no entry. The search stops at the first freed nodes
        (it never walks the shared part), and is skipped where the walk shows it would find
        nothing (``search``: search anyway)."""
        freed = set(self.freed)
        refusing: dict[Any, list[Any] | None] = dict.fromkeys(self.freed)
        if not freed:
            return refusing
        if not search and not self.leaves_above and self.upper - self.heads <= freed:
            # Every path down from a node above ``through`` goes past no leaf before it meets
            # ``through``'s own nodes (the walk from the outputs met none), which all free:
            # no backward writes before it raises, so no node needs more (no search).
            return refusing
        first: dict[Any, set[Any]] = {}  # a node -> the first freed nodes below it
        writes: dict[Any, bool] = {}  # a node -> a leaf below it on a path past no freed node
        parents_of: dict[Any, list[Any]] = {}
        for start in self.upper - freed:
            if start not in first and all(
                parent is None or (not parent.next_functions and parent not in freed)
                for parent, _ in start.next_functions
            ):  # (only leaves right below, a head's weight.t(): no freed node below it)
                continue
            stack = [start]
            while stack:
                node = stack[-1]
                if node in first:
                    stack.pop()
                    continue
                parents = parents_of.get(node)
                if parents is None:
                    parents = [p for p, _ in node.next_functions if p is not None]
                    parents_of[node] = parents
                pending = [p for p in parents if p not in freed and p not in first]
                if pending:
                    stack.extend(pending)
                    continue
                stack.pop()
                below: set[Any] = set()
                reaches_leaf = not parents and hasattr(node, "variable")  # (AccumulateGrad)
                for p in parents:
                    if p in freed:
                        below.add(p)
                    else:
                        below |= first[p]
                        reaches_leaf = reaches_leaf or writes[p]
                first[node], writes[node] = below, reaches_leaf
            if first[start] and writes[start]:
                refusing[start] = list(first[start])
        return refusing


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What a type of backward node is, for the walk's bookkeeping (cached per type)."""

    saves: bool  # saves tensors for backward (freed by a backward, refused a second time)
    custom: bool  # a custom autograd.Function: whether it saves depends on the call
    embedding: bool  # an embedding's backward (``_saved_sparse`` says whether sparse)
    checkpoint: bool  # a reentrant checkpoint's backward (see REENTRANT_CHECKPOINT)
    compiled: bool  # a torch.compile'd backward (see COMPILED_BACKWARD)
    hook: bool  # a module's full backward hook (see MODULE_HOOK)
    # A custom autograd.Function not known to be linear in its cotangent (not torch's own,
    # such as a reentrant checkpoint): its backward may clamp or normalise it.
    opaque: bool


_KINDS: dict[type, _Kind] = {}


def _kind(node: Any) -> _Kind:
    kind = _KINDS.get(type(node))
    if kind is None:
        custom = isinstance(node, torch.autograd.function.BackwardCFunction)
        name = type(node).__name__
        saves = (
            not custom
            and not hasattr(node, "variable")
            and any(  # (AccumulateGrad: a leaf)
                attr.startswith("_raw_saved") or attr == "saved_tensors" for attr in dir(node)
            )
        )  # (an add saves none, a matmul or tanh does)
        kind = _Kind(
            saves,
            custom,
            name.startswith("Embedding"),
            name == REENTRANT_CHECKPOINT,
            name == COMPILED_BACKWARD,
            name == MODULE_HOOK,
            custom and not _torch_own(getattr(type(node), "_forward_cls", None)),
        )
        _KINDS[type(node)] = kind
    return kind


def _torch_own(function: Any) -> bool:
    """Whether a custom autograd.Function is torch's own (a reentrant checkpoint, a module's
    backward hook, a collective) or funcgrad's (``counted``), whose backward is linear in
    its cotangent; not the class torch.func generates for a user's Function, nor the one
    ``torch.library.custom_op``'s ``register_autograd`` wraps a user's backward in."""
    module = getattr(function, "__module__", None) or ""
    return module.startswith(("torch.", "funcgrad.")) and not module.startswith(
        ("torch._functorch.autograd_function", "torch._library")
    )


def hook_or_function(starts: Iterable[Any]) -> tuple[bool, bool]:
    """Whether the nodes reached from ``starts`` hold a module's backward hook (see
    MODULE_HOOK), and a custom autograd.Function not known to be linear in its cotangent
    (see :class:`_Kind`): one walk."""
    hook = function = False
    for node in nodes(starts):
        kind = _kind(node)
        hook, function = hook or kind.hook, function or kind.opaque
    return hook, function


def _custom_saves(node: Any) -> bool:
    """Whether this call of a custom Function saved tensors (a gradient reversal saves none)."""
    try:
        return len(node._raw_saved_tensors) > 0
    except RuntimeError:  # already freed by a backward
        return True


_SPENT = "funcgrad: spent"
_REFUSES = "funcgrad: refuses a backward"


def spent(graph: Graph) -> str | None:
    """The call that spent (see :func:`spend`) one of the nodes that ``graph``'s backward
    frees, if any: that backward would raise in torch."""
    return next((node.metadata[_SPENT] for node in graph.freed if _SPENT in node.metadata), None)


def spend(
    graph: Graph,
    call: str,
    *,
    shared_freed: bool = False,
    heads_freed: Collection[Any] = (),
    torch_answers: bool = False,
) -> None:
    """After ``call`` ran ``graph``'s backward without ``retain_graph``: mark the nodes it
    frees as spent (:func:`spent`: a later call raises before any pass, on every rank), and
    hook the nodes funcgrad kept alive so that any later backward raises as torch's would,
    before it writes (:meth:`Graph.refusing`). ``shared_freed``: the last pass freed the part
    below ``through``; ``heads_freed``: the nodes above it the outputs' backward freed;
    ``torch_answers``: no other process must refuse with this one, so where torch freed
    every node and none needs a hook, nothing is marked (:func:`spent_if_raising`)."""

    def refuse(_: Any) -> None:
        raise RuntimeError(SECOND_BACKWARD.format(call=call))

    def refuse_before(freed: list[Any]) -> Callable[[Any], None]:
        # (It holds nodes below its own only, as the graph's edges do: no reference cycle.)
        def hook(_: Any) -> None:
            if any(torch._C._will_engine_execute_node(node) for node in freed):
                refuse(None)

        return hook

    # (torch raises itself at the nodes a pass really freed, which the caller names: reading
    # a saved tensor to find out would run its unpack hook)
    hooked = [
        (node, below)
        for node, below in graph.refusing().items()
        if not (
            below is None and ((shared_freed and node not in graph.heads) or node in heads_freed)
        )
    ]
    if torch_answers and not hooked:
        return
    for node in graph.freed:
        node.metadata.setdefault(_SPENT, call)
    for node, below in hooked:
        metadata = node.metadata
        if _REFUSES not in metadata:
            metadata[_REFUSES] = True
            node.register_prehook(refuse if below is None else refuse_before(below))


@contextlib.contextmanager
def spent_if_raising(
    graph: Graph, call: str, *, freed: bool, error: type[RuntimeError] = RuntimeError
) -> Iterator[None]:
    """Where the body (``call``'s passes through ``graph``; ``freed``: without retain_graph)
    raises, the graph counts as spent (:func:`spend`), and torch's refusal of saved tensors
    an earlier backward freed is raised as ``error`` with funcgrad's message."""
    try:
        yield
    except BaseException as caught:
        if freed:
            spend(graph, call)
        text = str(caught) if isinstance(caught, RuntimeError) else ""
        if text.startswith(FREED_GRAPH) and not text.startswith(FREED_GRAPH + ":"):  # torch's
            raise error(
                f"{FREED_GRAPH}: {call} reached saved tensors of this graph that an earlier "
                "backward without retain_graph freed (an earlier funcgrad call, or your own "
                ".backward() or torch.autograd.grad). Nothing was written. Pass "
                "retain_graph=True to the earlier backward, or run the forward again."
            ) from caught
        raise


SECOND_BACKWARD = (
    FREED_GRAPH + ": {call} already ran the backward "
    "of this graph without retain_graph, which frees it (funcgrad keeps some of its "
    "tensors for its own passes, but treats it as freed, as torch would). Pass "
    "retain_graph=True to the first call, or run the forward again."
)


@contextlib.contextmanager
def hooks_fired(through: Tensors) -> Iterator[None]:
    """Around the passes from ``through`` with the cotangents that already went through its
    tensor hooks (once per loss, as in torch): the user's hooks are held back (then put back
    in order) and a retained ``.grad`` restored; torch's own (FSDP's) stay."""
    held = []
    for t in through:
        hooks = t._backward_hooks or {}
        before = dict(hooks)
        for key, hook in before.items():
            if not _torch_hook(hook):
                del hooks[key]
        held.append((t, hooks, before, t.grad if t.retains_grad else None))
    try:
        yield
    finally:
        for t, hooks, before, grad in held:
            now = dict(hooks)  # (torch's hooks that remain, and any added meanwhile)
            hooks.clear()
            hooks.update({k: h for k, h in before.items() if k in now or not _torch_hook(h)})
            hooks.update(now)
            if t.retains_grad:
                t.grad = grad


def _torch_hook(hook: Any) -> bool:
    """Whether a tensor hook is torch's own (a function or bound method defined in torch,
    such as FSDP2's ``_pre_backward``), not the user's."""
    fn = getattr(hook, "func", hook)  # (a functools.partial)
    return str(getattr(fn, "__module__", None) or "").startswith("torch.")
