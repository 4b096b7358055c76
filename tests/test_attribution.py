"""funcgrad.attribution.token_attr: captum 0.9's LLMGradientAttribution token_attr, from one
teacher-forced forward.

Every method is compared with a per-target loop of prefix forwards and ``torch.autograd.grad``
(the algorithm captum runs, written out: no captum needed), and, where captum is installed,
with captum itself to 1e-10 in float64 on a random-weight GPT-2.
"""

from __future__ import annotations

import contextlib
import re
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcgrad
from funcgrad import _memory
from funcgrad.attribution import token_attr

transformers = pytest.importorskip("transformers")

METHODS = ["gradient", "grad_x_input", "integrated_gradients"]
VOCAB = 40
CALL = re.escape("funcgrad.attribution.token_attr(model, input_ids, target_ids)")


def _gpt2(attn: str = "eager", layers: int = 2, width: int = 32) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        n_positions=96,
        bos_token_id=None,
        eos_token_id=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation=attn,
    )
    return transformers.GPT2LMHeadModel(config).double().eval()


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).double().eval()


class TinyLM(torch.nn.Module):
    """Not a Hugging Face model: causal by a cumulative sum, returns a bare logits tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(ids)))
        return self.out(h.cumsum(1) + h**2)


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return _gpt2()


def _quadrature(method: str, n_steps: int) -> tuple[list[float], list[float]]:
    if method != "integrated_gradients":
        return [1.0], [1.0]
    nodes, weights = np.polynomial.legendre.leggauss(n_steps)
    return (0.5 * (1 + nodes)).tolist(), torch.tensor((0.5 * weights).tolist()).float().tolist()


def _loop(model, embedding, input_ids, target_ids, method, n_steps=16, baseline_id=0):
    """captum's algorithm by hand: for target i, a forward of prompt + targets[:i] (a batch of
    the path's points for integrated gradients) with the embedding's output replaced by a
    leaf, then one torch.autograd.grad of log p(target_i). Returns (attr, gradients)."""
    prompt = len(input_ids)
    alphas, steps = _quadrature(method, n_steps)
    rows, grads = [], []
    for i in range(len(target_ids)):
        ids = torch.cat([input_ids, target_ids[:i]])[None]
        with torch.no_grad():
            embeds = embedding(ids)
            base_ids = ids.clone()
            base_ids[0, :prompt] = baseline_id
            baseline = embedding(base_ids)
        if method == "integrated_gradients":
            leaf = torch.cat([baseline + a * (embeds - baseline) for a in alphas]).requires_grad_()
        else:
            leaf = embeds.clone().requires_grad_()
        handle = embedding.register_forward_hook(lambda module, inputs, output, leaf=leaf: leaf)
        try:
            logits = model(ids.expand(len(leaf), -1))
        finally:
            handle.remove()
        logits = getattr(logits, "logits", logits)
        logp = torch.log_softmax(logits[:, -1], -1)[:, target_ids[i]]
        (grad,) = torch.autograd.grad(logp.sum(), leaf)
        grad = (grad * torch.tensor(steps)[:, None, None]).sum(0)[:prompt]
        inputs = {
            "gradient": torch.ones_like(embeds[0, :prompt]),
            "grad_x_input": embeds[0, :prompt],
            "integrated_gradients": (embeds - baseline)[0, :prompt],
        }[method]
        rows.append((grad * inputs).sum(-1))
        grads.append(grad)
    return torch.stack(rows), torch.stack(grads)


def _ids(prompt: int, targets: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(prompt * 1000 + targets)
    ids = torch.randint(1, VOCAB, (prompt + targets,), generator=generator)
    return ids[:prompt], ids[prompt:]


# ----------------------------------------------------------------- against the autograd loop


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_gpt2_matches_the_per_target_loop(gpt2, method, mode):
    input_ids, target_ids = _ids(7, 5)
    emb = gpt2.get_input_embeddings()
    expected, expected_grads = _loop(gpt2, emb, input_ids, target_ids, method, n_steps=4)
    attr = token_attr(gpt2, input_ids, target_ids, method=method, n_steps=4, mode=mode)
    assert attr.shape == (5, 7)
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    if mode == "reverse":
        attr, grads = token_attr(
            gpt2, input_ids, target_ids, method=method, n_steps=4, return_gradients=True
        )
        assert grads.shape == (5, 7, 32)
        torch.testing.assert_close(grads, expected_grads, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["reverse", "forward", "groups"])
def test_other_targets_of_the_same_length_on_a_second_call(method, mode):
    """The composed functions are cached per shapes: the target ids are data of each call,
    never of the cache (they were baked into the cached heads: a second call with other
    targets of the same length returned the first call's attributions, 0.05-0.15 off), and
    the user's id tensors are never held (mutated in place after a call, then passed again)."""
    torch.manual_seed(11)
    model = _gpt2(layers=1, width=16)
    emb = model.get_input_embeddings()
    prompt, targets = (4, 14) if mode == "groups" else (5, 3)
    input_ids, first = _ids(prompt, targets)
    second = (first * 7 + 3) % VOCAB
    gradients = mode != "forward" and method != "integrated_gradients"
    kwargs = {"method": method, "n_steps": 3, "mode": "forward" if mode == "forward" else "reverse"}
    given = first.clone()
    for targets_now in (first, second, "mutated"):
        if isinstance(targets_now, str):
            given[:] = (first * 5 + 1) % VOCAB  # the tensor of the first call, changed in place
            targets_now = given.clone()
            passed = given
        else:
            passed = given if targets_now is first else targets_now
        expected, expected_grads = _loop(model, emb, input_ids, targets_now, method, n_steps=3)
        if gradients:
            attr, grads = token_attr(model, input_ids, passed, return_gradients=True, **kwargs)
            torch.testing.assert_close(grads, expected_grads, rtol=0, atol=1e-12)
        else:
            attr = token_attr(model, input_ids, passed, **kwargs)
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_reverse_mode_in_groups_of_targets_on_their_prefixes(gpt2, method):
    """T well above L_in: reverse mode runs a few groups of consecutive targets, each on its
    own prefix; the same attributions and gradients as the per-target loop."""
    input_ids, target_ids = _ids(4, 14)
    plan = funcgrad.attribution.plan(gpt2, input_ids, target_ids, method=method, mode="reverse")
    assert plan.forwards > 1, plan
    calls = []
    handle = gpt2.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    try:
        attr, grads = token_attr(
            gpt2, input_ids, target_ids, method=method, n_steps=3, return_gradients=True
        )
    finally:
        handle.remove()
    # (the hook is new since the causal probe last ran: its three forwards run again, once)
    calls = calls[3:]
    assert len(calls) == plan.forwards and len({shape[-1] for shape in calls}) == len(calls)
    emb = gpt2.get_input_embeddings()
    expected, expected_grads = _loop(gpt2, emb, input_ids, target_ids, method, n_steps=3)
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads, expected_grads, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_any_module_with_an_embedding_layer(method):
    model = TinyLM().double()
    input_ids, target_ids = _ids(4, 11)  # 2.5 L_in < T: forward mode under "auto"
    plan = funcgrad.attribution.plan(model, input_ids, target_ids, embedding=model.embed)
    assert plan.mode == "forward" and plan.directions == 4
    expected, _ = _loop(model, model.embed, input_ids, target_ids, method, n_steps=5)
    for mode in ("auto", "reverse", "forward"):
        attr = token_attr(
            model, input_ids, target_ids, method=method, n_steps=5, embedding=model.embed, mode=mode
        )
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)


