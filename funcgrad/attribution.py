"""Attribution with many targets: every target token's attribution from one forward.

``token_attr`` gives captum 0.9's ``LLMGradientAttribution(...).token_attr`` (one row per
target, one column per prompt token) with the model run once (once per integration step,
batched), not once per target: `funcgrad.compose_heads` of the model, fed its embedding
layer's output (a forward hook substitutes it, as captum's layer methods do), and the
targets' teacher-forced log-probabilities. In a causal LM position i reads positions
``<= i``, so the forward of ``prompt + targets[:-1]`` gives at position ``L_in + i - 1``
captum's logits (and gradients) of ``prompt + targets[:i]``.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeAlias, TypedDict, Unpack, cast, overload

import numpy as np
import torch

from . import _linearize, _memory
from ._errors import ForwardModeNoGradError, FuncgradWarning, describe
from ._heads import ComposedHeads, Composition, stacked_heads
from ._types import ChunkSize
from ._validate import check_chunk_size, check_not_inference_mode, outside_transforms

__all__ = ["AttributionPlan", "Method", "Mode", "plan", "token_attr"]

Method: TypeAlias = Literal["gradient", "grad_x_input", "integrated_gradients"]
"""What `token_attr` computes, each as a captum method under ``LLMGradientAttribution``:

- ``"gradient"``: ``LayerGradientXActivation(model, emb, multiply_by_inputs=False)``, the
  gradient of each target's log-probability with respect to each prompt embedding, summed
  over the embedding dimension;
- ``"grad_x_input"``: ``LayerGradientXActivation(model, emb)``, gradient times embedding,
  summed;
- ``"integrated_gradients"``: ``LayerIntegratedGradients(model, emb)`` with
  ``n_steps`` Gauss-Legendre steps from the baseline token's embedding, summed.
"""
Mode: TypeAlias = Literal["auto", "reverse", "forward"]
"""How the T x L_in attributions are formed: ``"reverse"``, T cotangents pulled back through
the model in one batched backward; ``"forward"``, L_in directional derivatives (one per prompt
token) in one batched forward-mode pass; ``"auto"``, forward mode where ``2.5 L_in < T``
(measured: the two cross near there) and it runs (fused attention kernels have no
forward-mode rule), else reverse mode."""

METHODS: tuple[Method, ...] = ("gradient", "grad_x_input", "integrated_gradients")
MODES: tuple[Mode, ...] = ("auto", "reverse", "forward")
_CALL = "funcgrad.attribution.token_attr(model, input_ids, target_ids)"
FORWARD_FACTOR = 2.5  # "auto": forward mode where FORWARD_FACTOR x L_in < T (`_choose`)
_PLAN_CALL = "funcgrad.attribution.plan(model, input_ids, target_ids)"

# Per model, weakly: forward mode failed (with the training flag then: "auto" takes reverse
# mode in that flag from then on); checked causal (`_check_causal`); the output layer did not
# give the returned logits (a soft-cap after it: the heads read the logits from then on);
# the last _COMPOSED_PER_MODEL composed functions per shapes (what compose_heads learns on a
# first call serves the later ones).
_NO_FORWARD: weakref.WeakKeyDictionary[torch.nn.Module, tuple[bool, str]]
_NO_FORWARD = weakref.WeakKeyDictionary()
_CAUSAL: weakref.WeakKeyDictionary[torch.nn.Module, _Probed] = weakref.WeakKeyDictionary()
_LOGITS_ONLY: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
_COMPOSED: weakref.WeakKeyDictionary[
    torch.nn.Module,
    collections.OrderedDict[
        tuple[Any, ...], tuple[weakref.ref[torch.nn.Module], Callable[..., Any]]
    ],
]
_COMPOSED = weakref.WeakKeyDictionary()
_COMPOSED_PER_MODEL = 16
_LOCK = threading.RLock()  # one call at a time, whatever the model (`_claimed`)
_BUSY: dict[int, torch.nn.Module] = {}  # the hooked modules of the calls running, by id


def _layer(model: torch.nn.Module, getter: str) -> torch.nn.Module | None:
    """``model.<getter>()`` where the model has it and it returns a module, else None."""
    get = getattr(model, getter, None)
    layer = get() if callable(get) else None
    return layer if isinstance(layer, torch.nn.Module) else None


def _hooked_layers(args: _Args) -> list[tuple[str, torch.nn.Module]]:
    """The layers a call hooks, named: the embedding layer, and the output layer if any."""
    output_layer = _layer(args.model, "get_output_embeddings")
    layers = [("embedding", args.embedding)]
    return layers if output_layer is None else [*layers, ("output layer", output_layer)]


@contextlib.contextmanager
def _claimed(args: _Args) -> Iterator[None]:
    """Runs one call alone: its module hooks run in every thread and for every model sharing
    the layers (a wrapper and its base, PEFT), so all calls share one re-entrant lock (one
    per model let a wrapper and its base race, and deadlocks two models calling each other);
    a call on a module of a call still running (from its forward) is refused."""
    modules = [args.model, *(layer for _, layer in _hooked_layers(args))]
    with _LOCK:
        busy = [module for module in modules if id(module) in _BUSY]
        if busy:
            raise RuntimeError(
                f"{_CALL}: called again on {type(busy[0]).__name__} while a call on it (or a "
                "model sharing its embedding or output layer) is running, from the model's "
                "forward or a hook: that call hooks those layers during its forward, and the "
                "inner call would run its hooks (all zeros). Call token_attr after the outer "
                "call returns."
            )
        added = {id(module): module for module in modules}
        _BUSY.update(added)
        try:
            yield
        finally:
            for key in added:
                del _BUSY[key]


@dataclasses.dataclass(frozen=True)
class AttributionPlan:
    """What `token_attr` runs for given shapes, and what captum would run.

    Attributes:
        mode: ``"reverse"`` or ``"forward"`` (never ``"auto"``).
        method: the attribution method.
        targets: T, the number of target tokens.
        prompt: L_in, the number of prompt tokens.
        rows: sequences in the one batched forward (``n_steps`` for integrated
            gradients, else 1), each ``L_in + T - 1`` tokens long.
        directions: what goes through the model after that forward: T cotangents (reverse
            mode) or L_in tangents (forward mode, computed with the forward).
        captum_forwards: the forwards captum's loop runs for the same answer, each of a batch
            of ``rows`` sequences: T (gradient, grad x input) or 3 T (integrated gradients:
            the input, the baseline and the ``n_steps`` scaled inputs for each target).
        why: the reason for the mode.
        heads_read: where the heads (of the largest group, see ``forwards``) split from
            the model: the input of its output layer (``get_output_embeddings()``; head i
            applies the layer to its own position: d-wide cotangents), or the logits (no
            output layer, one that is not a plain ``torch.nn.Linear`` without hooks, or one
            whose output the model changes: vocabulary-wide cotangents).
        chunk_size: the most cotangents pulled back together (`funcgrad.compose_heads`'
            argument): None in forward mode; 1 for integrated gradients on the CPU under
            ``"auto"`` (a loop: each pull is already a batch of ``n_steps`` sequences).
        forwards: the forwards of the model `token_attr` runs, each of ``rows`` sequences:
            1, or in reverse mode where T is well above L_in, a few groups of consecutive
            targets, each group's forward on its own prefix (so that the heads' backward
            runs over a shorter sequence, as captum's prefixes do).
        elementwise: the names (in ``model.named_modules()``) of the activation modules
            known to be elementwise, whose backward of the T cotangents (or forward-mode
            rule for the L_in tangents) runs as ONE product by their derivative, computed
            once per forward: exact types from an allow-list (torch's ``GELU``, ``SiLU``,
            ``ReLU``, ``Tanh``, ``Sigmoid``; transformers' GELU and SiLU activations) as
            their library wrote them, without hooks (docs/attribution.md lists what keeps a
            module on its own rules).
    """

    mode: Literal["reverse", "forward"]
    method: Method
    targets: int
    prompt: int
    rows: int
    directions: int
    captum_forwards: int
    why: str
    heads_read: str
    chunk_size: ChunkSize
    forwards: int
    elementwise: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Args:
    """The validated arguments of one call."""

    model: torch.nn.Module
    embedding: torch.nn.Module
    input_ids: torch.Tensor  # (L_in,), on the embedding's device
    target_ids: torch.Tensor  # (T,)
    kept: torch.Tensor | None  # (L_in,) bool: the prompt tokens not skipped; None: all
    method: Method
    n_steps: int
    baseline_id: int
    # The heads are targets[first:]; the earlier targets are only read (teacher forcing).
    first: int = 0


def _ids(value: object, name: str, call: str) -> torch.Tensor:
    """A 1-D int64 copy of token ids given as a (n,) or (1, n) tensor or a sequence of ints."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise TypeError(
                f"{call}: `{name}` must be a 1-D tensor of token ids or a sequence of ints, "
                f"got a {type(value).__name__} holding {sorted({type(v).__name__ for v in value})}."
            )
        value = torch.tensor(list(value), dtype=torch.long, device="cpu")
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{call}: `{name}` must be a 1-D tensor of token ids (int64), got {describe(value)}."
        )
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(
            f"{call}: `{name}` must hold integer token ids (torch.long), got {describe(value)}. "
            "Pass the tokenizer's ids, e.g. `tokenizer.encode(text, return_tensors='pt')`."
        )
    if value.dim() == 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 1:
        raise ValueError(
            f"{call}: `{name}` must have shape (n,) or (1, n) (one sequence), got "
            f"{describe(value)}. Attribute one sequence per call."
        )
    return value.to(dtype=torch.long, copy=True)  # (the user's tensor is never held)


