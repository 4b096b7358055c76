"""``funcgrad.backward``: one weighted update from k task losses, written into ``.grad``,
against TorchJD, the MGDA-UB recipe written out by hand, and plain autograd per task, in
float64; its errors, before any pass through the shared part; a spent graph refused as torch
refuses it."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from helpers import Unbatchable, _counted_graph, _grads, _raises, _setup, assert_tree_close
from torch import nn
from torchjd import aggregation as tjd
from torchjd.autojac import jac_to_grad, mtl_backward

import funcgrad
from funcgrad._counting import BackwardCounter, counted


def _torchjd(aggregator, k=3, two_features=False, seed=None):
    model, x, targets = _setup(k, two_features)
    features = model.features(x)
    mtl_backward(model.losses(features, targets), features)
    if seed is not None:  # for the aggregators that draw random numbers
        torch.manual_seed(seed)
    jac_to_grad(model.shared(), aggregator)
    return _grads(model)


def _funcgrad(weighting, k=3, two_features=False, **kwargs):
    model, x, targets = _setup(k, two_features)
    features = model.features(x)
    weights = funcgrad.backward(
        model.losses(features, targets), through=features, weighting=weighting, **kwargs
    )
    return _grads(model), weights


def _assert_grads_close(got, want, rtol=1e-8):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=rtol, msg=name)


# -- params level: exact Jacobian descent, against TorchJD ----------------------------------

AGGREGATORS = {
    "UPGrad": (tjd.UPGrad, tjd.UPGradWeighting),
    "MGDA": (tjd.MGDA, tjd.MGDAWeighting),
    "PCGrad": (tjd.PCGrad, tjd.PCGradWeighting),
    "Mean": (tjd.Mean, tjd.MeanWeighting),
    "DualProj": (tjd.DualProj, tjd.DualProjWeighting),
    "IMTLG": (tjd.IMTLG, tjd.IMTLGWeighting),
    "AlignedMTL": (tjd.AlignedMTL, tjd.AlignedMTLWeighting),
    "CAGrad": (lambda: tjd.CAGrad(c=0.5), lambda: tjd.CAGradWeighting(c=0.5)),
}


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("two_features", [False, True])
@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_params_level_equals_torchjd(name, two_features, chunk_size):
    aggregator, weighting = AGGREGATORS[name]
    want = _torchjd(aggregator(), two_features=two_features)
    for given in (aggregator(), weighting()):  # the Aggregator, and its Weighting
        got, weights = _funcgrad(given, two_features=two_features, chunk_size=chunk_size)
        _assert_grads_close(got, want, rtol=1e-6 if name == "CAGrad" else 1e-8)
        assert weights.shape == (3,)


@pytest.mark.parametrize(
    "make",
    [lambda: tjd.NashMTL(n_tasks=4), tjd.GradDrop, tjd.ConFIG, lambda: tjd.Krum(1), tjd.Random],
    ids=["NashMTL", "GradDrop", "ConFIG", "Krum", "Random"],
)
def test_params_level_jacobian_aggregators_equal_torchjd(make):
    """Aggregators that need the Jacobian itself (NashMTL, GradDrop, ConFIG, Random) run on
    it, hooks and all; Krum is Gramian-based. GradDrop and Random draw random numbers: the
    same seed on both sides, and the same column order (inputs in TorchJD's order)."""
    want = _torchjd(make(), k=4, seed=1)
    model, x, targets = _setup(4)
    features = model.features(x)
    losses = model.losses(features, targets)
    aggregator = make()
    torch.manual_seed(1)
    weights = funcgrad.backward(
        losses, through=features, weighting=aggregator, inputs=model.shared()
    )
    _assert_grads_close(_grads(model), want, rtol=1e-6)
    if isinstance(aggregator, (tjd.GradDrop, tjd.ConFIG)):
        assert weights is None
    else:
        assert weights.shape == (4,)


# -- features level: the MGDA-UB recipe (LibMTL's rep_grad), written out ---------------------


def _mgda_ub_by_hand(weighting, two_features=False):
    """LibMTL's recipe: the losses on a detached copy of the features, the Gramian of the
    per-task gradients with respect to it, then one backward of the weighted gradient."""
    model, x, targets = _setup(3, two_features)
    features = model.features(x)
    detached = tuple(f.detach().requires_grad_() for f in features)
    losses = model.losses(detached, targets)
    task_params = list(model.heads.parameters()) + list(model.shared_head.parameters())
    rows, own = [], []
    for loss in losses:
        grads = torch.autograd.grad(loss, detached + tuple(task_params), allow_unused=True)
        rows.append(torch.cat([g.flatten() for g in grads[: len(detached)]]))
        own.append(grads[len(detached) :])
    rows = torch.stack(rows)
    weights = weighting(rows @ rows.T)
    combined = weights @ rows
    direction, start = [], 0
    for f in features:
        direction.append(combined[start : start + f.numel()].reshape(f.shape))
        start += f.numel()
    torch.autograd.backward(features, direction)
    for p, *gs in zip(task_params, *own):
        p.grad = sum(g for g in gs if g is not None)
    return _grads(model), weights


@pytest.mark.parametrize("two_features", [False, True])
@pytest.mark.parametrize("make", [tjd.MGDAWeighting, tjd.UPGradWeighting, tjd.MeanWeighting])
def test_features_level_equals_mgda_ub_by_hand(make, two_features):
    want, want_weights = _mgda_ub_by_hand(make(), two_features)
    for given in (make(), tjd.MGDA() if make is tjd.MGDAWeighting else make()):
        got, weights = _funcgrad(given, two_features=two_features, level="features")
        _assert_grads_close(got, want)
        torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("level", ["params", "features"])
def test_no_weighting_equals_sum_of_losses(level):
    model, x, targets = _setup(3, two_features=True)
    sum(model.losses(model.features(x), targets)).backward()
    want = _grads(model)
    got, weights = _funcgrad(None, two_features=True, level=level)
    _assert_grads_close(got, want)
    torch.testing.assert_close(weights, torch.ones(3))


def test_grads_accumulate_and_mapping_losses_give_keyed_weights():
    model, x, targets = _setup(3)
    for _ in range(2):  # .grad += as autograd accumulates
        features = model.features(x)
        losses = dict(zip("abc", model.losses(features, targets)))
        weights = funcgrad.backward(losses, through=features, weighting=tjd.UPGradWeighting())
    assert list(weights) == ["a", "b", "c"]
    want = _torchjd(tjd.UPGrad())
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, 2 * want[name], rtol=1e-8, atol=1e-8)


def test_inputs_restricts_the_shared_update():
    model, x, targets = _setup(3)
    features = model.features(x)
    first = model.encoder[2]
    funcgrad.backward(
        model.losses(features, targets),
        through=features,
        weighting=tjd.UPGradWeighting(),
        inputs=first.named_parameters(),
    )
    assert model.encoder[0].weight.grad is None  # not in inputs: left alone
    assert first.weight.grad is not None and model.heads[0].weight.grad is not None


@pytest.mark.parametrize("k", [1, 2, 8, 32])
def test_features_level_runs_one_backward_through_the_shared_part(k):
    counter = BackwardCounter()
    model, x, targets = _setup(k, counter=counter)
    features = model.features(x)
    funcgrad.backward(
        model.losses(features, targets),
        through=features,
        weighting=tjd.UPGradWeighting(),
        level="features",
    )
    assert counter.backward == 1
    counter.reset()
    features = model.features(x)
    funcgrad.backward(model.losses(features, targets), through=features)  # no weighting
    assert counter.backward == 1


def test_params_level_passes_are_one_batch_or_one_per_direction():
    counter = BackwardCounter()
    model, x, targets = _setup(4, counter=counter)
    features = model.features(x)
    funcgrad.backward(model.losses(features, targets), through=features, weighting=tjd.MGDA())
    assert counter.backward == 1  # one vmapped backward of the 4 directions
    counter.reset()
    features = model.features(x)
    funcgrad.backward(
        model.losses(features, targets), through=features, weighting=tjd.MGDA(), chunk_size=1
    )
    assert counter.backward == 4


def test_float32_model():
    model, x, targets = _setup(3)
    model.float()
    features = model.features(x.float())
    weights = funcgrad.backward(
        model.losses(features, targets.float()), through=features, weighting=tjd.UPGrad()
    )
    assert weights.dtype == torch.float32
    assert all(torch.isfinite(g).all() for g in _grads(model).values())


# -- errors: clear, named, and before any pass through the shared part ----------------------