def test_llama_style_model():
    torch.manual_seed(1)
    model = _llama()
    input_ids, target_ids = _ids(5, 6)
    expected, _ = _loop(model, model.get_input_embeddings(), input_ids, target_ids, "grad_x_input")
    # Llama's RMSNorm computes in float32 even in a float64 model: float32's rounding.
    for mode in ("reverse", "forward"):
        attr = token_attr(model, input_ids, target_ids, mode=mode)
        torch.testing.assert_close(attr, expected, rtol=1e-5, atol=1e-6)


class Wrapper(torch.nn.Module):
    """Another model object on the same layers (as PEFT's wrappers are)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids)


class SoftCapped(Wrapper):
    """A Hugging Face model whose logits are changed after its output layer (Gemma-2's soft
    cap): the output layer's input is no split point there."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 3.0 * torch.tanh(self.inner(ids).logits / 3.0)


@pytest.mark.parametrize("method", METHODS)
def test_logits_changed_after_the_output_layer_are_read_as_logits(method):
    """The heads recompute the logits from the output layer's input only where the model
    returns that layer's output unchanged; else they read the logits, exactly."""
    from funcgrad import attribution

    torch.manual_seed(4)
    model = SoftCapped(_gpt2())
    input_ids, target_ids = _ids(5, 4)
    expected, _ = _loop(model, model.get_input_embeddings(), input_ids, target_ids, method, 4)
    for mode in ("reverse", "forward"):
        attr = token_attr(model, input_ids, target_ids, method=method, n_steps=4, mode=mode)
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    assert "not its output layer's output" in attribution._LOGITS_ONLY[model]
    assert "logits" in funcgrad.attribution.plan(model, input_ids, target_ids).heads_read


class ChangedInPlace(torch.nn.Module):
    """A causal LM that changes its logits in place after its output layer (so the tensor it
    returns is the layer's output, changed)."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.lm_head = torch.nn.Linear(6, VOCAB)
        self.change = change

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embed(ids))).cumsum(1)
        logits = self.lm_head(hidden)
        if self.change == "input":  # (the layer's input; its weights are frozen, see below)
            hidden.mul_(2.0)
        elif self.change == "scale":
            logits.mul_(3.0)
        elif self.change == "mix":  # (causal: position i adds position i - 1)
            logits[:, 1:] += logits[:, :-1].clone()
        elif self.change == "softcap":
            logits.copy_(0.5 * torch.tanh(logits / 0.5))
        else:
            logits.add_(torch.arange(VOCAB, dtype=logits.dtype))
        return logits


@pytest.mark.parametrize("change", ["scale", "mix", "softcap", "bias", "input"])
def test_logits_changed_in_place_after_the_output_layer_are_read_as_logits(change):
    """The model returns its output layer's output, changed in place: the same tensor, but
    not the layer's values, or the layer's input changed in place after it ran; the heads
    read the logits (was silently wrong, 0.18-1.1 off, where only the tensor's identity was
    checked)."""
    input_ids, target_ids = _ids(5, 4)
    for mode in ("reverse", "forward"):  # (a new model each: what is found is remembered)
        torch.manual_seed(8)
        model = ChangedInPlace(change).double()
        model.lm_head.requires_grad_(False)  # (else autograd refuses the changed input)
        expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
        attr = token_attr(model, input_ids, target_ids, mode=mode)
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
        assert "logits" in funcgrad.attribution.plan(model, input_ids, target_ids).heads_read


class RunningSum(torch.nn.Module):
    """An output layer that mixes the positions (causally: the model stays causal)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h.cumsum(1))


class OutputLayerLM(torch.nn.Module):
    """A causal LM with ``get_output_embeddings()``: ``out`` is any module."""

    def __init__(self, out: torch.nn.Module) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.mix = torch.nn.Linear(6, 6)
        self.out = out

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(ids))))


