"""Per-example heads with user hooks, and the per-example refusals: funcgrad.per_example /
per_example_gramian / backward(batch_dim=0) against a per-example loop of
torch.autograd.grad with the same hooks, in float64 (hooks counted as in one backward of the
losses); refusals leave .grad untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcgrad

B = 5


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def loop_jacobian(model, losses_fn):
    """(B, P): the rows of torch.autograd.grad(losses[b], params), a fresh forward each (so
    that hooks registered in losses_fn apply to each backward)."""
    params = trainable(model)
    rows = []
    for b in range(B):
        grads = torch.autograd.grad(losses_fn(model)[b], params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)]
            )
        )
    return torch.stack(rows)


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in trainable(model)])


def check_exact(model, losses_fn, counter=None):
    """Gramian and update (UPGrad-free: a native weighting) against the loop; ``counter``, a
    list the hooks append to, sees one call per backward."""
    jac = loop_jacobian(model, losses_fn)
    if counter is not None:
        counter.clear()
    with funcgrad.per_example(model) as pe:
        gram = funcgrad.per_example_gramian(losses_fn(model))
        calls = None if counter is None else len(counter)
        weights = pe.backward(losses_fn(model), weighting=lambda g: 1 / g.diagonal().sqrt())
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(flat_grads(model), weights @ jac, rtol=1e-9, atol=1e-11)
    return calls


def mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 1))


X, Y = torch.randn(B, 3), torch.randn(B)


# -- tensor hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["output", "intermediate", "first", "losses"])
def test_tensor_hook_matches_the_loop_and_fires_once(where):
    """A tensor hook on the last module's output (whose node also runs in the one backward,
    so torch captures its gradient before the hook) was applied wrongly: 2x on that layer."""
    model, calls = mlp(), []

    def hook(g):
        calls.append(1)
        return 2 * g

    def losses_fn(m):
        h = m[0](X)
        if where == "first":
            h.register_hook(hook)
        h = m[2](m[1](h))
        if where == "intermediate":
            h.register_hook(hook)
        out = m[4](m[3](h))
        if where == "output":
            out.register_hook(hook)
        losses = (out.squeeze(1) - Y) ** 2
        if where == "losses":
            losses.register_hook(hook)
        return losses

    assert check_exact(model, losses_fn, calls) == 1


# -- module hooks --------------------------------------------------------------------------


class Scale(nn.Module):
    """A custom module (the generic rule: a functional call of its forward alone)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.scale + torch.sin(x * self.scale)


def with_custom():
    return nn.Sequential(nn.Linear(3, 4), Scale(), nn.Tanh(), nn.Linear(4, 1))


def plain_losses(m):
    return (m(X).squeeze(1) - Y) ** 2


def rescale_output(module, args, output):
    return 0.5 * output


def shift_input(module, args):
    return (args[0] + 1.0,)


@pytest.mark.parametrize("layer", [0, 1])  # a Linear rule, the generic rule
@pytest.mark.parametrize("when", ["before", "after"])
def test_forward_hooks_and_pre_hooks_are_honoured(layer, when):
    """A forward hook that rescales a layer's output: the rules took output = forward(input),
    and the recorded output was the hook's (0.5 off). A pre-hook that changes the input is
    exact under the Linear rule (it reads the input forward got); the generic rule's
    second call of forward would apply it twice, so it is refused there (below)."""
    model = with_custom()

    def install():
        model[layer].register_forward_hook(rescale_output)
        if layer == 0:
            model[layer].register_forward_pre_hook(shift_input)

    if when == "before":
        install()
        check_exact(model, plain_losses)
        return
    jac = None
    with funcgrad.per_example(model) as pe:
        install()
        jac = loop_jacobian(model, plain_losses)
        gram = pe.gramian(plain_losses(model))
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("layer", [0, 1, 3])
def test_full_backward_hooks_are_honoured_and_fire_once(layer):
    model, calls = with_custom(), []

    def grad_output_hook(module, grad_output):
        calls.append("pre")
        return (2 * grad_output[0],)

    def grad_input_hook(module, grad_input, grad_output):
        calls.append("post")
        return (3 * grad_input[0],)

    model[layer].register_full_backward_pre_hook(grad_output_hook)
    model[layer].register_full_backward_hook(grad_input_hook)
    x = X.clone().requires_grad_()  # so that the first layer has a grad_input too

    def losses_fn(m):
        return (m(x).squeeze(1) - Y) ** 2

    check_exact(model, losses_fn)
    # one backward of the losses fires each hook as torch's autograd.grad of their sum to
    # the parameters does (the first layer's grad_input hook is not on the way to one)
    calls.clear()
    torch.autograd.grad(losses_fn(model).sum(), trainable(model))
    want = sorted(calls)
    calls.clear()
    with funcgrad.per_example(model) as pe:
        pe.gramian(losses_fn(model))
    assert sorted(calls) == want
    assert "pre" in want


