"""All pytree handling goes through optree (never torch.utils._pytree).

optree and torch disagree on dict key order and on ``None``; torch.func only ever sees the
flat tuples of leaves produced here, so the two registries never meet on one tree.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.utils._pytree as _torch_pytree

PyTree = Any
TreeDef = optree.PyTreeSpec


# Types that only torch's registry knows (Hugging Face's ModelOutput, a user's
# torch.utils._pytree.register_pytree_node), registered with optree in this namespace on first
# sight, with torch's own flatten and unflatten: one registry (optree) still flattens them.
NAMESPACE = "funcgrad"
_TORCH_NODES: dict[type, Any] = _torch_pytree.SUPPORTED_NODES
_TORCH_BUILTINS = _torch_pytree.BUILTIN_TYPES


def _from_torch(cls: type) -> None:
    node = _TORCH_NODES[cls]

    def flatten_node(value: Any) -> tuple[list[Any], Any, list[Any] | None]:
        children, context = node.flatten_fn(value)
        children = list(children)
        # Field names as path entries where the context is them (ModelOutput's keys), so
        # that a message names `['logits']`.
        names = isinstance(context, list | tuple) and len(context) == len(children)
        keys = list(context) if names and all(isinstance(k, str) for k in context) else None
        return children, context, keys

    def unflatten_node(context: Any, children: Any) -> Any:
        return node.unflatten_fn(list(children), context)

    optree.register_pytree_node(cls, flatten_node, unflatten_node, namespace=NAMESPACE)


def _torch_only(leaf: Any) -> bool:
    kind = type(leaf)
    return kind in _TORCH_NODES and kind not in _TORCH_BUILTINS and kind is not torch.Tensor


def flatten(tree: PyTree) -> tuple[list[Any], TreeDef]:
    """Flatten with optree; ``None`` is an empty node, dict keys are sorted. Types registered
    with ``torch.utils._pytree`` only (Hugging Face's ``ModelOutput``) are nodes too."""
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
    while any(_torch_only(leaf) for leaf in leaves):  # new types: register, flatten again
        for kind in {type(leaf) for leaf in leaves if _torch_only(leaf)}:
            _from_torch(kind)
        leaves, treedef = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
    return leaves, treedef


def unflatten(treedef: TreeDef, leaves: Any) -> PyTree:
    return optree.tree_unflatten(treedef, list(leaves))


def same(a: TreeDef, b: TreeDef) -> bool:
    """Whether two tree specs describe one structure. In compiled code, by node type and
    entries (dict keys, field names), child by child: there dynamo's own tree specs stand
    for optree's, and ``==`` between one of them and optree's (made on an eager call) is
    false, or compares namespaces that it drops."""
    if not torch.compiler.is_compiling():
        return bool(a == b)
    if a.is_leaf() or b.is_leaf():
        return bool(a.is_leaf() and b.is_leaf())
    if a.type is not b.type or list(a.entries()) != list(b.entries()):
        return False
    return all(same(x, y) for x, y in zip(a.children(), b.children(), strict=True))


def is_differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def leaf_path(treedef: TreeDef, index: int) -> str:
    """A readable path to leaf ``index`` of ``treedef``, such as ``['w'][0]``."""
    paths = optree.treespec_paths(treedef)
    return "".join(f"[{key!r}]" for key in paths[index]) or "<root>"


LEAF: TreeDef = flatten(torch.zeros(()))[1]
"""The tree of a bare leaf (what :func:`flatten` gives for a tensor)."""
