"""One call of ``gramian`` / ``backward``: validate (the losses, the weighting, the recorded
layers; before any pass) -> collect (the one backward) -> the layers' rules -> weigh ->
apply (``.grad`` written in one place, at the end)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import _per_example as _package
from .. import _sync, _weighting
from .._config import CheckMode, resolve_check
from .._errors import describe
from .._validate import named_inputs, values_readable
from . import _rules
from ._attention import _Attention
from ._checks import (
    _recorded_uses,
    _refuse_changed,
    _refuse_foreign_reads,
    _refuse_hooks,
    _refuse_parameter_hooks,
)
from ._choose import _layer_class
from ._generic import _Generic
from ._independence import _probe, _verify_independence, _verify_materialised
from ._layer import PerExamplePlan, _gram, _Layer, _LayerPlan, _squares
from ._record import (
    _explain_spent,
    _grads_after_hooks,
    _nested_params,
    _streamed_grads,
    _Use,
)
from ._rules import _Dense, _tiny, _tiny_share, _tiny_update

if TYPE_CHECKING:
    from ._recorder import PerExample


# .grad is read and written by one call at a time (threads sharing a model)
_APPLY = threading.Lock()


class _Run:
    """One call of ``gramian`` / ``backward``: validated at construction, before any pass."""

    def __init__(
        self,
        recorder: PerExample,
        losses: Any,
        inputs: Any,
        weighting: Any,
        call: str,
        check: CheckMode | None = None,
        *,
        diagonal: bool = False,
        replace: bool = False,
    ) -> None:
        self.recorder, self.call = recorder, call
        # G's diagonal alone: for the norms, or a weighting that declares it reads no more
        self.diagonal = diagonal or getattr(weighting, "reads_diagonal", False) is True
        self.replace = replace  # .grad = the update, where it is added to by default
        self.writes = False  # whether this call writes an update (set by `execute`)
        # the tiny layers formed together during the backward: their share of G (or of its
        # diagonal), summed (`_Stream.flush`)
        self.formed: torch.Tensor | None = None
        self.check = resolve_check(check, call)
        self.rule = _weighting.resolve(weighting, "params", call)
        if self.rule.needs_jacobian:
            raise ValueError(
                f"{call}: `weighting` {type(weighting).__name__} reads the (B, P) Jacobian of "
                "the per-example gradients, which the per-example path never forms (it works "
                "from the Gramian). Pass a Gramian weighting (UPGradWeighting(), "
                "MGDAWeighting(), UPGrad(), a callable Gramian -> weights)."
            )
        if not isinstance(losses, torch.Tensor) or losses.ndim != 1:
            raise ValueError(
                f"{call}: `losses` must be a 1-D tensor of per-example losses (one per example, "
                f"e.g. criterion(model(x), y) with reduction='none'), got {describe(losses)}. "
                "For a (B, k) tensor of k losses per example, pass losses.sum(1) or one task "
                "at a time."
            )
        if not losses.requires_grad or losses.grad_fn is None:
            raise ValueError(
                f"{call}: `losses` does not require grad: compute it from the hooked model's "
                "forward with grad enabled."
            )
        if losses.is_complex() or not losses.is_floating_point():
            raise TypeError(f"{call}: `losses` must be real floating point, got {losses.dtype}.")
        self.losses = losses
        self.batch = losses.shape[0]
        self.device = losses.device
        self.selected = self._select(inputs)
        self._inputs_given = inputs is not None
        # the graph's nodes outside the recorded calls (_recorded_uses' walk): their kinds
        # and saved arguments are part of the independence check's signature
        self.graph_nodes: list[Any] = []
        first = next(iter(self.selected), None)
        self.dtype = _weighting.work_dtype(first.dtype if first is not None else losses.dtype)

    def _select(self, inputs: Any) -> dict[torch.Tensor, str]:
        """Parameter -> its name, for the parameters whose gradients count."""
        model = self.recorder.model
        names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
        if inputs is None:
            return {p: n for p, n in names.items() if p.requires_grad}
        selected = {}
        for label, x in named_inputs(inputs, self.call):
            if x not in names:
                raise ValueError(
                    f"{self.call}: {label} is not a parameter of the hooked model "
                    f"({type(model).__name__}); per-example gradients exist only for the "
                    "parameters of the model given to funcgrad.per_example."
                )
            selected[x] = names[x]
        return selected

    def _collect(
        self,
        uses: list[_Use],
        retain_graph: bool,
        ready: Callable[[_Use], None] | None = None,
    ) -> None:
        """The ONE backward: every recorded call's output gradients Δ (no weight products).
        With ``ready``: each call handed to it as soon as its last Δ arrives, during the
        backward (`_Stream`), and no Δ held by the engine to the end."""
        edges = [e for use in uses for e in (*use.edges, *use.inner_edges)]
        slots: list[tuple[_Use, bool, int]] = []
        for use in uses:
            use.deltas = [None] * len(use.edges)
            use.inner_deltas = [None] * len(use.inner_edges)
            slots.extend((use, False, k) for k in range(len(use.edges)))
            slots.extend((use, True, k) for k in range(len(use.inner_edges)))
        left = {id(use): len(use.edges) + len(use.inner_edges) for use in uses}

        def arrived(i: int, grad: torch.Tensor | None) -> None:
            use, inner, k = slots[i]
            (use.inner_deltas if inner else use.deltas)[k] = grad
            left[id(use)] -= 1
            if not left[id(use)] and ready is not None:
                ready(use)

        self.recorder._recording = False
        try:
            if ready is None:
                deltas = _grads_after_hooks(self.losses, edges, retain_graph)
                for i, grad in enumerate(deltas):
                    arrived(i, grad)
            else:
                _streamed_grads(self.losses, edges, retain_graph, arrived)
        finally:
            self.recorder._recording = True

    # Execute ---------------------------------------------------------------------------

    def execute(self, retain_graph: bool, write: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # Autocast off: a caller's region is for its forward; under it the Gram products and
        # the norms would run in bf16/fp16 (and a clipped norm exceed C).
        with _weighting.no_autocast(self.device):
            return self._execute(retain_graph, write)

    def _execute(self, retain_graph: bool, write: bool) -> tuple[torch.Tensor, torch.Tensor]:
        recorder = self.recorder
        self.writes = write
        done: list[_Use] | None = None
        if write:  # every .grad to be written is checked before anything runs
            _sync.check_presets([(name, p) for p, name in self.selected.items()], self.call)
        try:
            try:
                uses = _recorded_uses(self)
            except ValueError:  # no record of this forward: say why, if known
                from ._recorder import _refuse_other_thread

                _refuse_other_thread(recorder, self.losses, self.call)
                _explain_spent(self.losses, self.call, recorder)
                raise
            _refuse_changed(self, uses)
            _refuse_hooks(self, uses)
            _refuse_parameter_hooks(self)
            _refuse_foreign_reads(self, uses)
            blocks = _blocks(self, uses)
            for block in blocks:
                for layer in block:
                    layer.precheck()
            due = _package._independence_due(self, blocks)  # see __init__
            probe = None if due is None else _probe(self, blocks)
            stream = None if due is not None or retain_graph else _Stream(self, blocks, write)
            self._collect(uses, retain_graph, None if stream is None else stream.ready)
            if probe is not None:
                _verify_independence(self, blocks, probe)
            recorder._recording = False  # functional calls of modules record nothing
            gram, weights, update = self._weigh(
                blocks, need_gramian=not write or self.rule.kind != "sum", write=write
            )
            if due is not None:
                _verify_materialised(self, blocks)
                recorder._independent.add(due)
            done = uses
        finally:
            recorder._recording = True
            if not retain_graph:  # consumed (and older forwards dropped)
                recorder._consume(done)
        if write:  # Apply: the one place that writes .grad (one thread at a time).
            with _APPLY:
                self._apply(update)
            # Post-accumulate-grad hooks fire once per leaf, on its final .grad: after the
            # lock is released (user code, which may call funcgrad again, never under it).
            _sync.post_accumulate(list({id(p): p for p, _ in update}.values()))
        return gram, weights

    def _apply(self, update: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``.grad`` written: replaced or accumulated (the hooks fire after, unlocked)."""
        if self.replace:
            for param in self.selected:
                param.grad = None
        for param, grad in update:
            _sync.accumulate(param, grad.to(param.dtype))

    def _weigh(
        self, blocks: list[list[_Layer]], need_gramian: bool, write: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        plans: list[_LayerPlan] = []
        finite = True
        if need_gramian:
            gram = _gramian(self, blocks)
            finite = _finite(gram)
            if not finite and _zero_unread(blocks):  # again, the rows no loss reads zeroed
                gram = _gramian(self, blocks)
                finite = _finite(gram)
        else:
            gram = torch.zeros(self.batch, self.batch, dtype=self.dtype, device=self.device)
        for block in blocks:
            plans.extend(layer.planned or layer.plan() for layer in block)
        self.recorder.plan = PerExamplePlan(self.batch, plans)
        if not finite:
            bad = (~torch.isfinite(gram.diagonal())).nonzero().flatten().tolist()
            raise ValueError(
                f"{self.call}: the Gramian of the per-example gradients is not finite"
                + (f": example(s) {bad} have NaN or inf gradients" if bad else " (overflow)")
                + ", so no weighting can be computed from it. Check those losses, or scale "
                "them down."
            )
        if self.rule.kind == "sum" or not write:
            weights = torch.ones(self.batch, dtype=self.dtype, device=self.device)
        elif type(self.rule.fn) is _Clip:  # ours: (B,) factors in (0, 1], finite as G is
            weights = self.rule.fn(gram.detach())  # (the norms it keeps are returned)
        else:
            weights = _weighting.weights_from_gramian(self.rule, gram, self.call, "example")
            if not values_readable([weights]) or not _finite(weights):  # (the message)
                weights = _weighting.check_finite(
                    weights, f"the {tuple(gram.shape)} Gramian", self.call
                )
        update: list[tuple[torch.Tensor, torch.Tensor]] = []
        if write:
            tiny: list[_Layer] = []
            for block in blocks:
                if len(block) == 1 and _tiny(block[0], self.diagonal):
                    tiny.append(block[0])  # together, below
                    continue
                for layer in block:
                    for name, grad in layer.update(weights).items():
                        update.append((layer.params[name], grad))
            if tiny:
                update.extend(_tiny_update(tiny, weights))
        return gram.detach(), weights.detach(), update


def _norms(gram: torch.Tensor) -> torch.Tensor:
    """The norms from G's diagonal, its squared norms clamped at 0 first: the ghost rule's
    ``<A_b A_bᵀ, Δ_b Δ_bᵀ>`` sums T² products and may round below 0 where the norm is tiny
    against ``‖A_b‖ ‖Δ_b‖`` (its absolute error is about eps·‖A_b‖²‖Δ_b‖²)."""
    return gram.diagonal().clamp_min(0).sqrt()


class _Clip:
    """Opacus's clipping factors, ``min(1, C / (‖g_b‖ + 1e-6))``, from G's diagonal alone;
    the norms kept (`norms`) for the call to return. `_Run._weigh` calls it directly, not
    through the checks of a user's weighting: its factors have the shape (B,) and G's dtype
    by construction, and are finite once G is (checked before)."""

    reads_diagonal = True

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.norms: torch.Tensor | None = None

    def __call__(self, gram: torch.Tensor) -> torch.Tensor:
        self.norms = _norms(gram)
        return (self.max_norm / (self.norms + 1e-6)).clamp(max=1.0)


def _finite(values: torch.Tensor) -> bool:
    """Whether every entry is finite, in one host read and one reduction: the sum is finite
    only where every entry is (NaN and inf carry into it); where finite entries overflow
    it, the entries themselves (``isfinite(x).all()`` costs four passes and their bools)."""
    values = values.detach()
    return math.isfinite(float(values.sum())) or bool(torch.isfinite(values).all())


# -- independence: loss b reads example b alone ----------------------------------------------
#
# The rules are exact when, for every layer whose parameters count, loss c depends on the
# layer's output Y only through Y[c]: then the one backward's Δ[b] is ∂L_b/∂Y[b], example b's
# own output gradient. Mixing the inputs before the first hooked layer is fine (it is data);
# mixing after a layer (h - h.mean(0), a sort, a pairwise loss...) puts ∂L_c/∂Y[b] into Δ[b].
# The check: one more backward, of Σ u_b L_b with random u, to the same outputs. For
# independent losses its Δ is u_b·Δ[b] row by row; a cross-example term shows as a row that


def _blocks(run: _Run, uses: list[_Use]) -> list[list[_Layer]]:
    """The layers (a module and its calls), grouped into blocks of layers that share a
    parameter: a block's parameters have their per-example gradients summed over its
    layers before their Gram."""
    by_module: dict[nn.Module, list[_Use]] = {}
    for use in uses:
        by_module.setdefault(use.module, []).append(use)
    layers: list[_Layer] = []
    for module, calls in by_module.items():
        cls = _layer_class(module)
        # its submodules' parameters that no nested call covers (out_proj in attention)
        recurse = cls in (_Generic, _Attention)
        params = {
            n: p
            for n, p in module.named_parameters(recurse=recurse)
            if p in run.selected and not any(p in _nested_params(use) for use in calls)
        }
        if params:
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and (
                module.scale_grad_by_freq or module.sparse
            ):
                raise ValueError(
                    f"{run.call}: module {run.recorder._names[module]!r} "
                    f"({type(module).__name__}) has "
                    "scale_grad_by_freq=True or sparse=True: its gradient is scaled by "
                    "counts over the whole batch (or sparse), which per-example gradients "
                    "do not sum to. Build it without those options."
                )
            layers.append(cls(run, module, calls, params))
    # Union of layers sharing a parameter.
    owner: dict[int, int] = {}
    parent = list(range(len(layers)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, layer in enumerate(layers):
        for p in layer.params.values():
            if id(p) in owner:
                parent[find(i)] = find(owner[id(p)])
            else:
                owner[id(p)] = i
    blocks: dict[int, list[_Layer]] = {}
    for i, layer in enumerate(layers):
        blocks.setdefault(find(i), []).append(layer)
    return list(blocks.values())


class _Stream:
    """Each layer processed as its last Δ arrives in the one backward, and its rows then let
    go, so that the layers' Δ and inputs are not all held at once (peak memory):

    - a call that writes nothing (``gramian``, ``per_example_norms``): the layer's block of
      G (or its share of G's diagonal) is formed there, then its inputs A and its Δ are
      dropped;
    - a call that writes: the norms' (B, C) per-example gradients are formed there (the
      update reads those), then their A and Δ are dropped; the other layers' A and Δ stay
      for the update ``Aᵀ (w ⊙ Δ)``, whose weights w need all of G first.

    Only single-layer blocks of the native rules whose rows all come from the one backward:
    not the generic rule (functional calls of its module), nor attention where its Δq, Δk,
    Δv need the recompute. A layer whose processing raises is left to the end, where the
    same rule runs again as it would have (and raises there, if it does).

    Tiny Linears (`_rules._tiny`: rows of at most `_TINY` elements) are not formed one by
    one: they wait, and are formed together (one product per shape, `_tiny_share`) once
    their rows reach `_TINY_HELD` elements, and the rest at the end of the call."""

    def __init__(self, run: _Run, blocks: list[list[_Layer]], write: bool) -> None:
        self.run, self.write = run, write
        self.waiting: dict[int, _Layer] = {}  # id(use) -> its layer
        self.left: dict[int, int] = {}  # id(layer) -> its calls whose Δ are still to come
        self.tiny: set[int] = set()  # id(layer), for the tiny layers
        self.pending: list[_Layer] = []  # tiny layers whose Δ arrived, not formed yet
        self.held = 0  # the elements of their rows
        for block in blocks:
            layer = block[0]
            if len(block) != 1 or not self.eligible(layer):
                continue
            self.left[id(layer)] = len(layer.uses)
            if not write and _tiny(layer, run.diagonal):
                self.tiny.add(id(layer))
            for use in layer.uses:
                self.waiting[id(use)] = layer

    def eligible(self, layer: _Layer) -> bool:
        from ._rules import _Dense, _Embedding, _Norm

        if self.write:
            return type(layer) is _Norm
        if isinstance(layer, _Attention):
            return all(use.inner_edges for use in layer.uses)
        return isinstance(layer, (_Dense, _Embedding, _Norm))

    def ready(self, use: _Use) -> None:
        """A call's last Δ arrived (in the backward: never raises)."""
        layer = self.waiting.pop(id(use), None)
        if layer is None:
            return
        self.left[id(layer)] -= 1
        if self.left[id(layer)]:
            return
        if id(layer) in self.tiny:
            self.pending.append(layer)
            assert isinstance(layer, _Dense)
            rows, width, out = layer.dims()
            self.held += layer.batch * rows * (width + out)
            if self.held >= _rules._TINY_HELD:
                self.flush()
            return
        try:
            self.process(layer)
        except Exception:  # left to the end: the rule runs again there
            layer.streamed = None
            return
        layer.release()

    def flush(self) -> None:
        """The tiny layers waiting: formed together, then let go. Where that raises, they
        are left to the end (formed there again, as a call without the stream would)."""
        pending, self.pending, self.held = self.pending, [], 0
        try:
            share = _tiny_share(pending, self.run.dtype, self.run.diagonal)
        except Exception:
            return
        formed = self.run.formed
        self.run.formed = share if formed is None else formed + share
        for layer in pending:
            layer.grouped = True
            layer.release()

    def process(self, layer: _Layer) -> None:
        from ._rules import _Dense

        if self.write:  # a norm: its (B, C) per-example gradients, kept for G and the update
            layer.per_example()
            return
        if isinstance(layer, _Dense):
            # its rows are let go once its block is formed, so the end's recompute (see
            # `_zero_unread`) cannot reach it: the rows no loss reads are zeroed in its input
            # always (a device-side pass, no host read), which adds exactly 0 where they are
            # finite and makes an inf or NaN there add nothing
            layer.zero_unread = True
        layer.streamed = layer.diagonal() if self.run.diagonal else layer.gramian()


def _zero_unread(blocks: list[list[_Layer]]) -> bool:
    """Where G came out not finite: the Linear / convolution layers' rows whose output
    gradient is all zeros (read by no loss) zeroed in their input from now on (G, the
    norms and the update), as the ghost Gramian skips them, so that an inf or an overflow
    there adds nothing on any path (torch's dense product gives NaN). Whether any layer
    changed (a layer formed during the backward had them zeroed already: `_Stream`)."""
    from ._rules import _Dense

    found = False
    for block in blocks:
        for layer in block:
            if isinstance(layer, _Dense) and not layer.zero_unread:
                layer.zero_unread, layer.kept, found = True, None, True
    return found


def _gramian(run: _Run, blocks: list[list[_Layer]]) -> torch.Tensor:
    """G, (B, B); or, where the call reads only its diagonal, ``diag(G)`` as a (B, B)
    matrix (the cross-example blocks are never formed)."""
    found = torch.zeros(run.batch, dtype=run.dtype, device=run.device)
    gram = None if run.diagonal else found.new_zeros(run.batch, run.batch)
    if run.formed is not None:  # tiny layers formed together during the backward
        if gram is None:
            found = found + run.formed
        else:
            gram = gram + run.formed
    tiny: list[_Layer] = []
    for block in blocks:
        if len(block) == 1 and block[0].grouped:  # in `run.formed`
            continue
        if len(block) == 1 and block[0].streamed is not None:  # formed during the backward
            if gram is None:
                found = found + block[0].streamed
            else:
                gram = gram + block[0].streamed
            continue
        if len(block) == 1 and _tiny(block[0], run.diagonal):
            tiny.append(block[0])
            continue
        if len(block) == 1:
            if gram is None:
                found = found + block[0].diagonal()
            else:
                gram = gram + block[0].gramian()
            continue
        summed: dict[int, torch.Tensor] = {}  # shared parameters: summed over the layers
        for layer in block:
            for name, g in layer.per_example().items():
                key = id(layer.params[name])
                summed[key] = summed[key] + g if key in summed else g
            layer.rule = "materialised, shares a parameter with " + ", ".join(
                other.name for other in block if other is not layer
            )
        for g in summed.values():
            if gram is None:
                found = found + _squares(g.to(run.dtype))
            else:
                gram = gram + _gram(g.to(run.dtype))
    if tiny:  # together: one product per shape
        share = _tiny_share(tiny, run.dtype, run.diagonal)
        if gram is None:
            found = found + share
        else:
            gram = gram + share
    if gram is None:
        return torch.diag(found)
    # exactly symmetric: the upper triangle mirrored (the materialised Grams, `_gram`,
    # form only it; a ghost block's square computed in full, a matmul's rounding, may
    # differ across the diagonal by ulps)
    upper = gram.triu(1)
    return upper + upper.T + torch.diag(gram.diagonal())