def test_forward_hook_before_ours_is_refused():
    model = mlp()
    with funcgrad.per_example(model) as pe:
        model[2].register_forward_hook(rescale_output, prepend=True)
        with pytest.raises(
            ValueError,
            match=r"module '2' \(Linear\) has a forward hook that runs before funcgrad's "
            r"\(rescale_output.*prepend=True.*Nothing was written",
        ):
            pe.backward(plain_losses(model))
    assert all(p.grad is None for p in model.parameters())


def test_global_forward_hook_is_refused():
    model = mlp()
    handle = torch.nn.modules.module.register_module_forward_hook(rescale_output)
    try:
        with funcgrad.per_example(model) as pe:
            losses = plain_losses(model)
            with pytest.raises(ValueError, match=r"forward hook .*register_module_forward_hook"):
                pe.backward(losses)
    finally:
        handle.remove()
    assert all(p.grad is None for p in model.parameters())


def test_non_full_backward_hook_is_refused():
    model = mlp()
    model[2].register_backward_hook(lambda module, gi, go: tuple(2 * g for g in gi))
    with funcgrad.per_example(model) as pe:
        with pytest.warns(FutureWarning, match="non-full backward hook"):  # torch's own
            losses = plain_losses(model)
        with pytest.raises(ValueError, match=r"module '2' \(Linear\) has a non-full backward"):
            pe.backward(losses)
    assert all(p.grad is None for p in model.parameters())


# -- state left behind, and calls in the wrong order --------------------------------------


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.fail = nn.Linear(3, 4), nn.Linear(4, 1), False

    def forward(self, x):
        h = self.a(x)
        if self.fail:
            raise RuntimeError("boom")
        return self.b(torch.tanh(h))


class Outer(nn.Module):
    """A parent with its own parameter (its calls collect the nested ones) around a module
    whose forward may raise."""

    def __init__(self):
        super().__init__()
        self.inner, self.w = Fails(), nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        return self.inner(x) * self.w


def test_a_forward_that_raised_inside_a_nested_module_leaves_no_state():
    """Its parent's frame stayed open, and the next forward's calls went into it."""
    model = Outer()
    with funcgrad.per_example(model) as pe:
        model.inner.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            model(X)
        model.inner.fail = False
        gram = pe.gramian(plain_losses(model))
    jac = loop_jacobian(model, plain_losses)
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


# -- losses that are a hooked module's own output ------------------------------------------


class TemperedCrossEntropy(nn.Module):
    """Cross-entropy with a learned temperature inside forward: the losses are this module's
    output."""

    def __init__(self):
        super().__init__()
        self.lin, self.t = nn.Linear(3, 4), nn.Parameter(torch.tensor(1.5))

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.lin(x) / self.t, labels, reduction="none")