class LinearSubclass(torch.nn.Linear):
    """A Linear whose forward is its own (here a running sum over the positions first)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h.cumsum(1))


def _mixing_hook(module, args, output):
    return output.cumsum(1)


def _forward_on_the_instance() -> torch.nn.Module:
    """A plain Linear whose ``forward`` is replaced on the instance (as accelerate's hooks
    replace it), here by one that mixes the positions."""
    import types

    layer = torch.nn.Linear(6, VOCAB)

    def forward(self: torch.nn.Linear, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.weight, self.bias).cumsum(1)

    layer.forward = types.MethodType(forward, layer)  # type: ignore[method-assign]
    return layer


@pytest.mark.parametrize(
    "make",
    [
        lambda: RunningSum(6),
        lambda: LinearSubclass(6, VOCAB),
        lambda: torch.nn.Sequential(torch.nn.Linear(6, VOCAB)),
        _forward_on_the_instance,
    ],
    ids=["module", "linear-subclass", "sequential", "forward-on-the-instance"],
)
def test_an_output_layer_that_may_mix_the_positions_is_read_as_logits(make):
    """The heads apply the output layer to their own row only where the layer is a plain
    torch.nn.Linear (row by row by construction); any other module may mix the rows (a
    running sum, causal, so the causal check passes), and the heads read the logits. Was
    silently wrong (0.42 off) on the first two, and on the last (0.5 off: a forward replaced
    on the instance)."""
    torch.manual_seed(6)
    model = OutputLayerLM(make()).double()
    input_ids, target_ids = _ids(5, 4)
    expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
    for mode in ("reverse", "forward"):
        attr = token_attr(model, input_ids, target_ids, mode=mode)
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    read = funcgrad.attribution.plan(model, input_ids, target_ids).heads_read
    assert "not a plain torch.nn.Linear" in read, read


@pytest.mark.parametrize("where", ["layer", "layer-pre", "global"])
def test_a_hook_added_to_the_output_layer_after_a_call_is_seen(where):
    """A hook on the output layer (or a global module hook) may mix the rows: checked on
    every call, so one registered after a first call sends the heads to the logits, and the
    attributions stay exact; removed, the split point is back. Was silently wrong (0.65 off)."""
    torch.manual_seed(7)
    model = OutputLayerLM(torch.nn.Linear(6, VOCAB)).double()
    input_ids, target_ids = _ids(5, 4)
    plan = funcgrad.attribution.plan
    assert plan(model, input_ids, target_ids).heads_read.startswith("the input of the output")
    token_attr(model, input_ids, target_ids, mode="reverse")  # the split point, remembered
    if where == "layer":
        handle = model.out.register_forward_hook(_mixing_hook)
    elif where == "layer-pre":
        # (the heads' own calls of the layer would run it a second time on their rows)
        handle = model.out.register_forward_pre_hook(lambda module, args: (2 * args[0].cumsum(1),))
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, output: (
                _mixing_hook(module, args, output) if module is model.out else None
            )
        )
    try:
        expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
        for mode in ("reverse", "forward"):
            attr = token_attr(model, input_ids, target_ids, mode=mode)
            torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
        assert "hook" in plan(model, input_ids, target_ids).heads_read
    finally:
        handle.remove()
    assert plan(model, input_ids, target_ids).heads_read.startswith("the input of the output")
    expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
    attr = token_attr(model, input_ids, target_ids, mode="reverse")
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_calls_on_one_model_in_several_threads_run_one_at_a_time(gpt2, mode):
    """A call hooks the model's embedding and output layers, hooks every thread runs: calls
    on one model in several threads ran each other's (31 of 60 calls raised: another call's
    embeddings substituted, the layer run 15 times in one forward). They now run one at a
    time, each exact."""
    import threading

    input_ids, target_ids = _ids(6, 5)
    jobs = [
        (input_ids, target_ids),
        ((input_ids + 1) % VOCAB, target_ids),
        (input_ids[:4], target_ids),
    ]
    expected = [token_attr(gpt2, ids, targets, mode=mode) for ids, targets in jobs]
    errors: list[BaseException] = []
    gaps: list[float] = []

    def work(job: int) -> None:
        for _ in range(8):
            try:
                attr = token_attr(gpt2, *jobs[job], mode=mode)
            except Exception as error:  # (collected: the test reports them)
                errors.append(error)
                continue
            gaps.append(float((attr - expected[job]).abs().max()))

    threads = [threading.Thread(target=work, args=(job,)) for job in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:2]
    assert len(gaps) == 8 * len(jobs) and max(gaps) <= 1e-12, max(gaps)


class CallsDuringItsForward(OutputLayerLM):
    """A model whose forward, on its first run in the calling thread while armed, calls
    ``self.during()`` (another token_attr call)."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(6, VOCAB))
        self.during: object = None
        self.results: list[object] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        during, self.during = self.during, None
        if callable(during):
            try:
                self.results.append(during())
            except Exception as error:  # (kept: the test looks at it)
                self.results.append(error)
        return super().forward(ids)


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_a_call_on_a_model_sharing_the_layers_waits_for_the_running_call(mode):
    """A wrapper and its base model are two model objects on the same layers, which a call
    hooks: a call on one, started in another thread while a call on the other runs its
    forward (with its hooks installed), waits for it (a lock per model let it run: 27 of 98
    calls raised, among them functorch's internal asserts, and 7 were wrong); both exact."""
    import threading

    torch.manual_seed(10)
    base = CallsDuringItsForward().double()
    wrapper = Wrapper(base)
    input_ids, target_ids = _ids(4, 5)
    expected, _ = _loop(base, base.embed, input_ids, target_ids, "grad_x_input")
    token_attr(base, input_ids, target_ids, mode=mode)  # (the causal probe: not in the race)
    token_attr(wrapper, input_ids, target_ids, mode=mode)
    results: list[object] = []

    def other() -> None:
        try:
            results.append(token_attr(wrapper, input_ids, target_ids, mode=mode))
        except Exception as error:  # (kept: the test looks at it)
            results.append(error)

    thread = threading.Thread(target=other, daemon=True)

    def start_the_other_call() -> None:
        thread.start()
        thread.join(timeout=0.5)  # (it waits for the lock: not done here)

    base.during = start_the_other_call
    results.append(token_attr(base, input_ids, target_ids, mode=mode))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(results) == 2 and all(isinstance(r, torch.Tensor) for r in results), results
    for attr in results:
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("on", ["model", "wrapper"])
def test_a_call_from_the_forward_of_a_running_call_on_its_layers_is_refused(on):
    """A model whose forward calls token_attr on itself (or on a model sharing its layers)
    while a call on it runs: the outer call's hooks are installed, and the inner call
    returned all zeros (a re-entrant lock let it in). Refused; the outer call is exact."""
    torch.manual_seed(12)
    model = CallsDuringItsForward().double()
    again = model if on == "model" else Wrapper(model)
    input_ids, target_ids = _ids(4, 3)
    expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
    token_attr(model, input_ids, target_ids)  # (past the causal probe: the forward is f's)
    model.during = lambda: token_attr(again, input_ids, target_ids)
    attr = token_attr(model, input_ids, target_ids)
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    (inner,) = model.results
    assert isinstance(inner, RuntimeError), inner
    assert re.search(CALL + ".*called again on .* while a call on it", str(inner)), inner
    torch.testing.assert_close(token_attr(again, input_ids, target_ids), expected)