def _validate(
    model: object,
    input_ids: object,
    target_ids: object,
    method: object,
    n_steps: object,
    embedding: object,
    mode: object,
    chunk_size: object,
    call: str,
    baseline_id: object = 0,
    skip_ids: object = (),
) -> tuple[_Args, Mode]:
    check_not_inference_mode(call)
    check_chunk_size(chunk_size, call)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{call}: `model` must be a torch.nn.Module (its embedding layer is hooked), got "
            f"{describe(model)}."
        )
    if method not in METHODS:
        raise ValueError(f"{call}: `method` must be one of {METHODS}, got {method!r}.")
    if mode not in MODES:
        raise ValueError(f"{call}: `mode` must be one of {MODES}, got {mode!r}.")
    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise ValueError(f"{call}: `n_steps` must be a positive int, got {n_steps!r}.")
    if not isinstance(baseline_id, int) or isinstance(baseline_id, bool):
        raise TypeError(f"{call}: `baseline_id` must be an int token id, got {baseline_id!r}.")
    if embedding is None:
        embedding = _layer(model, "get_input_embeddings")
        if embedding is None:
            raise ValueError(
                f"{call}: `model` has no `get_input_embeddings()` returning a module: pass "
                "`embedding=`, the layer whose output is attributed (e.g. `model.embed`)."
            )
    elif not isinstance(embedding, torch.nn.Module):
        raise TypeError(
            f"{call}: `embedding` must be the model's embedding layer (a torch.nn.Module), got "
            f"{describe(embedding)}."
        )
    inputs = _ids(input_ids, "input_ids", call)
    targets = _ids(target_ids, "target_ids", call)
    if len(inputs) == 0:
        raise ValueError(f"{call}: `input_ids` is empty; the first target needs a prompt.")
    if len(targets) == 0:
        raise ValueError(f"{call}: `target_ids` is empty (T = 0); give at least one target token.")
    skips = _ids(skip_ids, "skip_ids", call)
    config = getattr(model, "config", None)
    positions = getattr(config, "n_positions", None) or getattr(
        config, "max_position_embeddings", None
    )
    length = len(inputs) + len(targets) - 1
    if isinstance(positions, int) and length > positions:
        raise ValueError(
            f"{call}: the teacher-forced sequence (prompt + targets[:-1]) has {length} tokens, "
            f"more than the model's {positions} positions (its config). Shorten the prompt or "
            "the targets."
        )
    vocabulary = getattr(embedding, "num_embeddings", None)
    for name, ids in (("input_ids", inputs), ("target_ids", targets)):
        if len(ids) and (int(ids.min()) < 0 or (vocabulary and int(ids.max()) >= vocabulary)):
            expected = (
                f"in [0, {vocabulary}), the embedding's vocabulary"
                if vocabulary
                else ("non-negative")
            )
            raise ValueError(
                f"{call}: `{name}` must hold token ids {expected}, got ids from "
                f"{int(ids.min())} to {int(ids.max())}."
            )
    if method == "integrated_gradients" and vocabulary and not 0 <= baseline_id < vocabulary:
        raise ValueError(
            f"{call}: `baseline_id` must be a token id in [0, {vocabulary}), got {baseline_id}."
        )
    weight = next(embedding.parameters(), None)
    device = weight.device if weight is not None else inputs.device
    inputs, targets = inputs.to(device), targets.to(device)
    kept = None
    if len(skips):
        kept = ~torch.isin(inputs, skips.to(device))
        if not bool(kept.any()):
            raise ValueError(f"{call}: `skip_ids` skips every prompt token; nothing is left.")
    args = _Args(
        model, embedding, inputs, targets, kept, cast(Method, method), n_steps, baseline_id
    )
    return args, cast(Mode, mode)


def _quadrature(args: _Args) -> tuple[list[float], list[float]]:
    """(alphas, step sizes) as captum's ``gausslegendre``, its step sizes rounded to float32
    as captum rounds them, whatever the model's dtype."""
    if args.method != "integrated_gradients":
        return [1.0], [1.0]
    nodes, weights = np.polynomial.legendre.leggauss(args.n_steps)
    alphas = (0.5 * (1 + nodes)).tolist()
    steps = torch.tensor((0.5 * weights).tolist(), device="cpu").float().tolist()
    return alphas, steps


def _choose(
    args: _Args, mode: Mode, gradients: bool, call: str
) -> tuple[Literal["reverse", "forward"], str]:
    prompt, targets = len(args.input_ids), len(args.target_ids)
    if gradients:
        if mode == "forward":
            raise ValueError(
                f"{call}: `return_gradients=True` needs mode='reverse' (or 'auto'): forward "
                "mode forms the attributions, summed over the embedding dimension, directly."
            )
        return "reverse", "return_gradients=True: the (T, L_in, d) gradients come from reverse mode"
    hooked = _backward_hooked(args)
    if mode == "forward" and hooked is not None:
        raise ValueError(
            f"{call}: mode='forward' never runs module backward hooks, and {hooked} is "
            "registered: it changes the gradients that reverse mode (and captum) computes. "
            "Use mode='reverse' (or 'auto', which takes it), or remove the hook."
        )
    if mode != "auto":
        return mode, f"mode={mode!r} requested"
    if hooked is not None:
        return "reverse", f"{hooked} is registered, which forward mode never runs"
    record = _NO_FORWARD.get(args.model)
    failed = record[1] if record is not None and record[0] == args.model.training else None
    if FORWARD_FACTOR * prompt < targets and failed is None:
        return "forward", (
            f"{FORWARD_FACTOR:g} x L_in = {FORWARD_FACTOR * prompt:g} < T = {targets}: L_in "
            "tangents, not T cotangents"
        )
    if failed is not None:
        return "reverse", f"forward mode failed on this model before ({failed})"
    return "reverse", (
        f"T = {targets} <= {FORWARD_FACTOR:g} x L_in = {FORWARD_FACTOR * prompt:g}: T "
        "cotangents, not L_in tangents"
    )


def _backward_hooked(args: _Args) -> str | None:
    """The module backward hook (full or pre; the model's, its layers' or global) registered,
    or None: reverse mode runs them (as captum does), forward mode never does."""
    hooks = torch.nn.modules.module
    if hooks._global_backward_hooks or hooks._global_backward_pre_hooks:
        return "a global module backward hook"
    extra = _hooked_layers(args)
    modules = (*args.model.modules(), *(m for _, m in extra))
    if not any(m._backward_hooks or m._backward_pre_hooks for m in modules):
        return None  # (the common case, without the names)
    for name, module in (*args.model.named_modules(), *extra):
        if module._backward_hooks or module._backward_pre_hooks:
            return f"a backward hook on `{name or 'model'}` ({type(module).__name__})"
    return None  # (only where a hook was removed meanwhile, by another thread)


def _logits(output: object, call: str) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, tuple | list) and output else output
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(
            f"{call}: the model must return logits of shape (batch, length, vocabulary), as a "
            f"tensor, the first of a tuple, or `.logits`; got {describe(logits)}."
        )
    return logits


_SIMPLE = (bool, int, float, str, type(None))  # attributes the fingerprints compare by value


class _Same:
    """An object by identity without keeping it alive: a weak reference where it takes one,
    else its ``id`` and type."""

    __slots__ = ("key", "ref")

    def __init__(self, obj: Any) -> None:
        self.key = (id(obj), type(obj))
        try:
            self.ref: Any = weakref.ref(obj)
        except TypeError:
            self.ref = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same) or self.key != other.key:
            return False
        if self.ref is None or other.ref is None:
            return self.ref is other.ref
        mine = self.ref()
        return mine is not None and mine is other.ref()

    __hash__ = None  # type: ignore[assignment]


# A namespace is compared on its names of these types (not a loop variable, nor ``Out``).
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type, functools.partial)
_IGNORED = frozenset({"training", "use_cache"})  # (the probe runs in eval mode, without cache)