def test_errors_on_losses():
    _raises(
        r"losses\[1\] must be a scalar, got shape \(2,\)",
        losses=lambda ls, m, f: [ls[0], ls[1] * torch.ones(2)],
    )
    _raises(
        r"losses\[0\] must be a real floating scalar",
        losses=lambda ls, m, f: [torch.ones((), dtype=torch.complex128, requires_grad=True)],
        error=TypeError,
    )
    _raises(
        r"losses\['b'\] does not depend on `through`",
        losses=lambda ls, m, f: {"a": ls[0], "b": m.shared_head.bias.sum()},
    )
    _raises(
        r"`losses` must be a tensor or a non-empty sequence",
        losses=lambda ls, m, f: [],
        error=TypeError,
    )


def test_error_on_a_loss_around_through():
    counter, model, features, losses = _counted_graph()
    bad = [losses[0], losses[1] + model.encoder[0].weight.sum()]
    with pytest.raises(ValueError, match=r"losses\[1\] reaches inputs\['0.weight'\] other than"):
        funcgrad.backward(bad, through=features, inputs=model.encoder.named_parameters())
    with pytest.raises(
        ValueError, match=r"reaches a parameter of shape \(7, 5\) \(pass inputs=.*both shared"
    ):
        funcgrad.backward(bad, through=features)
    assert counter.backward == 0 and not _grads(model)


def test_errors_on_arguments():
    _raises("unknown `level` 'param'", level="param")
    _raises("`weighting` must be None, a callable", weighting=3, error=TypeError)
    _raises(
        "GradDrop is a TorchJD Aggregator without weights",
        weighting=tjd.GradDrop(),
        level="features",
    )
    _raises("`chunk_size` must be", chunk_size=0)
    with pytest.raises(ValueError, match="depends on no tensor of `inputs`"):
        model, x, targets = _setup()
        features = model.features(x)
        unrelated = torch.nn.Parameter(torch.ones(2))
        funcgrad.backward(model.losses(features, targets), through=features, inputs=[unrelated])
    with pytest.raises(ValueError, match=r"inputs\[0\] must be a leaf tensor"):
        model, x, targets = _setup()
        features = model.features(x)
        funcgrad.backward(model.losses(features, targets), through=features, inputs=[features[0]])
    with pytest.raises(ValueError, match="unknown `level`"):
        funcgrad.combine_heads(torch.sin, [torch.sum], level="both")
    with pytest.raises(ValueError, match=r"combine_heads\(f, heads\): `weighting` must return"):
        funcgrad.combine_heads(torch.sin, [torch.sum, torch.sum], lambda g: g.sum())(torch.ones(2))


@pytest.mark.parametrize("level", ["params", "features"])
def test_a_second_call_on_a_spent_graph_raises_as_torch_does(level):
    """retain_graph=False: a second backward through the same forward is refused (torch's
    contract), .grad unchanged, through the same features, a view of them, or an earlier
    layer's output, and so is the user's own backward, before it writes anything;
    retain_graph=True lets it accumulate again, as torch does."""
    model, x, targets = _setup()
    features = model.features(x)
    losses = model.losses(features, targets)
    weighting = tjd.UPGradWeighting()
    funcgrad.backward(losses, through=features, weighting=weighting, level=level)
    once = _grads(model)
    view = features[0].view_as(features[0])
    for through, outs in [
        (features, losses),
        ((view,), model.losses((view,), targets)),
    ]:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            funcgrad.backward(outs, through=through, weighting=weighting, level=level)
        assert_tree_close(_grads(model), once)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sum(losses).backward()
    assert_tree_close(_grads(model), once)  # the heads' .grad too

    model.zero_grad()
    features = model.features(x)
    losses = model.losses(features, targets)
    for _ in range(2):
        funcgrad.backward(
            losses, through=features, weighting=weighting, level=level, retain_graph=True
        )
    assert_tree_close(_grads(model), {name: 2 * g for name, g in once.items()})


def test_an_earlier_layers_output_of_a_spent_graph_is_refused():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    hidden = layers[:2](torch.randn(6, 4))
    features = layers[2](hidden)
    losses = [features[:, i].pow(2).mean() for i in range(3)]
    funcgrad.backward(losses, through=features, weighting=tjd.UPGradWeighting())
    grads = [p.grad.clone() for p in layers.parameters()]
    with pytest.raises(RuntimeError, match="second time"):
        funcgrad.backward([hidden.sum(), hidden.pow(2).sum()], through=hidden)
    for p, g in zip(layers.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


def _leaves(*tensors):
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def _same_grads(tensors, before):
    return all(
        (t.grad is None and b is None)
        or (t.grad is not None and b is not None and torch.equal(t.grad, b))
        for t, b in zip(tensors, before)
    )


def _cheap_graphs(kind):
    """(through, losses, every leaf) of a forward whose part below `through` saves no
    tensor (an add, a leaf: torch frees nothing there) while the heads' part does."""
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 1)
    c = torch.randn(4)
    if kind == "add":
        p = torch.randn(4, requires_grad=True)
        through = p + 1
        leaves = [p, *head.parameters()]
    else:  # precomputed features, detached from the encoder that made them
        encoder = torch.nn.Linear(3, 4)
        through = encoder(torch.randn(5, 3)).detach().requires_grad_()
        leaves = [through, *head.parameters()]
    return through, [(through * c).sum(), (through * through).sum(), head(through).sum()], leaves


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize("kind", ["add", "leaf"])
def test_a_second_call_through_heads_that_save_tensors_raises_as_torch_does(kind, level):
    """The part below `through` frees nothing, but the heads' part does: torch refuses a
    second sum(losses).backward(), and so does funcgrad, before writing anything."""
    through, losses, leaves = _cheap_graphs(kind)
    sum(losses).backward()
    once = _leaves(*leaves)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sum(losses).backward()  # torch's answer

    through, losses, leaves = _cheap_graphs(kind)
    funcgrad.backward(losses, through=through, level=level)
    assert all(torch.allclose(t.grad, g) for t, g in zip(leaves, once))
    before = _leaves(*leaves)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        funcgrad.backward(losses, through=through, level=level)
    assert _same_grads(leaves, before)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sum(losses).backward()
    assert _same_grads(leaves, before)


@pytest.mark.parametrize("level", ["params", "features"])
def test_the_users_backward_after_a_call_writes_nothing(level):
    """A loss with a parameter added to it (uncertainty weighting's log-variance): torch
    itself, on a freed graph, accumulates into that parameter before it reaches a freed node
    and raises; after funcgrad's call the user's backward raises before any .grad moves. A
    backward that runs no freed node (the engine prunes the rest) works, as in torch."""

    def forward():
        model, x, targets = _setup()
        log_vars = torch.nn.Parameter(torch.zeros(3))
        features = model.features(x)
        losses = model.losses(features, targets)
        return model, log_vars, features, [loss + v for loss, v in zip(losses, log_vars)]

    model, log_vars, features, losses = forward()
    sum(losses).backward()
    (want,) = torch.autograd.grad(losses[1], log_vars)  # torch: runs no freed node

    model, log_vars, features, losses = forward()
    funcgrad.backward(losses, through=features, level=level)
    tensors = [*model.parameters(), log_vars]
    before = _leaves(*tensors)
    for again in (lambda: sum(losses).backward(), lambda: losses[1].backward()):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            again()
        assert _same_grads(tensors, before)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        features[0].sum().backward()  # the shared part alone
    assert _same_grads(tensors, before)
    (got,) = torch.autograd.grad(losses[1], log_vars)
    torch.testing.assert_close(got, want)


class _Box:
    def __init__(self, tensor):
        self.tensor = tensor