def test_models_whose_forwards_call_each_other_in_two_threads_do_not_deadlock():
    """Model a's forward calls token_attr on b, b's on a, in two threads at once: with a
    lock per model the two calls took them in opposite orders and waited for ever. One lock
    for every call: both finish, exact, and the nested calls too."""
    import threading

    torch.manual_seed(13)
    input_ids, target_ids = _ids(4, 3)
    both_inside = threading.Barrier(2)
    nested = threading.local()

    class CallsThePeer(OutputLayerLM):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(6, VOCAB))
            self.peer: list[torch.nn.Module] = []  # (a list: not a submodule)
            self.results: list[torch.Tensor] = []

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if self.peer and not getattr(nested, "inside", False):
                nested.inside = True  # (once per thread: not from the peer's forward)
                # (both outer calls in their forwards; with one lock, one gets there)
                with contextlib.suppress(threading.BrokenBarrierError):
                    both_inside.wait(timeout=1)
                self.results.append(token_attr(self.peer[0], input_ids, target_ids))
            return super().forward(ids)

    a, b = CallsThePeer().double(), CallsThePeer().double()
    expected = {id(m): _loop(m, m.embed, input_ids, target_ids, "grad_x_input")[0] for m in (a, b)}
    a.peer.append(b)
    b.peer.append(a)
    results: dict[int, object] = {}

    def outer(model: torch.nn.Module) -> None:
        try:
            results[id(model)] = token_attr(model, input_ids, target_ids)
        except Exception as error:  # (kept: the test looks at it)
            results[id(model)] = error

    threads = [threading.Thread(target=outer, args=(m,), daemon=True) for m in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "deadlocked"
    for model, peer in ((a, b), (b, a)):
        torch.testing.assert_close(results[id(model)], expected[id(model)], rtol=0, atol=1e-12)
        (inner,) = model.results
        torch.testing.assert_close(inner, expected[id(peer)], rtol=0, atol=1e-12)


def test_the_cotangents_are_on_the_output_layer_input_not_on_the_vocabulary():
    """On a model with an output layer (``get_output_embeddings()``), the T cotangents pulled
    back through the model are on that layer's input, (T, d) a row, not on the logits (T,
    vocabulary): the peak memory stays far below T copies of the logits; and Hugging Face
    computes the logits of the last T positions only (``logits_to_keep``)."""
    from funcgrad import _memory

    torch.manual_seed(5)
    config = transformers.GPT2Config(
        vocab_size=4000, n_embd=8, n_layer=1, n_head=2, n_positions=64,
        bos_token_id=None, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).double().eval()
    input_ids, target_ids = _ids(24, 16)
    widths = []
    # (on the model: a hook on the output layer would make the heads read the logits)
    model.register_forward_hook(lambda module, args, out: widths.append(out.logits.shape[-2]))
    read = funcgrad.attribution.plan(model, input_ids, target_ids).heads_read
    assert read.startswith("the input of the output layer"), read
    token_attr(model, input_ids, target_ids, mode="reverse")  # (the first call measures)
    widths.clear()
    attr, peak = _memory.peak_of(
        lambda: token_attr(model, input_ids, target_ids, mode="reverse"), torch.device("cpu")
    )
    expected, _ = _loop(model, model.get_input_embeddings(), input_ids, target_ids, "grad_x_input")
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    logits_bytes = 16 * (24 + 16 - 1) * 4000 * 8  # T cotangents on the logits
    assert peak < logits_bytes / 4, (peak, logits_bytes)
    assert widths[0] == 16, widths  # the forward's logits: the last T positions


class VocabularyRows(TorchDispatchMode):
    """Counts the rows of the matrix products that are ``width`` wide (the output layer's),
    as they run (under vmap: every batched row)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        products = (
            torch.ops.aten.mm.default,
            torch.ops.aten.bmm.default,
            torch.ops.aten.addmm.default,
        )
        if func in products and out.shape[-1] == self.width:
            self.rows += out.numel() // self.width
        return out


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_the_output_layer_runs_on_one_row_per_target_whatever_the_prompt(gpt2, mode):
    """The heads apply the output layer to their own rows, and the model's own call of it
    gets its input detached: in forward mode the L_in tangents do not go through it (L_in x
    T rows a vocabulary wide otherwise). Each mode runs 2 T rows of it, the model's logits of
    the last T positions (``logits_to_keep``) and the heads', whatever L_in. The model is
    called without a key-value cache (``use_cache=False``)."""
    calls = []
    handle = gpt2.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True
    )
    try:
        for prompt in (4, 8):
            input_ids, target_ids = _ids(prompt, 12)
            token_attr(gpt2, input_ids, target_ids, mode=mode)  # (the first call measures)
            calls.clear()
            with VocabularyRows(VOCAB) as counted:
                attr = token_attr(gpt2, input_ids, target_ids, mode=mode)
            assert counted.rows == 2 * 12, (prompt, counted.rows)
            assert calls and all(kwargs.get("use_cache") is False for kwargs in calls), calls
            expected, _ = _loop(
                gpt2, gpt2.get_input_embeddings(), input_ids, target_ids, "grad_x_input"
            )
            torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    finally:
        handle.remove()


class CountedLM(TinyLM):
    """TinyLM with a `funcgrad.PassCounter` after its first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = funcgrad.PassCounter()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.counter(torch.tanh(self.mix(self.embed(ids))))
        return self.out(h.cumsum(1) + h**2)


def test_integrated_gradients_pull_the_cotangents_one_at_a_time_under_auto_on_the_cpu():
    """Each cotangent's pull is a batch of n_steps sequences already: under chunk_size="auto"
    the T cotangents go in a loop on the CPU (one vmap over T x n_steps sequences is bound by
    memory traffic); both exact."""
    model = CountedLM().double()
    input_ids, target_ids = _ids(6, 5)
    kwargs = {"embedding": model.embed, "mode": "reverse"}
    for method, n_steps, chunk_size, passes in [
        ("integrated_gradients", 4, "auto", 5),
        ("integrated_gradients", 4, None, 1),
        ("grad_x_input", 4, None, 1),
    ]:
        plan = funcgrad.attribution.plan(
            model, input_ids, target_ids, method=method, n_steps=n_steps, chunk_size=chunk_size,
            **kwargs,
        )  # fmt: skip
        assert plan.chunk_size == (1 if passes == 5 else chunk_size), plan
        model.counter.reset()
        attr = token_attr(
            model, input_ids, target_ids, method=method, n_steps=n_steps, chunk_size=chunk_size,
            **kwargs,
        )  # fmt: skip
        assert model.counter.backward == passes, (method, chunk_size, model.counter.backward)
        expected, _ = _loop(model, model.embed, input_ids, target_ids, method, n_steps)
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    plan = funcgrad.attribution.plan(model, input_ids, target_ids, **kwargs)
    assert plan.chunk_size == "auto", plan  # grad x input: one batch of sequences, vmapped


@pytest.mark.parametrize("chunk_size", [None, 1, 2, "auto"])
def test_chunk_sizes_agree(gpt2, chunk_size):
    input_ids, target_ids = _ids(6, 7)
    expected = token_attr(gpt2, input_ids, target_ids, mode="reverse", chunk_size=None)
    attr = token_attr(gpt2, input_ids, target_ids, mode="reverse", chunk_size=chunk_size)
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-13)


def test_inputs_as_captum_gives_them(gpt2):
    input_ids, target_ids = _ids(4, 3)
    expected = token_attr(gpt2, input_ids, target_ids)
    torch.testing.assert_close(token_attr(gpt2, input_ids[None], target_ids[None]), expected)
    torch.testing.assert_close(token_attr(gpt2, input_ids.tolist(), target_ids.tolist()), expected)
    with torch.no_grad():  # a user's no_grad does not stop it
        torch.testing.assert_close(token_attr(gpt2, input_ids, target_ids), expected)