def _code_names(namespace: dict[str, Any]) -> dict[str, _Same]:
    return {k: _Same(v) for k, v in namespace.items() if isinstance(v, _CODE)}


@dataclasses.dataclass
class _Probed:
    """What the causal probe saw of a model (`_check_causal`): `_structure`, `_attributes`
    and `_namespaces` (each with its live dict), holding nothing alive."""

    structure: tuple[Any, ...]
    attributes: tuple[Any, ...]
    namespaces: list[tuple[Any, dict[str, _Same]]]

    def same_namespaces(self) -> bool:
        """Whether the namespaces' code names still hold the same objects (by identity), no
        name added."""
        return all(_code_names(live) == names for live, names in self.namespaces)


def _modules(args: _Args) -> list[torch.nn.Module]:
    modules = list(args.model.modules())
    return modules if args.embedding in modules else [*modules, args.embedding]


def _structure(modules: list[torch.nn.Module]) -> tuple[Any, ...]:
    """What the model runs, cheap to read on every call: each module (weakly), its type and
    forwards, its and the global forward (pre-)hooks, and its buffers (`_tensor`)."""
    hooks = torch.nn.modules.module
    return (
        tuple(hooks._global_forward_hooks),
        tuple(hooks._global_forward_pre_hooks),
        tuple(
            (
                _Same(module),
                type(module),
                type(module).forward,
                _Same(module.__dict__.get("forward")),
                tuple((k, _Same(h)) for k, h in module._forward_hooks.items()),
                tuple((k, _Same(h)) for k, h in module._forward_pre_hooks.items()),
                tuple(_tensor(b) for b in module._buffers.values() if b is not None),
            )
            for module in modules
        ),
    )


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor by identity (weakly) and `_storage` (``t.data = other`` keeps the first)."""
    return (_Same(t), *_storage(t))


def _storage(t: torch.Tensor) -> tuple[Any, ...]:
    """Version, storage address, shape and strides; the type alone where there is no address
    (an uninitialized lazy parameter or buffer, a sparse tensor)."""
    if (
        isinstance(t, (torch.nn.UninitializedParameter, torch.nn.UninitializedBuffer))
        or t.layout != torch.strided
    ):
        return (type(t),)
    return (type(t), t._version, t.data_ptr(), t.shape, t.stride(), t.storage_offset())


def _attributes(model: torch.nn.Module, modules: list[torch.nn.Module]) -> tuple[Any, ...]:
    """The plain attributes of every module and of ``config`` (``attn.is_causal = False``),
    and every `_parameter` (a learned mixing matrix can turn non-causal): dearer than
    `_structure`, read in forward mode only (reverse mode checks every call: `_future_leak`)."""
    config = getattr(model, "config", None)
    owners = [*modules, config] if config is not None else modules
    return tuple(
        tuple(
            (k, v if type(v) in _SIMPLE else _tensor(v))
            for k, v in vars(owner).items()
            if (type(v) in _SIMPLE or isinstance(v, torch.Tensor)) and k not in _IGNORED
        )
        for owner in owners
        if hasattr(owner, "__dict__")
    ) + tuple(
        _parameter(name, p)
        for module in modules
        for name, p in module._parameters.items()
        if p is not None
    )


def _parameter(name: str, p: torch.Tensor) -> tuple[Any, ...]:
    """A parameter by name, ``id`` and `_storage`, with no weak reference (which
    ``torch.utils.swap_tensors`` refuses). A write that skips the version counter
    (``p.data.add_``, a fused CPU optimizer) is not seen."""
    return (name, id(p), *_storage(p))


def _namespaces(modules: list[torch.nn.Module]) -> list[tuple[Any, dict[str, _Same]]]:
    """``torch``, ``torch.nn.functional``, ``torch.Tensor`` and the Python module of each of
    the model's module classes, each with a copy of its code names (`_code_names`)."""
    sources: dict[int, Any] = {}
    for owner in (torch, torch.nn.functional, torch.Tensor):
        sources[id(owner)] = owner
    for module in modules:
        source = sys.modules.get(type(module).__module__)
        if source is not None:
            sources.setdefault(id(source), source)
    lives = [vars(source) for source in sources.values()]
    return [(live, _code_names(live)) for live in lives]


def _check_rope_threshold(model: torch.nn.Module, shortest: int, longest: int) -> None:
    """Refuses, from the config, a ``longrope`` or ``dynamic`` rotary embedding whose
    threshold length (past which every position's frequencies change) falls among captum's
    prefix lengths, ``shortest`` to ``longest`` (the probe's lengths cannot see it)."""
    config = getattr(model, "config", None)
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or rope.get("rope_type") not in ("longrope", "dynamic"):
        return
    threshold = rope.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if threshold is None:
        threshold = getattr(config, "max_position_embeddings", None)
    if isinstance(threshold, int) and shortest <= threshold < longest:
        raise ValueError(
            f"{_CALL}: the model's rotary embedding (config.rope_parameters['rope_type'] = "
            f"{rope.get('rope_type')!r}) changes its frequencies past "
            f"original_max_position_embeddings = {threshold} tokens, and captum's prefixes "
            f"(lengths {shortest} to {longest}) fall on both sides of it: one teacher-forced "
            "forward does not give their answers. Split the targets at that length, or "
            "run captum's loop."
        )


def _check_causal(args: _Args, mode: Literal["reverse", "forward"]) -> None:
    """Refuses a model whose logits at position i read positions after i. The probe: three
    forwards without gradients, in eval mode (flags restored), of ``prompt + targets[:-1]``,
    of it with its last token changed and of it without its last token; the earlier logits
    must not move. Run on a model's first call and whenever `_structure` (in forward mode also
    `_attributes`, `_namespaces`) changed since (reverse mode also checks `_future_leak`)."""
    model = args.model
    sequence = torch.cat([args.input_ids, args.target_ids[:-1]])
    _check_rope_threshold(model, len(args.input_ids), len(sequence))
    if len(sequence) < 2:
        return
    modules = _modules(args)
    structure = _structure(modules)
    seen = _CAUSAL.get(model)
    if seen is not None and seen.structure == structure:
        if mode == "reverse":
            return
        if seen.attributes == _attributes(model, modules) and seen.same_namespaces():
            return
    probed = _Probed(structure, _attributes(model, modules), _namespaces(modules))
    _CAUSAL.pop(model, None)
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            before = _logits(model(sequence[None]), _CALL)
            vocabulary = getattr(args.embedding, "num_embeddings", None) or before.shape[-1]
            changed = sequence.clone()
            changed[-1] = (changed[-1] + 1) % vocabulary
            after = _logits(model(changed[None]), _CALL)
            shorter = _logits(model(sequence[None, :-1]), _CALL)
    finally:
        for module, flag in flags:
            module.training = flag
    earlier = before[0, :-1]
    if earlier.shape != after[0, :-1].shape or earlier.shape != shorter[0].shape:
        return  # (the logits' shape checks name this on the call itself)
    # (a changed last token: bitwise the same earlier logits, so `_tolerance`; the shorter
    # sequence runs other blocking: 1000 eps of the dtype, see docs/attribution.md)
    scale = float(earlier.abs().max())
    changed_gap = float((earlier - after[0, :-1]).abs().max())
    shorter_gap = float((earlier - shorter[0]).abs().max())
    gap = max(changed_gap, shorter_gap)
    if not (
        changed_gap <= _tolerance(earlier.dtype) * max(scale, 1.0)
        and shorter_gap <= 1e3 * torch.finfo(earlier.dtype).eps * max(scale, 1.0)
    ):
        raise ValueError(
            f"{_CALL}: the model is not causal: changing the last token of prompt + "
            f"targets[:-1], or leaving it out, moved the logits at earlier positions (by up "
            f"to {gap:.3g}, against logits up to {scale:.3g}). One teacher-forced forward "
            "equals captum's prefix "
            "forwards only where position i reads positions <= i (a causal LM: GPT-2, Llama). "
            "For a bidirectional model (BERT), run captum's loop, or `funcgrad.compose_heads` "
            "on each prefix's forward."
        )
    _CAUSAL[model] = probed


def _seen_after(args: _Args, mode: Literal["reverse", "forward"]) -> None:
    """After a call's forwards, record what the model changed itself during them (a counter,
    a hook), so that only changes between calls trigger a new probe."""
    seen = _CAUSAL.get(args.model)
    if seen is not None:
        modules = _modules(args)
        seen.structure = _structure(modules)
        if mode == "forward":
            seen.attributes = _attributes(args.model, modules)
            seen.namespaces = [(live, _code_names(live)) for live, _ in seen.namespaces]


def _tolerance(dtype: torch.dtype) -> float:
    """1000 eps of ``dtype``, at most float32's (a causal model's exact zeros stay exact in
    bf16/fp16, whose own 1000 eps would let anything through)."""
    return 1e3 * min(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps)