@pytest.mark.parametrize("level", ["params", "features"])
def test_a_spent_graph_goes_when_dropped(level):
    """The refusing hooks hold no reference cycle: every tensor the graph saved is freed
    when the user drops the losses and features, as after torch's own backward."""
    saved = []

    def pack(tensor):
        box = _Box(tensor.detach())  # (not the tensor: its own grad_fn may save it)
        saved.append(weakref.ref(box))  # the graph holds the only reference
        return box

    model, x, targets = _setup()
    log_vars = torch.nn.Parameter(torch.zeros(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        features = model.features(x)
        losses = [loss + v for loss, v in zip(model.losses(features, targets), log_vars)]
    funcgrad.backward(losses, through=features, level=level)
    del features, losses
    gc.collect()
    assert saved and all(ref() is None for ref in saved)


class _ReverseGradient(torch.autograd.Function):
    """A gradient reversal layer (domain adaptation): it saves no tensor."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -grad


@pytest.mark.parametrize("level", ["params", "features"])
def test_heads_whose_custom_functions_save_nothing_run_again_as_in_torch(level):
    """A custom Function that saved no tensor frees nothing: torch runs its backward again,
    and so does funcgrad."""

    def forward():
        torch.manual_seed(0)
        p = torch.randn(4, requires_grad=True)
        through = p + 1
        return p, through, [_ReverseGradient.apply(through).sum(), through.sum()]

    p, through, losses = forward()
    sum(losses).backward()
    sum(losses).backward()  # torch: no error
    p_, through, losses = forward()
    for _ in range(2):
        funcgrad.backward(losses, through=through, level=level)
    torch.testing.assert_close(p_.grad, p.grad)


@pytest.mark.parametrize("level", ["params", "features"])
def test_backward_in_inference_mode_as_torch(level):
    """A graph built outside inference mode, backward inside it: torch.autograd.backward
    works there (its .grad are inference tensors), and so does funcgrad, with the same
    .grad."""
    model, x, targets = _setup()
    losses = model.losses(model.features(x), targets)
    with torch.inference_mode():
        torch.autograd.backward(losses)
    want = _grads(model)
    model.zero_grad()
    features = model.features(x)
    losses = model.losses(features, targets)
    with torch.inference_mode():
        funcgrad.backward(losses, through=features, level=level, retain_graph=True)
        funcgrad.backward(losses, through=features, level=level, weighting=lambda g: g.new_ones(3))
    assert_tree_close(_grads(model), {name: 2 * g for name, g in want.items()}, rtol=1e-6)
    assert all(torch.is_inference(p.grad) for p in model.parameters())


def test_graphs_that_free_nothing_run_again_as_in_torch():
    """A leaf `through` (precomputed features, an embedding table) or one that only adds
    leaves saves no tensor: torch runs its backward again, and so does funcgrad (a second
    call with a new forward of the heads accumulates the same update again)."""
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(6, 4))
    bias = torch.nn.Parameter(torch.randn(4))
    heads = torch.randn(3, 4)
    for through in (table, table + bias):
        torch.autograd.backward(through, torch.ones_like(through))  # torch: no error
        torch.autograd.backward(through, torch.ones_like(through))
        table.grad = bias.grad = None
        losses = [(through @ h).sin().sum() for h in heads]
        funcgrad.backward(losses, through=through, weighting=tjd.UPGradWeighting())
        once = table.grad.clone()
        losses = [(through @ h).sin().sum() for h in heads]
        funcgrad.backward(losses, through=through, weighting=tjd.UPGradWeighting())
        torch.testing.assert_close(table.grad, 2 * once)


@pytest.mark.parametrize("level", ["features", "params"])
def test_a_1d_tensor_of_losses_is_k_losses(level):
    model, x, targets = _setup()
    features = model.features(x)
    losses = model.losses(features, targets)
    want = funcgrad.backward(losses, through=features, level=level, retain_graph=True)
    want_grads = _grads(model)
    model.zero_grad()
    got = funcgrad.backward(torch.stack(losses), through=features, level=level)
    torch.testing.assert_close(got, want)
    assert_tree_close(_grads(model), want_grads)


def test_a_matrix_of_losses_is_a_clear_error():
    model, x, targets = _setup()
    features = model.features(x)
    losses = torch.stack(model.losses(features, targets))
    with pytest.raises(ValueError, match=r"`losses` must be k scalar losses .* shape \(1, 3\)"):
        funcgrad.backward(losses[None], through=features)


@pytest.mark.parametrize("level", ["features", "params"])
def test_sparse_embedding_gradients_are_written_sparse_as_torch(level):
    """nn.EmbeddingBag(sparse=True) as the shared part: the per-task gradients are sparse;
    the Gramian and w @ P take them dense and .grad is written sparse, as torch writes it."""
    torch.manual_seed(0)
    emb = torch.nn.EmbeddingBag(10, 4, mode="sum", sparse=True).double()
    heads = [torch.nn.Linear(4, 1).double() for _ in range(2)]
    idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    f = emb(idx, offsets)
    (heads[0](f).sum() + 2 * heads[1](f).sum()).backward()
    want = emb.weight.grad.to_dense()
    emb.weight.grad = None
    f = emb(idx, offsets)
    losses = [h(f).sum() for h in heads]
    with warnings.catch_warnings():  # the sparse embedding is seen: a loop, no vmap attempt
        warnings.simplefilter("error")
        funcgrad.backward(losses, through=f, level=level, weighting=lambda g: weights)
    assert emb.weight.grad.is_sparse
    torch.testing.assert_close(emb.weight.grad.to_dense(), want)
    # Torch's own sparse .grad and funcgrad's add to each other, in both orders (the same
    # sparse dims: one, the rows).
    f = emb(idx, offsets)
    (heads[0](f).sum() + 2 * heads[1](f).sum()).backward()
    assert emb.weight.grad.sparse_dim() == 1
    f = emb(idx, offsets)
    losses = [h(f).sum() for h in heads]
    funcgrad.backward(losses, through=f, level=level, weighting=lambda g: weights)
    torch.testing.assert_close(emb.weight.grad.to_dense(), 3 * want)


def test_an_integer_grad_preset_is_refused_before_anything_is_written():
    torch.manual_seed(0)
    encoder, heads = torch.nn.Linear(3, 4).double(), [torch.nn.Linear(4, 1).double()] * 2
    encoder.weight.grad = torch.zeros_like(encoder.weight)
    encoder.bias.grad_dtype = None  # (torch lets a .grad of another dtype be set then)
    encoder.bias.grad = torch.ones(4, dtype=torch.int64)
    f = encoder(torch.randn(5, 3, dtype=torch.float64))
    losses = [h(f).sum() for h in heads]
    with pytest.raises(ValueError, match=r"backward.*dtype torch.int64.*Nothing was run"):
        funcgrad.backward(losses, through=f, weighting=lambda g: torch.ones(2), level="params")
    assert torch.equal(encoder.weight.grad, torch.zeros_like(encoder.weight))


@pytest.mark.parametrize("weighting", [None, "ones"])
@pytest.mark.parametrize("level", ["features", "params"])
def test_no_two_leaves_share_a_grad_and_no_grad_holds_k_rows(level, weighting):
    """autograd hands one tensor to both leaves of a sum (base + delta): each .grad must
    own its storage, as torch's AccumulateGrad gives it (a clip or a second accumulation
    on one leaf must not change the other); a task-specific leaf's .grad must not be a row
    of the k stacked per-task gradients (k times its memory kept alive)."""
    torch.manual_seed(0)
    base = torch.randn(3, 4, requires_grad=True)
    delta = torch.zeros(3, 4, requires_grad=True)
    heads = [torch.nn.Linear(4, 50) for _ in range(3)]
    x = torch.randn(5, 3)
    rule = None if weighting is None else (lambda g: torch.ones(3))
    for _ in range(2):  # the second call accumulates into the first one's .grad
        t = x @ (base + delta)
        losses = [h(t).pow(2).mean() for h in heads]
        funcgrad.backward(losses, through=t, level=level, weighting=rule)
    want = [torch.zeros_like(p) for p in (base, delta, heads[0].weight)]
    for _ in range(2):
        t = x @ (base + delta)
        grads = torch.autograd.grad(
            sum(h(t).pow(2).mean() for h in heads), [base, delta, heads[0].weight]
        )
        for w, g in zip(want, grads):
            w += g
    for p, w in zip((base, delta, heads[0].weight), want):
        torch.testing.assert_close(p.grad, w)
    assert base.grad.data_ptr() != delta.grad.data_ptr()
    weight_grad = heads[0].weight.grad
    assert (
        weight_grad.untyped_storage().nbytes() == weight_grad.numel() * weight_grad.element_size()
    )


# -- an error at any stage leaves every .grad unchanged ----------------------------------------


def _multitask():
    torch.manual_seed(2)
    encoder = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4))
    heads = nn.ModuleList(nn.Linear(4, 1) for _ in range(3))
    return encoder, heads


def _grad_list(*modules):
    return [None if p.grad is None else p.grad.clone() for m in modules for p in m.parameters()]


def _same(before, after):
    return len(before) == len(after) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(before, after)
    )


def _nan_weights(gramian):
    return torch.full(gramian.shape[:1], float("nan"))


def _raising_weighting(gramian):
    raise RuntimeError("the solver failed")


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize(
    "stage", ["validate", "collect", "weigh-nan", "weigh-raises", "apply-freed-graph"]
)
def test_an_error_at_any_stage_of_backward_leaves_every_grad_unchanged(level, stage):
    encoder, heads = _multitask()
    x = torch.randn(8, 5)
    features = encoder(x)
    losses = [head(features).pow(2).mean() for head in heads]
    weighting = lambda g: torch.ones(g.shape[0])  # noqa: E731
    if stage == "apply-freed-graph":  # a first call frees the shared part's graph (at level
        # "params" the graph is kept during the call, whatever retain_graph: see backward)
        funcgrad.backward(losses, through=features, weighting=weighting, level="features")
    before = _grad_list(encoder, heads)
    if stage == "validate":
        losses = [*losses, encoder(x).sum()]  # does not depend on `through`
        error = ValueError
    elif stage == "collect":
        losses[2].backward(retain_graph=False)  # frees that loss's own graph
        for p in heads[2].parameters():  # (what that backward wrote is not funcgrad's)
            p.grad = None
        for p in encoder.parameters():
            p.grad = None
        before = _grad_list(encoder, heads)
        error = RuntimeError
    elif stage == "weigh-nan":
        weighting, error = _nan_weights, ValueError
    elif stage == "weigh-raises":
        weighting, error = _raising_weighting, RuntimeError
    else:
        error = RuntimeError
    with pytest.raises(error):
        funcgrad.backward(losses, through=features, weighting=weighting, level=level)
    assert _same(before, _grad_list(encoder, heads))


def test_backward_accepts_check():
    encoder, heads = _multitask()
    features = encoder(torch.randn(8, 5))
    losses = [head(features).pow(2).mean() for head in heads]
    with pytest.raises(ValueError, match="`check` must be True, False or 'strict'"):
        funcgrad.backward(losses, through=features, check="sometimes")
    funcgrad.backward(losses, through=features, weighting=lambda g: torch.ones(3), check="strict")
    assert all(p.grad is not None for p in encoder.parameters())


@pytest.mark.parametrize("level", ["features", "params"])
def test_backward_collects_the_losses_gradients_as_autograd(level):
    """The per-task cotangents and each task's own gradients against a loop of
    torch.autograd.grad; one loss has an infinite derivative on its path (sqrt at 0)."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(3, 4).double()
    heads = [torch.nn.Linear(4, 1).double() for _ in range(3)]
    x = torch.randn(5, 3, dtype=torch.float64)

    def losses_of(features):
        return [
            heads[0](features).pow(2).mean(),
            heads[1](features).tanh().sum(),
            torch.sqrt(torch.relu(heads[2](features))).sum(),  # relu makes zeros: sqrt at 0
        ]

    features = encoder(x)
    losses = losses_of(features)
    params = [*encoder.parameters(), *(p for h in heads for p in h.parameters())]
    want = [torch.zeros_like(p) for p in params]
    for loss in losses:
        for w, g in zip(
            want, torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        ):
            if g is not None:
                w += g
    funcgrad.backward(losses, through=features, level=level)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, equal_nan=True)


