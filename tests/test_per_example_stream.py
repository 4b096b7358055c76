"""Each layer processed as its Δ arrives in the one backward (`_run._Stream`), so that the
layers' output gradients are not all held at once: the Δ of a layer is freed before the
backward reaches the layers below it (calls that write nothing: every native layer; calls
that write: the norms), with the results exact in float64 against a per-example loop, also
with user hooks, failed calls, reuse across shapes and the paths that cannot stream."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import PER_EXAMPLE_CALLS, per_example_jacobian
from torch import nn

import funcgrad

B, T, V, D = 5, 6, 20, 8


class Encoder(nn.Module):
    """Embedding, a TransformerEncoderLayer (attention with a padding mask, LayerNorms, the
    feed-forward Linears), a Linear head: every native rule. ``spy`` sees the output
    gradient at the layer's output (a tensor hook on it) and, at the input of the encoder
    layer, records whether the head's and the last norm's output gradients are still alive
    (weak references)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True).double()
        self.head = nn.Linear(D, 3).double()
        self.embed.double()
        self.watch: dict[str, weakref.ref[torch.Tensor]] = {}
        self.alive_below: dict[str, bool] | None = None
        self.spy = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.embed(tokens)
        if self.spy:
            h.register_hook(self._below)
        h = self.layer(h, src_key_padding_mask=pad)
        out = self.head(h)
        if self.spy:
            out.register_hook(lambda g: self._keep("head", g))
        return out.pow(2).sum((1, 2))

    def _keep(self, name: str, grad: torch.Tensor) -> None:
        self.watch[name] = weakref.ref(grad)

    def _below(self, grad: torch.Tensor) -> None:
        gc.collect()
        self.alive_below = {name: ref() is not None for name, ref in self.watch.items()}


def tokens(batch: int = B) -> torch.Tensor:
    found = torch.randint(1, V, (batch, T))
    found[1, 4:] = 0  # padded
    return found


def norm_spy(model: Encoder) -> None:
    """The output gradient of the encoder's last LayerNorm, watched."""

    def watch(module, args, out):
        out.register_hook(lambda g: model._keep("norm2", g))

    model.layer.norm2.register_forward_hook(watch)


@pytest.fixture
def one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """No layer taken as tiny (`_rules._tiny`): each formed alone, as the larger layers
    are, so that these small models test the per-layer path (streamed, ghost, live rows)."""
    monkeypatch.setattr("funcgrad._per_example._rules._TINY", 0)


@pytest.mark.parametrize("call", ["gramian", "norms"])
def test_a_call_that_writes_nothing_frees_each_delta_before_the_layers_below(call, one_by_one):
    torch.manual_seed(0)
    model = Encoder().eval()
    norm_spy(model)
    x = tokens()
    jac = per_example_jacobian(model, lambda m: m(x))
    with funcgrad.per_example(model) as pe:
        pe.gramian(model(x))  # the first call of a signature checks independence: no stream
        model.spy = True
        if call == "gramian":
            got = pe.gramian(model(x))
            torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
        else:
            got = funcgrad.per_example_norms(model(x))
            torch.testing.assert_close(got, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
    # at the embedding's output gradient, the head's and the norm's Δ were already freed
    assert model.alive_below == {"head": False, "norm2": False}


def test_a_call_that_writes_frees_the_norms_delta_and_keeps_what_the_update_needs():
    torch.manual_seed(1)
    model = Encoder().eval()
    norm_spy(model)
    x = tokens()
    jac = per_example_jacobian(model, lambda m: m(x))
    weights = torch.rand(B, dtype=torch.float64)
    with funcgrad.per_example(model) as pe:
        pe.gramian(model(x))  # the first call of a signature checks independence: no stream
        model.spy = True
        pe.backward(model(x), weighting=lambda g: weights)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, weights @ jac, rtol=1e-10, atol=1e-12)
    # the head's Δ is held for Aᵀ(w ⊙ Δ) (w needs all of G); the norm's was freed
    assert model.alive_below == {"head": True, "norm2": False}


