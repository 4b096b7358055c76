"""The layer base: a hooked module and its recorded calls (`_Layer`), the ghost products,
and the plan that says which rule each layer took."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree

from .._errors import describe
from ._record import _Use

if TYPE_CHECKING:
    from ._run import _Run

# Bound on the elements of one transient block (ghost T x T products, unfolded inputs).
_BLOCK = 1 << 22


def _cat_rows(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """``torch.cat(parts, dim)``, without the copy where there is one part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _all_zero(d: torch.Tensor) -> torch.Tensor:
    """Whether each row ``d[b, t, :]`` of d (B, T, p) is all zeros (B, T) (NaN is not), as
    ``(d == 0).all(-1)`` but from the rows' largest and smallest entries, both 0, float
    reductions: 4-10x faster on a CPU than torch's bool reduction along the last dim (see
    docs/benchmarks_per_example.md), and than ``|d|.amax(-1) == 0`` (which formed ``|d|``:
    16% slower, and a transient copy). A NaN makes both NaN, so not 0. No host read."""
    if d.shape[-1] == 0 or d.numel() == 0:
        return d.new_ones(d.shape[:-1], dtype=torch.bool)
    return (d.amax(-1) == 0) & (d.amin(-1) == 0)


def _live_index(d: torch.Tensor) -> torch.Tensor:
    """The flat indices b·T + t of the rows of d (B, T, p) whose output gradient Δ_bt is not
    all zeros (NaN counts as not zero), in order: one host read (``nonzero``)."""
    return (~_all_zero(d)).reshape(-1).nonzero().squeeze(1)


def _live_rows(
    a: torch.Tensor, d: torch.Tensor, live: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows (b, t) whose output gradient Δ_bt is not all zeros, packed in example order:
    A (N, d), Δ (N, p) and each row's example (N,). A row with Δ_bt = 0 (a padding
    position that the losses do not read, and that no other position reads: a masked key)
    adds exactly 0 to every ghost product it is in, so it is skipped (one host read, none
    where ``live``, `_live_index` of d, is given)."""
    batch, rows = a.shape[:2]
    # (widths given: -1 cannot be inferred where there are no rows, T = 0)
    flat_a = a.reshape(batch * rows, a.shape[2:].numel())
    flat_d = d.reshape(batch * rows, d.shape[2:].numel())
    if live is None:
        live = _live_index(d)
    if live.shape[0] < batch * rows:
        flat_a, flat_d = flat_a.index_select(0, live), flat_d.index_select(0, live)
        examples = live // max(1, rows)
    else:
        examples = torch.arange(batch, device=a.device).repeat_interleave(rows)
    return flat_a, flat_d, examples


def _ghost(
    a: torch.Tensor, d: torch.Tensor, block: int = 0, live: torch.Tensor | None = None
) -> torch.Tensor:
    """``G[b, c] = sum_{t,s} <a_bt, a_cs> <d_bt, d_cs>`` for a (B, T, ·) and d (B, T, p):
    the rows with Δ_bt = 0 skipped (`_live_rows`), the upper triangle alone (c ≥ b, then
    mirrored), in blocks of examples whose (n_rows, N_rows) kernel holds at most ``block``
    elements (default: as many as the layer's own rows, A and Δ: the (BT)² kernel is never
    formed, and the transient memory stays about that of the rows). ``live``: the live
    rows' `_live_index`, where the caller has it already."""
    batch, rows = a.shape[:2]
    if rows == 1:
        return (a[:, 0] @ a[:, 0].T) * (d[:, 0] @ d[:, 0].T)
    flat_a, flat_d, examples = _live_rows(a, d, live)
    count = flat_a.shape[0]
    gram = d.new_zeros(batch, batch)
    if count == 0:
        return gram
    # each example's first packed row: row ranges of the examples, from one host read
    starts = torch.searchsorted(examples, torch.arange(batch + 1, device=a.device)).tolist()
    budget = max(block or (a.numel() + d.numel()), 1 << 16)
    first = 0
    while first < batch:
        lo = starts[first]
        stop = first + 1  # at least one example; as many as the budget allows
        while stop < batch and (starts[stop + 1] - lo) * (count - lo) <= budget:
            stop += 1
        hi = starts[stop]
        if hi > lo:
            part_a, part_d = flat_a[lo:hi], flat_d[lo:hi]
            prod = (part_a @ flat_a[lo:].T).mul_(part_d @ flat_d[lo:].T)  # (n, N - lo)
            cols = prod.new_zeros(hi - lo, batch - first)  # summed over the columns' rows
            cols.index_add_(1, examples[lo:] - first, prod)
            block_rows = prod.new_zeros(stop - first, batch - first)
            block_rows.index_add_(0, examples[lo:hi] - first, cols)
            gram[first:stop, first:] = block_rows
            gram[first:, first:stop] = block_rows.T
        first = stop
    return gram