# -- the shared graph is freed by the last pass, as by sum(losses).backward() ------------


class _Saved:
    """The tensors a forward saves for backward, each packed in a box that only the graph
    holds (see test_a_spent_graph_goes_when_dropped): a node drops its boxes when a
    backward without retain_graph runs it, so ``alive()`` counts the saved tensors the graph
    still holds while the user still holds its outputs."""

    def __init__(self):
        self.refs = []

    def pack(self, tensor):
        box = _Box(tensor.detach())
        self.refs.append(weakref.ref(box))
        return box

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda box: box.tensor)

    def alive(self):
        gc.collect()
        return sum(ref() is not None for ref in self.refs)


def _freeing_model(shared):
    """(encoder: x -> features, its parameters, 3 heads, x, targets) in float64. "mlp": a
    plain encoder; "checkpoint": the same inside a reentrant checkpoint (pulled by
    .backward(), one direction at a time); "narrow": 2 features for 3 tasks (k > m)."""
    torch.manual_seed(0)
    width = 2 if shared == "narrow" else 6
    layers = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, width), torch.nn.Tanh()
    ).double()
    heads = torch.nn.ModuleList(torch.nn.Linear(width, 1) for _ in range(3)).double()
    x, targets = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    x.requires_grad_(shared == "checkpoint")  # (a reentrant checkpoint needs such an input)

    def encoder(inputs):
        if shared == "checkpoint":
            return torch.utils.checkpoint.checkpoint(layers, inputs, use_reentrant=True)
        return layers(inputs)

    return encoder, list(layers.parameters()), heads, x, targets


def _freeing_losses(heads, features, targets):
    return [(head(features) - targets[:, i : i + 1]).pow(2).mean() for i, head in enumerate(heads)]


@pytest.mark.parametrize("shared", ["mlp", "checkpoint", "narrow"])
@pytest.mark.parametrize("level", ["params", "features"])
def test_backward_frees_the_shared_graph_as_sum_backward_does(level, shared):
    """retain_graph=False: the shared part's saved tensors are gone once backward returns,
    while the user still holds `through` and the losses, as after sum(losses).backward()
    (the previous step's activations no longer live through the next forward); the
    gradients are TorchJD's (params) or w @ the per-head autograd gradients (features), in
    one batched pass through the shared part (one per direction through a reentrant
    checkpoint)."""
    encoder, params, heads, x, targets = _freeing_model(shared)
    saved = _Saved()
    with saved.hooks():
        features = encoder(x)
    losses = _freeing_losses(heads, features, targets)
    sum(losses).backward()
    assert saved.refs and saved.alive() == 0  # torch's own backward: the reference

    want = []
    for i in range(3):  # per-head autograd, on a graph of its own (.backward(): a reentrant
        for p in params:  # checkpoint hides its parameters from torch.autograd.grad)
            p.grad = None
        _freeing_losses(heads, encoder(x), targets)[i].backward()
        want.append([p.grad for p in params])
    for p in [*params, *heads.parameters()]:
        p.grad = None
    saved, counter = _Saved(), BackwardCounter()
    with saved.hooks():
        features = counted(encoder(x), counter)
    losses = _freeing_losses(heads, features, targets)
    weights = funcgrad.backward(
        losses, through=features, weighting=tjd.UPGradWeighting(), level=level, inputs=params
    )
    assert saved.alive() == 0, f"{saved.alive()} of {len(saved.refs)} saved tensors still held"
    assert counter.backward == (3 if shared == "checkpoint" and level == "params" else 1)
    assert features.grad_fn is not None and all(loss.grad_fn is not None for loss in losses)
    for j, p in enumerate(params):
        torch.testing.assert_close(p.grad, sum(w * g[j] for w, g in zip(weights, want)))
    if level == "params" and shared != "checkpoint":  # TorchJD's mtl_backward + jac_to_grad
        # (on a forward of its own; TorchJD cannot go through a reentrant checkpoint)
        got = [p.grad for p in params]
        for p in [*params, *heads.parameters()]:
            p.grad = None
        features = encoder(x)
        mtl_backward(_freeing_losses(heads, features, targets), features)
        jac_to_grad(params, tjd.UPGrad())
        for p, g in zip(params, got):
            torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("level", ["params", "features"])
def test_retain_graph_keeps_the_shared_graph_for_a_second_call(level):
    encoder, params, heads, x, targets = _freeing_model("mlp")
    saved = _Saved()
    with saved.hooks():
        features = encoder(x)
    losses = _freeing_losses(heads, features, targets)
    weighting = tjd.UPGradWeighting()
    funcgrad.backward(losses, through=features, weighting=weighting, level=level, retain_graph=True)
    assert saved.alive() == len(saved.refs) > 0
    once = [p.grad.clone() for p in params]
    funcgrad.backward(losses, through=features, weighting=weighting, level=level)
    for p, g in zip(params, once):
        torch.testing.assert_close(p.grad, 2 * g)
    assert saved.alive() == 0


@pytest.mark.parametrize(
    ("options", "passes"),
    [
        ({"chunk_size": 1}, 3),  # a loop: its last direction frees
        ({"chunk_size": 2}, 2),  # two vmapped chunks: the last one frees
        ({"chunk_size": "auto"}, 2),  # direction 0 alone (measured), then the rest: it frees
        ({"check": True}, 4),  # one vmap, then 3 unbatched comparisons: the last one frees
    ],
)
def test_every_way_of_pulling_the_params_level_frees_with_its_last_pass(options, passes):
    """No pass is added to free the graph: the last one through it does."""
    encoder, params, heads, x, targets = _freeing_model("mlp")
    saved, counter = _Saved(), BackwardCounter()
    with saved.hooks():
        features = counted(encoder(x), counter)
    losses = _freeing_losses(heads, features, targets)
    weights = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    funcgrad.backward(losses, through=features, weighting=lambda g: weights, **options)
    assert saved.alive() == 0
    assert counter.backward == passes
    got = [p.grad for p in params]
    for p in params:
        p.grad = None
    sum(
        w * loss for w, loss in zip(weights, _freeing_losses(heads, encoder(x), targets))
    ).backward()
    for p, g in zip(params, got):
        torch.testing.assert_close(g, p.grad)