def test_skip_ids_drop_columns_and_keep_the_skipped_tokens_in_the_baseline(gpt2):
    input_ids, target_ids = _ids(6, 3)
    input_ids[0] = 7  # a BOS-like token to skip
    full = token_attr(gpt2, input_ids, target_ids, skip_ids=[7])
    assert full.shape == (3, int((input_ids != 7).sum()))
    torch.testing.assert_close(full, token_attr(gpt2, input_ids, target_ids)[:, input_ids != 7])


@pytest.mark.parametrize("where", ["full", "pre", "global", "global-pre"])
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # (torch's, on the embedding)
def test_module_backward_hooks_take_reverse_mode(where):
    """A module backward hook (full or pre, on a module of the model or global) changes the
    gradients that reverse mode, captum's, computes; forward mode never runs it (was silently
    wrong, 0.006-0.4 off, where "auto" took forward mode). "auto" takes reverse mode, and
    mode="forward" is refused, naming the module."""
    torch.manual_seed(9)
    model = OutputLayerLM(torch.nn.Linear(6, VOCAB)).double()
    input_ids, target_ids = _ids(3, 11)  # 2.5 L_in < T: forward mode under "auto"
    module = torch.nn.modules.module
    hooks = {
        "full": lambda: model.mix.register_full_backward_hook(lambda m, gi, go: (2 * gi[0],)),
        "pre": lambda: model.mix.register_full_backward_pre_hook(lambda m, go: (3 * go[0],)),
        "global": lambda: module.register_module_full_backward_hook(
            lambda m, gi, go: (2 * gi[0],) if m is model.mix else None
        ),
        "global-pre": lambda: module.register_module_full_backward_pre_hook(
            lambda m, go: (3 * go[0],) if m is model.mix else None
        ),
    }
    handle = hooks[where]()
    try:
        expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
        # (reverse mode runs on eager autograd, which runs the hook: no fallback to warn of;
        # torch's own warning of a global full hook on a module without inputs may come)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attr = token_attr(model, input_ids, target_ids)
        assert not [w for w in caught if issubclass(w.category, funcgrad.FuncgradWarning)]
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
        plan = funcgrad.attribution.plan(model, input_ids, target_ids)
        assert plan.mode == "reverse" and "backward hook" in plan.why, plan
        name = "a global module backward" if where.startswith("global") else "`mix`"
        with pytest.raises(ValueError, match=CALL + ".*" + re.escape(name) + ".*mode='reverse'"):
            token_attr(model, input_ids, target_ids, mode="forward")
    finally:
        handle.remove()
    assert funcgrad.attribution.plan(model, input_ids, target_ids).mode == "forward"


