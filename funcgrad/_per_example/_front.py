"""The public front: `funcgrad.per_example`, `funcgrad.per_example_gramian`, and
``funcgrad.backward(losses, batch_dim=0)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._config import CheckMode
from ._record import _BACKWARD, _GRAMIAN
from ._recorder import PerExample, _distributed_refusal, _recorder_of
from ._run import _Clip, _norms, _Run


def per_example(model: nn.Module, *, batch_dim: int = 0) -> PerExample:
    """Hook ``model`` for per-example heads: Jacobian descent over the examples of a batch
    (instance-wise risk minimisation), per-example gradient norms and similarities, at
    about the cost of one backward.

    Per-example losses ``losses = criterion(model(x), y)`` (``reduction="none"``, shape
    (B,)) are B heads on one expensive function. Their Gramian ``G[b, b'] = <grad_b,
    grad_b'>`` (gradients with respect to the parameters) comes from ONE backward of the
    losses, layer by layer: for a Linear layer with inputs A and output gradients Δ it is
    ``(A Aᵀ) ∘ (Δ Δᵀ)`` and the weighted update is ``Aᵀ (w ⊙ Δ)``. The hooks record each
    layer's input A during the forward, so the model must be hooked before it (as TorchJD's
    ``autogram.Engine(model, batch_dim=0)``).

    Args:
        model: the module whose parameters get per-example gradients. Every module of it
            with parameters is hooked; a module with parameters must take and return tensors
            batched along dim 0 and treat the examples independently (no BatchNorm in
            training mode: refused here and at its forward, before any backward).
        batch_dim: 0, the batch dimension of every module's inputs and outputs.

    Returns:
        A `PerExample`, also a context manager that removes the hooks at its end. Its
        ``backward(losses, weighting=..., inputs=...)`` writes ``.grad += w @ grads`` with
        ``w = weighting(G)`` and returns ``w`` (the same as
        ``funcgrad.backward(losses, batch_dim=0, ...)``); its ``gramian(losses)`` returns G
        without writing ``.grad`` (as `funcgrad.per_example_gramian`); ``print(pe.plan)``
        shows the rule each layer took in the last call.

    Examples:
        >>> import torch, funcgrad
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
        ...                             torch.nn.Linear(8, 1))
        >>> x, y = torch.randn(16, 3), torch.randn(16, 1)
        >>> with funcgrad.per_example(model) as pe:
        ...     losses = (model(x) - y).pow(2).squeeze(1)           # (16,): one per example
        ...     weights = pe.backward(losses, weighting=lambda g: 1 / g.diagonal().sqrt())
        >>> weights.shape, model[0].weight.grad.shape
        (torch.Size([16]), torch.Size([8, 3]))
        >>> print(pe.plan)  # doctest: +NORMALIZE_WHITESPACE
        per-example plan, B=16 (flops of the Gramian per layer: ghost / materialised)
          0  Linear  (16, 3)  ghost (A Aᵀ)∘(Δ Δᵀ)  ...
          2  Linear  (16, 8)  ghost (A Aᵀ)∘(Δ Δᵀ)  ...

    Notes:
        Cost: the forward, ONE backward of the losses to every layer's output (without the
        weight-gradient products), then per layer the Gramian block and the update
        ``Aᵀ (w ⊙ Δ)`` (one matmul). Rules, chosen per layer and input shape by flops:
        Linear on (B, d) inputs: ``(A Aᵀ)∘(Δ Δᵀ)``, B²(d+p); on (B, T, d): ghost
        ``<A_b A_b'ᵀ, Δ_b Δ_b'ᵀ>`` (B²T²(d+p)) or the materialised ``A_bᵀ Δ_b`` and their
        Gram (B·T·d·p + B²·d·p); Conv1d/Conv2d: the same with T the output positions (the
        ghost products on unfolded inputs, the per-example gradients as one convolution
        backward with the examples as groups); Hugging Face's Conv1D: the Linear rules,
        transposed; Embedding: the Gram of one-hot rows is index equality (or the
        per-example gradients on the rows used; an index shared by the batch, (1, T)
        position ids, is expanded to (B, T) during the model's call where its output is
        broadcast against the batch, and refused otherwise); nn.MultiheadAttention
        (batch_first, no bias_k, no dropout drawn): its q/k/v and out projections take the
        Linear rules, their output gradients from one batched backward through the
        attention alone; LayerNorm/GroupNorm/BatchNorm (eval) affine parameters: their
        (B, C) per-example gradients; every other module with parameters (custom modules,
        Linear subclasses with their own forward): its per-example gradients materialised
        exactly by ``torch.func.vmap`` over a functional call of that module alone (a loop
        of plain autograd calls where torch.func cannot run it), never skipped. A
        parameter shared by several modules (tied weights) has its per-example gradients
        summed over its uses before their Gram, so the cross terms are exact; a module
        called twice is one layer with the calls' rows concatenated. A parameter that
        reaches the losses outside any hooked module's forward (``F.linear(h, emb.weight)``)
        is refused with a clear error, before the backward. ``model.eval()`` modules with
        dropout are fine; random draws inside a module with parameters are refused (its
        per-example gradients would need the same draws). No process group: the
        cross-rank blocks of G need every rank's per-layer A and Δ (see the README).
        User hooks act as in one backward of the losses: tensor hooks, module forward
        (pre-)hooks and full backward hooks are honoured; a forward hook that runs before
        funcgrad's (a global one, or ``prepend=True``), a non-full backward hook and a tensor
        hook registered inside a generic-rule module's forward are refused before anything
        is written. Modules with ``batch_first=False`` are refused; nn.RNN/GRU/LSTM with
        ``batch_first=True`` are exact (a loop over the examples).

        Independence: loss b must read each counted layer's output through row b alone
        (mixing the inputs before the first layer is fine). It is verified on the first
        call of each signature, and on every call under ``check=True`` or ``"strict"``: one
        more backward, of ``sum_b u_b * losses[b]``, must give each layer's output
        gradients as ``u_b`` times those of the plain one, row by row (along each output's
        batch dim), and materialised modules are run on single examples against their rows.
        The user hooks it finds (tensor hooks on the losses and on hooked modules' inputs
        and outputs, the model's module backward hooks) are held back in that backward, so
        they fire once per call; the comparison is then with one more hook-free backward.
        Hooks elsewhere run in the check's backwards too (see docs/per_example.md). A
        model that mixes the examples (``h - h.mean(0)``, a softmax or batch statistics
        over dim 0, a sort, a pairwise or InfoNCE loss, a time-major layer) is refused
        naming the module and the ops, before ``.grad`` is written. A hooked module that
        reads a counted parameter not its own in its forward (``h + F.linear(h,
        self.lin.weight)`` after ``self.lin(h)``) is refused on every call.
    """
    return PerExample(model, batch_dim=batch_dim)


def per_example_gramian(
    losses: torch.Tensor,
    *,
    inputs: Any = None,
    retain_graph: bool = False,
    check: CheckMode | None = None,
) -> torch.Tensor:
    """The (B, B) Gramian of the per-example gradients, ``G[b, b'] = <grad_b, grad_b'>``,
    for per-example losses computed under `funcgrad.per_example`; no ``.grad`` is
    written.

    Same values as ``J @ J.T`` with ``J`` the (B, P) Jacobian of ``losses`` with respect to
    the parameters (the rows of ``torch.autograd.grad(losses[b], params)``, flattened), at
    the cost of one backward. Its diagonal holds the squared per-example gradient norms
    (Opacus's ghost norms); its rows the gradient similarities of data attribution
    (TracIn-style scores, In-Run Data Shapley's ghost dot-products).

    Args:
        losses: a 1-D tensor of B per-example losses, from a forward of a model hooked by
            `funcgrad.per_example` (the hooks that saw that forward are found).
        inputs: the parameters whose gradients count (tensors, a Module, a mapping or
            ``named_parameters()`` pairs); None: every parameter of the hooked model that
            requires grad.
        retain_graph: keep the graph after the backward.
        check: True or ``"strict"``: verify on this call that loss b reads example b alone
            (one more backward, see `funcgrad.per_example`); False: only on the first call
            of each signature; None: the global setting (`funcgrad.set_check`).

    Returns:
        G, shape (B, B), detached (float32 for half-precision parameters).

    Examples:
        >>> import torch, funcgrad
        >>> model = torch.nn.Linear(3, 1)
        >>> x = torch.randn(4, 3)
        >>> with funcgrad.per_example(model):
        ...     gram = funcgrad.per_example_gramian(model(x).squeeze(1))
        >>> rows = torch.stack([torch.cat([x[b], torch.ones(1)]) for b in range(4)])
        >>> torch.allclose(gram, rows @ rows.T)  # d loss_b / d(W, b) = (x_b, 1)
        True
    """
    recorder = _recorder_of(losses, _GRAMIAN)
    return recorder.gramian(losses, inputs=inputs, retain_graph=retain_graph, check=check)


_NORMS = "funcgrad.per_example_norms(losses)"
_CLIP = "funcgrad.per_example_clip(losses, max_norm)"


def per_example_norms(
    losses: torch.Tensor,
    *,
    inputs: Any = None,
    retain_graph: bool = False,
    check: CheckMode | None = None,
) -> torch.Tensor:
    """The norms of the per-example gradients, ``‖grad_b‖``, for per-example losses computed
    under `funcgrad.per_example`; no ``.grad`` is written.

    Same values as ``funcgrad.per_example_gramian(losses).diagonal().sqrt()``, but only G's
    diagonal is formed: per layer the cheaper of the ghost ``‖A_bᵀ Δ_b‖²`` from
    ``<A_b A_bᵀ, Δ_b Δ_bᵀ>`` (B·T²·(d+p)) and the materialised per-example gradient
    (B·T·d·p), as fastDP's mixed rule, where the Gramian's cross-example blocks cost B
    times that. Opacus's ghost clipping computes the same norms with a second backward.

    Args:
        losses: a 1-D tensor of B per-example losses, from a forward of a model hooked by
            `funcgrad.per_example`.
        inputs: the parameters whose gradients count (as in `funcgrad.per_example_gramian`);
            None: every parameter of the hooked model that requires grad.
        retain_graph: keep the graph after the backward.
        check: as in `funcgrad.per_example_gramian`.

    Returns:
        The (B,) norms, detached (float32 for half-precision parameters).

    Examples:
        >>> import torch, funcgrad
        >>> model = torch.nn.Linear(3, 1)
        >>> x = torch.randn(4, 3)
        >>> with funcgrad.per_example(model):
        ...     norms = funcgrad.per_example_norms(model(x).squeeze(1))
        >>> torch.allclose(norms, (x.pow(2).sum(1) + 1).sqrt())  # d loss_b / d(W, b) = (x_b, 1)
        True
    """
    recorder = _recorder_of(losses, _NORMS)
    run = _Run(recorder, losses, inputs, None, _NORMS, check, diagonal=True)
    return _norms(run.execute(retain_graph, write=False)[0])


def per_example_clip(
    losses: torch.Tensor,
    max_norm: float,
    *,
    accumulate: bool = True,
    inputs: Any = None,
    retain_graph: bool = False,
    check: CheckMode | None = None,
) -> torch.Tensor:
    """DP-SGD's clipped sum: ``.grad += sum_b min(1, C / (‖grad_b‖ + 1e-6)) grad_b`` with
    ``C = max_norm``, from one forward and one backward; returns the norms ``‖grad_b‖``.

    The clipping factors are Opacus's (``C / (norm + 1e-6)``, at most 1), computed from G's
    diagonal alone (as `funcgrad.per_example_norms`), and the update is ``Aᵀ (w ⊙ Δ)`` per
    layer from the same backward (book-keeping: no second backward, no per-example gradient
    on the ghost layers). Add the noise and the accounting after it (docs/per_example.md's
    DP-SGD section shows how, with Opacus's accountant).

    Args:
        losses: a 1-D tensor of B per-example losses, from a forward of a model hooked by
            `funcgrad.per_example`.
        max_norm: C > 0, the clipping bound of each example's gradient.
        accumulate: True: add to ``.grad`` (as ``funcgrad.backward`` and torch's backward);
            False: replace it (as Opacus's optimizer; ``.grad`` is None for a selected
            parameter that does not reach the losses).
        inputs: the parameters whose gradients count (as in `funcgrad.per_example_gramian`);
            None: every parameter of the hooked model that requires grad.
        retain_graph: keep the graph after the backward.
        check: as in `funcgrad.per_example_gramian`.

    Returns:
        The (B,) per-example gradient norms before clipping, detached.

    Examples:
        >>> import torch, funcgrad
        >>> model = torch.nn.Linear(3, 1)
        >>> x = 10 * torch.randn(4, 3)
        >>> with funcgrad.per_example(model):
        ...     norms = funcgrad.per_example_clip(model(x).squeeze(1), max_norm=1.0)
        >>> clipped = torch.cat([x, torch.ones(4, 1)], 1) / (norms + 1e-6)[:, None]
        >>> torch.allclose(model.weight.grad[0], clipped[:, :3].sum(0))
        True
    """
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not (0 < max_norm < float("inf"))
    ):
        raise ValueError(
            f"{_CLIP}: `max_norm` must be a positive finite number (the clipping bound C of "
            f"each example's gradient norm), got {max_norm!r}."
        )
    recorder = _recorder_of(losses, _CLIP)
    clip = _Clip(float(max_norm))
    run = _Run(recorder, losses, inputs, clip, _CLIP, check, replace=not accumulate)
    gram, _ = run.execute(retain_graph, write=True)
    return clip.norms if clip.norms is not None else _norms(gram)


def backward_from_losses(
    losses: Any,
    *,
    through: Any,
    batch_dim: Any,
    weighting: Any,
    level: Any,
    inputs: Any,
    retain_graph: bool,
    chunk_size: Any,
    check: Any,
    process_group: Any,
) -> torch.Tensor:
    """``funcgrad.backward(losses, batch_dim=0, ...)``: the per-example path, or a clear error
    for a call that gave neither ``through`` nor ``batch_dim``."""
    if batch_dim is None:
        raise TypeError(
            "funcgrad.backward(losses, through=...): `through` is missing. Pass the shared "
            "features that the k task losses are computed from, or, for per-example losses "
            "(a 1-D tensor, one loss per example), batch_dim=0 under funcgrad.per_example(model)."
        )
    if through is not None:
        raise ValueError(
            f"{_BACKWARD}: `through` is not used with `batch_dim` (every hooked layer is the "
            "shared part); remove it, or remove batch_dim for k task losses on shared features."
        )
    if batch_dim != 0 or isinstance(batch_dim, bool):
        raise ValueError(f"{_BACKWARD}: `batch_dim` must be 0, got {batch_dim!r}.")
    if level != "params":
        raise ValueError(
            f"{_BACKWARD}: `level` must be 'params' for per-example losses (the Gramian of "
            f"the per-example parameter gradients), got {level!r}: there is no `through`."
        )
    if chunk_size is not None:
        raise ValueError(
            f"{_BACKWARD}: `chunk_size` does not apply to per-example losses (one backward, "
            f"no batched pullback); got {chunk_size!r}, remove it."
        )
    if process_group is not None:
        raise NotImplementedError(_distributed_refusal(_BACKWARD))
    recorder = _recorder_of(losses, _BACKWARD)
    return recorder.backward(
        losses, weighting=weighting, inputs=inputs, retain_graph=retain_graph, check=check
    )
