"""References for the tests: plain torch.autograd, head by head, in float64."""

from __future__ import annotations

import collections

import optree
import torch

Pair = collections.namedtuple("Pair", ["p", "q"])


def autograd_reference(f, heads, args, argnums=0, has_aux=False):
    """values and per-head grads by torch.autograd.grad, one backward of f per head."""
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    values, grads = [], []
    for head in heads:
        args_ = list(args)
        leaves_per_arg = []
        for a in nums:
            leaves, treedef = optree.tree_flatten(args[a])
            leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
            leaves_per_arg.append((leaves, treedef))
            args_[a] = optree.tree_unflatten(treedef, leaves)
        y = f(*args_)
        if has_aux:
            y = y[0]
        z = head(y)
        flat = [leaf for leaves, _ in leaves_per_arg for leaf in leaves]
        g = torch.autograd.grad(z, flat, allow_unused=True)
        g = [torch.zeros_like(x) if gi is None else gi for gi, x in zip(g, flat)]
        trees, start = [], 0
        for leaves, treedef in leaves_per_arg:
            trees.append(optree.tree_unflatten(treedef, g[start : start + len(leaves)]))
            start += len(leaves)
        values.append(z.detach())
        grads.append(trees[0] if isinstance(argnums, int) else tuple(trees))
    return values, grads


def tree_index(tree, i):
    return optree.tree_map(lambda leaf: leaf[i], tree)


def assert_tree_close(actual, expected, rtol=1e-9, atol=1e-11):
    a_leaves, a_def = optree.tree_flatten(actual)
    e_leaves, e_def = optree.tree_flatten(expected)
    assert a_def == e_def, f"{a_def} != {e_def}"
    for a, e in zip(a_leaves, e_leaves):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def autograd_vjp(f, primal, cotangent):
    """J_f(primal)^T cotangent by torch.autograd.grad, with pytrees through optree."""
    leaves, treedef = optree.tree_flatten(primal)
    leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
    out = optree.tree_leaves(f(optree.tree_unflatten(treedef, leaves)))
    grads = torch.autograd.grad(out, leaves, optree.tree_leaves(cotangent), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    return optree.tree_unflatten(treedef, grads)


def assert_rows_close(got, expected, rtol):
    """Row by row, each against its own scale: a small head is not judged by a big one."""
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=rtol, atol=rtol * float(e.abs().max()))


def task_losses(encoder, heads, x, y):
    """(features, one mean squared error per head): the multi-task step of the
    distributed tests."""
    features = encoder(x)
    losses = [
        torch.nn.functional.mse_loss(head(features), y[:, i : i + 1])
        for i, head in enumerate(heads)
    ]
    return features, losses