class LevelRecordingLM(OutputLayerLM):
    """Records the innermost torch.func transform level active in each forward that is
    differentiated (None: none; the causal probe's forwards run without gradients)."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(6, VOCAB))
        self.levels: list[int | None] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        level = torch._C._functorch.maybe_current_level()
        if torch.is_grad_enabled() or level is not None:
            self.levels.append(level)
        return super().forward(ids)


@pytest.mark.parametrize("method", ["grad_x_input", "integrated_gradients"])
def test_reverse_mode_runs_the_model_on_eager_autograd(method):
    """Reverse mode runs the model's forward on eager autograd, outside any torch.func
    transform (its ops unwrapped, the activations' autograd.Function on autograd's own path;
    was inside torch.func.vjp), with the per-target loop's answer; forward mode stays on
    torch.func (only it has forward mode)."""
    torch.manual_seed(4)
    model = LevelRecordingLM().double()
    input_ids, target_ids = _ids(5, 4)
    expected, _ = _loop(model, model.embed, input_ids, target_ids, method, n_steps=4)
    for _ in range(2):  # (the first call of a shape, and a steady one)
        model.levels.clear()
        attr = token_attr(model, input_ids, target_ids, method=method, n_steps=4, mode="reverse")
        torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
        assert model.levels == [None], model.levels
    model.levels.clear()
    attr = token_attr(model, input_ids, target_ids, method=method, n_steps=4, mode="forward")
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    assert len(model.levels) == 1 and model.levels[0] is not None, model.levels


def test_fused_attention_falls_back_to_reverse_mode_under_auto():
    torch.manual_seed(2)
    model = _gpt2("sdpa")
    input_ids, target_ids = _ids(3, 10)
    assert funcgrad.attribution.plan(model, input_ids, target_ids).mode == "forward"
    with warnings.catch_warnings():
        # no warning of funcgrad's under auto (torch's own on first use of forward AD, when
        # this test runs alone, is not this test's)
        warnings.simplefilter("error", funcgrad.FuncgradWarning)
        attr = token_attr(model, input_ids, target_ids)
    plan = funcgrad.attribution.plan(model, input_ids, target_ids)
    assert plan.mode == "reverse" and "forward AD" in plan.why, plan
    expected = token_attr(model, input_ids, target_ids, mode="reverse")
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-13)


def test_an_error_of_the_model_in_the_forward_mode_pass_is_not_remembered():
    """Under "auto", forward mode falls back to reverse mode where it cannot run, and the
    model is remembered; an error of the model's own in that pass (here its third forward)
    was swallowed and the model remembered for good. It is now reported (compose_heads'
    warning, kept) and not remembered: the next call takes forward mode again."""

    class FailsOnce(OutputLayerLM):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(6, VOCAB))
            self.forwards = 0

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.forwards += 1
            if self.forwards == 4:  # (after the causal probe's three: the forward-mode pass)
                raise RuntimeError("the model's own error")
            return super().forward(ids)

    torch.manual_seed(14)
    model = FailsOnce().double()
    input_ids, target_ids = _ids(3, 10)
    plan = funcgrad.attribution.plan
    assert plan(model, input_ids, target_ids).mode == "forward"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", funcgrad.FuncgradWarning)
        attr = token_attr(model, input_ids, target_ids)
    assert any("the model's own error" in str(w.message) for w in caught), caught
    expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)
    assert plan(model, input_ids, target_ids).mode == "forward"


def test_plan_counts():
    model = TinyLM()
    input_ids, target_ids = _ids(8, 4)
    plan = funcgrad.attribution.plan(
        model,
        input_ids,
        target_ids,
        method="integrated_gradients",
        n_steps=16,
        embedding=model.embed,
    )
    assert (plan.mode, plan.rows, plan.directions, plan.captum_forwards) == ("reverse", 16, 4, 12)
    plan = funcgrad.attribution.plan(
        model, input_ids[:1], target_ids, return_gradients=True, embedding=model.embed
    )
    assert plan.mode == "reverse" and "return_gradients" in plan.why
    # "auto" takes forward mode where 2.5 L_in < T (measured), for every method.
    for method in ("grad_x_input", "integrated_gradients"):
        for targets, mode in [(9, "reverse"), (10, "reverse"), (11, "forward")]:
            plan = funcgrad.attribution.plan(
                model, input_ids[:4], list(range(targets)), method=method, embedding=model.embed
            )
            assert plan.mode == mode, (targets, plan)


@pytest.mark.slow  # ~15 s: dispatch-mode accounting of every op
def test_memory_is_bounded_under_a_budget():
    """chunk_size="auto" with a budget: the T-wide backward goes in chunks, so the peak stays
    near one forward and backward of the summed log-probabilities (interpreto#96)."""
    torch.manual_seed(3)
    model = _gpt2(width=64)
    input_ids, target_ids = _ids(8, 48)
    emb = model.get_input_embeddings()

    def floor() -> None:
        sequence = torch.cat([input_ids, target_ids[:-1]])[None]
        embeds = emb(sequence).detach().requires_grad_()
        handle = emb.register_forward_hook(lambda module, inputs, output: embeds)
        logits = model(sequence).logits[0, len(input_ids) - 1 :]
        handle.remove()
        torch.log_softmax(logits, -1).gather(-1, target_ids[:, None]).sum().backward()

    def attribute(chunk_size):
        return lambda: token_attr(
            model, input_ids, target_ids, mode="reverse", chunk_size=chunk_size
        )

    device = torch.device("cpu")
    _, floor_peak = _memory.peak_of(floor, device)
    expected, all_at_once = _memory.peak_of(attribute(None), device)
    with funcgrad.memory_budget(10_000):
        # The heads' cotangents on the output layer's input (a group's heads x heads x d)
        # would not fit: the heads read the logits.
        read = funcgrad.attribution.plan(model, input_ids, target_ids).heads_read
        assert read.startswith("the logits") and "budget" in read, read
    with funcgrad.memory_budget(floor_peak // 2):
        # The first call on new shapes measures one and two directions (chunks of 2 and 3);
        # the calls after it run in the chunks that fit.
        token_attr(model, input_ids, target_ids, mode="reverse")
        attr, chunked = _memory.peak_of(attribute("auto"), device)
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-13)
    # (T = 48 > L_in = 8: reverse mode runs groups of targets on their prefixes, which cut
    # the all-at-once peak already, from 13x to about 3x one forward and backward; GPT-2's
    # GELU backward as one product by its derivative (see test_attribution_elementwise)
    # cut it to 1.36x, and the chunked peak from 1.39x to 1.31x (the derivative's vjp, one
    # layer's temporaries during the forward, is part of it): the chunks save 4% here.)
    assert chunked < all_at_once, (chunked, all_at_once, floor_peak)
    assert chunked <= 1.5 * floor_peak, (chunked, floor_peak)


def test_what_is_kept_between_calls_is_bounded_and_lets_the_model_go():
    import gc

    from funcgrad import attribution

    model = TinyLM()
    for targets in range(1, 21):  # 20 shapes: the last 16 are kept
        token_attr(model, [1, 2], list(range(targets)), embedding=model.embed, mode="reverse")
    assert len(attribution._COMPOSED[model]) == attribution._COMPOSED_PER_MODEL
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


# ------------------------------------------------- the assumptions of one forward, checked


class Bidirectional(TinyLM):
    """Position i reads every position: one teacher-forced forward is not the prefixes'."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.embed(ids)))
        return self.out(h + h.mean(1, keepdim=True))


class Remapped(TinyLM):
    """Changes the ids before its embedding layer: the layer's output is not embed(ids)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.where(ids >= 30, 1, ids))


def test_a_model_that_is_not_causal_is_refused():
    model = Bidirectional()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match=CALL + ".*not causal"):
        token_attr(model, [1, 2, 3], [4, 5], embedding=model.embed)
    assert model.training  # the probe ran in eval mode, and the flags are back
    assert len(calls) == 3  # the probe's three forwards, then nothing


def test_bert_is_refused_as_not_causal():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    model = transformers.BertForMaskedLM(config).double().eval()
    with pytest.raises(ValueError, match=CALL + ".*not causal"):
        token_attr(model, [1, 2, 3], [4, 5])


def test_the_causal_probe_runs_once_per_model():
    model = TinyLM()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    for targets in ([4, 5], [4, 5, 6]):
        token_attr(model, [1, 2, 3], targets, embedding=model.embed, mode="reverse")
    assert len(calls) == 3 + 2  # the probe's three, then one forward per call


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_a_model_that_changes_the_ids_before_the_layer_is_refused(gpt2, mode):
    model = Remapped()
    input_ids, target_ids = torch.tensor([1, 31, 3]), torch.tensor([4, 5, 6, 7])
    with pytest.raises(ValueError, match=CALL + ".*other values than on the token ids alone"):
        token_attr(model, input_ids, target_ids, embedding=model.embed, mode=mode)
    handle = gpt2.register_forward_pre_hook(lambda module, args: ((args[0] + 1) % VOCAB,))
    try:
        with pytest.raises(ValueError, match=CALL + ".*other values"):
            token_attr(gpt2, input_ids, target_ids, mode=mode)
    finally:
        handle.remove()


def test_a_layer_not_fed_the_ids_is_refused(gpt2):
    with pytest.raises(ValueError, match=CALL + ".*other values.*position embeddings"):
        token_attr(gpt2, [1, 2, 3], [4, 5], embedding=gpt2.transformer.wpe)
    with pytest.raises(ValueError, match=CALL + ".*could not map the .* token ids"):
        token_attr(gpt2, [1, 2, 3], [4, 5], embedding=gpt2.transformer.ln_f)


def test_a_tensor_hook_on_the_embedding_output_is_refused(gpt2):
    emb = gpt2.get_input_embeddings()

    def hook(module, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: 3 * grad)

    handle = emb.register_forward_hook(hook)
    try:
        with pytest.raises(ValueError, match=CALL + ".*tensor hook"):
            token_attr(gpt2, [1, 2, 3], [4, 5], mode="reverse")
    finally:
        handle.remove()


def test_a_forward_hook_that_returns_a_new_output_is_attributed_as_captum_does(gpt2):
    """The hook's output is what captum's later hook sees: the attribution is to it."""
    emb = gpt2.get_input_embeddings()
    handle = emb.register_forward_hook(lambda module, inputs, output: 2 * output)
    try:
        input_ids, target_ids = _ids(4, 3)
        attr = token_attr(gpt2, input_ids, target_ids, mode="reverse")
        expected, _ = _loop(gpt2, emb, input_ids, target_ids, "grad_x_input")
    finally:
        handle.remove()
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)