def _ghost_diagonal(
    a: torch.Tensor, d: torch.Tensor, unread: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum_{t,s} <a_bt, a_bs> <d_bt, d_bs>`` = ``‖A_bᵀ Δ_b‖²`` for each example b (G's
    diagonal alone: B T² products, not B² T²), for a (B, T, d) and d (B, T, p), in blocks.
    ``unread`` (B, T), `_all_zero` of d: the kernel's entries of those rows set to 0, as
    if they were zeroed in A (the same values; B·T² elements where A has B·T·d, and this
    rule is taken where T ≤ dp/(d+p) < d), so that an inf or NaN there adds nothing."""
    batch, rows = a.shape[:2]
    step = max(1, _BLOCK // max(1, rows * rows))
    parts = []
    for s in range(0, batch, step):
        kernel = torch.bmm(a[s : s + step], a[s : s + step].transpose(1, 2))
        if unread is not None:  # in place, rows then columns (no (B, T, T) mask formed)
            part = unread[s : s + step]
            kernel.masked_fill_(part.unsqueeze(2), 0).masked_fill_(part.unsqueeze(1), 0)
        kernel.mul_(torch.bmm(d[s : s + step], d[s : s + step].transpose(1, 2)))
        parts.append(kernel.view(kernel.shape[0], rows * rows).sum(1))
    return torch.cat(parts) if parts else a.new_zeros(0)


def _squares(grads: torch.Tensor) -> torch.Tensor:
    """(B,): the squared norms of per-example gradients (B, ...)."""
    return _flat(grads).pow(2).sum(1)


# Rows of G formed by one product of `_gram` (its upper triangle in such row blocks), at
# least: B / 8 for larger B (fewer, larger products); and the size of product (B * B * D
# multiply-adds) from which the blocks pay for reading the rows again: below it, one product
# (docs/benchmarks_per_example.md, session 9)
_GRAM_ROWS = 32
_GRAM_BLOCKED_FROM = 2**25


def _gram(grads: torch.Tensor) -> torch.Tensor:
    """The upper triangle and diagonal of the per-example gradients' Gram (B, B), its
    lower triangle left 0: every block of G is summed into G, whose lower triangle
    `_run._gramian` mirrors from the upper one. In row blocks of step = max(`_GRAM_ROWS`,
    B/8) examples, each against the examples from its first on: (1 + step/B)/2 of the full
    product's flops (5/8 at B = 128, 9/16 at B = 512; torch has no syrk), 2-15% faster on
    session 9's CPU where the product is large (docs/benchmarks_per_example.md); a small
    product, or fewer than two blocks, is one product, the whole G."""
    flat = _flat(grads)
    batch = flat.shape[0]
    step = _gram_step(batch, flat.shape[1])
    if step >= batch:
        return flat @ flat.T
    gram = flat.new_zeros(batch, batch)
    for s in range(0, batch, step):
        gram[s : s + step, s:] = flat[s : s + step] @ flat[s:].T
    return gram


def _gram_step(batch: int, width: int) -> int:
    """The rows of G that one product of `_gram` forms for (B, width) gradients: B (one
    product, the whole G) where the product is small or would make fewer than two blocks."""
    step = max(_GRAM_ROWS, batch // 8)
    if batch < 2 * step or batch * batch * width < _GRAM_BLOCKED_FROM:
        return max(batch, 1)
    return step


def _gram_pairs(batch: int, width: int) -> int:
    """The entries (b, c) of G that `_gram` forms for (B, width) gradients, each at the cost
    of ``width`` multiply-adds: B² for one product, about (1 + step/B)/2 of it in blocks."""
    step = _gram_step(batch, width)
    return sum(min(step, batch - s) * (batch - s) for s in range(0, batch, step))


def _flat(grads: torch.Tensor) -> torch.Tensor:
    """(B, ...) as (B, P); B = 0 too (where ``reshape(B, -1)`` cannot tell P)."""
    return grads.reshape(grads.shape[0], math.prod(grads.shape[1:]))


@dataclasses.dataclass
class _LayerPlan:
    name: str
    kind: str
    shape: tuple[int, ...]
    rule: str
    ghost_flops: float | None
    materialised_flops: float | None
    params: list[str]

    def line(self) -> str:
        costs = "/".join(
            "-" if c is None else f"{c / 1e6:.3g}M"
            for c in (self.ghost_flops, self.materialised_flops)
        )
        params = ", ".join(self.params)
        return f"  {self.name}  {self.kind}  {self.shape}  {self.rule}  [{costs}]  {params}"


@dataclasses.dataclass
class PerExamplePlan:
    """The rule each layer took in the last per-example call, and its cost estimates
    (flops of its Gramian block, ghost / materialised)."""

    batch: int
    layers: list[_LayerPlan]

    def __str__(self) -> str:
        head = (
            f"per-example plan, B={self.batch} (flops of the Gramian per layer: ghost / "
            "materialised)"
        )
        return "\n".join([head, *(layer.line() for layer in self.layers)])


class _Layer:
    """A hooked module and its recorded calls in one graph; its parameters ``params`` (name
    -> the selected parameter)."""

    kind = "generic"

    def __init__(self, run: _Run, module: nn.Module, uses: list[_Use], params: dict[str, Any]):
        self.run, self.module, self.uses, self.params = run, module, uses, params
        self.name = run.recorder._names.get(module, type(module).__name__)
        self.batch = run.batch
        self.rule = ""
        self.ghost_flops: float | None = None
        self.materialised_flops: float | None = None
        # formed during the one backward (`_run._Stream`): this layer's block of G, or its
        # share of G's diagonal; and its plan, kept when its rows were let go
        self.streamed: torch.Tensor | None = None
        self.planned: _LayerPlan | None = None
        # formed with the other tiny layers during the backward (`_run._Stream.flush`): its
        # share is in the run's `formed`
        self.grouped = False
        self.tiny: dict[bool, bool] = {}  # `_rules._tiny`, by `diagonal`

    def release(self) -> None:
        """Its share formed during the backward (`_run._Stream`): the plan kept, the rows
        (inputs A, output gradients Δ) let go, so that their memory is freed as the backward
        goes. Nothing reads them after this."""
        self.planned = self.plan()
        for use in self.uses:
            use.args, use.kwargs, use.versions = (), {}, []
            use.deltas = [None] * len(use.deltas)
            use.inner_deltas = [None] * len(use.inner_deltas)
            use.inner_input = None

    def fail(self, what: str, got: Any, shape: tuple[int, ...] = ()) -> None:
        flattened = ""
        if self.batch > 0 and len(shape) and shape[0] > self.batch and shape[0] % self.batch == 0:
            flattened = (
                f" Its dim 0 is {shape[0]} = B·{shape[0] // self.batch}: the batch flattened "
                "with another dim, as tokens flattened to (B·T, d) before a layer (Hugging "
                "Face's OPT does so before its feed-forward Linears and their LayerNorm), "
                "whose rows no longer say which example they belong to: keep (B, T, d) there "
                "(reshape back around such layers)."
            )
        raise ValueError(
            f"{self.run.call}: module {self.name!r} ({type(self.module).__name__}) {what} "
            f"{got}, but the losses have B = {self.batch} entries: per-example Gramians need "
            "every hooked module's inputs and outputs batched along dim 0 (batch_first=True "
            "for nn.MultiheadAttention / nn.Transformer*; no reshape of the batch into other "
            "dimensions, no output shared by the whole batch such as positional embeddings "
            f"of shape (T, d): expand them to (B, T, d) first).{flattened} Fix the module, or "
            "leave its parameters out with inputs=."
        )

    def input(self, use: _Use) -> torch.Tensor:
        """The call's first argument (the layer's input A), checked to be batched."""
        x = use.args[0] if use.args else next(iter(use.kwargs.values()), None)
        if not isinstance(x, torch.Tensor):
            self.fail("has an input that", f"is {describe(x)}")
        assert isinstance(x, torch.Tensor)
        self.check_batched(x, "has an input that")
        return x

    def check_batched(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.ndim == 0 or tensor.shape[0] != self.batch:
            self.fail(what, f"has shape {tuple(tensor.shape)}", tuple(tensor.shape))

    def check_layout(self) -> None:
        """A module that says which dim is its batch (``batch_first``) has it at dim 0:
        time-major layouts are refused by their attribute, also where T == B."""
        if getattr(self.module, "batch_first", None) is False:
            raise ValueError(
                f"{self.run.call}: module {self.name!r} ({type(self.module).__name__}) has "
                "batch_first=False: its inputs and outputs are time-major (T, B, ...), "
                "where per-example Gramians need them batched along dim 0 (this holds even "
                "where T == B, which the shapes cannot tell). Build it with "
                "batch_first=True and pass (B, T, ...) inputs, or leave its parameters out "
                "with inputs=."
            )

    def precheck(self) -> None:
        """The batch dimension of every recorded input and output, before the backward."""
        self.check_layout()
        for use in self.uses:
            for _, shape, _ in use.outputs:
                if len(shape) == 0 or shape[0] != self.batch:
                    self.fail("has an output that", f"has shape {tuple(shape)}", tuple(shape))
            if self.kind != "generic":
                self.input(use)

    def out_dim(self, use: _Use, k: int) -> int:
        """The batch dim of the call's recorded output k."""
        return 0

    def leaf_dims(self, use: _Use) -> tuple[list[Any], Any, list[int | None]]:
        """The call's flat arguments, their spec and each one's batch dim (None: not
        batched)."""
        leaves, spec = _pytree.tree_flatten((use.args, use.kwargs))
        shared = self.shared_arguments(use)
        dims: list[int | None] = [
            0
            if isinstance(x, torch.Tensor)
            and x.ndim >= 1
            and x.shape[0] == self.batch
            and not any(x is s for s in shared)
            else None
            for x in leaves
        ]
        return leaves, spec, dims

    def shared_arguments(self, use: _Use) -> list[torch.Tensor]:
        """Arguments that are not per example though their dim 0 may be B: an
        nn.MultiheadAttention's 2-D ``attn_mask`` (T, S), shared by the batch (T == B would
        read as batched). Every other tensor of size B along dim 0 is taken as per example."""
        if not isinstance(self.module, nn.MultiheadAttention):
            return []
        bound = inspect.signature(self.module.forward).bind_partial(*use.args, **use.kwargs)
        mask = bound.arguments.get("attn_mask")
        if not isinstance(mask, torch.Tensor):
            return []
        if mask.ndim == 3:
            self.fail(
                "has an attn_mask that",
                f"has shape {tuple(mask.shape)} (a 3-D mask holds one (T, S) mask per example "
                "and head, (B * num_heads, T, S), which per-example gradients cannot split by "
                "example here): pass a 2-D (T, S) mask shared by the batch, or key_padding_mask "
                "(B, S)",
            )
        return [mask]

    def delta(self, use: _Use, i: int = 0) -> torch.Tensor:
        d = use.deltas[i]
        if d is None:
            _, shape, dtype = use.outputs[i]
            d = torch.zeros(shape, dtype=dtype, device=self.run.device)
        dim = self.out_dim(use, i)
        if d.ndim <= dim or d.shape[dim] != self.batch:
            self.fail("has an output gradient that", f"has shape {tuple(d.shape)}")
        return d

    def gramian(self) -> torch.Tensor:
        """This layer's block of G (its parameters alone)."""
        self.rule = "materialised"
        return sum((_gram(g) for g in self.per_example().values()), self.zero())

    def diagonal(self) -> torch.Tensor:
        """This layer's share of G's diagonal, (B,): its per-example gradients' squared norms."""
        self.rule = "materialised"
        found = self.per_example().values()
        return sum((_squares(g.to(self.run.dtype)) for g in found), self.zero_diagonal())

    def wide(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype this layer's per-example gradients and its share of the update are
        formed in from operands of ``dtype`` (Δ's): that of its parameters' `.grad` where
        wider. Under a caller's autocast Δ is bf16/fp16 and the parameters float32: the
        clip factors and the products rounded to Δ's dtype left a clipped norm above C, and
        the update off the G that decided them (a bf16 model stays in bf16)."""
        for param in self.params.values():
            dtype = torch.promote_types(dtype, param.dtype)
        return dtype

    def zero_diagonal(self) -> torch.Tensor:
        return torch.zeros(self.batch, dtype=self.run.dtype, device=self.run.device)

    def zero(self) -> torch.Tensor:
        return torch.zeros(self.batch, self.batch, dtype=self.run.dtype, device=self.run.device)

    def per_example(self) -> dict[str, torch.Tensor]:  # name -> (B, *shape)
        raise NotImplementedError

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def plan(self) -> _LayerPlan:
        shape: tuple[int, ...] = ()
        first = self.uses[0].args[0] if self.uses[0].args else None
        if isinstance(first, torch.Tensor):
            shape = tuple(first.shape)
        return _LayerPlan(
            self.name,
            type(self.module).__name__,
            shape,
            self.rule,
            self.ghost_flops,
            self.materialised_flops,
            list(self.params),
        )


def _add(found: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    found[key] = found[key] + value if key in found else value