def _future_leak(grads: torch.Tensor, prompt: int, first: int) -> torch.Tensor:
    """Reverse mode's causality check on every call, a 0-dim bool tensor: whether a head of
    ``targets[first:]`` (head i at position ``prompt + first + i - 1``) has a gradient at a
    later position above `_tolerance` of the largest after ``prompt + first``; ``grads`` is
    (heads, length, d). A causal model's are exact zeros."""
    start = prompt + first  # (the first position after any head's own)
    heads, length = grads.shape[:2]
    if length <= start:
        return torch.zeros((), dtype=torch.bool, device=grads.device)
    g = grads.detach()[:, start:].abs().amax(-1)  # (heads, length - start)
    own = torch.arange(heads, device=g.device)  # (head i's own position, less start + 1)
    later = torch.arange(length - start, device=g.device)[None, :] >= own[:, None]
    leak = torch.where(later, g, 0).amax()
    return leak > _tolerance(g.dtype) * g.amax()


def _refuse_tensor_hooks(output: Any) -> None:
    if getattr(output, "_backward_hooks", None):
        raise ValueError(
            f"{_CALL}: the embedding layer's output has a tensor hook (registered by a forward "
            "hook on the layer?); token_attr substitutes that output, so the hook would not "
            "run, where captum runs it. Remove it, or make the forward hook return the "
            "changed output."
        )


def _check_substituted(output: Any, plain: torch.Tensor) -> None:
    """Refuses a layer output (replaced by the hook) other than ``plain``, the ids' embeddings
    computed outside the model, or one with a tensor hook (dropped with it)."""
    _refuse_tensor_hooks(output)
    real = output.detach()
    gap = (real - plain).abs().max()
    if not bool(gap <= 64 * torch.finfo(real.dtype).eps * plain.abs().max()):
        raise ValueError(
            f"{_CALL}: inside the model's forward, the embedding layer returned other values "
            f"than on the token ids alone (by up to {float(gap):.3g}): the model changes the "
            "ids before the layer (a forward pre-hook, a remap), the layer is not fed the "
            "ids (position embeddings), or it draws random numbers. Pass `embedding=`, the "
            "layer that maps the token ids to their embeddings, and keep the ids unchanged "
            "before it."
        )


def _ran_twice(layer: torch.nn.Module) -> str:
    return (
        f"{_CALL}: the embedding layer ({type(layer).__name__}) ran more than once in one "
        "forward of the model: the model calls it again (a shared embedding used twice, on "
        "the previous tokens, say, or the layer run twice), and token_attr replaces its one "
        "output by the attributed embeddings, so the other runs' outputs would not be "
        "attributed. Pass `embedding=` a module that the model runs once on the token ids "
        "(wrap that one use in a module of its own), or attribute with a loop of "
        "torch.autograd.grad."
    )


def _versions(*tensors: Any) -> tuple[int, ...]:
    """The version counters of ``tensors`` (-1 for a non-tensor)."""
    return tuple(t._version if isinstance(t, torch.Tensor) else -1 for t in tensors)


class _NotTheLogits(Exception):
    """The model's output layer did not give the logits it returned (see `_composed`)."""


def _unembedding(args: _Args) -> tuple[torch.nn.Module | None, str]:
    """(the output layer or None, `AttributionPlan.heads_read`): ``get_output_embeddings()``
    where it is row-wise, has not failed `_composed`'s check, and the heads' T x rows x T x d
    cotangents on its input fit half of `funcgrad.memory_budget`; else the heads read the
    logits."""
    layer = _layer(args.model, "get_output_embeddings")
    if layer is None:
        return None, "the logits (no get_output_embeddings() returning a module)"
    if args.model in _LOGITS_ONLY:
        return None, f"the logits ({_LOGITS_ONLY[args.model]})"
    mixes = _not_row_wise(layer)
    if mixes is not None:
        return None, f"the logits ({mixes})"
    weight = next(args.embedding.parameters(), None)
    width = int(getattr(layer, "in_features", 0) or getattr(args.embedding, "embedding_dim", 1))
    itemsize = weight.element_size() if weight is not None else 4
    targets, rows = len(args.target_ids) - args.first, len(_quadrature(args)[0])
    nbytes = targets * rows * targets * width * itemsize
    budget = _memory.budget(args.input_ids.device)
    if 2 * nbytes > budget:
        return None, (
            f"the logits (the heads' cotangents on the output layer's input, "
            f"{nbytes / 2**20:.3g} MiB, exceed half the memory budget, {budget / 2**20:.3g} MiB)"
        )
    return layer, f"the input of the output layer ({type(layer).__name__})"


def _not_row_wise(layer: torch.nn.Module) -> str | None:
    """Why head i may not apply the output layer to its own row alone, or None: only a plain
    ``torch.nn.Linear`` maps each row on its own (its own ``forward`` and `_plain_call`,
    plain weights, no hook of its own nor global one). Checked on every call."""
    kind = type(layer)
    if not (
        isinstance(layer, torch.nn.Linear)
        and kind.forward is torch.nn.Linear.forward
        and _plain_call(layer)
        and all(
            t is None or type(t) in (torch.Tensor, torch.nn.Parameter)
            for t in (layer.weight, layer.bias)
        )
    ):
        return (
            f"the output layer, {kind.__name__}, is not a plain torch.nn.Linear: it may mix "
            "the positions, so it is not applied to each target's row alone"
        )
    hooks = torch.nn.modules.module
    if (
        layer._forward_hooks
        or layer._forward_pre_hooks
        or layer._backward_hooks
        or layer._backward_pre_hooks
        or hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    ):
        return (
            "the output layer has a hook, or a global module hook is registered: it may mix "
            "the positions, so the layer is not applied to each target's row alone"
        )
    return None


def _plain_call(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs torch's own ``Module.__call__`` (not overridden by the
    class) and its class's ``forward`` (neither replaced on the instance)."""
    kind, base, calls = type(module), torch.nn.Module, ("_call_impl", "_wrapped_call_impl")
    return (
        kind.__call__ is base.__call__
        and all(getattr(kind, name) is getattr(base, name) for name in calls)
        and not any(name in vars(module) for name in ("forward", *calls))
    )


def _chunk(args: _Args, mode: Literal["reverse", "forward"], chunk_size: ChunkSize) -> ChunkSize:
    """compose_heads' chunk_size: None in forward mode; 1 for integrated gradients on the
    CPU under ``"auto"`` (each pull is already a batch of ``n_steps``: docs/attribution.md,
    "Memory")."""
    if mode == "forward":
        return None
    if chunk_size == "auto" and args.method == "integrated_gradients" and args.n_steps > 1:
        return 1 if args.input_ids.device.type == "cpu" else chunk_size
    return chunk_size