def test_a_new_embedding_module_is_never_served_an_old_entry():
    """The composed functions are cached per id(embedding): an id is reused once a module is
    freed, and an entry must serve only the module it was made for (here the reuse is made
    deterministic: the old entry filed under the new module's id)."""
    from funcgrad import attribution

    model = TinyLM().double()
    input_ids, target_ids = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    token_attr(model, input_ids, target_ids, embedding=model.embed, mode="reverse")
    cache = attribution._COMPOSED[model]
    (old_key,) = cache
    model.embed = torch.nn.Embedding(VOCAB, 6).double()
    cache[(id(model.embed), *old_key[1:])] = cache[old_key]
    attr = token_attr(model, input_ids, target_ids, embedding=model.embed, mode="reverse")
    expected, _ = _loop(model, model.embed, input_ids, target_ids, "grad_x_input")
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-12)


def test_a_train_mode_failure_of_forward_mode_does_not_stick_in_eval_mode():
    class Dropped(TinyLM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * torch.nn.functional.dropout(
                torch.ones((), dtype=torch.float64), 0.5, self.training
            )

    model = Dropped().double()
    input_ids, target_ids = torch.tensor([1, 2]), torch.tensor([4, 5, 6, 7, 8, 9])
    model.train()
    token_attr(model, input_ids, target_ids, embedding=model.embed)
    model.eval()
    assert funcgrad.attribution.plan(model, input_ids, target_ids, embedding=model.embed).mode == (
        "forward"
    )


def test_sequences_past_the_models_positions_are_refused():
    torch.manual_seed(0)
    model = _gpt2()  # n_positions = 96
    with pytest.raises(ValueError, match=CALL + ".*has 97 tokens, more than the model's 96"):
        token_attr(model, list(range(1, 38)) + [1] * 40, list(range(1, 22)))


@pytest.mark.parametrize("chunk_size", [0, -2, "x", 2.5, True])
def test_chunk_size_is_checked_by_token_attr_and_plan(chunk_size):
    model = TinyLM()
    token_attr(model, [1, 2], [3, 4], embedding=model.embed, chunk_size=1)
    with pytest.raises(ValueError, match=CALL + ".*`chunk_size` must be"):
        token_attr(model, [1, 2], [3, 4], embedding=model.embed, chunk_size=chunk_size)
    # (plan() reported a chunk_size that token_attr refuses)
    plan_call = re.escape("funcgrad.attribution.plan(model, input_ids, target_ids)")
    with pytest.raises(ValueError, match=plan_call + ".*`chunk_size` must be"):
        funcgrad.attribution.plan(
            model, [1, 2], [3, 4], embedding=model.embed, chunk_size=chunk_size
        )


def test_inference_mode_is_refused_by_name():
    model = TinyLM()
    with torch.inference_mode(), pytest.raises(RuntimeError, match=CALL + ".*inference_mode"):
        token_attr(model, [1, 2], [3, 4], embedding=model.embed)


# ------------------------------------------------------------------------- against captum


class WordTokenizer:
    """The least of a Hugging Face tokenizer that captum's LLM attribution calls: token id i
    is the word ``w{i}`` (no download)."""

    def encode(self, text, return_tensors=None, add_special_tokens=True):
        ids = [int(word[1:]) for word in text.split()]
        return torch.tensor([ids]) if return_tensors == "pt" else ids

    def decode(self, ids):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return " ".join(f"w{i}" for i in ([ids] if isinstance(ids, int) else ids))

    def convert_ids_to_tokens(self, ids):
        return [f"w{i}" for i in ids]

    def convert_tokens_to_ids(self, tokens):
        return [int(token[1:]) for token in tokens]

    def __call__(self, text, return_offsets_mapping=False, add_special_tokens=True):
        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        return {"input_ids": self.encode(text), "offset_mapping": spans}


def _captum(model, input_ids, target_ids, method, n_steps=16, skip=None, unreduced=False):
    """captum 0.9's token_attr, or with ``unreduced`` its per-target (L_in, d) attributions
    before the sum (the method's own attribute, as LLMGradientAttribution calls it)."""
    attr = pytest.importorskip("captum.attr")
    tokenizer = WordTokenizer()
    emb = model.get_input_embeddings()
    layer = {
        "gradient": lambda: attr.LayerGradientXActivation(model, emb, multiply_by_inputs=False),
        "grad_x_input": lambda: attr.LayerGradientXActivation(model, emb),
        "integrated_gradients": lambda: attr.LayerIntegratedGradients(model, emb),
    }[method]()
    llm = attr.LLMGradientAttribution(layer, tokenizer)
    inp = attr.TextTokenInput(tokenizer.decode(input_ids), tokenizer, skip_tokens=skip)
    kwargs = {"n_steps": n_steps} if method == "integrated_gradients" else {}
    if not unreduced:
        return llm.attribute(inp, target=target_ids, **kwargs).token_attr
    rows = []
    for i in range(len(target_ids)):
        full = llm.attr_method.attribute(
            inp.to_tensor(), additional_forward_args=(inp, target_ids, i), **kwargs
        )
        rows.append(full[0, : len(input_ids)])
    return torch.stack(rows)


@pytest.mark.slow  # captum's loop: T (x n_steps + 2) forwards, ~5-10 s
@pytest.mark.parametrize("method", METHODS)
def test_matches_captum(gpt2, method):
    input_ids, target_ids = _ids(8, 6)
    expected = _captum(gpt2, input_ids, target_ids, method)
    attr, grads = token_attr(
        gpt2, input_ids, target_ids, method=method, n_steps=16, return_gradients=True
    )
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-10)
    forward = token_attr(gpt2, input_ids, target_ids, method=method, n_steps=16, mode="forward")
    torch.testing.assert_close(forward, expected, rtol=0, atol=1e-10)
    # The unreduced attributions: gradients times what captum multiplies them by.
    unreduced = _captum(gpt2, input_ids, target_ids, method, unreduced=True)
    emb = gpt2.get_input_embeddings()
    with torch.no_grad():
        embeds = emb(input_ids)
        inputs = {
            "gradient": torch.ones_like(embeds),
            "grad_x_input": embeds,
            "integrated_gradients": embeds - emb(torch.zeros_like(input_ids)),
        }[method]
    torch.testing.assert_close(grads * inputs, unreduced, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_matches_captum_with_skipped_tokens(gpt2):
    input_ids, target_ids = _ids(7, 4)
    input_ids[0] = 3
    method = "integrated_gradients"
    expected = _captum(gpt2, input_ids, target_ids, method, n_steps=8, skip=[3])
    attr = token_attr(gpt2, input_ids, target_ids, method=method, n_steps=8, skip_ids=[3])
    torch.testing.assert_close(attr, expected, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------- the classifier recipe


def test_every_class_of_a_classifier_with_compose_heads():
    """The documented recipe: every class's log-probability is a head on the logits."""
    classes = 5
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, classes))
    x = torch.randn(8)
    heads = funcgrad.stacked_heads(
        lambda onehot, logits: (onehot * torch.log_softmax(logits, -1)).sum(), torch.eye(classes)
    )
    values, grads = funcgrad.compose_heads(net, heads)(x)
    saliency = grads  # (classes, 8): d log p(c) / dx
    grad_x_input = grads * x
    for c in range(classes):
        leaf = x.clone().requires_grad_()
        (expected,) = torch.autograd.grad(torch.log_softmax(net(leaf), -1)[c], leaf)
        torch.testing.assert_close(saliency[c], expected, rtol=0, atol=1e-14)
        torch.testing.assert_close(grad_x_input[c], expected * x, rtol=0, atol=1e-14)
    torch.testing.assert_close(values, torch.log_softmax(net(x), -1), rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"input_ids": torch.tensor([1.0, 2.0])}, TypeError, "`input_ids` must hold integer"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long)}, ValueError, r"`input_ids`.*\(2, 3\)"),
        ({"input_ids": np.array([1, 2])}, TypeError, r"`input_ids` must be a 1-D tensor .*ndarray"),
        ({"target_ids": torch.tensor([], dtype=torch.long)}, ValueError, "T = 0"),
        ({"input_ids": []}, ValueError, "`input_ids` is empty"),
        ({"target_ids": [1, "a"]}, TypeError, "`target_ids` must be"),
        ({"target_ids": torch.tensor([1, VOCAB])}, ValueError, rf"\[0, {VOCAB}\).*to {VOCAB}"),
        ({"method": "saliency"}, ValueError, r"`method` must be one of .*'saliency'"),
        ({"mode": "jacfwd"}, ValueError, "`mode` must be one of"),
        ({"n_steps": 0}, ValueError, "`n_steps` must be a positive int, got 0"),
        ({"baseline_id": 1.5}, TypeError, "`baseline_id` must be an int"),
        (
            {"method": "integrated_gradients", "baseline_id": VOCAB},
            ValueError,
            rf"`baseline_id` must be a token id in \[0, {VOCAB}\), got {VOCAB}",
        ),
        ({"embedding": "wte"}, TypeError, "`embedding` must be"),
        ({"mode": "forward", "return_gradients": True}, ValueError, "mode='reverse'"),
        ({"skip_ids": [1, 2, 3]}, ValueError, "skips every prompt token"),
    ],
)
def test_errors_before_the_model_runs(kwargs, error, match):
    calls = []
    model = TinyLM()
    model.register_forward_hook(lambda *args: calls.append(1))
    arguments = {"input_ids": torch.tensor([1, 2, 3]), "target_ids": torch.tensor([4, 5])}
    arguments |= {"embedding": model.embed} | kwargs
    with pytest.raises(error, match=CALL + ".*" + match):
        token_attr(model, **arguments)
    assert not calls