class Score(nn.Module):
    """A last module that returns the (B,) losses itself."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(4))

    def forward(self, h):
        return (h @ self.v).cosh()


LABELS = torch.randint(4, (B,))


@pytest.mark.parametrize(
    ("make", "forward"),
    [
        (TemperedCrossEntropy, lambda m: m(X, LABELS)),
        (lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Score()), lambda m: m(X)),
    ],
)
def test_losses_that_are_a_hooked_modules_output(make, forward):
    """Refused, blaming a functional use (the walk started below the losses' own node)."""
    model = make()
    jac = loop_jacobian(model, forward)
    with funcgrad.per_example(model):
        weights = funcgrad.backward(forward(model), batch_dim=0, weighting=lambda g: g.diagonal())
        gram = funcgrad.per_example_gramian(forward(model))
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(flat_grads(model), weights @ jac, rtol=1e-9, atol=1e-11)


def test_a_second_call_on_consumed_losses_says_so():
    model = mlp()
    with funcgrad.per_example(model) as pe:
        losses = plain_losses(model)
        pe.backward(losses)
        before = flat_grads(model).clone()
        for call in (pe.backward, lambda losses: funcgrad.backward(losses, batch_dim=0)):
            with pytest.raises(ValueError, match=r"earlier call .* consumed .*retain_graph=True"):
                call(losses)
        assert torch.equal(flat_grads(model), before)


def test_two_forwards_then_two_calls():
    """The first call dropped the second forward's records (a message blaming a functional
    use); a second forward's losses after the first's call are valid use."""
    model = mlp()
    x2 = torch.randn(B, 3)
    jacs = [
        loop_jacobian(model, plain_losses),
        loop_jacobian(model, lambda m: (m(x2).squeeze(1) - Y) ** 2),
    ]
    with funcgrad.per_example(model) as pe:
        first = plain_losses(model)
        second = (model(x2).squeeze(1) - Y) ** 2
        grams = [pe.gramian(first), funcgrad.per_example_gramian(second)]
    for gram, jac in zip(grams, jacs):
        torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


def test_calls_in_the_reverse_order_of_the_forwards_say_so():
    model = mlp()
    with funcgrad.per_example(model) as pe:
        first = plain_losses(model)
        second = plain_losses(model)
        pe.gramian(second)
        with pytest.raises(ValueError, match=r"later forward dropped this forward's records"):
            pe.backward(first)
    assert all(p.grad is None for p in model.parameters())


def test_a_call_after_the_block_says_the_hooks_were_removed():
    model = mlp()
    with funcgrad.per_example(model) as pe:
        losses = plain_losses(model)
    for call in (pe.backward, lambda losses: funcgrad.backward(losses, batch_dim=0)):
        with pytest.raises(ValueError, match=r"hooks were removed .*inside the block"):
            call(losses)
    assert all(p.grad is None for p in model.parameters())


def test_a_per_example_is_not_reentered_after_its_block():
    """Re-entered, its hooks were gone: the forward recorded nothing, and the call blamed a
    functional use."""
    model = mlp()
    with funcgrad.per_example(model) as pe:
        pe.backward(plain_losses(model))
    with pytest.raises(RuntimeError, match=r"hooks were removed .*Make a new one"), pe:
        pass
    with funcgrad.per_example(model) as pe:  # a new one works
        pe.backward(plain_losses(model))


def test_a_call_after_a_failed_call_says_so():
    model = mlp()
    with funcgrad.per_example(model) as pe:
        losses = plain_losses(model)
        with pytest.raises(TypeError, match=r"`weighting`"):  # before the call starts
            pe.backward(losses, weighting="nonsense")
        with pytest.raises(ValueError, match=r"parameter .*outside"):  # a functional use
            pe.backward(losses + model[0].weight.sum())
        with pytest.raises(ValueError, match=r"earlier call on the losses .* raised"):
            pe.backward(losses)
    assert all(p.grad is None for p in model.parameters())


# -- layouts: which dim is the batch -------------------------------------------------------


@pytest.mark.parametrize("module", ["attention", "encoder", "gru"])
def test_time_major_layout_is_refused_also_where_t_equals_b(module):
    """dim 0's size was checked, not the layout: with T == B, a torch shape error."""
    model = {
        "attention": lambda: nn.MultiheadAttention(4, 2, batch_first=False),
        "encoder": lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0).eval(),
        "gru": lambda: nn.GRU(4, 3, batch_first=False),
    }[module]()
    x = torch.randn(B, B, 4)  # (T, B, E) with T == B

    def forward(m):
        if module == "attention":
            return m(x, x, x)[0]
        return m(x)[0] if module == "gru" else m(x)

    with funcgrad.per_example(model) as pe:
        losses = forward(model).pow(2).sum((0, 2))
        with pytest.raises(ValueError, match=r"batch_first=False: .*time-major .*T == B"):
            pe.backward(losses)
    assert all(p.grad is None for p in model.parameters())