def _forward_kwargs(model: torch.nn.Module, targets: int) -> dict[str, Any]:
    """``logits_to_keep=T`` and ``use_cache=False``, where the model's forward takes them
    (Hugging Face's causal LMs)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # (a forward without a signature)
        return {}
    wanted = {"logits_to_keep": targets, "use_cache": False}
    return {name: value for name, value in wanted.items() if name in parameters}


# ----------------------------------------------------------- elementwise activations, batched

ELEMENTWISE = True  # False: activations run their own rules (`_elementwise_activations`)

# True inside a torch.func transform or a funcgrad call differentiating its f: the
# attributions keep their graph, so the activations run their own rules.
_NESTED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "funcgrad_attribution_nested", default=False
)


class _Source:
    """The activation's input and ``forward``, for `_Elementwise`'s backward under
    create_graph; x is cleared when the model's forward ends."""

    def __init__(self, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.x: torch.Tensor | None = x
        self.forward = forward


class _Elementwise(torch.autograd.Function):
    """``y = f(x)`` for an elementwise f with ``f'(x)`` given: backward ``cot * f'(x)`` and
    forward mode ``t * f'(x)``, one product each (f's own rules may run a dozen ops per
    batched direction). Only x is differentiable. Under ``create_graph=True`` the backward is
    f's own vjp at x (exact second derivatives), refused once x is gone."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor, y: torch.Tensor, derivative: torch.Tensor, source: _Source
    ) -> torch.Tensor:
        return y.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[2])
        ctx.save_for_forward(inputs[2])
        ctx.source = inputs[3]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        derivative: torch.Tensor = ctx.saved_tensors[0]
        if torch.is_grad_enabled():  # (create_graph: f'(x) is not a constant there)
            source: _Source = ctx.source
            if source.x is None:
                raise RuntimeError(
                    f"{_CALL}: a graph of the backward of an elementwise activation was "
                    "asked for after the model's forward (create_graph=True): funcgrad's "
                    "batched activation gives first derivatives only there. Set "
                    "funcgrad.attribution.ELEMENTWISE = False."
                )
            (exact,) = torch.func.vjp(source.forward, source.x)[1](grad)
            return exact, None, None, None
        return grad * derivative, None, None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        derivative: torch.Tensor = ctx.saved_tensors[0]
        return tangent * derivative


# transformers.activations' classes whose forward is elementwise (read in transformers 5.25).
_TRANSFORMERS_ELEMENTWISE = (
    "NewGELUActivation",
    "FastGELUActivation",
    "QuickGELUActivation",
    "GELUActivation",
    "GELUTanh",
    "SiLUActivation",
)


def _elementwise_kinds() -> tuple[type[torch.nn.Module], ...]:
    """The activation types known to be elementwise: torch's, and transformers' if imported."""
    nn = torch.nn
    kinds: list[type[torch.nn.Module]] = [nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid]
    activations = sys.modules.get("transformers.activations")
    for name in _TRANSFORMERS_ELEMENTWISE:
        kind = getattr(activations, name, None)
        if isinstance(kind, type) and issubclass(kind, nn.Module):
            kinds.append(kind)
    return tuple(kinds)


def _library_functions_intact() -> bool:
    """Whether the functions the allow-listed forwards look up at run time (``F.gelu``,
    ``F.silu``, ``torch.tanh``, ..., and the names ``F``, ``torch``, ``nn``, ``math`` in the
    two libraries' modules) are still torch's own (a replaced one may mix the positions)."""
    functional = torch.nn.functional
    own = torch._C._VariableFunctions
    if functional.gelu is not torch._C._nn.gelu or any(
        getattr(torch, name) is not getattr(own, name)
        for name in ("tanh", "sigmoid", "pow", "erf", "relu")
    ):
        return False
    for function in (functional.silu, functional.relu):
        code = getattr(function, "__code__", None)
        if hasattr(function, "__wrapped__") or (
            getattr(code, "co_filename", None) != functional.__file__
        ):
            return False
    # (NewGELUActivation's constant, by value)
    if math.pi != 3.141592653589793 or math.sqrt(2.0 / math.pi) != 0.7978845608028654:
        return False
    modules = [sys.modules.get("torch.nn.modules.activation")]
    activations = sys.modules.get("transformers.activations")
    if activations is not None:
        modules.append(activations)
    expected = {"F": functional, "torch": torch, "nn": torch.nn, "math": math}
    return all(
        getattr(module, name, value) is value
        for module in modules
        for name, value in expected.items()
    )


def _is_elementwise(module: torch.nn.Module, kinds: tuple[type[torch.nn.Module], ...]) -> bool:
    """Whether ``module`` is exactly one of ``kinds`` as its library wrote it: `_plain_call`,
    its class's own ``forward`` (code in the library's file), not in place, no forward or
    backward hook of its own (pre-hooks are kept), and its ``act`` the library's own."""
    kind = type(module)
    if kind not in kinds or getattr(module, "inplace", False) is not False:
        return False
    if not _plain_call(module):
        return False
    # (not replaced on the class, by `kernelize` or a functools.wraps copy, say)
    forward = vars(kind).get("forward")
    library = sys.modules.get(kind.__module__)
    if (
        getattr(forward, "__qualname__", None) != f"{kind.__qualname__}.forward"
        or kind.__module__ not in ("torch.nn.modules.activation", "transformers.activations")
        or getattr(forward, "__module__", None) != kind.__module__
        or hasattr(forward, "__wrapped__")
        or library is None
        or getattr(getattr(forward, "__code__", None), "co_filename", None)
        != getattr(library, "__file__", 0)
    ):
        return False
    if module._forward_hooks or module._backward_hooks or module._backward_pre_hooks:
        return False
    if hasattr(module, "act"):
        act = getattr(module, "act", None)
        gelu = torch._C._nn.gelu  # (torch.nn.functional.gelu, where not replaced)
        own = {getattr(kind, name, None) for name in ("_gelu_python", "_gelu_tanh_python")}
        plain = act is gelu or (
            isinstance(act, functools.partial)
            and act.func is gelu
            and not act.args
            and act.keywords == {"approximate": "tanh"}
        )
        bound = getattr(act, "__self__", None) is module and getattr(act, "__func__", 0) in own
        if not (plain or bound):
            return False
    return True


def _derivative(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """f'(x) in one op for an allow-listed activation (y = f(x)): torch's own backward op on
    ones (bitwise the vjp of ones for torch's modules; for transformers' tanh GELU formula,
    equal to rounding: docs/attribution.md); None where torch has none (QuickGELU, ...)."""
    aten = torch.ops.aten
    nn = torch.nn
    kind = type(module)
    name = kind.__name__ if kind.__module__ == "transformers.activations" else ""
    act = getattr(module, "act", None)
    gelu = torch._C._nn.gelu
    ones = torch.ones_like(y)
    # (cast: the ops are typed Any)
    if kind is nn.GELU:
        return cast(
            torch.Tensor, aten.gelu_backward(ones, x, approximate=cast(nn.GELU, module).approximate)
        )
    if kind is nn.SiLU or name == "SiLUActivation":
        return cast(torch.Tensor, aten.silu_backward(ones, x))
    if kind is nn.ReLU:
        return cast(torch.Tensor, aten.threshold_backward(ones, y, 0))
    if kind is nn.Tanh:
        return cast(torch.Tensor, aten.tanh_backward(ones, y))
    if kind is nn.Sigmoid:
        return cast(torch.Tensor, aten.sigmoid_backward(ones, y))
    if name == "NewGELUActivation" or (
        name == "GELUTanh"
        and getattr(act, "__func__", None) is getattr(kind, "_gelu_tanh_python", None)
    ):
        return cast(torch.Tensor, aten.gelu_backward(ones, x, approximate="tanh"))
    if name in ("GELUActivation", "GELUTanh") and act is gelu:
        return cast(torch.Tensor, aten.gelu_backward(ones, x))
    if name in ("GELUActivation", "GELUTanh") and isinstance(act, functools.partial):
        # (`_is_elementwise` checked that the partial is F.gelu's approximate="tanh")
        return cast(torch.Tensor, aten.gelu_backward(ones, x, approximate="tanh"))
    return None


def _elementwise_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's modules that `_elementwise_activations` replaces (none under a global
    module hook, which would see the detached input)."""
    hooks = torch.nn.modules.module
    if (
        not ELEMENTWISE
        or _NESTED.get()
        or (
            hooks._global_forward_hooks
            or hooks._global_backward_hooks
            or hooks._global_backward_pre_hooks
        )
    ):
        return []
    kinds = _elementwise_kinds()
    found = [(name, m) for name, m in model.named_modules() if _is_elementwise(m, kinds)]
    return found if found and _library_functions_intact() else []


def _differentiation_levels() -> tuple[Any, Any]:
    """The torch.func and forward-AD levels: other ones inside the model's forward mean that
    it differentiates there itself, where `_Elementwise` gives no second derivative."""
    level = torch._C._functorch.maybe_current_level()
    return level, torch.autograd.forward_ad._current_level


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (a checkpoint recomputes the forward without
    this call's hooks); True where torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


@contextlib.contextmanager
def _elementwise_activations(model: torch.nn.Module) -> Iterator[None]:
    """For one forward, each `_elementwise_modules` module called on one floating tensor runs
    on it detached, and its output becomes ``_Elementwise.apply(x, y, f'(x))``, f'(x) from
    `_derivative` or one vjp of ones (exact: the Jacobian is diagonal). ASSUMPTION: the
    allow-listed modules are elementwise (`_is_elementwise`). Not applied in another thread,
    under saved-tensor hooks (checkpoint), nor inside a transform the forward opened."""
    handles = []
    inputs: list[torch.Tensor | None] = []
    sources: list[_Source] = []
    caller = threading.get_ident()
    levels = _differentiation_levels()

    def detach(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if threading.get_ident() != caller:
            return None
        x = args[0] if len(args) == 1 and not kwargs else None
        if (
            not isinstance(x, torch.Tensor)
            or not x.is_floating_point()
            or _saved_tensor_hooks_active()
            or _differentiation_levels() != levels
        ):
            inputs.append(None)
            return None
        inputs.append(x)
        return (x.detach(),), kwargs

    def replace(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if threading.get_ident() != caller:
            return None
        x = inputs.pop()
        if x is None:
            return None
        plain = args[0]  # (x detached; the output is f(plain), same shape and dtype)
        derivative = _derivative(module, plain, output)
        if derivative is None:  # (J^T 1 = f'(x) for a diagonal Jacobian)
            pull = torch.func.vjp(module.forward, plain)[1]
            (derivative,) = pull(torch.ones_like(output))
        sources.append(_Source(x, module.forward))
        replaced: torch.Tensor = _Elementwise.apply(  # type: ignore[no-untyped-call]
            x, output.detach(), derivative, sources[-1]
        )
        return replaced

    try:
        for _, module in _elementwise_modules(model):
            handles.append(module.register_forward_pre_hook(detach, with_kwargs=True))
            handles.append(module.register_forward_hook(replace))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for source in sources:
            source.x = None


def _composed(
    args: _Args,
    mode: Literal["reverse", "forward"],
    chunk_size: ChunkSize,
    dtype: torch.dtype,
    unembedding: torch.nn.Module | None,
) -> Callable[..., Any]:
    """compose_heads of the model (fed embeddings through a hook) and the T heads, cached per
    model, embedding, method, shapes and split point. With an output layer (``unembedding``)
    f returns its (rows, T, d) input at the last T positions and head i applies the layer to
    its own row (d-wide cotangents, one position per head); without, f returns the (rows, T)
    target log-probabilities."""
    prompt, targets = len(args.input_ids), len(args.target_ids) - args.first
    _, steps = _quadrature(args)
    key = (
        id(args.embedding),
        None if unembedding is None else id(unembedding),
        args.method,
        args.n_steps,
        prompt,
        targets,
        args.first,
        mode,
        chunk_size,
        dtype,
        args.input_ids.device,
    )
    cache = _COMPOSED.setdefault(args.model, collections.OrderedDict())
    found = cache.get(key)
    if found is not None and found[0]() is args.embedding:
        cache.move_to_end(key)
        return found[1]
    model_ref, embedding_ref = weakref.ref(args.model), weakref.ref(args.embedding)
    unembedding_ref = None if unembedding is None else weakref.ref(unembedding)
    rows = len(steps)
    keep = _forward_kwargs(args.model, targets)

    def f(
        x: torch.Tensor,
        scaled: torch.Tensor,
        direction: torch.Tensor,
        sequence: torch.Tensor,
        target_ids: torch.Tensor,
        plain: torch.Tensor,
    ) -> torch.Tensor:
        """The model on the embeddings moved by x: every position's by x, (length, d), in
        reverse mode (for `_future_leak`); the prompt's by x (L_in,) times ``direction`` in
        forward mode."""
        model, embedding = model_ref(), embedding_ref()
        assert model is not None and embedding is not None
        if x.dim() == 2:
            embeds = scaled + x
        else:
            moved = x[:, None] * direction
            embeds = torch.cat([scaled[:, :prompt] + moved, scaled[:, prompt:]], dim=1)
        calls: list[tuple[int, ...]] = []
        refused: list[ValueError] = []  # (the first run's output, raised after the forward)
        layer: list[tuple[Any, Any, Any, tuple[int, ...]]] = []  # (args, kwargs, out, versions)

        def substitute(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
            calls.append(tuple(output.shape) if isinstance(output, torch.Tensor) else ())
            if len(calls) > 1:  # (the cause, whatever this run's output is: named first)
                raise ValueError(_ran_twice(module))
            try:
                if calls[-1] != tuple(embeds.shape):
                    raise ValueError(
                        f"{_CALL}: the embedding layer returned {describe(output)}, expected "
                        f"shape {tuple(embeds.shape)} (batch, length, d): pass `embedding=`, "
                        "the layer that maps the token ids to their embeddings."
                    )
                _check_substituted(output, plain)
            except ValueError as error:  # (unless the layer runs again: that is the cause)
                refused.append(error)
                return None
            return embeds

        def detach(module: torch.nn.Module, inputs: Any, kwargs: Any) -> Any:
            # (the heads apply the layer themselves: the model's own call needs no derivative)
            layer.append((inputs, kwargs, None, ()))
            return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in inputs), kwargs

        def capture(module: torch.nn.Module, inputs: Any, kwargs: Any, output: Any) -> None:
            given, kwargs, _, _ = layer[-1]
            layer[-1] = (given, kwargs, output, _versions(*given, output))

        handles = [embedding.register_forward_hook(substitute)]
        output_layer = None if unembedding_ref is None else unembedding_ref()
        if output_layer is not None:
            handles.append(output_layer.register_forward_pre_hook(detach, with_kwargs=True))
            handles.append(output_layer.register_forward_hook(capture, with_kwargs=True))
        try:
            with _elementwise_activations(model):
                output = model(sequence.expand(rows, -1), **keep)
        finally:
            for handle in handles:
                handle.remove()
        if refused:
            raise refused[0]
        if not calls:
            raise ValueError(
                f"{_CALL}: the embedding layer did not run in the model's forward: pass "
                "`embedding=`, the layer that maps the token ids to their embeddings."
            )
        raw = _logits(output, _CALL)
        logits = raw[:, -targets:]
        if logits.shape[:2] != (rows, targets) or logits.shape[-1] <= int(target_ids.max()):
            raise ValueError(
                f"{_CALL}: the model returned logits of shape {tuple(logits.shape)} at the "
                f"last {targets} positions, expected ({rows}, {targets}, vocabulary) with a "
                f"vocabulary above the largest target id, {int(target_ids.max())}."
            )
        if output_layer is None:
            chosen = target_ids.expand(rows, -1)[..., None]
            return logits.log_softmax(-1).gather(-1, chosen)[..., 0]
        # The heads' output_layer(input) are the logits returned only where the layer ran
        # once, on one tensor, and neither was changed after (in place: by version counter).
        inputs, kwargs, returned, versions = layer[0] if len(layer) == 1 else ((), {}, None, ())
        inputs = tuple(inputs)
        hidden = inputs[0] if len(inputs) == 1 and not kwargs else None
        if (
            returned is not raw
            or not isinstance(hidden, torch.Tensor)
            or hidden.shape[:2] != raw.shape[:2]
            or _versions(hidden, returned) != versions
        ):
            raise _NotTheLogits(
                f"its output layer ({type(output_layer).__name__}) ran {len(layer)} times"
                if len(layer) != 1
                else "its logits are not its output layer's output on one tensor, unchanged"
            )
        return hidden[:, -targets:]

    device = args.input_ids.device
    like: dict[str, Any] = {"dtype": dtype, "device": device}
    weights = torch.tensor(steps, **like)  # (rows,)
    strategy: Literal["vjp", "jacfwd"] = "jacfwd" if mode == "forward" else "vjp"
    chunk = _chunk(args, mode, chunk_size)

    def weighed(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Head i: the step-size-weighted sum of the (rows, T) log-probabilities."""
        return (p * y).sum()

    def unembedded(position: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Head i: log p(target i) from the layer on position i's row, weighed by step sizes."""
        target = current[0].gather(0, position.reshape(1)).reshape(1, 1, 1)
        output_layer = unembedding_ref() if unembedding_ref is not None else None
        assert output_layer is not None
        row = y.gather(1, position.expand(rows, 1, y.shape[-1]))
        logits: torch.Tensor = output_layer(row)  # (rows, 1, V)
        chosen = logits.log_softmax(-1).gather(-1, target.expand(rows, 1, 1))
        return (weights * chosen.reshape(rows)).sum()

    heads = (
        stacked_heads(weighed, weights[None, :, None] * torch.eye(targets, **like)[:, None, :])
        if unembedding_ref is None
        else stacked_heads(unembedded, torch.arange(targets, device=device))
    )
    # (reverse mode on eager autograd where it may run there: docs/attribution.md)
    fn: ComposedHeads[tuple[torch.Tensor, Any]] = ComposedHeads(
        Composition(
            f, heads, 0, False, strategy, chunk, None, "compose_heads(f, heads)", "autograd"
        )
    )
    current: list[torch.Tensor] = []  # this call's target ids (the cached heads serve all)

    def call(*arguments: Any) -> Any:
        current.append(arguments[4])  # (f's target_ids: the heads' own, a copy of the user's)
        try:
            return fn(*arguments)
        finally:
            current.clear()

    cache[key] = (embedding_ref, call)
    while len(cache) > _COMPOSED_PER_MODEL:
        cache.popitem(last=False)
    return call


def _embed(args: _Args, ids: torch.Tensor) -> Any:
    """The layer's output on ``ids``, detached; computed with gradients on, as captum's, so
    that a tensor hook a forward hook registers is refused."""
    try:
        with torch.enable_grad():
            embeds = args.embedding(ids)
    except (IndexError, RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"{_CALL}: the embedding layer could not map the (1, {ids.shape[1]}) token ids to "
            f"embeddings ({type(error).__name__}: {error}). `embedding` must be the layer "
            "that maps token ids to embeddings (called on the ids alone, as "
            "`model.get_input_embeddings()`), and the ids must be in its vocabulary."
        ) from error
    _refuse_tensor_hooks(embeds)
    return embeds.detach() if isinstance(embeds, torch.Tensor) else embeds


def _prepare(args: _Args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, scaled, direction, plain), as captum forms them: the ids ``prompt +
    targets[:-1]``; every row's embeddings (the path's points); what the gradients are
    multiplied by; the sequence's own embeddings, which the layer must produce in the model."""
    prompt = len(args.input_ids)
    sequence = torch.cat([args.input_ids, args.target_ids[:-1]])
    with torch.no_grad():
        embeds = _embed(args, sequence[None])
        if (
            not isinstance(embeds, torch.Tensor)
            or embeds.dim() != 3
            or not embeds.is_floating_point()
        ):
            raise ValueError(
                f"{_CALL}: the embedding layer must map (1, length) token ids to (1, length, d) "
                f"floating embeddings, got {describe(embeds)}."
            )
        if args.method != "integrated_gradients":
            own = embeds[0, :prompt]
            direction = own if args.method == "grad_x_input" else torch.ones_like(own)
            return sequence, embeds, direction, embeds
        # (captum's baseline: the baseline token at every attributed prompt position)
        base_ids = sequence.clone()
        replaced = torch.full_like(args.input_ids, args.baseline_id)
        if args.kept is not None:
            replaced = torch.where(args.kept, replaced, args.input_ids)
        base_ids[:prompt] = replaced
        baseline = _embed(args, base_ids[None])
        alphas, _ = _quadrature(args)
        scaled = torch.cat([baseline + alpha * (embeds - baseline) for alpha in alphas], dim=0)
        return sequence, scaled, (embeds - baseline)[0, :prompt], embeds


# (attributions, gradients or None in forward mode, reverse mode's `_future_leak` or None)
_Formed: TypeAlias = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _run(
    args: _Args,
    mode: Literal["reverse", "forward"],
    chunk_size: ChunkSize,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(attributions, gradients or None in forward mode); reverse mode by `_groups`."""
    if mode == "forward":
        attributions, _, _ = _run_group(args, mode, chunk_size)
        return attributions, None
    parts = [
        _run_group(
            dataclasses.replace(args, target_ids=args.target_ids[:stop], first=start),
            mode,
            chunk_size,
        )
        for start, stop in _groups(args)
    ]
    leaks = [leak for _, _, leak in parts if leak is not None]
    if leaks and bool(torch.stack(leaks).any()):
        _CAUSAL.pop(args.model, None)
        raise ValueError(
            f"{_CALL}: the model is not causal (now): on this call a target's log-probability "
            "has a nonzero gradient with respect to the embedding of a later position than "
            "its own (by more than 1000 eps of the largest gradient after the prompt), so it "
            "reads tokens "
            "captum's prefix forward does not have. Something in the model changed after its "
            "causal check (a hook, a replaced forward, module or function, a switched "
            "attribute or config), or it mixes positions in train mode only. One "
            "teacher-forced forward equals captum's prefix forwards only where position i "
            "reads positions <= i."
        )
    gradients = [grads for _, grads, _ in parts if grads is not None]
    return torch.cat([attr for attr, _, _ in parts]), torch.cat(gradients)


def _run_group(args: _Args, mode: Literal["reverse", "forward"], chunk_size: ChunkSize) -> _Formed:
    """One forward of ``prompt + targets[:-1]`` and the heads of ``targets[first:]``."""
    sequence, scaled, direction, plain = _prepare(args)
    shape = direction.shape[:1] if mode == "forward" else scaled.shape[1:]
    x = torch.zeros(shape, dtype=scaled.dtype, device=scaled.device)
    unembedding, _ = _unembedding(args)
    heads = args.target_ids[args.first :]
    token = _NESTED.set(not outside_transforms(()))

    def attempt(layer: torch.nn.Module | None) -> _Formed:
        fn = _composed(args, mode, chunk_size, scaled.dtype, layer)
        with torch.enable_grad():
            _, grads = fn(x, scaled, direction, sequence, heads, plain)
        return _formed(args, mode, grads, direction)

    try:
        try:
            return attempt(unembedding)
        except _NotTheLogits as error:  # (the heads read the logits from now on)
            _LOGITS_ONLY[args.model] = str(error)
        # (outside the except: an error of this call is not shown as raised while handling it)
        return attempt(None)
    finally:
        _NESTED.reset(token)


def _formed(
    args: _Args, mode: Literal["reverse", "forward"], grads: torch.Tensor, direction: torch.Tensor
) -> _Formed:
    """`_Formed` from compose_heads' result (forward mode: the attributions themselves)."""
    if mode == "forward":
        return grads, None, None
    prompt = len(args.input_ids)
    leak = _future_leak(grads, prompt, args.first)
    grads = grads[:, :prompt]
    return (grads * direction).sum(-1), grads, leak


def _groups(args: _Args) -> list[tuple[int, int]]:
    """Reverse mode's groups of consecutive targets, (start, stop), each with its own forward
    of ``prompt + targets[:stop - 1]`` (a head's backward runs over its group's prefix): the
    G <= 8 equal groups of least ``sum of length x (1 + heads)``, if that saves 10%."""
    prompt, targets = len(args.input_ids), len(args.target_ids)

    def bounds(count: int) -> list[tuple[int, int]]:
        stops = [round(targets * (g + 1) / count) for g in range(count)]
        return [(start, stop) for start, stop in zip([0, *stops[:-1]], stops, strict=True)]

    def cost(groups: list[tuple[int, int]]) -> int:
        return sum((prompt + stop - 1) * (1 + stop - start) for start, stop in groups)

    best = min((bounds(count) for count in range(1, min(targets, 8) + 1)), key=cost)
    return best if cost(best) < 0.9 * cost(bounds(1)) else bounds(1)


def _forward_fallback(caught: list[warnings.WarningMessage]) -> int | None:
    """The index in ``caught`` of compose_heads' warning that forward mode could not run."""
    for index, message in enumerate(caught):
        text = str(message.message)
        if issubclass(message.category, FuncgradWarning) and "used reverse mode instead" in text:
            return index
    return None


def _why_not_forward(text: str) -> str:
    """The error inside compose_heads' fallback warning (its first 200 characters)."""
    inner = text.split(" call (", 1)[-1].rsplit("); used reverse mode", 1)[0]
    return inner[:200]


# token_attr's keyword arguments besides return_gradients, for its overloads.
class _TokenAttrOptions(TypedDict, total=False):
    method: Method
    n_steps: int
    baseline_id: int
    embedding: torch.nn.Module | None
    skip_ids: torch.Tensor | Sequence[int]
    mode: Mode
    chunk_size: ChunkSize


@overload
def token_attr(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    target_ids: torch.Tensor | Sequence[int],
    *,
    return_gradients: Literal[False] = False,
    **options: Unpack[_TokenAttrOptions],
) -> torch.Tensor: ...
@overload
def token_attr(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    target_ids: torch.Tensor | Sequence[int],
    *,
    return_gradients: Literal[True],
    **options: Unpack[_TokenAttrOptions],
) -> tuple[torch.Tensor, torch.Tensor]: ...
def token_attr(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    target_ids: torch.Tensor | Sequence[int],
    *,
    method: Method = "grad_x_input",
    n_steps: int = 50,
    baseline_id: int = 0,
    embedding: torch.nn.Module | None = None,
    skip_ids: torch.Tensor | Sequence[int] = (),
    mode: Mode = "auto",
    chunk_size: ChunkSize = "auto",
    return_gradients: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every target token's attribution to every prompt token, from one forward of the model.

    Same values as captum 0.9's

    ```python
    LLMGradientAttribution(LayerGradientXActivation(model, embedding), tokenizer).attribute(
        TextTokenInput(prompt, tokenizer, baselines=baseline_id, skip_tokens=skip_ids),
        target=target_ids,
    ).token_attr
    ```

    (``LayerIntegratedGradients(model, embedding)`` and ``n_steps=`` for integrated
    gradients; ``multiply_by_inputs=False`` for the gradient), a ``(T, L_in)`` tensor: row i
    is the attribution of ``log p(target_i | prompt, targets[:i])`` to each prompt token, the
    gradient with respect to the embedding layer's output summed over the embedding dimension.
    captum runs a forward and a backward per target (T x (n_steps + 2) forwards for
    integrated gradients); here the model runs once on ``prompt + targets[:-1]`` (teacher
    forcing: in a causal LM position i reads positions ``<= i`` only, so each target's
    log-probability is the one captum's prefix forward computes), with the n_steps points of
    the integration path as one batch, and the T log-probabilities are differentiated
    together by `funcgrad.compose_heads`.

    Args:
        model: a causal language model: ``model(ids)`` of shape (batch, length) returns
            logits of shape (batch, length, vocabulary), as a tensor, the first of a tuple,
            or ``.logits`` (Hugging Face). It must treat the rows of a batch independently
            and position i must depend on positions ``<= i`` only. Put it in ``eval()`` mode
            (dropout draws a new mask on every forward, as under captum).
        input_ids: the prompt's token ids, shape (L_in,) or (1, L_in) (a tokenizer's
            ``return_tensors="pt"``), or a list of ints.
        target_ids: the T target token ids that follow the prompt, shape (T,) or (1, T).
        method: ``"gradient"``, ``"grad_x_input"`` or ``"integrated_gradients"`` (see
            `funcgrad.attribution.Method`).
        n_steps: integration steps (Gauss-Legendre, as captum's default ``"gausslegendre"``,
            its step sizes rounded to float32 as captum rounds them); integrated gradients
            only.
        baseline_id: the token whose embedding starts the integration path at every prompt
            position (captum's ``TextTokenInput(baselines=...)``, 0 by default).
        embedding: the layer whose output is attributed, hooked as captum hooks it; None:
            ``model.get_input_embeddings()`` (Hugging Face: ``wte`` on GPT-2, before the
            position embeddings are added).
        skip_ids: prompt tokens to leave out (captum's ``skip_tokens``, e.g. a BOS token):
            their columns are dropped and the baseline keeps them.
        mode: ``"reverse"`` (T cotangents in one batched backward), ``"forward"`` (L_in
            tangents in one batched forward-mode pass) or ``"auto"`` (see
            `funcgrad.attribution.plan`).
        chunk_size: at most this many cotangents per batched backward (``"auto"``: as many
            as fit `funcgrad.memory_budget`; None: all T at once; 1: a loop), so that a long
            generation does not run out of memory. Reverse mode only.
        return_gradients: also return the (T, L_in, d) gradients (integrated gradients: the
            path's weighted sum of gradients), from reverse mode.

    Returns:
        The ``(T, L_in)`` attributions (L_in less the skipped tokens); with
        ``return_gradients=True``, ``(attributions, gradients)``, where ``attributions ==
        (gradients * inputs).sum(-1)``: inputs are ones (gradient), the prompt's embeddings
        (grad x input) or the embeddings minus the baseline's (integrated gradients).

    Examples:
        >>> import torch, funcgrad
        >>> class TinyLM(torch.nn.Module):  # causal: position i reads positions <= i
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = torch.nn.Embedding(10, 4)
        ...         self.out = torch.nn.Linear(4, 10)
        ...     def forward(self, ids):
        ...         return self.out(self.embed(ids).tanh().cumsum(1))
        >>> model = TinyLM()
        >>> attr = funcgrad.attribution.token_attr(
        ...     model, torch.tensor([1, 2, 3]), torch.tensor([4, 5]), embedding=model.embed
        ... )
        >>> attr.shape  # (T, L_in)
        torch.Size([2, 3])

    Notes:
        Cost: one forward of the model on ``L_in + T - 1`` tokens (a batch of ``n_steps``
        for integrated gradients), then, in reverse mode, T cotangents pulled back in one
        batched backward (chunks of ``chunk_size``; a loop for integrated gradients on the
        CPU): the backward work of captum's T backwards, without its T (or T x (n_steps +
        2)) forwards. The cotangents start at the output layer's input (Hugging Face's
        ``get_output_embeddings()``), d wide, where that layer is a plain
        ``torch.nn.Linear`` without hooks or a replaced ``forward`` (row by row: checked on
        every call) and the model returns its output unchanged as its logits, else at the
        logits. Hugging Face models are called with ``logits_to_keep=T`` and
        ``use_cache=False``. Where T is well above L_in, reverse mode runs a few groups of
        consecutive targets, each on its own prefix (``plan().forwards``). In forward mode
        (under ``"auto"`` where ``2.5 L_in < T``), the L_in tangents go through with that
        forward, whatever T. Allow-listed elementwise activations run their batched
        backward, or forward-mode rule, as one product by their derivative
        (``plan().elementwise``).
        Forward mode needs forward-mode rules for every op: fused attention kernels
        (``attn_implementation="sdpa"``) lack them; ``"auto"`` then falls back to reverse
        mode and remembers it for the model (``plan`` says so). Module backward hooks run
        in reverse mode only: ``"auto"`` takes it where one is registered, and
        ``mode="forward"`` is refused.
        All calls of ``token_attr`` run one at a time, under one lock (the model must not
        run in another thread meanwhile). Causality is probed (three forwards without
        gradients) on the first call with a model and whenever what it runs changed since;
        reverse mode also checks, on every call, that no target's gradient reaches a later
        position. A model found not causal is refused. docs/attribution.md says more.
    """
    args, requested = _validate(
        model,
        input_ids,
        target_ids,
        method,
        n_steps,
        embedding,
        mode,
        chunk_size,
        _CALL,
        baseline_id,
        skip_ids,
    )
    with _claimed(args):
        attributions, gradients = _attribute(args, requested, chunk_size, return_gradients)
    if args.kept is not None:
        attributions = attributions[:, args.kept]
        gradients = None if gradients is None else gradients[:, args.kept]
    if return_gradients:
        assert gradients is not None
        return attributions, gradients
    return attributions


def _attribute(
    args: _Args, requested: Mode, chunk_size: ChunkSize, return_gradients: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_attr once its arguments are checked: mode, causal check, forwards, pulls."""
    chosen, _ = _choose(args, requested, return_gradients, _CALL)
    _check_causal(args, chosen)
    if chosen != "forward" or requested != "auto":
        try:
            result = _run(args, chosen, chunk_size)
        except ForwardModeNoGradError as error:
            error.add_note(f"{_CALL}: use mode='reverse' (or 'auto', which sees it).")
            raise
        _seen_after(args, chosen)
        return result
    # Under "auto", compose_heads' fallback to reverse mode is this function's choice: no
    # warning, and reverse mode on this model from then on (plan() says why).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FuncgradWarning)
        try:
            result = _run(args, chosen, chunk_size)
        except ForwardModeNoGradError:  # (seen before any result: reverse mode from now on)
            _NO_FORWARD[args.model] = (args.model.training, "it runs ops in no-grad mode")
            chosen = "reverse"
            result = _run(args, chosen, chunk_size)
    failed = _forward_fallback(caught)
    if failed is not None:
        text = str(caught[failed].message)
        why = _why_not_forward(text)
        if "draws random numbers" in text or _linearize.is_forward_mode_limit(RuntimeError(why)):
            _NO_FORWARD[args.model] = (args.model.training, why)
        else:  # (the model's own error: not remembered, and its warning is kept)
            failed = None
    for index, message in enumerate(caught):  # every other warning, as it was
        if index != failed:
            warnings.warn_explicit(
                message.message, message.category, message.filename, message.lineno
            )
    _seen_after(args, chosen)
    return result


def plan(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    target_ids: torch.Tensor | Sequence[int],
    *,
    method: Method = "grad_x_input",
    n_steps: int = 50,
    embedding: torch.nn.Module | None = None,
    mode: Mode = "auto",
    chunk_size: ChunkSize = "auto",
    return_gradients: bool = False,
) -> AttributionPlan:
    """What `token_attr` runs for these arguments (nothing is run).

    Args:
        model: as in `token_attr`.
        input_ids: as in `token_attr`.
        target_ids: as in `token_attr`.
        method: as in `token_attr`.
        n_steps: as in `token_attr`.
        embedding: as in `token_attr`.
        mode: as in `token_attr`.
        chunk_size: as in `token_attr`.
        return_gradients: as in `token_attr`.

    Returns:
        An `AttributionPlan`: the mode and why, the batch of the one forward, the directions
        through the model, and the forwards captum's loop runs.

    Examples:
        >>> import torch, funcgrad
        >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
        >>> emb = model[0]
        >>> p = funcgrad.attribution.plan(model, [1, 2], list(range(8)), embedding=emb)
        >>> p.mode, p.directions, p.captum_forwards
        ('forward', 2, 8)
    """
    args, requested = _validate(
        model, input_ids, target_ids, method, n_steps, embedding, mode, chunk_size, _PLAN_CALL
    )
    chosen, why = _choose(args, requested, return_gradients, _PLAN_CALL)
    prompt, targets = len(args.input_ids), len(args.target_ids)
    rows = n_steps if method == "integrated_gradients" else 1
    groups = [(0, targets)] if chosen == "forward" else _groups(args)
    start, stop = max(groups, key=lambda group: group[1] - group[0])
    return AttributionPlan(
        mode=chosen,
        method=args.method,
        targets=targets,
        prompt=prompt,
        rows=rows,
        directions=prompt if chosen == "forward" else targets,
        captum_forwards=3 * targets if method == "integrated_gradients" else targets,
        why=why,
        heads_read=_unembedding(
            dataclasses.replace(args, target_ids=args.target_ids[:stop], first=start)
        )[1],
        chunk_size=_chunk(args, chosen, chunk_size),
        forwards=len(groups),
        elementwise=tuple(name for name, _ in _elementwise_modules(args.model)),
    )