def _sparse_model(deep):
    """A sparse embedding (vmap cannot batch its sparse gradient), as `through` itself
    (its backward is the first one run) or under a layer that saves tensors (run before)."""
    torch.manual_seed(0)
    emb = torch.nn.EmbeddingBag(10, 4, mode="sum", sparse=True).double()
    layer = torch.nn.Linear(4, 5).double()
    heads = torch.nn.ModuleList(torch.nn.Linear(5 if deep else 4, 1) for _ in range(3)).double()
    idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])

    def encoder():
        bags = emb(idx, offsets)
        return torch.tanh(layer(bags)) if deep else bags

    return encoder, [emb.weight, *(layer.parameters() if deep else ())], heads


@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("fix", [{}, {"retain_graph": True}, {"chunk_size": 2}])
def test_a_sparse_embedding_is_pulled_by_a_loop_that_frees_the_graph(deep, fix):
    """vmap cannot batch the sparse embedding's gradient, and a batched pass that frees the
    graph would fail there after freeing the layers above it (deep): the walk of the graph
    sees the sparse embedding, and the pulls loop from the start (no warning), the last
    direction freeing the graph unless retain_graph; autograd's gradients."""
    encoder, params, heads = _sparse_model(deep)
    weights = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    weighting = lambda g: weights  # noqa: E731
    features = encoder()
    sum(w * head(features).sum() for w, head in zip(weights, heads)).backward()
    want = [p.grad.to_dense() for p in params]
    for p in [*params, *heads.parameters()]:
        p.grad = None
    saved = _Saved()
    with saved.hooks():
        features = encoder()
    losses = [head(features).sum() for head in heads]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        funcgrad.backward(losses, through=features, weighting=weighting, **fix)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad.to_dense(), w)
    kept = fix.get("retain_graph", False)
    assert saved.alive() == (len(saved.refs) if kept else 0)


@pytest.mark.parametrize("level", ["params", "features"])
def test_a_retry_after_a_weighting_error_on_a_freed_graph_is_refused_up_front(level):
    """The weighting runs after passes that freed part of the graph (each loss's backward its
    own part; at level "params" also the pull, the shared part): a retry through that graph
    is torch's error, raised before any pass and any write, and so is the user's own
    backward; with retain_graph=True the graph is kept and the retry answers."""
    nan = lambda g: g[0] / 0 - g[0] / 0  # noqa: E731
    counter, model, features, losses = _counted_graph()
    with pytest.raises(ValueError, match="non-finite weights"):
        funcgrad.backward(losses, through=features, weighting=nan, level=level)
    counter.reset()
    with pytest.raises(funcgrad.SecondBackwardError, match="backward through the graph a second"):
        funcgrad.backward(losses, through=features, weighting=tjd.UPGradWeighting(), level=level)
    with pytest.raises(RuntimeError, match="backward through the graph a second"):
        torch.stack(losses).sum().backward()
    assert counter.backward == 0 and not _grads(model)

    counter, model, features, losses = _counted_graph()
    with pytest.raises(ValueError, match="non-finite weights"):
        funcgrad.backward(losses, through=features, weighting=nan, level=level, retain_graph=True)
    funcgrad.backward(losses, through=features, weighting=tjd.UPGradWeighting(), level=level)
    assert _grads(model)


def _freeing_ranks(rank, store):
    """On each of 2 gloo ranks, for each Sync policy (a ProcessGroup, a DDP module that is
    the shared encoder or only part of it, an FSDP2 encoder) at both levels: two steps in a
    row, each freeing the shared part's saved tensors (DDP's reducer and FSDP's hooks still
    reduce the second step), every .grad the one process's on the whole batch."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from helpers import rank_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_default_dtype(torch.float64)
    with rank_group(rank, store, timeout_s=120):
        mesh = init_device_mesh("cpu", (2,))
        generator = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)
        shard = slice(rank * 4, rank * 4 + 4)
        for wrap in ("group", "ddp", "ddp part", "fsdp"):
            for level in ("params", "features"):
                torch.manual_seed(0)
                encoder = torch.nn.Sequential(
                    torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6), torch.nn.Tanh()
                )
                heads = torch.nn.ModuleList(torch.nn.Linear(6, 1) for _ in range(3))
                reference = copy.deepcopy((encoder, heads))
                if wrap == "fsdp":
                    group = fully_shard(encoder, mesh=mesh)
                    run = encoder
                elif wrap == "ddp":
                    run = group = torch.nn.parallel.DistributedDataParallel(encoder)
                elif wrap == "ddp part":
                    group = torch.nn.parallel.DistributedDataParallel(encoder[0])
                    run = torch.nn.Sequential(group, *encoder[1:])
                else:
                    run, group = encoder, dist.group.WORLD
                for step in range(2):
                    label = f"{wrap} {level} step {step}"
                    saved = _Saved()
                    with saved.hooks():
                        features = run(x[shard])
                    losses = [
                        F.mse_loss(h(features), y[shard, i : i + 1]) for i, h in enumerate(heads)
                    ]
                    funcgrad.backward(
                        losses,
                        through=features,
                        weighting=tjd.UPGradWeighting(),
                        level=level,
                        process_group=group,
                    )
                    assert saved.alive() == 0, label
                    features = reference[0](x)
                    losses = [
                        F.mse_loss(h(features), y[:, i : i + 1]) for i, h in enumerate(reference[1])
                    ]
                    funcgrad.backward(
                        losses, through=features, weighting=tjd.UPGradWeighting(), level=level
                    )
                    pairs = zip(
                        [*encoder.parameters(), *heads.parameters()],
                        [*reference[0].parameters(), *reference[1].parameters()],
                    )
                    for p, q in pairs:
                        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        torch.testing.assert_close(got, q.grad, rtol=1e-7, atol=1e-9, msg=label)


@pytest.mark.slow
def test_every_sync_policy_frees_the_shared_graph(tmp_path):
    from funcgrad.bench.ranks import spawn_ranks

    spawn_ranks(_freeing_ranks, str(tmp_path / "store"))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_check_that_catches_a_wrong_batch_answers_and_frees(k):
    """check=True on a shared part whose batched backward torch gets wrong (cdist): the
    unbatched calls answer (with k <= 3 they are the comparisons themselves, the last of
    which freed the graph; else a loop whose last direction frees it)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x, points = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    scales = torch.linspace(-1, 1, 20, dtype=torch.float64).reshape(5, 4)
    weights = torch.linspace(0.5, 2.0, k, dtype=torch.float64)

    def losses_of(features):
        return [(features * scales**i).sum() for i in range(k)]

    sum(w * loss for w, loss in zip(weights, losses_of(torch.cdist(x @ weight, points)))).backward()
    want, weight.grad = weight.grad, None
    saved = _Saved()
    with saved.hooks():
        features = torch.cdist(x @ weight, points)
    with pytest.warns(funcgrad.FuncgradWarning, match="check found that vmap computed"):
        funcgrad.backward(
            losses_of(features), through=features, weighting=lambda g: weights, check=True
        )
    torch.testing.assert_close(weight.grad, want)
    assert saved.alive() == 0


# -- graph shapes: the cheap side per loss, and the refusal after a call -------------------