class Recurrent(nn.Module):
    def __init__(self, cell, **kwargs):
        super().__init__()
        self.rnn = cell(3, 4, num_layers=2, batch_first=True, **kwargs)
        directions = 2 if kwargs.get("bidirectional") else 1
        self.head = nn.Linear(4 * directions, 1)
        self.h0 = torch.randn(2 * directions, B, 4)

    def forward(self, x):
        h0 = self.h0 if not isinstance(self.rnn, nn.LSTM) else (self.h0, self.h0.cos())
        out, state = self.rnn(x, h0)
        h_n = state[0] if isinstance(state, tuple) else state  # (layers, B, H)
        return self.head(out).pow(2).sum((1, 2)) + h_n.sin().sum((0, 2))


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_recurrent_batch_first_is_exact(cell, bidirectional):
    """Always refused before (h_n is (layers, B, H)), with a batch_first=True hint that did
    not help."""
    model = Recurrent(cell, bidirectional=bidirectional)
    x = torch.randn(B, 6, 3)
    check_exact(model, lambda m: m(x))


class HookedInside(nn.Module):
    """A custom module (the generic rule) that registers a tensor hook inside forward."""

    def __init__(self, calls):
        super().__init__()
        self.scale, self.calls = nn.Parameter(torch.randn(4)), calls

    def forward(self, x):
        h = x * self.scale
        if h.requires_grad:
            h.register_hook(lambda g: self.calls.append(1) or 2 * g)
        return torch.sin(h)


def test_tensor_hook_inside_a_generic_modules_forward_is_refused():
    """It fired twice: in the one backward and again in the second call of the forward."""
    model = nn.Sequential(nn.Linear(3, 4), HookedInside([]), nn.Linear(4, 1))
    with funcgrad.per_example(model) as pe:
        losses = plain_losses(model)
        with pytest.raises(
            ValueError, match=r"module '1' \(HookedInside\) registers a tensor hook inside"
        ):
            pe.backward(losses)
    assert all(p.grad is None for p in model.parameters())
    with funcgrad.per_example(model) as pe:  # without its parameters: exact
        jac = loop_jacobian(model, plain_losses)[:, :16]  # the first Linear's
        counts = []
        for _ in range(2):
            model[1].calls.clear()
            gram = pe.gramian(plain_losses(model), inputs=model[0])
            counts.append(len(model[1].calls))
        # A hook inside a module's forward is out of funcgrad's reach: the independence
        # check's backward (on the first call of a signature) runs it once more.
        assert counts == [2, 1]
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


def test_input_changing_pre_hook_on_a_generic_module_is_refused():
    """The second call of its forward applied the change twice (functional_call ran it)."""
    model = with_custom()
    model[1].register_forward_pre_hook(shift_input)
    with (
        funcgrad.per_example(model) as pe,
        pytest.raises(
            ValueError,
            match=r"module '1' \(Scale\) has a forward pre-hook \(shift_input\) that returns a "
            r"new input.*Nothing was written",
        ),
    ):
        pe.backward(plain_losses(model))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("generic", [False, True])
def test_weight_norm_pre_hook_is_honoured(generic):
    """torch.nn.utils.weight_norm computes `weight` from weight_g / weight_v in a forward
    pre-hook: a Linear took the Linear rule ('bias only', weight_g and weight_v left out)."""
    model = with_custom()
    with pytest.warns(FutureWarning, match="weight_norm"):  # torch's deprecation
        if generic:
            model[1] = torch.nn.utils.weight_norm(model[1], name="scale", dim=None)
        else:
            model[3] = torch.nn.utils.weight_norm(model[3])
    check_exact(model, plain_losses)


def test_global_pre_hooks_and_backward_hooks_are_honoured():
    model, calls = with_custom(), []

    def grad_output_hook(module, grad_output):
        calls.append(type(module).__name__)
        return tuple(None if g is None else 2 * g for g in grad_output)

    module_hooks = torch.nn.modules.module
    handles = [
        module_hooks.register_module_forward_pre_hook(
            lambda module, args: (args[0] * 1.5,) if isinstance(module, nn.Linear) else None
        ),
        module_hooks.register_module_full_backward_pre_hook(grad_output_hook),
    ]
    x = X.clone().requires_grad_()  # else torch warns that the hooks see no inputs

    def losses_fn(m):
        return (m(x).squeeze(1) - Y) ** 2

    try:
        check_exact(model, losses_fn)
        calls.clear()
        torch.autograd.grad(losses_fn(model).sum(), trainable(model))
        want = sorted(calls)
        calls.clear()
        with funcgrad.per_example(model) as pe:
            pe.gramian(losses_fn(model))
        assert sorted(calls) == want
    finally:
        for handle in handles:
            handle.remove()