def test_clip_is_exact_with_the_norms_streamed():
    torch.manual_seed(2)
    model = Encoder().eval()
    x = tokens()
    jac = per_example_jacobian(model, lambda m: m(x))
    norms = jac.norm(dim=1)
    clip = float(norms.median())
    with funcgrad.per_example(model):
        funcgrad.per_example_clip(model(x), clip)
    expected = (clip / (norms + 1e-6)).clamp(max=1) @ jac
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_user_hooks_on_the_streamed_layers_are_honoured():
    """A tensor hook rescaling a layer's output gradient, a full backward hook on a norm,
    a post-accumulate-grad hook: as in one backward of the losses, each once."""
    torch.manual_seed(3)
    model = Encoder().eval()
    x = tokens()
    calls = {"full": 0, "post": 0}

    def full(module, grad_in, grad_out):
        calls["full"] += 1

    model.layer.norm1.register_full_backward_hook(full)
    model.head.bias.register_post_accumulate_grad_hook(
        lambda p: calls.__setitem__("post", calls["post"] + 1)
    )

    def rescale(module, args, out):
        out.register_hook(lambda g: g * 3.0)

    model.layer.linear1.register_forward_hook(rescale)

    jac = per_example_jacobian(model, lambda m: m(x))
    calls.update(full=0, post=0)
    with funcgrad.per_example(model) as pe:
        got = pe.gramian(model(x))
        torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
        assert calls == {"full": 1, "post": 0}
        pe.backward(model(x))  # the plain sum
    assert calls == {"full": 2, "post": 1}
    got = model.head.bias.grad
    torch.testing.assert_close(got, jac[:, -3:].sum(0), rtol=1e-10, atol=1e-12)


def test_reuse_across_shapes_after_a_failure_in_the_backward_and_after_retain_graph():
    torch.manual_seed(4)
    model = Encoder().eval()
    pe = funcgrad.per_example(model)
    for batch in (B, 3, 7):
        x = tokens(batch)
        jac = per_example_jacobian(model, lambda m, x=x: m(x))
        torch.testing.assert_close(pe.gramian(model(x)), jac @ jac.T, rtol=1e-10, atol=1e-12)
    # a user hook that raises in the middle of the backward (after the head streamed)
    x = tokens()
    boom = model.layer.norm1.register_full_backward_pre_hook(
        lambda m, g: (_ for _ in ()).throw(RuntimeError("user hook failed"))
    )
    with pytest.raises(RuntimeError, match="user hook failed"):
        pe.gramian(model(x))
    boom.remove()
    assert all(p.grad is None for p in model.parameters())
    jac = per_example_jacobian(model, lambda m: m(x))
    # retain_graph keeps the rows (nothing streamed), then the second call streams
    losses = model(x)
    first = pe.gramian(losses, retain_graph=True)
    second = funcgrad.per_example_norms(losses)
    torch.testing.assert_close(first, jac @ jac.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(second, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
    pe.remove()


def test_mutating_what_was_returned_changes_nothing_later():
    torch.manual_seed(5)
    model = Encoder().eval()
    x = tokens()
    jac = per_example_jacobian(model, lambda m: m(x))
    with funcgrad.per_example(model) as pe:
        got = pe.gramian(model(x))
        got.fill_(7.0)
        norms = funcgrad.per_example_norms(model(x))
        norms.fill_(7.0)
        again = pe.gramian(model(x))
    torch.testing.assert_close(again, jac @ jac.T, rtol=1e-10, atol=1e-12)


def test_a_model_that_mixes_examples_is_still_refused():
    torch.manual_seed(6)

    class Mixing(Encoder):
        def forward(self, tokens):
            h = self.embed(tokens)
            h = self.layer(h)
            h = h - h.mean(0)  # mixes the examples after a hooked layer
            return self.head(h).pow(2).sum((1, 2))

    model = Mixing().eval()
    with funcgrad.per_example(model) as pe, pytest.raises(ValueError, match="example"):
        pe.gramian(model(tokens()))


def test_mixed_rules_shared_parameters_and_generic_layers_stay_exact():
    """A block of layers sharing a parameter (a Linear called twice) and a generic module
    (a GRU) beside streamed layers: those are formed at the end, the others streamed."""
    torch.manual_seed(7)

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, D)
            self.shared = nn.Linear(D, D)
            self.gru = nn.GRU(D, D, batch_first=True)
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, 2)

        def forward(self, x):
            h = self.shared(torch.tanh(self.shared(self.inp(x))))
            h, _ = self.gru(h)
            return self.head(self.norm(h)).pow(2).sum((1, 2))

    model = Mixed().double()
    x = torch.randn(B, T, 4, dtype=torch.float64)
    jac = per_example_jacobian(model, lambda m: m(x))
    with funcgrad.per_example(model) as pe:
        torch.testing.assert_close(pe.gramian(model(x)), jac @ jac.T, rtol=1e-10, atol=1e-12)
        norms = funcgrad.per_example_norms(model(x))
        torch.testing.assert_close(norms, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
        weights = torch.rand(B, dtype=torch.float64)
        pe.backward(model(x), weighting=lambda g: weights)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, weights @ jac, rtol=1e-10, atol=1e-12)


