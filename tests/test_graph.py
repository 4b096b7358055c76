"""Walking an autograd graph (``funcgrad._graph``), against what torch's own backward does on
the same graph: the leaves and edges a walk reaches (torch.autograd.grad, with the stop
tensor detached), the reentrant checkpoints it finds (torch's refusal of ``.grad()`` through
one), and the marks of a spent graph (a later backward raises as torch's does on the graph
it freed, before anything is written)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.utils.checkpoint

import funcgrad
from funcgrad import _graph


def _edges(*tensors):
    return {_graph.edge(t): i for i, t in enumerate(tensors)}


def _reached(output, leaves):
    """The indices of the leaves that torch's backward of ``output`` gives a gradient."""
    grads = torch.autograd.grad(output, leaves, allow_unused=True, retain_graph=True)
    return {i for i, g in enumerate(grads) if g is not None}


# -- walk -----------------------------------------------------------------------------------


def test_walk_reaches_what_autograd_reaches_and_goes_no_further_than_a_stop_edge():
    x, w, b = (torch.randn(3, requires_grad=True) for _ in range(3))
    h = torch.tanh(x * w)  # the stop: x is reached only through it, w also around it
    z = (h * b).sum() + w.sum()
    found, stopped = _graph.walk([_graph.edge(z)], _edges(x, w, b), _edges(h))
    assert found == _reached((h.detach() * b).sum() + w.sum(), [x, w, b]) == {1, 2}
    assert stopped == {0}
    found, stopped = _graph.walk([_graph.edge(z)], _edges(x, w, b), {})
    assert found == _reached(z, [x, w, b]) == {0, 1, 2} and stopped == set()

    leaves: dict = {}
    _graph.walk([_graph.edge(z)], {}, _edges(h), leaves)
    assert sorted(id(t) for t in leaves.values()) == sorted([id(w), id(b)])


def test_walk_tells_the_outputs_of_one_node_apart_by_their_edges():
    x = torch.randn(2, 3, requires_grad=True)
    a, b = torch.sin(x).unbind(0)  # one node, two edges
    assert a.grad_fn is b.grad_fn
    assert _graph.walk([_graph.edge(a.sum())], _edges(x), _edges(a)) == (set(), {0})
    assert _graph.walk([_graph.edge(b.sum())], _edges(x), _edges(a)) == ({0}, set())


def test_walk_records_which_nodes_pass_gradient_into_each_node():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    t = torch.tanh(y)
    z = t.sum() + y.sum()  # y's node gets gradient from two nodes
    into: dict = {}
    _graph.walk([_graph.edge(z)], {}, {}, into=into)
    add = z.grad_fn
    sum_t, sum_y = (node for node, _ in add.next_functions)
    assert into[sum_t] == [add] and into[sum_y] == [add]
    assert into[t.grad_fn] == [sum_t]
    assert sorted(map(id, into[y.grad_fn])) == sorted(map(id, [t.grad_fn, sum_y]))
    accumulate = y.grad_fn.next_functions[0][0]
    assert accumulate.variable is x and into[accumulate] == [y.grad_fn]


# -- through and its paths -----------------------------------------------------------------


def test_through_lists_distinct_independent_tensors():
    x = torch.randn(3, requires_grad=True)
    h, g = torch.sin(x), torch.cos(x)
    assert _graph.through_edges((h, g), "call") == {_graph.edge(h): 0, _graph.edge(g): 1}
    with pytest.raises(ValueError, match=r"call: through\[1\] is the same tensor as through\[0\]"):
        _graph.through_edges((h, h), "call")
    with pytest.raises(ValueError, match=r"call: through\[1\] is computed from through\[0\]"):
        _graph.through_edges((h, h * 2), "call")


def test_check_paths_refuses_what_the_pullback_through_through_would_miss():
    x, u = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    y = torch.sin(x)
    _graph.check_paths((y.sum(), y[0]), (x,), (y,), False, "call")
    with pytest.raises(ValueError, match=r"outputs\[1\] does not depend on `through`"):
        _graph.check_paths((y.sum(), x.sum()), (x,), (y,), False, "call")
    with pytest.raises(ValueError, match=r"outputs\[0\] depends on inputs\[0\] other than through"):
        _graph.check_paths((y.sum() + x.sum(),), (x,), (y,), False, "call")
    with pytest.raises(ValueError, match=r"`through` does not depend on inputs\[1\]"):
        _graph.check_paths((y.sum(),), (x, u), (y,), False, "call")
    _graph.check_paths((y.sum(),), (x, u), (y,), True, "call")


