"""All pytree handling goes through optree (never torch.utils._pytree).

optree and torch disagree on dict key order and on ``None``; torch.func only ever sees the
flat tuples of leaves produced here, so the two registries never meet on one tree.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

PyTree = Any
TreeDef = optree.PyTreeSpec


def flatten(tree: PyTree) -> tuple[list[Any], TreeDef]:
    """Flatten with optree; ``None`` is an empty node, dict keys are sorted."""
    return optree.tree_flatten(tree, none_is_leaf=False)


def unflatten(treedef: TreeDef, leaves: Any) -> PyTree:
    return optree.tree_unflatten(treedef, list(leaves))


def is_differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def leaf_path(treedef: TreeDef, index: int) -> str:
    """A readable path to leaf ``index`` of ``treedef``, such as ``['w'][0]``."""
    paths = optree.treespec_paths(treedef)
    return "".join(f"[{key!r}]" for key in paths[index]) or "<root>"


LEAF: TreeDef = flatten(torch.zeros(()))[1]
"""The tree of a bare leaf (what :func:`flatten` gives for a tensor)."""