class SelfAttend(nn.Module):
    """Self-attention whose q, k, v come from one input (the packed in-projection: one
    Linear of 3·d outputs), or from two copies of it (``apart``: three Linear layers)."""

    def __init__(self, apart: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(D, 2, batch_first=True, bias=bias).double()
        self.head = nn.Linear(D, 2).double()
        self.apart = apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = x.clone() if self.apart else x
        pad = torch.zeros(x.shape[:2], dtype=torch.bool)
        pad[0, 3:] = True
        out, _ = self.attention(x, kv, kv, key_padding_mask=pad, need_weights=False)
        return self.head(torch.tanh(out)).pow(2).sum((1, 2))


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention_takes_q_k_v_as_one_linear_exactly(apart, bias):
    torch.manual_seed(8)
    model = SelfAttend(apart, bias)
    x = torch.randn(B, T, D, dtype=torch.float64)
    jac = per_example_jacobian(model, lambda m: m(x))
    weights = torch.rand(B, dtype=torch.float64)
    with funcgrad.per_example(model) as pe:
        for _ in range(2):  # the first call checks independence, the second streams
            torch.testing.assert_close(pe.gramian(model(x)), jac @ jac.T, rtol=1e-10, atol=1e-12)
            rule = pe.plan.layers[0].rule
            assert rule.startswith("q: " if apart else "qkv: ") and "out: " in rule, rule
            norms = funcgrad.per_example_norms(model(x))
            torch.testing.assert_close(norms, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
        pe.backward(model(x), weighting=lambda g: weights)
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(got, weights @ jac, rtol=1e-10, atol=1e-12)
        # the packed weight alone (inputs=): its rows q, k, v in place
        weight = model.attention.in_proj_weight
        columns = slice(0, weight.numel())
        gram = pe.gramian(model(x), inputs=[weight])
        part = jac[:, columns]
        torch.testing.assert_close(gram, part @ part.T, rtol=1e-10, atol=1e-12)


def test_the_live_rows_are_counted_where_the_first_output_feature_is_never_read(
    one_by_one,
):
    """The live rows are those whose output gradient has any feature not 0, not only the
    first (which the loss never reads here: a count of the rows whose first feature is not
    0 would be 0); the exact count decides and is shown."""
    torch.manual_seed(9)
    layer = nn.Linear(3, 4).double()
    x = torch.randn(B, T, 3, dtype=torch.float64)

    def losses(m):
        out = m(x)
        return out[:, :2, 1:].pow(2).sum((1, 2))  # 2 rows live an example, feature 0 unread

    jac = per_example_jacobian(layer, losses)
    with funcgrad.per_example(layer) as pe:
        torch.testing.assert_close(pe.gramian(losses(layer)), jac @ jac.T, rtol=1e-10, atol=1e-12)
    assert f"T={T}, {2 * B} rows live" in pe.plan.layers[0].rule, str(pe.plan)


def test_a_layer_whose_work_fails_in_the_backward_is_formed_at_the_end(monkeypatch):
    """The work inside the backward never raises there: a layer that fails is left whole
    (its rows kept) and formed after the backward, as without streaming."""
    from funcgrad._per_example import _attention, _rules

    torch.manual_seed(10)
    model = Encoder().eval()
    x = tokens()
    jac = per_example_jacobian(model, lambda m: m(x))
    failed = []

    def flaky(original):
        def run(*args, **kwargs):
            if torch._C._current_graph_task_id() != -1:  # inside the backward
                failed.append(original)
                raise RuntimeError("flaky")
            return original(*args, **kwargs)

        return run

    with funcgrad.per_example(model) as pe:
        pe.gramian(model(x))  # the first call of a signature: no stream
        monkeypatch.setattr(_rules._Dense, "gramian", flaky(_rules._Dense.gramian))
        # attention's parts fail half-way: after its Δq, Δk, Δv were read
        monkeypatch.setattr(_attention, "_Use", flaky(_attention._Use))
        got = pe.gramian(model(x))
        assert failed  # the head, the feed-forward Linears and the attention failed there
        torch.testing.assert_close(got, jac @ jac.T, rtol=1e-10, atol=1e-12)
        norms = funcgrad.per_example_norms(model(x))
        torch.testing.assert_close(norms, jac.norm(dim=1), rtol=1e-10, atol=1e-12)


def test_which_recorded_outputs_have_another_below_them_matches_a_full_walk():
    """`_above_another` (the walk that stops at the first target) against a full walk,
    on a graph with shared sub-graphs (diamonds), a target below two others, and targets
    with nothing below."""
    from funcgrad._per_example._record import _above_another

    torch.manual_seed(11)
    x = torch.randn(3, requires_grad=True)
    nodes = []
    h = x * 2
    for i in range(8):
        a, b = h.sin(), h.cos()  # a diamond
        h = a * b + (h if i % 3 else 0)
        nodes.append(h)
    side = x.exp()  # nothing recorded below
    nodes.append(side)
    out = h.sum() + side.sum()
    del out  # (the nodes hold the graph)
    for pick in ([0, 3, 7, 8], [7], [2, 5], list(range(9))):
        targets = {nodes[i].grad_fn: None for i in pick}

        def below(node, targets=targets):
            stack, seen = [c for c, _ in node.next_functions if c is not None], set()
            while stack:
                n = stack.pop()
                if n in targets:
                    return True
                if n not in seen:
                    seen.add(n)
                    stack.extend(c for c, _ in n.next_functions if c is not None)
            return False

        assert _above_another(targets) == {n: below(n) for n in targets}


def _reads_per_call(model, losses_of, call) -> list[int]:
    """Host reads of ``call`` on calls 1, 2, 3 (from the second, the layers stream)."""
    counts = []
    with funcgrad.per_example(model):
        for _ in range(3):
            losses = losses_of()
            with funcgrad.HostReadCounter() as reads:
                call(losses)
            assert not any(" in process" in str(r) for r in reads.reads), reads.reads
            counts.append(reads.count)
    return counts


@pytest.mark.parametrize("call", list(PER_EXAMPLE_CALLS))
def test_a_streamed_layer_costs_no_host_read(call):
    """Streaming reads nothing per layer: on 2-D inputs (ghost (A Aᵀ)∘(Δ Δᵀ), no live count)
    a call reads as many values whatever the depth, the end-of-call check that G (or its
    diagonal) is finite (main's counts: 1, 1, 0, 2; the clip's factors are finite once G is,
    unchecked since session 12)."""
    torch.manual_seed(11)
    x, y = torch.randn(6, 5), torch.randint(3, (6,))
    found = []
    for depth in (1, 4):
        hidden = [m for _ in range(depth) for m in (nn.Linear(16, 16), nn.Tanh())]
        model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), *hidden, nn.Linear(16, 3))

        def losses(model=model):
            return nn.functional.cross_entropy(model(x), y, reduction="none")

        found.append(_reads_per_call(model, losses, PER_EXAMPLE_CALLS[call]))
    expected = {"gramian": 1, "norms": 1, "backward": 0, "clip": 1}[call]
    assert found == [[expected] * 3] * 2, found