class _Cube(torch.autograd.Function):
    """A custom Function that saves its input (torch refuses a second backward through it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


def _shape_forward(shape):
    """(every leaf, through, the losses) of a small float64 forward of the given shape."""
    g = torch.Generator().manual_seed(0)

    def param(*size):
        return nn.Parameter(torch.randn(*size, generator=g, dtype=torch.float64))

    w, w2, x = param(5, 3), param(5, 5), torch.randn(4, 3, generator=g, dtype=torch.float64)
    h1, h2, h3 = param(5), param(5), param(5)
    log_vars = param(3)
    extra: list[torch.Tensor] = []
    features = torch.tanh(x @ w.T)
    through: torch.Tensor | tuple[torch.Tensor, ...] = features
    if shape == "leaf shared by two losses":  # h3: in losses 0 and 1 (its .grad: their sum)
        losses = [
            (features @ h1 + features @ h3).pow(2).mean(),
            ((features @ h2) * (features @ h3)).mean(),
            (features @ h2).sin().mean(),
        ]
    elif shape == "leaf used twice by a loss":
        f = features @ h1
        losses = [(f * f.sin() + h1.pow(2).sum()).mean(), (features * h2).exp().mean()]
    elif shape == "shared normalisation above through":
        normed = nn.functional.layer_norm(features, (5,))
        losses = [(normed @ h).pow(2).mean() for h in (h1, h2, h3)]
    elif shape == "multi-output ops":
        columns = features.unbind(1)
        first, rest = features.split([2, 3], dim=1)
        top, _ = features.max(dim=1)
        losses = [
            (columns[0] * h1[:4]).pow(2).sum(),
            (rest.sum(1) * h2[:4]).sin().sum(),
            (top * h3[:4]).exp().sum(),
            columns[3].sum() * first.pow(2).sum(),
        ]
    elif shape == "view through":
        through = features.view(2, 10)
        losses = [(through @ torch.cat([h, h])).pow(2).sum() for h in (h1, h2)]
    elif shape == "two through":
        u = param(2, 3)
        extra.append(u)
        other = torch.sigmoid(x @ u.T)
        through = (features, other)
        losses = [
            (features @ h1).pow(2).sum(),
            (other.sum(1) * (features @ h2)).sum(),
            other.pow(3).sum() * h3.sum(),
        ]
    elif shape == "custom Function in the shared part":
        through = _Cube.apply(features @ w2)
        losses = [(through @ h).pow(2).sum() for h in (h1, h2)]
    elif shape == "custom Functions in the heads":
        losses = [_Cube.apply(features @ h1).sum(), _ReverseGradient.apply(features @ h2).sum()]
    elif shape == "non-reentrant checkpoint":
        through = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(t @ w2.T), features, use_reentrant=False
        )
        losses = [(through @ h).pow(2).sum() for h in (h1, h2)]
    else:  # uncertainty weighting: a log-variance added to each loss
        assert shape == "log-variances"
        losses = [
            (features @ h).pow(2).mean() * torch.exp(-s) + s for h, s in zip((h1, h2, h3), log_vars)
        ]
    leaves = [w, w2, h1, h2, h3, log_vars, *extra]
    return leaves, through, losses


SHAPES = [
    "leaf shared by two losses",
    "leaf used twice by a loss",
    "shared normalisation above through",
    "multi-output ops",
    "view through",
    "two through",
    "custom Function in the shared part",
    "custom Functions in the heads",
    "non-reentrant checkpoint",
    "log-variances",
]


@pytest.mark.parametrize(
    "options",
    [
        {"level": "features"},
        {"level": "params"},
        {"level": "params", "chunk_size": 1},
        {"level": "params", "check": True},
    ],
    ids=lambda o: "-".join(f"{v}" for v in o.values()),
)
@pytest.mark.parametrize("shape", SHAPES)
def test_graph_shapes_give_sum_backward_and_refuse_a_second_backward_before_writing(shape, options):
    """With all-ones weights, backward's .grad is sum(losses).backward()'s in float64 on
    graphs whose cheap side (one torch.autograd.grad per loss, into `through` and that loss's
    own leaves) or whose bookkeeping of the freed graph could go wrong; then every later
    backward through the graph raises torch's error before any .grad moves: a second call,
    sum(losses).backward(), one loss's .backward(), and torch.autograd.grad."""
    leaves, _, losses = _shape_forward(shape)
    sum(losses).backward()
    want = [leaf.grad for leaf in leaves]

    leaves, through, losses = _shape_forward(shape)
    k = len(losses)
    funcgrad.backward(losses, through=through, weighting=lambda g: g.new_ones(k), **options)
    for leaf, g in zip(leaves, want):
        if g is None:
            assert leaf.grad is None
        else:
            torch.testing.assert_close(leaf.grad, g, rtol=1e-10, atol=1e-12)
    before = _leaves(*leaves)
    for again in (
        lambda: funcgrad.backward(losses, through=through, **options),
        lambda: sum(losses).backward(),
        lambda: losses[0].backward(),
        lambda: torch.autograd.grad(sum(losses), leaves[0]),
    ):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            again()
        assert _same_grads(leaves, before)


@pytest.mark.parametrize("level", ["params", "features"])
def test_retain_graph_twice_then_without_then_refused(level):
    """Two calls with retain_graph=True, a third without (the .grad of three
    sum(losses).backward()), then a fourth call or the user's backward raises before any
    .grad moves, a log-variance added to a loss included."""
    leaves, _, losses = _shape_forward("log-variances")
    for retain in (True, True, False):
        sum(losses).backward(retain_graph=retain)
    want = [leaf.grad for leaf in leaves]
    leaves, through, losses = _shape_forward("log-variances")
    weighting = lambda g: g.new_ones(3)  # noqa: E731
    for retain in (True, True, False):
        funcgrad.backward(
            losses, through=through, weighting=weighting, level=level, retain_graph=retain
        )
    for leaf, g in zip(leaves, want):
        if g is not None:
            torch.testing.assert_close(leaf.grad, g, rtol=1e-10, atol=1e-12)
    before = _leaves(*leaves)
    for again in (
        lambda: funcgrad.backward(losses, through=through, weighting=weighting, level=level),
        lambda: sum(losses).backward(),
    ):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            again()
        assert _same_grads(leaves, before)


def test_a_call_that_failed_after_freeing_the_graph_leaves_it_refusing_before_writing():
    """vmap cannot batch the shared part's backward and fails after the batched (last) pull
    freed the nodes above the failing one: backward's clear error, nothing written. The
    graph is then freed in part, and a later backward through it must still raise before
    any .grad moves (as after a call that succeeded); torch's own would first accumulate
    into the heads' parameters, then raise at the freed node."""

    def forward():
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        heads = [nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(3)]
        x = torch.randn(5, 3, dtype=torch.float64)
        features = torch.tanh(Unbatchable.apply(x @ w.T))
        return [w, *heads], features, [(features @ h).pow(2).mean() for h in heads]

    leaves, features, losses = forward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=r"cannot run.*Nothing was written"):
            funcgrad.backward(losses, through=features, weighting=lambda g: g.new_ones(3))
    assert all(leaf.grad is None for leaf in leaves)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sum(losses).backward()
    assert all(leaf.grad is None for leaf in leaves), "the heads' .grad were written"


@pytest.mark.parametrize("retain_graph", [False, True])
def test_without_weighting_the_losses_take_one_backward_of_their_sum(retain_graph):
    """weighting=None needs only the sum of V: ONE backward of sum(losses) to `through`
    and the task-specific leaves (a leaf shared by two losses included), not one per loss,
    with the .grad of sum(losses).backward(); without retain_graph it frees the heads'
    part, and a later backward raises as torch's would."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(5, 6).double()
    heads = torch.nn.ModuleList(torch.nn.Linear(6, 1) for _ in range(4)).double()
    common = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))  # shared by 2 losses
    x = torch.randn(7, 5, dtype=torch.float64)
    counter = BackwardCounter()

    def losses_of(features):
        above = counter(features)  # one node above `through` that every loss runs through
        losses = [heads[i](above).pow(2).mean() for i in range(4)]
        losses[1] = losses[1] + (above * common).sum()
        losses[3] = losses[3] + (above * common).tanh().sum()
        return losses

    leaves = [*encoder.parameters(), *heads.parameters(), common]
    sum(losses_of(encoder(x))).backward()
    want = [p.grad.clone() for p in leaves]
    for p in leaves:
        p.grad = None
    counter.reset()
    features = encoder(x)
    losses = losses_of(features)
    weights = funcgrad.backward(losses, through=features, retain_graph=retain_graph)
    assert counter.backward == 1
    assert torch.equal(weights, torch.ones(4, dtype=torch.float64))
    for p, w in zip(leaves, want, strict=True):
        torch.testing.assert_close(p.grad, w)
    if retain_graph:
        funcgrad.backward(losses, through=features)  # the graph is still there
        for p, w in zip(leaves, want, strict=True):
            torch.testing.assert_close(p.grad, 2 * w)
    else:
        before = [p.grad.clone() for p in leaves]
        with pytest.raises(RuntimeError, match="a second time"):
            sum(losses).backward()
        assert all(torch.equal(p.grad, b) for p, b in zip(leaves, before, strict=True))


def test_without_weighting_losses_of_mixed_dtypes_are_one_backward_of_their_sum():
    """The one backward takes the losses as they are, each its own root (nothing summed
    across dtypes or devices): float32 and float64 losses on one float64 encoder."""
    torch.manual_seed(0)
    encoder = torch.nn.Linear(5, 6).double()
    head32 = torch.nn.Linear(6, 1).float()
    head64 = torch.nn.Linear(6, 1).double()
    x = torch.randn(7, 5, dtype=torch.float64)

    def losses_of(features):
        return [head32(features.float()).pow(2).mean(), head64(features).tanh().mean()]

    leaves = [*encoder.parameters(), *head32.parameters(), *head64.parameters()]
    torch.autograd.backward(losses_of(encoder(x)))  # (as sum(losses).backward(), per dtype)
    want = [p.grad.clone() for p in leaves]
    for p in leaves:
        p.grad = None
    features = encoder(x)
    funcgrad.backward(losses_of(features), through=features)
    for p, w in zip(leaves, want, strict=True):
        torch.testing.assert_close(p.grad, w)


def test_backward_inside_a_torch_func_transform_is_a_clear_error():
    """backward writes .grad, as .backward() does, which torch refuses inside a transform:
    funcgrad's own message, naming what to use there, before any pass; .grad untouched."""
    lin = torch.nn.Linear(3, 2, dtype=torch.float64)

    def g(x):
        features = lin(x)
        funcgrad.backward([features.sum(), features.pow(2).sum()], through=features)
        return features.sum()

    with pytest.raises(RuntimeError, match=r"inside a torch.func transform.*combine_heads"):
        torch.func.grad(g)(torch.randn(3, dtype=torch.float64))
    assert lin.weight.grad is None and lin.bias.grad is None