def test_flop_counter_global_hooks_are_known_observers():
    """FlopCounterMode's ModuleTracker registers a global forward hook that returns None."""
    from torch.utils.flop_counter import FlopCounterMode

    model = mlp()
    jac = loop_jacobian(model, plain_losses)
    with funcgrad.per_example(model) as pe, FlopCounterMode(display=False):
        gram = pe.gramian(plain_losses(model))
    torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-9, atol=1e-11)


def test_tensor_hook_on_a_parameter_is_refused():
    """It was ignored: the last layer's .grad was half of torch's."""
    model = mlp()
    model[2].weight.register_hook(lambda g: 2 * g)
    with funcgrad.per_example(model) as pe:
        for call in (pe.gramian, pe.backward):
            with pytest.raises(
                ValueError, match=r"parameter '2.weight' has a tensor hook \(test_tensor_hook_on"
            ):
                call(plain_losses(model))
        pe.backward(plain_losses(model), inputs=[model[0].weight])  # without it: fine
    assert model[2].weight.grad is None and model[0].weight.grad is not None


def test_a_hook_between_two_recorders_is_seen_by_the_inner_one():
    model = mlp()
    with funcgrad.per_example(model) as first:
        model[2].register_forward_hook(rescale_output, prepend=True)
        with funcgrad.per_example(model) as second:  # its hook runs first of all
            losses = plain_losses(model)
            with pytest.raises(ValueError, match=r"module '2' \(Linear\) has a forward hook"):
                first.backward(losses)
            second.clear()
    assert all(p.grad is None for p in model.parameters())