# -- reentrant checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [True, False, None], ids=["reentrant", "not", "none"])
def test_a_reentrant_checkpoint_is_found_where_torch_refuses_grad_through_it(use_reentrant):
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    if use_reentrant is None:
        h = layer(x)
    else:
        h = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=use_reentrant)
    out = torch.tanh(h).sum()
    found = _graph.scan([out]).checkpoint
    try:  # torch's own answer: .grad() cannot run through a reentrant checkpoint
        torch.autograd.grad(out, x, retain_graph=True)
        refused = False
    except RuntimeError as error:
        assert "incompatible with .grad()" in str(error)
        refused = True
    assert found == refused == (use_reentrant is True)
    assert not _graph.scan([x, torch.randn(2)]).checkpoint  # no grad_fn: no graph


# -- a spent graph ---------------------------------------------------------------------------


THROUGH = {
    "tanh": lambda x: torch.tanh(x * 3),  # tanh saves its result: torch's backward frees it
    "add": lambda x: x + 1,  # saves no tensor: torch frees nothing, a backward runs again
}


def _forward(kind):
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    b = torch.zeros((), requires_grad=True)  # added to a loss: reached before any freed node
    through = THROUGH[kind](x)
    return x, b, through, [through.sum() + b, through[:2].sum()]


def _torch_refuses_a_second_backward(kind):
    x, _, _, outputs = _forward(kind)
    torch.autograd.grad(outputs, x)  # frees what it can, as a call without retain_graph does
    try:
        torch.autograd.grad(outputs, x)
    except RuntimeError as error:
        assert "backward through the graph a second time" in str(error)
        return True
    return False


@pytest.mark.parametrize("kind", list(THROUGH))
def test_a_spent_graph_refuses_a_later_backward_as_torch_does_before_writing(kind):
    refuses = _torch_refuses_a_second_backward(kind)
    assert refuses == (kind == "tanh")
    x, b, through, outputs = _forward(kind)
    graph = _graph.check_paths(tuple(outputs), (x,), (through,), False, "call")
    assert bool(graph.freed) == refuses
    assert _graph.spent(graph) is None
    _graph.spend(graph, "the first call")
    assert _graph.spent(graph) == ("the first call" if refuses else None)
    if refuses:
        with pytest.raises(RuntimeError, match="the first call already ran the backward"):
            sum(outputs).backward()
        assert x.grad is None and b.grad is None  # torch itself would have written b.grad
    else:
        sum(outputs).backward()  # runs again, as in torch
        fresh, _, _, again = _forward(kind)
        torch.testing.assert_close(x.grad, torch.autograd.grad(sum(again), fresh)[0])
        assert b.grad == 1


def test_a_second_spend_keeps_the_first_calls_mark():
    x, _, through, outputs = _forward("tanh")
    graph = _graph.check_paths(tuple(outputs), (x,), (through,), False, "call")
    _graph.spend(graph, "the first call")
    _graph.spend(graph, "the second call")
    assert _graph.spent(graph) == "the first call"
    with pytest.raises(RuntimeError, match="the first call already ran"):
        sum(outputs).backward()


@pytest.mark.parametrize("retain", [False, True])
def test_spend_hooks_the_shared_part_only_where_torch_kept_it(retain):
    """Where the call's last pass freed the shared part (no retain_graph), torch raises there
    itself: no hook on its nodes; where it was kept, every freed node refuses. Either way the
    user's backward raises before b (added to an output) gets a .grad."""
    x, b, through, outputs = _forward("tanh")
    graph = _graph.check_paths(tuple(outputs), (x,), (through,), False, "call")
    torch.autograd.grad(through, x, torch.ones_like(through), retain_graph=retain)
    _graph.spend(graph, "the first call", shared_freed=not retain)
    assert (_graph._REFUSES in through.grad_fn.metadata) == retain
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sum(outputs).backward()
    assert x.grad is None and b.grad is None