@pytest.mark.parametrize("level", ["params", "features"])
def test_a_second_backward_where_torch_freed_the_graph_is_refused_and_writes_nothing(level):
    """In one process, where the first backward's own passes freed the whole graph, nothing
    is marked (torch's freed graph answers, as after sum(losses).backward()); a second
    backward is refused at the first freed node with funcgrad's message, before any write."""
    counter, model, features, losses = _counted_graph()
    funcgrad.backward(losses, through=features, weighting=lambda g: g.new_ones(3), level=level)
    before = [p.grad.clone() for p in model.parameters()]
    counter.reset()
    with pytest.raises(funcgrad.SecondBackwardError, match="earlier backward without retain"):
        funcgrad.backward(losses, through=features, weighting=lambda g: g.new_ones(3), level=level)
    assert counter.backward == 0  # (refused in the losses' own backward, the cheap part)
    for p, grad in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, grad)


# -- hooks: as torch's backward fires them (issue 42, item 2) ---------------------------------


def _hooked(where, hook):
    """The multi-task model with ``hook`` registered at ``where``; (model, features, losses,
    calls): ``calls`` counts the hook's calls."""
    model, x, targets = _setup()
    calls = []

    def counted_hook(*args):
        calls.append(1)
        return hook(*args)

    def on_output(module):  # a forward hook that only registers a tensor hook on the output
        module.register_forward_hook(lambda m, i, out: out.register_hook(counted_hook) and None)

    if where == "below":  # an intermediate tensor of the shared encoder
        on_output(model.encoder[0])
    elif where == "above":  # an intermediate tensor of one head
        on_output(model.heads[0])
    elif where == "parameter":
        model.encoder[0].weight.register_hook(counted_hook)
    elif where == "head parameter":
        model.heads[1].weight.register_hook(counted_hook)
    elif where == "input":
        x.requires_grad_()
        x.register_hook(counted_hook)
    elif where == "encoder module":  # (a layer whose input requires grad)
        model.encoder[2].register_full_backward_hook(counted_hook)
    elif where == "head module":
        model.heads[0].register_full_backward_hook(counted_hook)
    features = model.features(x)
    if where == "through":
        features[0].register_hook(counted_hook)
    elif where == "retain_grad":
        features[0].retain_grad()
    losses = model.losses(features, targets)
    if where == "loss":
        losses[1].register_hook(counted_hook)
    return model, x, features, losses, calls


_TENSOR_HOOKS = ["through", "below", "above", "loss", "parameter", "head parameter", "input"]
_HOOK_CASES = [
    *[(where, "double") for where in _TENSOR_HOOKS],
    *[(where, "observe") for where in _TENSOR_HOOKS],
    ("encoder module", "observe module"),
    ("encoder module", "scale inputs"),
    ("head module", "observe module"),
    ("head module", "scale inputs"),
    ("retain_grad", None),
]
_HOOKS = {
    "double": lambda g: 2 * g,
    "observe": lambda g: None,
    # a module's full backward hook: (module, grad_input, grad_output) -> new grad_input
    "observe module": lambda m, gi, go: None,
    "scale inputs": lambda m, gi, go: tuple(None if g is None else 3 * g for g in gi),
    None: None,
}


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize(("where", "kind"), _HOOK_CASES)
def test_hooks_fire_once_per_backward_as_in_sum_backward(where, kind, level):
    """With weighting=None, every hook fires as often as in ``sum(losses).backward()`` and
    the .grad are its: a tensor hook on `through` fired twice before (once in each loss's
    backward to `through`, again in the pass from `through` down: 2x the gradient), and a
    retained `through.grad` got the sum twice."""
    model, x, features, losses, calls = _hooked(where, _HOOKS[kind])
    sum(losses).backward()
    expected, expected_calls = _grads(model), len(calls)
    expected_x = None if x.grad is None else x.grad.clone()
    expected_retained = features[0].grad if where == "retain_grad" else None

    model, x, features, losses, calls = _hooked(where, _HOOKS[kind])
    funcgrad.backward(losses, through=features, level=level)
    assert_tree_close(_grads(model), expected)
    assert len(calls) == expected_calls
    if expected_x is not None:
        assert_tree_close(x.grad, expected_x)
    if where == "retain_grad":
        assert_tree_close(features[0].grad, expected_retained)


@pytest.mark.parametrize("level", ["params", "features"])
@pytest.mark.parametrize("hook", ["double", "clip"])
def test_a_hook_on_through_fires_once_per_loss_at_the_weighted_levels(level, hook):
    """At the weighted levels each loss's gradient on `through` goes through `through`'s
    hooks once, as in that loss's own ``torch.autograd.grad`` (a nonlinear hook too), and
    the update is ``w @`` those per-task gradients: reference built loss by loss."""
    fn = {"double": lambda g: 2 * g, "clip": lambda g: g.clamp(-0.01, 0.01)}[hook]
    w = torch.tensor([0.2, 0.3, 0.5])
    model, _, features, losses, calls = _hooked("through", fn)
    params = model.shared()
    per_task = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    expected = [sum(wi * g[j] for wi, g in zip(w, per_task)) for j in range(len(params))]
    assert len(calls) == 3

    model, _, features, losses, calls = _hooked("through", fn)
    funcgrad.backward(losses, through=features, level=level, weighting=lambda gramian: w)
    assert_tree_close([p.grad for p in model.shared()], expected)
    assert len(calls) == 3  # once per loss, as in the reference


def test_a_linear_hook_on_through_is_applied_once_where_torchjd_applies_it_twice():
    """TorchJD's ``mtl_backward`` runs `through`'s hooks in the backward of each loss and
    again in its pass from `through` down; funcgrad runs them once. So funcgrad with a
    doubling hook on `through` equals TorchJD without a hook on doubled losses."""
    model, _, features, losses, _ = _hooked("through", lambda g: 2 * g)
    funcgrad.backward(losses, through=features, weighting=tjd.UPGradWeighting())
    got = [p.grad for p in model.shared()]

    model, x, targets = _setup()
    features = model.features(x)
    mtl_backward([2 * loss for loss in model.losses(features, targets)], features)
    jac_to_grad(model.shared(), tjd.UPGrad())
    assert_tree_close(got, [p.grad for p in model.shared()])


_LEVELS = [
    {},
    {"level": "features"},
    {"weighting": tjd.UPGradWeighting()},
    {"weighting": tjd.UPGradWeighting(), "level": "features"},
]


@pytest.mark.parametrize("kwargs", _LEVELS)
@pytest.mark.parametrize("preset", [False, True])
def test_post_accumulate_grad_hooks_fire_once_per_leaf_on_its_final_grad(kwargs, preset):
    """Every leaf written fires its post-accumulate-grad hooks once, after its .grad holds
    its final value, the heads' leaves before the shared ones (as torch's engine reaches
    them); they never fired before. With weighting=None the values are
    ``sum(losses).backward()``'s, whose hooks fire alike."""

    def run(backward):
        model, x, targets = _setup()
        seen = []
        for name, p in model.named_parameters():
            if preset:
                p.grad = torch.full_like(p, 0.5)
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: seen.append((name, p.grad.clone()))
            )
        features = model.features(x)
        backward(model.losses(features, targets), features)
        return model, seen

    model, seen = run(
        lambda losses, features: funcgrad.backward(losses, through=features, **kwargs)
    )
    names = [name for name, _ in seen]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # once each
    assert_tree_close(dict(seen), _grads(model))  # on the final .grad
    shared = {f"encoder.{n}" for n, _ in model.encoder.named_parameters()}
    first_shared = min(i for i, n in enumerate(names) if n in shared)
    assert all(n in shared for n in names[first_shared:])  # the heads' first
    if not kwargs:
        _, expected = run(lambda losses, features: sum(losses).backward())
        assert_tree_close(dict(seen), dict(expected))