class TwoNames(nn.Module):
    """One parameter under two attribute names, read through both in forward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.w2 = self.w

    def forward(self, x):
        return torch.tanh(x @ self.w) @ self.w2


def test_generic_rule_replaces_a_parameter_under_all_its_names():
    """The generic rule calls forward alone (not module(...), whose hooks are out of it); it
    still replaces a parameter under both of its names, as torch.func.functional_call."""
    model = nn.Sequential(nn.Linear(3, 4), TwoNames(), nn.Linear(4, 1))
    model[1].register_forward_hook(rescale_output)
    check_exact(model, plain_losses)


# -- .grad writes: presets checked first, post-accumulate-grad hooks once -------------------


def test_post_accumulate_grad_hooks_fire_once_per_parameter_on_its_final_grad():
    torch.manual_seed(0)
    model = mlp().double()
    x, y = X.double(), Y.double()
    seen = []
    for name, p in model.named_parameters():
        p.grad = torch.ones_like(p)  # accumulated into: the hook sees the sum
        p.register_post_accumulate_grad_hook(lambda t, n=name: seen.append((n, t.grad.clone())))
    with funcgrad.per_example(model):
        losses = (model(x).squeeze(1) - y) ** 2
        funcgrad.backward(losses, batch_dim=0)
    assert sorted(n for n, _ in seen) == sorted(n for n, _ in model.named_parameters())
    final = dict(model.named_parameters())
    for name, grad in seen:
        torch.testing.assert_close(grad, final[name].grad)


def test_an_expanded_grad_preset_is_refused_before_anything_is_written():
    torch.manual_seed(0)
    model = mlp().double()
    x, y = X.double(), Y.double()
    first, last = model[0].weight, model[2].bias
    first.grad = torch.zeros_like(first)
    last.grad = torch.zeros(1, dtype=torch.float64).expand(*last.shape)  # stride 0
    before = first.grad.clone()
    with funcgrad.per_example(model):
        losses = (model(x).squeeze(1) - y) ** 2
        with pytest.raises(ValueError, match=r"backward.*expanded: stride 0"):
            funcgrad.backward(losses, batch_dim=0)
    assert torch.equal(first.grad, before)


def test_a_channels_last_conv_weight_gets_a_grad_in_its_own_layout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 1)).double()
    model[0].to(memory_format=torch.channels_last)
    x = torch.randn(B, 2, 4, 4, dtype=torch.float64)
    reference = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 1)).double()
    reference.load_state_dict(model.state_dict())
    reference[0].to(memory_format=torch.channels_last)
    reference(x).squeeze(1).pow(2).sum().backward()
    with funcgrad.per_example(model):
        funcgrad.backward(model(x).squeeze(1).pow(2), batch_dim=0)
    weight, want = model[0].weight, reference[0].weight
    assert weight.grad.stride() == want.grad.stride()
    torch.testing.assert_close(weight.grad, want.grad)


# -- review C: shared arguments, inputs changed in place, parametrizations, rounding -------


def _loop_gramian(model, inputs, params=None):
    params = params or [p for p in model.parameters() if p.requires_grad]
    rows = []
    for b in range(inputs[0].shape[0]):
        loss = model(*inputs)[b]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)]
            )
        )
    jac = torch.stack(rows)
    return jac @ jac.T


def test_attention_with_a_shared_2d_mask_where_t_equals_b_is_exact():
    """Review finding: a (T, T) attn_mask with T == B was split by example (a torch shape
    error inside the rule): a 2-D mask is shared by the batch."""

    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(4, 2, batch_first=True)

        def forward(self, x):
            mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
            return self.attention(x, x, x, attn_mask=mask)[0].pow(2).sum((1, 2))

    torch.manual_seed(0)
    model = Causal().double()
    x = torch.randn(5, 5, 4, dtype=torch.float64)  # B = T = 5
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(model(x))
    torch.testing.assert_close(gram, _loop_gramian(model, (x,)))


def test_a_shared_table_of_size_b_is_refused_with_its_cause():
    """Review finding: a (T, d) argument with T == B was split by example, silently (5x off);
    the independence check refuses it, and its message names that cause."""

    class AddPos(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x, pos):
            return torch.tanh((x + pos) @ self.w)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = AddPos()

        def forward(self, x, pos):
            return self.a(x, pos).pow(2).sum((1, 2))

    torch.manual_seed(0)
    model = Model().double()
    x, pos = torch.randn(5, 5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    with funcgrad.per_example(model), pytest.raises(ValueError, match=r"a \(T, d\) table"):
        funcgrad.per_example_gramian(model(x, pos))


def test_an_input_changed_in_place_after_the_forward_is_refused():
    """Review finding: the next batch copied into the input buffer between the forward and
    the call gave a wrong Gramian (torch's own backward raises there)."""
    torch.manual_seed(0)
    model = mlp().double()
    buffer = torch.randn(B, 3, dtype=torch.float64)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with funcgrad.per_example(model):
        losses = model(buffer).squeeze(1) ** 2
        buffer.copy_(torch.randn(B, 3, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"an input of module '0' .* changed in place"):
            funcgrad.backward(losses, batch_dim=0)
    assert all(not p.grad.any() for p in model.parameters())


def test_parametrized_modules_are_refused_by_name():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    with pytest.raises(ValueError, match=r"module '0' .* parametrized tensors"):
        funcgrad.per_example(model)


def test_float32_rounding_in_a_materialised_module_is_no_mixing():
    """Review finding: an independent module whose float32 forward cancels (h - h.mean(1) on
    large h) rounds a single example otherwise than the batch (with BLAS threads: a single
    row takes another kernel), and was refused as mixing. A difference that float64 does not
    show is rounding: the module below stands for such a kernel, off by 1e-2 on one example
    alone, in float32 only (1e-2)."""

    class Kernel(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 8, dtype=torch.float32))

        def forward(self, x):
            h = x @ self.w
            if h.dtype == torch.float32 and x.shape[0] == 1:  # another kernel's rounding
                h = h * (1 + 1e-2)
            return h - h.mean(1, keepdim=True)

    torch.manual_seed(0)
    model = nn.Sequential(Kernel(), nn.Linear(8, 1)).float()
    x = torch.randn(6, 6, dtype=torch.float32)
    with funcgrad.per_example(model):
        gram = funcgrad.per_example_gramian(model(x).squeeze(1) ** 2)
    want = _loop_gramian(lambda t: model(t).squeeze(1) ** 2, (x,), list(model.parameters()))
    torch.testing.assert_close(gram, want, rtol=5e-2, atol=1e-3)  # (the 1e-2 "rounding")