def test_errors_on_the_model():
    with pytest.raises(TypeError, match=CALL + ".*`model` must be a torch.nn.Module"):
        token_attr(lambda ids: ids, [1], [2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=CALL + ".*no `get_input_embeddings\\(\\)`"):
        token_attr(TinyLM(), [1], [2])
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 4), torch.nn.Linear(4, 3))
    with pytest.raises(ValueError, match=CALL + ".*above the largest target id, 3"):
        token_attr(model, [1, 2], [3], embedding=model[0])
    flat = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 4), torch.nn.Flatten(0))
    with pytest.raises(ValueError, match=CALL + ".*logits of shape"):
        token_attr(flat, [1, 2], [3], embedding=flat[0])
    unused = torch.nn.Embedding(VOCAB, 6)  # (not the model's: its hook never runs)
    with pytest.raises(ValueError, match=CALL + ".*embedding layer did not run"):
        token_attr(TinyLM(), [1, 2], [3], embedding=unused)
    with pytest.raises(ValueError, match=CALL + r".*\(1, length, d\) floating embeddings"):
        token_attr(TinyLM(), [1, 2], [3], embedding=torch.nn.Flatten(0))


# ------------------------------------------------------- Hugging Face outputs as pytrees (item 5)


def test_compose_heads_takes_a_model_output(gpt2):
    """f may return a ModelOutput (registered with torch.utils._pytree only): its tensors are
    leaves, heads read its fields."""
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    embeds = gpt2.get_input_embeddings()(ids).detach()

    def f(e):
        return gpt2(inputs_embeds=e, use_cache=False)

    heads = [lambda out: out.logits[0, -1, 2], lambda out: out["logits"][0, 2].logsumexp(-1)]
    _, grads = funcgrad.compose_heads(f, heads)(embeds)
    for i, head in enumerate(heads):
        leaf = embeds.clone().requires_grad_()
        (expected,) = torch.autograd.grad(head(f(leaf)), leaf)
        torch.testing.assert_close(grads[i], expected, rtol=0, atol=1e-13)
    with pytest.raises(TypeError, match=r"leaf \['cache'\], must be a floating-point"):
        funcgrad.compose_heads(lambda e: gpt2(inputs_embeds=e, use_cache=True), heads)(embeds)


class Pair:
    """A user's type, registered with torch's pytree registry only."""

    def __init__(self, first, second):
        self.first, self.second = first, second


torch.utils._pytree.register_pytree_node(
    Pair, lambda p: ([p.first, p.second], ["first", "second"]), lambda xs, _: Pair(*xs)
)


def test_a_type_registered_with_torch_only_is_a_node():
    x = torch.randn(3)
    _, grads = funcgrad.compose_heads(
        lambda x: Pair(x.sin(), x.exp()), [lambda p: p.first.sum(), lambda p: p.second[0]]
    )(x)
    torch.testing.assert_close(grads, torch.stack([x.cos(), torch.eye(3)[0] * x.exp()]))
    with pytest.raises(TypeError, match=r"leaf \['second'\]"):
        funcgrad.compose_heads(lambda x: Pair(x.sin(), 1), [lambda p: p.first.sum()])(x)


@pytest.mark.parametrize(
    "obj",
    [token_attr, funcgrad.attribution.plan, funcgrad.attribution.AttributionPlan],
    ids=lambda obj: obj.__name__,
)
def test_type_hints_are_readable(obj):
    import typing

    assert typing.get_type_hints(obj)