def test_post_accumulate_grad_hooks_run_an_optimizer_in_backward_as_torch():
    """The optimizer-in-backward recipe (one SGD step per parameter in its hook, then
    ``.grad = None``) gives torch's parameters with weighting=None."""

    def step(p):
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)
        p.grad = None

    def run(backward):
        model, x, targets = _setup()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        features = model.features(x)
        backward(model.losses(features, targets), features)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, _grads(model)

    got, got_grads = run(lambda losses, features: funcgrad.backward(losses, through=features))
    expected, _ = run(lambda losses, features: sum(losses).backward())
    assert_tree_close(got, expected)
    assert not got_grads


# -- .grad presets: as torch's AccumulateGrad, checked before anything runs (item 8) ----------


def _backward_with(prepare, how, model_fn=None):
    """(model, error) after ``prepare(model)`` then ``how``: "torch" (``sum(losses)
    .backward()``) or the kwargs of ``funcgrad.backward``."""
    model, x, targets = _setup() if model_fn is None else model_fn()
    prepare(model)
    features = model.features(x)
    losses = model.losses(features, targets)
    try:
        if how == "torch":
            sum(losses).backward()
        else:
            funcgrad.backward(losses, through=features, **how)
    except (RuntimeError, ValueError) as error:
        return model, error
    return model, None


def _with_grad(name, make):
    def prepare(model):
        p = model.get_parameter(name)
        grad = make(p)
        if grad is not None:
            p.grad = grad

    return prepare


def _ones(gramian):
    return torch.ones(gramian.shape[0])


# (weights all ones: the weighted paths, whose .grad is sum(losses).backward()'s)
_ALL_LEVELS = [
    {},
    {"level": "features"},
    {"weighting": _ones},
    {"weighting": _ones, "level": "features"},
]


@pytest.mark.parametrize("kwargs", _ALL_LEVELS)
@pytest.mark.parametrize("name", ["encoder.2.weight", "heads.1.weight"])
@pytest.mark.parametrize("leaf", [True, False])
def test_a_grad_that_requires_grad_is_accumulated_into_in_place_as_torch(kwargs, name, leaf):
    """torch's backward (without create_graph) adds into a .grad that requires grad in
    place, in no-grad mode: same object, still requiring grad, no graph added. funcgrad
    raised ("a leaf Variable that requires grad ...") after writing other leaves."""

    presets = []

    def make(p):
        grad = torch.full_like(p, 0.5, requires_grad=True)
        presets.append(grad if leaf else grad * 1)
        return presets[-1]

    model, error = _backward_with(_with_grad(name, make), "torch")
    assert error is None and model.get_parameter(name).grad is presets[0]
    expected = _grads(model)
    model, error = _backward_with(_with_grad(name, make), kwargs)
    assert error is None
    grad = model.get_parameter(name).grad
    assert grad is presets[1] and grad.requires_grad and grad.is_leaf == leaf
    assert_tree_close(_grads(model), expected)


@pytest.mark.parametrize("kwargs", _ALL_LEVELS)
@pytest.mark.parametrize("name", ["encoder.2.bias", "heads.1.weight"])
def test_an_expanded_grad_is_refused_before_anything_runs_or_is_written(kwargs, name):
    """torch cannot accumulate into an expanded (stride-0) .grad either: it raises after
    writing other leaves. funcgrad refuses it before any pass, with every .grad as it was."""
    model, error = _backward_with(
        _with_grad(name, lambda p: torch.ones(1).expand(p.shape)), "torch"
    )
    assert isinstance(error, RuntimeError) and "single memory location" in str(error)

    counter = BackwardCounter()
    model, x, targets = _setup(counter=counter)
    p = model.get_parameter(name)
    p.grad = torch.ones(1).expand(p.shape)
    features = model.features(x)
    match = r"funcgrad\.backward.*\.grad of .* is expanded: stride 0 in dim 0.*\.clone\(\)"
    with pytest.raises(ValueError, match=match):
        funcgrad.backward(model.losses(features, targets), through=features, **kwargs)
    assert counter.backward == 0
    assert list(_grads(model)) == [name]


class _ConvModel(torch.nn.Module):
    """A channels_last convolution as the shared encoder, two heads."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(36, 1) for _ in range(2))

    def features(self, x):
        return (self.conv(x).flatten(1),)

    def losses(self, features, targets):
        return [
            (head(features[0]) - targets[:, i : i + 1]).pow(2).mean()
            for i, head in enumerate(self.heads)
        ]


def _conv_setup():
    torch.manual_seed(0)
    return _ConvModel(), torch.randn(2, 3, 5, 5), torch.randn(2, 2)


@pytest.mark.parametrize("kwargs", _ALL_LEVELS)
@pytest.mark.parametrize("preset", [False, True])
def test_a_channels_last_weight_gets_grad_with_its_strides_as_torch(kwargs, preset):
    """A new .grad takes the parameter's strides (torch's layout contract), an existing one
    keeps its own: a channels_last conv weight got a contiguous .grad at level "params"."""

    def prepare(model):
        if preset:  # a .grad from an earlier backward, in torch's layout
            model.conv.weight.grad = torch.ones_like(model.conv.weight)

    model, _ = _backward_with(prepare, "torch", _conv_setup)
    expected, strides = _grads(model), model.conv.weight.grad.stride()
    assert strides == model.conv.weight.stride() != model.conv.weight.contiguous().stride()
    model, error = _backward_with(prepare, kwargs, _conv_setup)
    assert error is None
    assert model.conv.weight.grad.stride() == strides
    assert_tree_close(_grads(model), expected)


def _sparse(p):
    return torch.zeros_like(p).to_sparse()


def _view(p):
    return torch.zeros(2, *p.shape)[1]


def _float32(p):  # (a .grad of another dtype than its parameter, which torch allows then)
    p.grad_dtype = None
    return torch.full_like(p, 0.5, dtype=torch.float32)


def _grad_dtype(p):  # (no .grad yet; torch makes a new one of this dtype)
    p.grad_dtype = torch.float32


def _zeros(p):
    return torch.zeros_like(p)


@pytest.mark.parametrize("kwargs", _ALL_LEVELS)
@pytest.mark.parametrize("name", ["encoder.2.weight", "heads.1.weight"])
@pytest.mark.parametrize("make", [_sparse, _view, _float32, _grad_dtype, _zeros])
def test_grad_presets_are_accumulated_as_torch(kwargs, name, make):
    """A sparse .grad meeting a dense gradient is replaced by their dense sum (funcgrad
    raised after writing other leaves); a view is added into in place (its base sees it);
    a .grad of another dtype than its parameter (``grad_dtype=None``) is added into in
    place, and a ``grad_dtype`` set on the parameter gives a new .grad of that dtype (funcgrad
    raised torch's assignment error after writing other leaves); zeros, as
    ``zero_grad(set_to_none=False)`` leaves them, are added into."""
    model, error = _backward_with(_with_grad(name, make), "torch")
    assert error is None
    expected = _grads(model)
    model, error = _backward_with(_with_grad(name, make), kwargs)
    assert error is None
    grad = model.get_parameter(name).grad
    assert grad.layout == expected[name].layout and grad.dtype == expected[name].dtype
    # (a float32 .grad: float64 sums that differ in the last bit may round apart)
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if grad.dtype == torch.float32 else {}
    assert_tree_close(
        {n: g.to_dense().double() for n, g in _grads(model).items()},
        {n: g.to_dense().double() for n, g in expected.items()},
        **tolerance,
    )


@pytest.mark.parametrize("kwargs", _ALL_LEVELS)
def test_zero_grad_without_none_keeps_every_grad_object(kwargs):
    """After ``zero_grad(set_to_none=False)`` every .grad is added into in place, as torch's."""
    model, x, targets = _setup()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    held = {n: p.grad for n, p in model.named_parameters()}
    features = model.features(x)
    funcgrad.backward(model.losses(features, targets), through=features, **kwargs)
    assert all(p.grad is held[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("kwargs", _ALL_LEVELS)
def test_a_leaf_given_twice_in_inputs_is_written_once(kwargs):
    """As ``torch.autograd.backward(..., inputs=[p, p])``: the gradient once."""
    model, x, targets = _setup()
    shared = model.shared()
    features = model.features(x)
    sum(model.losses(features, targets)).backward(inputs=[shared[0], *shared])
    expected = [p.grad for p in shared]
    model, x, targets = _setup()
    shared = model.shared()
    features = model.features(x)
    funcgrad.backward(
        model.losses(features, targets), through=features, inputs=[shared[0], *shared], **kwargs
    )
    assert_tree_close([p.grad for p in shared], expected)
