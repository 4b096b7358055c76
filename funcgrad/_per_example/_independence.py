"""Independence: loss b reads example b alone.

The rules are exact when, for every layer whose parameters count, loss c depends on the
layer's output Y only through Y[c]: then the one backward's Δ[b] is ∂L_b/∂Y[b], example b's
own output gradient. Mixing the inputs before the first hooked layer is fine (it is data);
mixing after a layer (h - h.mean(0), a sort, a pairwise loss...) puts ∂L_c/∂Y[b] into Δ[b].
The check: one more backward, of Σ u_b L_b with random u, to the same outputs. For
independent losses its Δ is u_b·Δ[b] row by row; a cross-example term shows as a row that
differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import math
import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree

from ._generic import _bare_call, _buffers_kept, _Generic
from ._layer import _Layer
from ._record import _grads_after_hooks, _keys, _Use

if TYPE_CHECKING:
    from ._run import _Run

_PROBE_SEED = 20260  # u comes from its own generator: the user's random streams are untouched
_ALONE = 32  # examples run alone through a materialised module, at most


def _independence_due(run: _Run, blocks: list[list[_Layer]]) -> tuple[Any, ...] | None:
    """The call's signature when the independence check runs on it (the first call of the
    signature, or every call under check=True / "strict"), else None."""
    tested = [use for block in blocks for layer in block for use in layer.uses]
    if not tested or run.batch == 0:
        return None
    losses = run.losses
    parts: list[Any] = [
        tuple(losses.shape),
        losses.dtype,
        losses.device,
        type(losses.grad_fn).__name__,
        tuple(run.selected.values()),
        # train / eval changes what a module does (dropout drawn or not): a signature
        # checked in one mode is not checked in the other
        tuple(m.training for m in run.recorder.model.modules()),
        # the ops around the recorded calls, with their arguments: a term that mixes the
        # examples added after the checked call, under the same final op (out.roll(1, 0)),
        # or with the same ops on other dims (out.flip(0) after out.flip(1)), was unchecked
        _graph_signature(run.graph_nodes),
    ]
    for use in tested:
        leaves = _pytree.tree_leaves((use.args, use.kwargs))
        shapes = tuple((x.shape, x.dtype) for x in leaves if isinstance(x, torch.Tensor))
        parts.append((id(use.module), shapes, tuple(shape for _, shape, _ in use.outputs)))
    key = tuple(parts)
    checked = run.recorder._independent
    if run.check is False and key in checked:
        return None
    if len(checked) >= _SIGNATURES:  # (a scalar that changes on every call: bounded)
        checked.clear()
    return key


_SIGNATURES = 1024  # signatures held as checked, at most (then all are checked again)

# node type -> (its saved non-tensor arguments, its saved tensors): torch names a node's
# saved argument x `_saved_x`, and one that holds tensors also has `_raw_saved_x`
_SAVED: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}

# Nodes whose saved index tensors say which rows they read: their values, not only their
# shapes, decide whether the examples mix (out[perm], out.index_select(0, perm), a sort
# along the examples' dim). node type -> the attribute with the indices, and whether it
# takes them along `_saved_dim` ("dim"), along the dim of their position in a tuple of
# indices ("tuple"), or over the whole tensor ("all").
_INDEXERS: dict[str, tuple[str, str]] = {
    **{
        name: ("_saved_index", "dim")
        for name in (
            "IndexSelectBackward0",
            "GatherBackward0",
            "ScatterBackward0",
            "ScatterBackward1",
            "ScatterAddBackward0",
            "ScatterReduceBackward0",
            "IndexAddBackward0",
            "IndexCopyBackward0",
            "IndexReduceBackward0",
        )
    },
    **{
        name: ("_saved_indices", "dim")
        for name in (
            "SortBackward0",
            "SortBackward1",
            "TopkBackward0",
            "KthvalueBackward0",
            "MedianBackward1",
            "NanmedianBackward1",
            "ModeBackward0",
            "MaxBackward0",
            "MinBackward0",
            "CummaxBackward0",
            "CumminBackward0",
        )
    },
    "IndexBackward0": ("_saved_indices", "tuple"),
    "IndexPutBackward0": ("_saved_indices", "tuple"),
    "TakeBackward0": ("_saved_index", "all"),
    "EmbeddingBackward0": ("_saved_indices", "all"),
    "MaskedSelectBackward0": ("_saved_mask", "all"),
    "MaskedScatterBackward0": ("_saved_mask", "all"),
}
# Nodes whose saved 0-dim CPU tensor may be a Python number the loss multiplies by (torch
# wraps it in a tensor) or a scale kept as a tensor: `lam * out.mean(0)` with lam = 0 on the
# checked call mixes nothing. node type -> its operands' saved names, in the order of its
# inputs (`next_functions`): only an operand with no edge (a constant) is read, and only
# where no saved-tensor hook would run to read it (`_saved_constant`)
_SCALED: dict[str, tuple[str, ...]] = {
    "MulBackward0": ("self", "other"),
    "DivBackward0": ("self", "other"),
    "DivBackward2": ("self", "other"),
    "LerpBackward1": ("self", "end", "weight"),
}
# Nodes whose float weight takes one input alone at ±1 (held exactly there, `_bucket`)
_ENDS = frozenset({"LerpBackward0", "LerpBackward1"})


def _graph_signature(nodes: list[Any]) -> tuple[Any, ...]:
    """The graph's nodes around the recorded calls (`_recorded_uses`' walk), each as its
    kind and its saved non-tensor arguments (dims, sizes, flags; a float as `_bucket` holds
    it), plus what of its saved tensors can decide whether it mixes the examples and is
    read cheaply:

    - the index tensors of the nodes that read rows by index (`_INDEXERS`), where they
      index the examples' dim (dim 0: ``per_example`` takes ``batch_dim=0``) or the whole
      tensor: their contents, by a digest (one host read each on an accelerator). Indices
      along other dims (a class label picked by ``gather(1, y)`` or ``o[arange(B), y]``, a
      sequence position, even where that dim has the batch's size) are left out: they
      cannot move one example's row to another, and they change with every batch.
    - a 0-dim CPU tensor that is a constant operand of a ``mul``/``div`` (either one) or
      the tensor weight of a ``lerp`` (`_saved_constants`): whether it is 0 or ±1, its
      sign and its binary exponent, so that a term switched on from 0 (a loss weight that
      ramps up) or grown past the check's tolerance is checked again, and a scale that
      moves within one power of two is not.

    Other saved tensors (activations, masks of ``where`` and dropout, a mixing matrix) are
    not read: their values change with every batch (docs/reliability.md)."""
    parts: list[Any] = []
    for node in nodes:
        kind = type(node)
        names = _SAVED.get(kind)
        if names is None:
            attrs = dir(kind)
            held = {a[len("_raw") :] for a in attrs if a.startswith("_raw_saved_")}
            plain = tuple(a for a in attrs if a.startswith("_saved_") and a not in held)
            names = _SAVED[kind] = (plain, tuple(sorted(held)))
        plain, tensors = names
        if not plain and not tensors:
            parts.append(kind)
            continue
        try:
            ends = kind.__name__ in _ENDS
            entry: list[Any] = [kind, *(_frozen(getattr(node, a), ends) for a in plain)]
            if tensors:
                name = kind.__name__
                if name in _INDEXERS:
                    entry.append(_indices(node, *_INDEXERS[name]))
                elif name in _SCALED:
                    entry.extend(_saved_constants(node, _SCALED[name]))
        except RuntimeError:  # a saved tensor freed by an earlier backward: torch refuses later
            entry = [kind, "freed"]
        parts.append(tuple(entry))
    signature = tuple(parts)
    try:
        hash(signature)
    except TypeError:
        signature = _hashable(signature)
    return signature


def _frozen(value: Any, ends: bool = False) -> Any:
    """A saved argument as a value that equals itself: a float by its hex form (NaN equal
    to NaN); sizes and dims (tuples of ints, the common case) as they are."""
    kind = type(value)
    if kind is float:
        return _bucket(value, ends)
    if kind is list:
        return tuple(_bucket(v, ends) if type(v) is float else v for v in value)
    return value


def _bucket(number: float, ends: bool = False) -> Any:
    """A float as the signature holds it: exactly where it is 0 or not finite (a term
    switched off), or, with ``ends`` (a ``lerp`` weight, which at 1 takes the end alone),
    ±1; else its sign and its power of two. A float argument (a clamp bound, a slope, an
    exponent, a delta, a label smoothing, a scale) cannot move one example's row to
    another; what decides whether a term that mixes them is present is whether it is 0 (or
    1), and how large it is, for the check's tolerance. So a schedule that moves it within
    one power of two is one signature, checked once."""
    if number == 0 or (ends and abs(number) == 1) or not math.isfinite(number):
        return number.hex() if number == number else "nan"
    return (number > 0, math.frexp(number)[1])


def _hashable(value: Any) -> Any:
    """``value`` with whatever does not hash (a list inside a tuple) by its repr."""
    if isinstance(value, (tuple, list)):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _saved_constants(node: Any, operands: tuple[str, ...]) -> list[Any]:
    """The 0-dim CPU scales among ``node``'s constant operands (those with no edge in
    ``next_functions``), each as `_bucket` holds it. An operand that needs a gradient (an
    activation) is never read; a constant one is read only where torch keeps it without a
    saved-tensor hook (``_raw_saved_x.unpack_hook is None``): reading one saved under
    checkpointing would run the segment's forward again, under ``save_on_cpu`` copy it
    back. A hooked constant is held as "hooked", its value unseen (docs/reliability.md);
    a Python number, which torch wraps in a tensor and never hooks, is always read."""
    found: list[Any] = []
    for (edge, _), operand in zip(node.next_functions, operands):
        if edge is not None:
            continue
        raw = getattr(node, f"_raw_saved_{operand}", None)
        if raw is None:
            continue
        if raw.unpack_hook is not None:
            found.append((operand, "hooked"))
            continue
        found.append((operand, _scale(getattr(node, f"_saved_{operand}"), operand == "weight")))
    return found


def _scale(value: Any, ends: bool = False) -> Any:
    if not isinstance(value, torch.Tensor) or value.ndim or not value.is_cpu:
        return None
    try:
        number = float(value.detach())  # (not .item(): a host read HostReadCounter counts)
    except Exception:  # unreadable (a fake tensor): check the call
        return object()
    return _bucket(number, ends)


def _indices(node: Any, attr: str, how: str) -> tuple[Any, ...]:
    """The digest of ``node``'s index tensor along dim 0 (or over the whole tensor), read
    only where it takes that dim: an index along another dim is not unpacked (a saved
    tensor's unpack hook may run the forward of a checkpointed segment again)."""
    if how == "tuple":  # x[i0, i1, ...]: only i0 indexes the examples' dim
        raws = getattr(node, f"_raw{attr}")
        held = raws[0].unpack() if raws else None
        return () if held is None else ((0, _digest(held)),)
    if how == "dim":
        dim = node._saved_dim
        if dim < 0:
            sizes = getattr(node, "_saved_self_sym_sizes", None)
            ndim = len(sizes) if sizes is not None else getattr(node, attr).dim()
            dim %= max(ndim, 1)
        if dim != 0:
            return ()
    return ((0, _digest(getattr(node, attr))),)


def _digest(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The index values' digest; where they cannot be read (a tensor subclass, a fake or
    meta tensor), a new object, so that the signature is new and the call is checked."""
    try:
        data = tensor.detach().cpu().contiguous()
        blob: Any = data.numpy() if data.numel() else b""  # read in place, no copy
        digest: Any = hashlib.blake2b(blob, digest_size=16).digest()
    except Exception:  # any failure to read: check the call
        digest = object()
    return (tuple(tensor.shape), tensor.dtype, digest)


@dataclasses.dataclass
class _Probe:
    """What the check's backward of Σ u_b L_b found."""

    weights: torch.Tensor  # u, (B,)
    # each checked call, its layer, its Δ(u), and its Δ along all ones where the check ran
    # its own (user hooks held back), else None: compared with the one backward's
    deltas: list[tuple[_Use, _Layer, list[torch.Tensor | None], list[torch.Tensor | None] | None]]


@contextlib.contextmanager
def _hooks_held_back(run: _Run, uses: list[_Use]) -> Iterator[bool]:
    """Hold back, for the check's backward, the user hooks that funcgrad can find, so that
    each fires once per call, in the one backward: the tensor hooks on the losses and on the
    inputs and outputs of the recorded calls (their dicts, made at the call), and the full
    backward hooks and backward pre-hooks of the model's modules (torch's BackwardHook
    objects, found by the garbage collector's referrers, only where such hooks exist).
    Yields whether any was held back.

    The tensors among the losses and those inputs and outputs that retain their gradient
    (``h.retain_grad()``: torch's retains-grad hook cannot be held back) get their ``.grad``
    back as it was before the check's backward."""
    candidates = [run.losses, *(ref() for use in uses for ref in use.tensors)]
    retained = [
        (t, t.grad)
        for t in {id(t): t for t in candidates if t is not None}.values()
        if t.retains_grad
    ]
    dicts = [d for use in uses for d in use.hook_dicts]
    if run.losses._backward_hooks is not None:
        dicts.append(run.losses._backward_hooks)
    saved = [(d, list(d.items())) for d in {id(d): d for d in dicts}.values() if d]
    module_hooks = []
    modules = list(run.recorder.model.modules())
    globals_ = nn.modules.module
    if (
        globals_._global_backward_hooks
        or globals_._global_backward_pre_hooks
        or any(m._backward_hooks or m._backward_pre_hooks for m in modules)
    ):
        from torch.utils.hooks import BackwardHook

        mine = {id(m) for m in modules}
        for obj in gc.get_referrers(*modules):
            held = isinstance(obj, BackwardHook) and id(obj.module) in mine
            if held and (obj.user_hooks or obj.user_pre_hooks):
                module_hooks.append((obj, obj.user_hooks, obj.user_pre_hooks))
    try:
        for d, _ in saved:
            d.clear()
        for obj, _, _ in module_hooks:
            obj.user_hooks, obj.user_pre_hooks = [], []
        yield bool(saved or module_hooks)
    finally:
        for tensor, grad in retained:
            tensor.grad = grad
        for d, items in saved:
            d.update(items)
        for obj, hooks, pre_hooks in module_hooks:
            obj.user_hooks, obj.user_pre_hooks = hooks, pre_hooks


def _probe(run: _Run, blocks: list[list[_Layer]]) -> _Probe:
    """The extra backward, of Σ u_b L_b, to the outputs of the layers whose parameters count
    (no weight products), read as the one backward reads them (after the tensor hooks on
    those outputs); the graph is kept for the one backward that follows. u_b = ±2^k: for
    independent losses each row of Δ(u) is then u_b times the row of Δ exactly, as
    scaling by a power of two commutes with rounding (a gradient that is only rounding
    noise, behind a LayerNorm, stays exactly proportional).

    The user hooks that funcgrad finds are held back (`_hooks_held_back`): they fire once
    per call, and a hook that is not linear in the gradient (clipping) is no mixing. Where
    one was held back, the comparison is with a second backward along all ones, with the
    same hooks held back (the one backward applied them): one more backward."""
    tested = [(use, layer) for block in blocks for layer in block for use in layer.uses]
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    # 2K values ±2^k, each block of 2K examples a new permutation of them: two examples in
    # one block always get different weights (a cross term between them shows), with no
    # fixed period; float16 keeps k < 4 (its range is narrow).
    cpu = torch.device("cpu")  # the generator's device, whatever the default device is
    powers = 2.0 ** torch.arange(4 if run.losses.dtype == torch.float16 else 8, device=cpu)
    values = torch.cat([powers, -powers]).to(torch.float64)
    rounds = -(-run.batch // len(values))
    index = torch.cat(
        [torch.randperm(len(values), generator=generator, device=cpu) for _ in range(rounds)]
    )
    weights = values[index[: run.batch]].to(device=run.device, dtype=run.losses.dtype)
    edges = [e for use, _ in tested for e in use.edges]
    plain: tuple[torch.Tensor | None, ...] | None = None
    run.recorder._recording = False
    try:
        # its warnings are the one backward's, given there
        with _hooks_held_back(run, [u for u, _ in tested]) as held, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = _grads_after_hooks(run.losses, edges, True, weights)
            if held:
                plain = _grads_after_hooks(run.losses, edges, True)
    finally:
        run.recorder._recording = True
    probe = _Probe(weights, [])
    start = 0
    for use, layer in tested:
        stop = start + len(use.edges)
        probe.deltas.append(
            (
                use,
                layer,
                list(found[start:stop]),
                None if plain is None else list(plain[start:stop]),
            )
        )
        start = stop
    return probe


def _verify_independence(run: _Run, blocks: list[list[_Layer]], probe: _Probe) -> None:
    """Compare the probe's Δ with u_b times the one backward's Δ, row by row (along each
    output's batch dim); raise naming the mixed layer and the ops after it, before anything
    is written."""
    weights = probe.weights
    excess, relative, owners = [], [], []
    for use, layer, scaled, own in probe.deltas:
        for k, (plain, other) in enumerate(zip(use.deltas if own is None else own, scaled)):
            if plain is None or other is None:
                continue
            work = torch.float64 if plain.dtype == torch.float64 else torch.float32
            dim = layer.out_dim(use, k)
            a = plain.detach().movedim(dim, 0).reshape(run.batch, -1).to(work)
            b = other.detach().movedim(dim, 0).reshape(run.batch, -1).to(work)
            w = weights.to(work)[:, None]
            err = torch.addcmul(b, w, a, value=-1).norm(dim=1)  # one temporary
            scale = b.norm(dim=1) + w[:, 0].abs() * a.norm(dim=1)
            # Rounding is relative to each example's own row (independent rows are computed
            # from that example alone); a cross-example term is not.
            tol = math.sqrt(torch.finfo(plain.dtype).eps)
            excess.append((err - tol * (scale + 1e-6 * scale.max())).max())
            relative.append((err / scale.clamp_min(torch.finfo(work).tiny)).max().to(torch.float64))
            owners.append(use)
    if not excess:
        return
    flags = (torch.stack(excess) > 0).tolist()  # one read of the host for every layer
    dirty = [use for use, flag in zip(owners, flags) if flag]
    if not dirty:
        return
    worst = {id(use): float(r) for use, r, flag in zip(owners, relative, flags) if flag}
    tested = [use for block in blocks for layer in block for use in layer.uses]
    mixed, top, ops = _mixing_site(run, tested, {id(use) for use in dirty})
    names = run.recorder._names
    where = f"module {names.get(mixed.module)!r} ({type(mixed.module).__name__})"
    after = (
        "the losses"
        if top is None
        else (
            f"the input of module {names.get(top.module)!r} ({type(top.module).__name__}) (or "
            "inside that module's own forward)"
        )
    )
    ops = ops[::-1]  # met from the losses back: in forward order
    listed = (", ..., " if len(ops) > 12 else "") + ", ".join(ops[-12:])
    raise ValueError(
        f"{run.call}: the losses do not treat the examples independently: the output "
        f"gradient of {where} on example b also carries other examples' losses (a backward "
        "of sum_b u_b * losses[b] with random u differs from u_b times the plain one by up "
        f"to {worst.get(id(mixed), max(worst.values())):.2g} of an example's row), so its "
        "per-example gradients, G and the update would be wrong. The examples are mixed "
        f"between the output of {where} and {after}"
        + (f", by one of these ops (in forward order): {listed}" if listed else "")
        + ". The rules need loss b to depend on every hooked layer's output through row b "
        "alone: no reduction, normalisation, sort or permutation over dim 0 after a layer "
        "whose parameters count (h - h.mean(0), softmax(dim=0), batch statistics, h[perm], "
        "roll), no loss that reads other examples (pairwise, contrastive / InfoNCE), and "
        "every hooked layer with the examples along dim 0 (not time-major); mixing the "
        "inputs before the first layer is fine. Compute loss b from example b alone, or leave "
        "the parameters of the layers before the mixing out with inputs= (those after it "
        "stay exact), or use a per-example loop of torch.autograd.grad."
    )


def _verify_materialised(run: _Run, blocks: list[list[_Layer]]) -> None:
    """A module materialised by its functional call on each example alone (vmap or a loop)
    is exact only if its own forward treats the examples independently: its outputs on each
    example alone must be the rows of its output on the batch. Seen here: a module that
    mixes the examples inside its forward (batch statistics, a sort), where no hooked
    layer before it would show the mixing in its output gradients."""
    run.recorder._recording = False
    try:
        for block in blocks:
            for layer in block:
                if isinstance(layer, _Generic):
                    for use in layer.uses:
                        _compare_rows(run, layer, use)
    finally:
        run.recorder._recording = True


def _compare_rows(run: _Run, layer: _Layer, use: _Use) -> None:
    """One call's output on the batch against calls on single examples (all of them up to
    _ALONE, else _ALONE drawn by funcgrad's own generator): eager calls, as vmap would fall
    back to a slow loop for attention."""
    worst = _rows_differ(run, layer, use, None)
    state = [*layer.module.named_parameters(), *layer.module.named_buffers()]
    if worst is not None and any(
        t.is_floating_point() and t.dtype != torch.float64 for _, t in state
    ):
        # Rounding, not mixing? A float32 forward may cancel (h - h.mean(1) on large h) where
        # a single example's call rounds otherwise than the batch's: in float64 it decides.
        double = {n: t.double() if t.is_floating_point() else t for n, t in state}
        with contextlib.suppress(Exception):  # (one that cannot run in float64: as it was)
            worst = _rows_differ(run, layer, use, double)
    if worst is not None:
        raise ValueError(
            f"{run.call}: module {layer.name!r} ({type(layer.module).__name__}) does not "
            "treat the examples independently in its own forward: its output on each example "
            f"alone differs from its row of the output on the batch (by up to {worst:.2g} of "
            "a row, relative), so its per-example gradients, computed from calls on each "
            "example alone, would be wrong. It mixes the examples (a reduction, "
            "normalisation, sort or permutation over dim 0 inside it), or it takes an "
            "argument whose dim 0 has size B but is not per example (a (T, d) table with T "
            "== B: funcgrad splits every argument of size B along dim 0; make such a table "
            "a buffer or parameter of the module, or pass it as (1, T, d)). Make its "
            "forward treat each example alone, or leave its parameters out with inputs=."
        )


def _rows_differ(
    run: _Run, layer: _Layer, use: _Use, double: dict[str, torch.Tensor] | None
) -> float | None:
    """The worst relative difference between the module's rows on the batch and on single
    examples where it exceeds rounding (``double``: float64 copies of its parameters and
    buffers, run on float64 copies of the floating-point arguments); None where none does."""
    module = layer.module
    leaves, spec, dims = layer.leaf_dims(use)
    if double is not None:
        leaves = [
            x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for x in leaves
        ]
    batched = [i for i, dim in enumerate(dims) if dim is not None]
    positions = [i for i, _, _ in use.outputs]

    def call(values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        filled = list(leaves)
        for i, v in zip(batched, values):
            filled[i] = v
        args, kwargs = _pytree.tree_unflatten(filled, spec)
        # forward alone, as the rule's own calls: the user's forward hooks and backward
        # hooks are not run again (their effect is in the recorded output and gradients)
        flat = _pytree.tree_leaves(_bare_call(module, double, args, kwargs))
        return tuple(flat[i].detach() for i in positions)

    values = [leaves[i] for i in batched]
    narrow = [dims[i] for i in batched]
    if run.batch <= _ALONE:
        picked = list(range(run.batch))
    else:
        generator = torch.Generator().manual_seed(_PROBE_SEED)
        drawn = torch.randperm(run.batch, generator=generator, device=torch.device("cpu"))
        picked = sorted(drawn[:_ALONE].tolist())
    # As the recorded call (grad enabled: no inference fast paths); its warnings were given
    # by the user's forward already. The re-runs leave the random generators and the
    # module's buffers as they were.
    devices = [run.device] if run.device.type == "cuda" else []
    with (
        torch.enable_grad(),
        warnings.catch_warnings(),
        torch.random.fork_rng(devices=devices),
        _buffers_kept(module),
    ):
        warnings.simplefilter("ignore")
        whole = call(values)
        alone = [call([v.narrow(d, b, 1) for v, d in zip(values, narrow)]) for b in picked]
    index = torch.tensor(picked, device=run.device)
    outs = [layer.out_dim(use, k) for k in range(len(positions))]
    rows = [torch.cat(parts, dim).movedim(dim, 0) for parts, dim in zip(zip(*alone), outs)]
    whole = tuple(
        w.index_select(dim, index.to(w.device)).movedim(dim, 0) for w, dim in zip(whole, outs)
    )
    flags, relative = [], []
    for got, want in zip(rows, whole):
        tol = math.sqrt(torch.finfo(want.dtype).eps)
        work = torch.float64 if want.dtype == torch.float64 else torch.float32
        got = got.reshape(len(picked), -1).to(work)
        want = want.reshape(len(picked), -1).to(work)
        err = (got - want).norm(dim=1)
        scale = got.norm(dim=1) + want.norm(dim=1)
        flags.append((err - tol * (scale + 1e-6 * scale.max())).max())
        relative.append((err / scale.clamp_min(torch.finfo(work).tiny)).max())
    if not flags:
        return None
    bad = (torch.stack(flags) > 0).tolist()
    if not any(bad):
        return None
    return max(float(r) for r, flag in zip(relative, bad) if flag)


def _mixing_site(
    run: _Run, tested: list[_Use], dirty: set[int]
) -> tuple[_Use, _Use | None, list[str]]:
    """Where the examples mix: the stretch of graph between a point whose output gradients
    are clean (the losses, or the input of a checked layer that is clean) and a checked
    layer's mixed output, with the ops met on the way (by the graph's node names)."""
    by_edge = {key: use for top in run.recorder._uses for use in top.walk() for key in _keys(use)}
    starts: list[tuple[_Use | None, list[tuple[Any, int]]]] = [(None, [(run.losses.grad_fn, -1)])]
    for use in reversed(tested):
        if id(use) not in dirty:
            starts.append((use, [(e.node, e.output_nr) for e in use.upstream]))
    for top, stack in starts:
        ops: list[str] = []
        seen: set[Any] = set()
        hit: _Use | None = None
        while stack:
            node, nr = stack.pop(0)
            end = by_edge.get((node, nr))
            if end is not None:  # a recorded call's output: the stretch ends there
                if id(end) in dirty and hit is None:
                    hit = end
                continue
            if node in seen:
                continue
            seen.add(node)
            if getattr(node, "variable", None) is None:
                name = _op_name(node)
                if name not in ops and name != "backward_hook_function":  # a module hook's
                    ops.append(name)
            stack.extend((nxt, i) for nxt, i in node.next_functions if nxt is not None)
        if hit is not None:
            return hit, top, ops
    first = next(use for use in tested if id(use) in dirty)
    return first, None, []


def _op_name(node: Any) -> str:
    """``MeanBackward1`` -> ``mean``, ``NativeBatchNormBackward0`` -> ``native_batch_norm``."""
    name = re.sub(r"Backward\d*$", "", type(node).__name__).strip("_")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
