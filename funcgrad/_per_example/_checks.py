"""The refusals of a call's recorded graph, before any pass: the calls on the graph of the
losses (a selected parameter reaching them outside its module's forward refused), inputs or
parameters changed in place since the forward, hooks the rules cannot honour, and a module
that reads a counted parameter not its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.utils import parametrize

from ._choose import _layer_class
from ._generic import _Generic
from ._record import _hook_name, _keys, _nested_params, _refuse_reentrant_checkpoint, _Use

if TYPE_CHECKING:
    from ._run import _Run


def _recorded_uses(run: _Run) -> list[_Use]:
    """Every recorded call on the graph of the losses (nested calls included), after a
    walk that refuses a selected parameter reaching the losses outside them."""
    by_edge: dict[tuple[Any, int], _Use] = {}
    for top in run.recorder._uses:
        for key in _keys(top):
            by_edge[key] = top
    reached: dict[int, _Use] = {}
    # Edges to visit; a recorded call is stepped over, from its outputs to its inputs.
    # From the losses' own edge: they may be a recorded call's output (a module that
    # returns the per-example losses).
    root = get_gradient_edge(run.losses)
    stack: list[tuple[Any, int]] = [(root.node, root.output_nr)]
    seen: set[Any] = set()
    nodes: list[Any] = []
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
        nodes.append(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            _check_leaf(run, leaf)
        stack.extend((nxt, i) for nxt, i in node.next_functions if nxt is not None)
    if not reached:
        _refuse_reentrant_checkpoint(run.losses, run.call)
        raise ValueError(
            f"{run.call}: the losses depend on no module call that funcgrad.per_example "
            "recorded: hook the model before its forward, and compute the losses from "
            "that forward."
        )
    run.graph_nodes = nodes
    return [use for top in run.recorder._uses if id(top) in reached for use in top.walk()]


def _refuse_parametrized(run: _Run, uses: list[_Use]) -> None:
    """A parametrization registered after `funcgrad.per_example` hooked the model (refused
    there when present at that time): the module's weight is then computed from the
    parametrization's original, which the rules would credit with the weight's own
    gradient (G 3-35 and the update 2-4.5 off in float64 on a Linear, found in session 7)."""
    for use in uses:
        module = use.module
        if not parametrize.is_parametrized(module):
            continue
        if not any(p in run.selected for p in module.parameters()):
            continue  # (none of its parameters counted: no per-example gradient formed)
        name = run.recorder._names.get(module, type(module).__name__)
        raise ValueError(
            f"{run.call}: module {name!r} ({type(module).__name__}) has parametrized tensors "
            "(torch.nn.utils.parametrize: parametrizations.weight_norm, spectral_norm, "
            "orthogonal, register_parametrization) registered after funcgrad.per_example "
            "hooked the model; its per-example gradients would go through the "
            "parametrization, which funcgrad's rules do not do (G and the update would be "
            "wrong). Nothing was written. Remove the parametrization "
            "(parametrize.remove_parametrizations), use torch.nn.utils.weight_norm "
            "(supported), or leave the module's parameters out with inputs=."
        )


def _refuse_changed(run: _Run, uses: list[_Use]) -> None:
    """An input or parameter of a recorded call changed in place since the forward (the
    next batch copied into the input buffer, an optimizer step): torch's backward would
    raise for a tensor it saved; the rules read them all, so each is checked. Also a
    parametrization registered since the model was hooked."""
    _refuse_parametrized(run, uses)
    for use in uses:
        for tensor, version in use.versions:
            if tensor._version != version:
                name = run.recorder._names.get(use.module, type(use.module).__name__)
                what = (
                    "a parameter"
                    if any(tensor is p for p in use.module.parameters(recurse=False))
                    else "an input"
                )
                raise RuntimeError(
                    f"{run.call}: {what} of module {name!r} "
                    f"({type(use.module).__name__}), shape {tuple(tensor.shape)}, was "
                    "changed in place after the forward (e.g. the next batch copied into "
                    "the input buffer, or an optimizer step), so the per-example "
                    "gradients read from it would be wrong (torch's own backward raises "
                    "there too). Nothing was written. Call gramian/backward before "
                    "changing it, or give the model a copy."
                )


def _refuse_hooks(run: _Run, uses: list[_Use]) -> None:
    for use in uses:
        if use.hooked is not None:
            name = run.recorder._names.get(use.module, type(use.module).__name__)
            raise ValueError(
                f"{run.call}: module {name!r} ({type(use.module).__name__}) has "
                f"{use.hooked}. Nothing was written. Register the hook on the module "
                "without prepend=True (module forward hooks, pre-hooks and full backward "
                "hooks are honoured), remove it during the per-example forward, or leave "
                "the module's parameters out with inputs=."
            )


def _refuse_parameter_hooks(run: _Run) -> None:
    """A tensor hook on a parameter rewrites each of its gradients in torch's per-example
    loop; the rules never form them (the ghost products) nor run the parameter's node.
    Also a complex parameter: the rules work in real arithmetic (its imaginary parts were
    dropped with a warning, G and the update silently wrong: 22 off on a complex Linear)."""
    for param, name in run.selected.items():
        if param.is_complex():
            raise ValueError(
                f"{run.call}: parameter {name!r} is complex ({param.dtype}); the per-example "
                "rules compute G and the update in real arithmetic, so they do not support "
                "complex parameters. Nothing was written, and this forward's records are "
                "released: run the forward again, then leave it out with inputs=, keep "
                "its real and imaginary parts as two real parameters, or use "
                "funcgrad.backward(losses, through=...) on task losses, which supports them."
            )
        if param._backward_hooks:
            hook = next(iter(param._backward_hooks.values()))
            raise ValueError(
                f"{run.call}: parameter {name!r} has a tensor hook "
                f"({_hook_name(hook)}, register_hook), which torch applies to each of "
                "its gradients; the per-example rules never form that gradient (the "
                "Gramian comes from the layer's inputs and output gradients), so they "
                "cannot apply it. Nothing was written. Remove the hook during the call "
                "(handle.remove()), put it on the module's output instead, or leave the "
                "parameter out with inputs=."
            )


def _check_leaf(run: _Run, leaf: torch.Tensor) -> None:
    name = run.selected.get(leaf)
    if name is not None and not any(
        leaf is p for ps in run.recorder._direct.values() for p in ps
    ):  # (on this error path only)
        raise ValueError(
            f"{run.call}: parameter {name!r} belongs to a module that funcgrad.per_example "
            "did not hook: one added to the model or put in place of another after it "
            "hooked the model (the hooks are placed once, on the modules present then). "
            "Nothing was written. Hook the model again (pe.remove(), then "
            "funcgrad.per_example(model)), or leave the parameter out with inputs=."
        )
    if name is not None:
        raise ValueError(
            f"{run.call}: parameter {name!r} reaches the losses outside the forward of "
            "the module that holds it (a functional use such as F.linear(h, "
            "emb.weight), or a parent module reading a child's parameter): the hooks "
            "cannot see its input there. Call it through a module (e.g. an nn.Linear "
            "whose weight is tied to it: head.weight = emb.weight), or leave it out with "
            "inputs=."
        )
    if isinstance(leaf, nn.Parameter) and leaf.requires_grad and not run._inputs_given:
        raise ValueError(
            f"{run.call}: a parameter of shape {tuple(leaf.shape)} outside the hooked "
            f"model ({type(run.recorder.model).__name__}) reaches the losses. Hook the "
            "module that holds it too (funcgrad.per_example(a module containing both)), "
            "or pass inputs= to update only the hooked model's parameters."
        )


def _refuse_foreign_reads(run: _Run, uses: list[_Use]) -> None:
    """Refuse a module materialised by its functional call (a custom module, a parent with
    its own parameters) that reads, in its own forward, a counted parameter that is not
    its own: a child's that it also calls (``h + F.linear(h, self.lin.weight)`` after
    ``self.lin(h)``), or another module's. The walk from the losses steps over every
    recorded call, and the child's rule sees only its own calls, so that use would be
    missed. Only the graph inside such calls is walked (nested calls stepped over). Also
    refused: such a module reading the output of another hooked module's call that the
    walk from the losses does not reach (a module called inside its forward that is not
    its child, such as one passed as an argument): its parameters' share was missing."""
    generic = [use for use in uses if _layer_class(use.module) is _Generic]
    if not generic:
        return
    by_edge = {key: use for top in run.recorder._uses for use in top.walk() for key in _keys(use)}
    counted = {id(use) for use in uses}
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
            other = by_edge.get(key, use)
            if other is not use:  # another recorded call, outside this one
                if id(other) not in counted and any(
                    p in run.selected for p in other.module.parameters()
                ):
                    _refuse_unreached(run, use, other)
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


def _refuse_unreached(run: _Run, use: _Use, other: _Use) -> None:
    """``use``'s call reads the output of ``other``'s, which the walk from the losses steps
    over (found in session 7: a custom module calling a Linear passed as an argument, whose
    per-example gradients were left out: G 17 off, the update 2.2 off)."""
    names = run.recorder._names
    name = names.get(use.module, type(use.module).__name__)
    other_name = names.get(other.module, type(other.module).__name__)
    raise ValueError(
        f"{run.call}: module {name!r} ({type(use.module).__name__}) reads, in its own "
        f"forward, the output of a call of module {other_name!r} "
        f"({type(other.module).__name__}) that is not one of its children (a module "
        "passed to it as an argument, or called by a forward set on its instance), so the "
        f"per-example gradients of {other_name!r}'s parameters would be missing. Nothing "
        f"was written. Make {other_name!r} a child of {name!r} (an attribute of it), call "
        "it outside and pass its output in, or leave its parameters out with inputs=."
    )