class _Tagger(nn.Module):
    """Embedding, Linear, LayerNorm, Linear, head on padded tokens, one loss per position
    read (the padding positions are read by no loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.first, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)
        self.second, self.head = nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.first(self.embed(ids))))
        return self.head(torch.relu(self.second(h)))


@pytest.mark.parametrize("call", list(PER_EXAMPLE_CALLS))
def test_a_streamed_sequence_model_reads_no_more_than_before_streaming(call):
    """On (B, T, d) rows each ghost layer counts its live rows with the one read its ghost
    products take (`nonzero`), the Embedding its own; nothing more per layer. Main (before
    streaming) read 14, 5, 0 and 6 values per call here."""
    torch.manual_seed(12)
    model = _Tagger()
    ids = torch.randint(1, 50, (8, 6))
    ids[:, 4:] = 0
    y, mask = torch.randint(3, (8, 6)), (ids != 0).float()

    def losses():
        out = model(ids).transpose(1, 2)
        return (nn.functional.cross_entropy(out, y, reduction="none") * mask).sum(1)

    counts = _reads_per_call(model, losses, PER_EXAMPLE_CALLS[call])
    bound = {"gramian": 14, "norms": 5, "backward": 0, "clip": 6}[call]
    assert max(counts) <= bound, counts


@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("width", [3, 16])
def test_inf_in_a_row_no_loss_reads_adds_nothing_on_the_streamed_path(width, tiny, monkeypatch):
    """An inf in the input at padding positions (read by no loss): the streamed layers'
    rows there add nothing (zeroed in A on the device, or masked in the norms' kernel), so
    G, the norms, the update and the clipped sum equal a per-example loop on the input
    with those rows set to 0 (the same losses). Narrow layers take the materialised rules
    (A_bᵀ Δ_b, where torch's product gives NaN), wide ones the ghost products; with
    ``tiny``, both are tiny (`_rules._tiny`) and formed together, materialised."""
    if not tiny:
        monkeypatch.setattr("funcgrad._per_example._rules._TINY", 0)
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(width, width + 1), nn.ReLU(), nn.Linear(width + 1, width))
    model = model.double()
    x = torch.randn(B, T, width, dtype=torch.float64)
    length = torch.tensor([T, 4, 2, 5, 3])
    read = torch.arange(T) < length[:, None]  # (B, T): the positions the losses read
    x_inf = x.masked_fill(~read[..., None], float("inf"))
    x_zero = x.masked_fill(~read[..., None], 0.0)

    def losses(m, inputs):
        return torch.where(read[..., None], m(inputs), 0.0).pow(2).sum((1, 2))

    jac = per_example_jacobian(model, lambda m: losses(m, x_zero))
    assert torch.isfinite(jac).all()
    weights = torch.rand(B, dtype=torch.float64)
    with funcgrad.per_example(model) as pe:
        for _ in range(3):  # the first call checks independence, the others stream
            gram = pe.gramian(losses(model, x_inf))
            torch.testing.assert_close(gram, jac @ jac.T, rtol=1e-10, atol=1e-12)
            rule = "materialised" if width == 3 or tiny else "ghost"
            assert all(layer.rule.startswith(rule) for layer in pe.plan.layers), pe.plan
            norms = funcgrad.per_example_norms(losses(model, x_inf))
            torch.testing.assert_close(norms, jac.norm(dim=1), rtol=1e-10, atol=1e-12)
            rule = "materialised" if width == 3 else "ghost"  # the cheaper for the norms
            assert all(layer.rule.startswith(rule) for layer in pe.plan.layers), pe.plan
        for p in model.parameters():
            p.grad = None
        pe.backward(losses(model, x_inf), weighting=lambda g: weights)
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(got, weights @ jac, rtol=1e-10, atol=1e-12)
        for p in model.parameters():
            p.grad = None
        clip = float(jac.norm(dim=1).median())
        funcgrad.per_example_clip(losses(model, x_inf), clip)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    factors = (clip / (jac.norm(dim=1) + 1e-6)).clamp(max=1)
    torch.testing.assert_close(got, factors @ jac, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "shape", [(0, 3, 4), (3, 0, 4), (3, 5, 0), (1, 1, 1), (7, 300, 50), (2000, 30, 5)]
)
def test_the_unread_rows_are_those_whose_output_gradient_is_all_zeros(shape):
    """`_all_zero` (the rows zeroed in A, and skipped by the ghost products) is
    ``(d == 0).all(-1)``: NaN, inf and the smallest subnormal are not zero, -0.0 is; also
    in several blocks of examples and on a transposed Δ."""
    from funcgrad._per_example._layer import _all_zero, _live_index

    torch.manual_seed(14)
    d = torch.randn(shape)
    if d.numel():
        d[torch.rand(shape[:-1]) < 0.5] = 0
        d.view(-1)[: min(4, d.numel())] = torch.tensor([-0.0, float("nan"), -float("inf"), 1e-45])[
            : min(4, d.numel())
        ]
    for found in (d, d.transpose(0, 1).contiguous().transpose(0, 1)):
        expected = (found == 0).all(-1)
        assert torch.equal(_all_zero(found), expected)
        assert torch.equal(_live_index(found), (~expected).flatten().nonzero().squeeze(1))


class _Probed(nn.Module):
    """Linear, (LayerNorm or Linear), Linear; a read-only user hook on the output that runs
    its own ``torch.autograd.grad`` through the middle layer's node during funcgrad's
    backward (that node's pre-hooks fire in that nested backward too)."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6).double()
        self.b = (nn.LayerNorm(6) if norm else nn.Linear(6, 6)).double()
        self.c = nn.Linear(6, 2).double()
        self.probed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        u = self.b(torch.tanh(h))
        y = self.c(torch.tanh(u))

        def probe(grad: torch.Tensor) -> None:  # logs a norm: changes no gradient
            with torch.enable_grad():
                torch.autograd.grad(u.pow(2).sum(), h, retain_graph=True)
            self.probed += 1

        if torch.is_grad_enabled():
            y.register_hook(probe)
        return y.pow(2).sum((1, 2))


@pytest.mark.parametrize("norm", [False, True])
def test_a_user_hook_running_its_own_backward_through_a_layer_is_not_taken_for_its_delta(norm):
    """The nested backward's gradient at a layer's node is not that layer's Δ: each call of
    a sequence (first and streamed) exact against a per-example loop."""
    torch.manual_seed(11)
    model = _Probed(norm)
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    jac = per_example_jacobian(model, lambda m: m(x))
    norms = jac.norm(dim=1)
    clip = float(norms.median())

    def weigh(gram: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve(gram + torch.eye(4, dtype=gram.dtype), torch.ones(4).double())

    params = list(model.parameters())
    with funcgrad.per_example(model) as pe:
        for call in "GGNCBGNB":
            for p in params:
                p.grad = None
            model.probed = 0
            losses = model(x)
            if call == "G":
                got, want = pe.gramian(losses), jac @ jac.T
            elif call == "N":
                got, want = funcgrad.per_example_norms(losses), norms
            else:
                if call == "C":
                    funcgrad.per_example_clip(losses, clip)
                    want = (clip / (norms + 1e-6)).clamp(max=1) @ jac
                else:
                    pe.backward(losses, weighting=weigh)
                    want = weigh(jac @ jac.T) @ jac
                got = torch.cat([p.grad.flatten() for p in params])
            assert model.probed == 1, call
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=call)


@pytest.mark.parametrize("call", ["gramian", "norms", "backward"])
def test_tiny_linears_of_one_shape_form_their_per_example_gradients_in_one_product(
    call, monkeypatch
):
    """Tiny Linears (`_rules._tiny`) of one shape are formed together: the batched products
    a call runs do not grow with the number of layers (one per layer before, and one per
    output feature of each before that), and so do those of the update (a weighted one:
    G, then ``Aᵀ (w ⊙ Δ)``), exact, on the first call (no stream) and streamed ones."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.bmm:  # (the backward's are mm)
                self.count += 1
            return func(*args, **(kwargs or {}))

    from funcgrad._per_example._rules import _Dense

    alone = [0]  # the per-layer update (one product a layer)
    weighted = _Dense.weighted

    def counted(self, *args):
        alone[0] += 1
        return weighted(self, *args)

    monkeypatch.setattr(_Dense, "weighted", counted)
    found = []
    for depth in (2, 6):
        torch.manual_seed(12)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(depth)))
        model = model.double()
        x = torch.randn(4, 3, 4, dtype=torch.float64)
        jac = per_example_jacobian(model, lambda m, x=x: m(x).pow(2).sum((1, 2)))
        counts = []
        with funcgrad.per_example(model) as pe:
            for _ in range(3):  # the first call and streamed ones
                losses = model(x).pow(2).sum((1, 2))
                with Products() as products:
                    if call == "gramian":
                        got, want = pe.gramian(losses), jac @ jac.T
                    elif call == "norms":
                        got, want = funcgrad.per_example_norms(losses), jac.norm(dim=1)
                    else:
                        weights = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
                        pe.backward(losses, weighting=lambda g, w=weights: w)
                        got = torch.cat([p.grad.flatten() for p in model.parameters()])
                        want = weights @ jac
                        for p in model.parameters():
                            p.grad = None
                assert f"one product for {depth} tiny layer(s)" in str(pe.plan), str(pe.plan)
                counts.append(products.count)
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        found.append(counts)
    assert found[0] == found[1], found
    assert max(found[0]) <= 3, found
    assert alone == [0]