def test_no_hook_on_a_shared_part_that_torch_freed_a_bias_free_linear():
    """through = x @ w with a data x (a bias-free linear: MmBackward0 saves x for w's
    gradient and leaves its `mat2` slot empty, which reads None whether freed or not): after
    a call without retain_graph torch has freed that node and raises there itself, so spend
    puts no hook on it (the cost the probe of torch's freeing is there to save; where the
    probe lands on such a node, which depends on a set's order, every node of the shared
    part is hooked again)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    heads = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    through = torch.randn(5, 3) @ w.T
    losses = [(through @ h).tanh().sum() for h in heads]
    funcgrad.backward(losses, through=through, weighting=lambda g: g.new_ones(3))
    with pytest.raises(RuntimeError, match="second time"):
        through.grad_fn._saved_self  # noqa: B018 (torch freed it)
    assert _graph._REFUSES not in through.grad_fn.metadata
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sum(losses).backward()


def _random_heads(seed):
    """A small graph of random heads on a random ``through``: some heads add or multiply a
    leaf of their own (a path to a leaf past no freed node), ``through`` saves or not, is a
    leaf, or one output of a node with several."""
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    x, p = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    kind = rnd.choice(["tanh", "add", "leaf", "unbind", "mul", "view"])
    pieces = (x * 3).reshape(2, 2).unbind()
    through = {
        "tanh": lambda: torch.tanh(x * 2),
        "add": lambda: x + 1,
        "leaf": lambda: x,
        "unbind": lambda: pieces[0],
        "mul": lambda: x * p,
        "view": lambda: x.exp().view(2, 2),
    }[kind]()
    own = p[: through.numel()].reshape(through.shape)
    ops = ["sin", "add", "scale", "other output", "add through"]
    ops += ["add own", "mul own"] if rnd.random() < 0.5 else []  # (else no leaf above)
    outputs = []
    for _ in range(rnd.randint(1, 4)):
        h = through
        for _ in range(rnd.randint(0, 3)):
            op = rnd.choice(ops)
            h = {
                "sin": lambda h: h.sin(),
                "add": lambda h: h + 1.5,
                "scale": lambda h: h * 2.0,
                "add own": lambda h: h + own,
                "mul own": lambda h: h * own,
                "other output": lambda h: h + pieces[1] if kind == "unbind" else h,
                "add through": lambda h: h + through,  # (a path that saves nothing)
            }[op](h)
        outputs.append(h.sum() + p.sum() if "add own" in ops and rnd.random() < 0.3 else h.sum())
    return x, through, outputs


def test_refusing_takes_its_shortcut_only_where_the_full_search_finds_nothing_more():
    """Where the walk from the outputs met no leaf and every node of ``through`` frees,
    ``refusing`` skips its search: on random graphs it gives what the full search gives."""
    shortcuts = 0
    for seed in range(300):
        x, through, outputs = _random_heads(seed)
        try:
            graph = _graph.check_paths(tuple(outputs), (x,), (through,), True, "c")
        except ValueError:  # (a head that reaches x other than through `through`)
            continue
        assert graph.refusing() == graph.refusing(search=True)
        shortcuts += not graph.leaves_above and graph.upper - graph.heads <= set(graph.freed)
    assert shortcuts > 10


def test_only_nodes_with_a_write_before_any_freed_node_refuse_ahead():
    """A node that saves nothing refuses ahead of the freed nodes below it only where a path
    from it reaches a leaf past no freed node (a leaf added to a loss): elsewhere the backward
    raises at a freed node before anything is written. And after `grads`, whose outputs'
    backwards freed their own parts and whose last pull freed the part below `through`, no
    hook is left to register (see docs/performance.md)."""
    x, _, through, outputs = _forward("tanh")
    refusing = _graph.check_paths(tuple(outputs), (x,), (through,), False, "c").refusing()
    ahead = [node for node, below in refusing.items() if below is not None]
    assert ahead == [outputs[0].grad_fn]  # through.sum() + b: b's path saves nothing
    x, _, through, _ = _forward("tanh")
    plain = [(through * 2).sin().sum(), through[:2].exp().sum()]  # every path: a freed node
    refusing = _graph.check_paths(tuple(plain), (x,), (through,), False, "c").refusing()
    assert all(below is None for below in refusing.values())

    x, _, through, _ = _forward("tanh")
    heads = [(through * (i + 1)).sin().sum() for i in range(3)]
    nodes = {n for n in _graph.check_paths(tuple(heads), (x,), (through,), False, "c").upper}
    funcgrad.grads(heads, x, through=through)
    assert nodes and not [n for n in nodes if _graph._REFUSES in n.metadata]
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        heads[0].backward()
    assert x.grad is None
