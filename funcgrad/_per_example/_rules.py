"""The native rules: Linear (ghost or materialised), Conv1d/Conv2d, Embedding and the
norms' affine parameters."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import describe
from ._layer import (
    _BLOCK,
    _add,
    _all_zero,
    _cat_rows,
    _ghost,
    _ghost_diagonal,
    _gram,
    _gram_pairs,
    _Layer,
    _squares,
)
from ._record import _shared_use, _Use

_FEW_CHANNELS = 4  # a convolution's input channels: at most this many, and at most
_FEW_OUTPUTS = 32  # this many output channels, its per-example gradients are formed by
# `_Conv.by_output_kernel` on the CPU (its cost grows with both and with the positions:
# wider, the grouped weight-gradient kernel wins; docs/benchmarks_per_example.md)
_PAIRS = 1 << 18  # elements: the Embedding's pair products, at least this many a block
_WHOLE = 1 << 20  # elements (4 MiB in float32): a per-example weight gradient this
# small is formed in one product, never in blocks of output features; a larger one in
# blocks of about this many elements at least (a quarter of the rows A and Δ where that is
# more): blocks of few output features cost more per flop (strided, small products; the
# transformer's q/k/v layer: 6.1 ms in blocks of 32 features, 5.0 ms whole, one thread)
_TINY = 1 << 13  # elements: a Linear whose rows A and Δ hold at most this many, and whose
# per-example weight gradients at most this many too, is a tiny layer (`_tiny`): formed
# with the other tiny layers of its shape in one product, not one by one (each layer's own
# ops and Python cost more than its arithmetic there; at 2^14 the stacked copies made the
# update slower than one product a layer: docs/benchmarks_per_example.md)
_TINY_HELD = 1 << 20  # elements: the tiny layers' rows held in the backward before they
# are formed together (`_run._Stream`), and the most stacked in one product, so that
# neither raises the peak by more than about this


class _Rows(_Layer):
    """A layer read as rows: its inputs A (B, T, d) and output gradients Δ (B, T, p), the
    calls' rows concatenated (the data that `_Dense`'s rules read)."""

    transposed = False  # the weight stored (d, p), as HF's Conv1D: x @ W + b
    bias_kept: torch.Tensor | None = None  # `bias_rows`, once formed
    # rows with Δ_bt = 0 zeroed in A: set where G came out not finite (see _Run._weigh),
    # and always for a layer formed during the backward (`_run._Stream`)
    zero_unread = False
    unread: torch.Tensor | None = None  # (B, T): `_all_zero` of Δ, where the count formed it

    def oriented(self, grad: torch.Tensor) -> torch.Tensor:
        """A weight gradient computed as (..., p, d), in the layout of the weight."""
        return grad.transpose(-1, -2) if self.transposed else grad

    def rows(self, zeroed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """A (B, T, d) and Δ (B, T, p), the calls' rows concatenated; where `zero_unread`
        (and ``zeroed``), A's rows that no loss reads set to 0."""
        a_parts, d_parts = [], []
        for use in self.uses:
            a, d = self.unfold(use)
            if self.zero_unread and zeroed:  # one call: its mask, if the count formed it
                a = _unread_rows_zeroed(a, d, self.unread if len(self.uses) == 1 else None)
            a_parts.append(a)
            d_parts.append(d)
        return _cat_rows(a_parts), _cat_rows(d_parts)

    def unfold(self, use: _Use) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.input(use)
        if a.ndim < 2:
            self.fail("has an input that", describe(a))
        d = self.delta(use)
        return _by_example(a, self.batch), _by_example(d, self.batch)

    def dims(self) -> tuple[int, int, int]:
        """(T rows per example over all calls, d, p), from shapes alone."""
        weight = self.params["weight"]  # called where the weight counts
        if self.transposed:
            width, out = weight.shape
        else:
            width, out = weight[0].numel(), weight.shape[0]
        rows = sum(self.input(use).numel() // (self.batch * width) for use in self.uses)
        return rows, width, out

    def bias_rows(self) -> torch.Tensor:
        """(B, p): the per-example bias gradients, Δ summed over each example's rows; kept
        (`bias_kept`), so that the update after G (or its diagonal) reads them, not Δ."""
        if self.bias_kept is None:
            found = [self.delta(use) for use in self.uses]
            sums = [_by_example(d, self.batch).sum(1, dtype=self.wide(d.dtype)) for d in found]
            self.bias_kept = sum(sums[1:], sums[0])
        return self.bias_kept

    def flat(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, Δ) as (B, d) and (B, p) for one call on 2-D inputs (the MLP case: the
        fewest ops, as each costs microseconds of overhead at small B), else None."""
        if isinstance(self, _Conv) or len(self.uses) != 1:
            return None
        use = self.uses[0]
        a = use.args[0] if use.args else None
        if not isinstance(a, torch.Tensor) or a.ndim != 2 or use.deltas[0] is None:
            return None
        return a, use.deltas[0]


class _Dense(_Rows):
    """Linear, and convolutions once unfolded (`_Conv`): the ghost and materialised rules
    on the rows A (B, T, d) and Δ (B, T, p) of `_Rows`."""

    kind = "linear"
    kept: torch.Tensor | None = None  # materialised per-example weight gradients, if small

    def gramian(self) -> torch.Tensor:
        dtype = self.run.dtype
        flat = self.flat()
        if flat is not None and "weight" in self.params:  # ghost, T = 1
            a, d = flat
            if a.dtype != dtype or d.dtype != dtype:
                a, d = a.to(dtype), d.to(dtype)
            batch, width, out = a.shape[0], a.shape[1], d.shape[1]
            self.ghost_flops = float(batch * batch * (width + out + 1))
            self.materialised_flops = float(batch * width * out * (1 + batch))
            return self.ghost_flat(a, d, "bias" in self.params)
        bias = self.bias_rows().to(dtype) if "bias" in self.params else None
        if "weight" not in self.params:
            self.rule = "bias only"
            assert bias is not None
            return bias @ bias.T
        batch = self.batch
        rows, width, out = self.dims()
        # the ghost products on the rows whose Δ is not zero (padding skipped), upper
        # triangle: about N²/2·(d+p) for N such rows; the materialised rule's Gram, the
        # entries that `_gram` forms (its upper triangle, in blocks, where it is large)
        self.materialised_flops = float(batch * rows * width * out) + self.gram_flops(
            rows, width, out
        )

        def ghost(live: int) -> float:
            return float(live * (live + rows) // 2) * (width + out + 1)

        live, index = batch * rows, None
        if rows > 1 and out > 0 and not isinstance(self, _Conv):
            # the live rows' indices (a pass over Δ and ONE host read, `nonzero`): their
            # count decides, and the ghost products take them as they are (no second read)
            self.unread = _all_zero(
                _cat_rows([_by_example(self.delta(use), batch) for use in self.uses])
            )
            index = (~self.unread).reshape(-1).nonzero().squeeze(1)
            live = int(index.shape[0])
        self.ghost_flops = ghost(live)
        if self.ghost_flops <= self.materialised_flops:
            # the rows no loss reads are skipped by the ghost products: never zeroed here
            a, d = self.rows(zeroed=False)
            a, d = a.to(dtype), d.to(dtype)
            if rows == 1:
                return self.ghost_flat(a[:, 0], d[:, 0], bias is not None)
            self.rule = f"ghost <A_b A_b'ᵀ, Δ_b Δ_b'ᵀ> T={rows}, {live} rows live"
            g = _ghost(a, d, live=index)
            if live < batch * rows:
                # G skipped those rows (finite even where they hold inf or NaN): the update
                # and the norms zero them too (the count is known: no host read)
                self.zero_unread = True
        else:
            self.rule = f"materialised A_bᵀ Δ_b T={rows}"
            g = self.materialised(lambda grads: _gram(grads.to(dtype)), rows, width, out)
        return g if bias is None else g + bias @ bias.T

    def diagonal(self) -> torch.Tensor:
        """G's diagonal alone: ``‖a_b‖² ‖Δ_b‖²`` for one row per example (``(‖a_b‖² + 1)
        ‖Δ_b‖²`` with the bias, whose rows are Δ); else per layer the
        cheaper of the ghost ``<A_b A_bᵀ, Δ_b Δ_bᵀ>`` (B·T²·(d+p)) and the materialised
        ``‖A_bᵀ Δ_b‖²`` (B·T·d·p), fastDP's mixed rule (2T² ≤ dp, about)."""
        dtype = self.run.dtype
        flat = self.flat()
        if flat is not None and "weight" in self.params:  # the bias's rows are Δ itself
            a, d = flat[0].to(dtype), flat[1].to(dtype)
            self.rule = "ghost ‖A_b‖²‖Δ_b‖²"
            inputs: torch.Tensor = torch.linalg.vecdot(a, a)  # (autocast off: _Run.execute)
            outputs: torch.Tensor = torch.linalg.vecdot(d, d)
            return (inputs + 1 if "bias" in self.params else inputs) * outputs
        bias = self.bias_rows().to(dtype) if "bias" in self.params else None
        found = self.zero_diagonal() if bias is None else _squares(bias)
        if "weight" not in self.params:
            self.rule = "bias only"
            return found
        batch = self.batch
        rows, width, out = self.dims()
        self.ghost_flops = float(batch * rows * rows * (width + out))
        self.materialised_flops = float(batch * rows * width * out)
        if self.ghost_flops <= self.materialised_flops:
            # the rows no loss reads masked in the (B, T, T) kernel, not zeroed in A
            a, d = self.rows(zeroed=False)
            unread = _all_zero(d) if self.zero_unread and rows > 1 else None
            self.rule = f"ghost <A_b A_bᵀ, Δ_b Δ_bᵀ> T={rows}"
            return found + _ghost_diagonal(a.to(dtype), d.to(dtype), unread)
        self.rule = f"materialised ‖A_bᵀ Δ_b‖² T={rows}"
        return found + self.materialised(lambda grads: _squares(grads.to(dtype)), rows, width, out)

    def materialised(
        self, reduce: Callable[[torch.Tensor], torch.Tensor], rows: int, width: int, out: int
    ) -> torch.Tensor:
        """The sum of ``reduce`` (the Gram, or the squared norms) over the per-example weight
        gradients ``A_bᵀ Δ_b``. Kept whole for the update where `keeps` says so; else formed
        in blocks of output features (a Linear: (B, p_block, d) at a time, as many elements
        as a quarter of the rows A and Δ), so that the transient memory stays below that of
        the rows (exact: the Gram is a sum over the weight's entries)."""
        if isinstance(self, _Conv) or self.writes_whole(rows, width, out):
            grads = self.weight_per_example()
            if self.keeps(grads, rows, width, out):
                self.kept = grads
            return reduce(grads)
        a, d = self.rows()
        dtype = self.wide(d.dtype)
        a, d = a.to(dtype), d.to(dtype)
        step = self.feature_step(rows, width, out)
        found = [
            reduce(torch.bmm(d[..., s : s + step].transpose(1, 2), a)) for s in range(0, out, step)
        ]
        return sum(found[1:], found[0])

    def feature_step(self, rows: int, width: int, out: int) -> int:
        """The output features of one block of `materialised` ((B, step, d) gradients): a
        quarter of the rows' elements, or `_WHOLE` where that is more."""
        budget = max(self.batch * rows * (width + out) // 4, _WHOLE)
        return max(1, budget // max(1, self.batch * width))

    def gram_flops(self, rows: int, width: int, out: int) -> float:
        """The multiply-adds of the materialised rule's Gram as `materialised` forms it: the
        entries of G that `_gram` forms (its upper triangle in blocks, where the product is
        large), for the whole gradients or for each block of output features."""
        if isinstance(self, _Conv) or self.writes_whole(rows, width, out):
            return float(_gram_pairs(self.batch, width * out) * width * out)
        step = self.feature_step(rows, width, out)
        sizes = [min(step, out - s) * width for s in range(0, out, step)]
        return float(sum(_gram_pairs(self.batch, size) * size for size in sizes))

    def writes_whole(self, rows: int, width: int, out: int) -> bool:
        """Whether the whole (B, p, d) per-example gradients are formed at once: where they
        are kept for the update (`keeps`), small next to the rows (a block would hold all of
        them), or small outright (at most `_WHOLE` elements: one product, where blocks of a
        tiny layer would cost one product per output feature for no memory saved)."""
        whole = self.batch * width * out
        kept = self.run.writes and 2 * whole <= self.batch * rows * (width + out)
        return kept or whole <= _WHOLE or 4 * whole <= self.batch * rows * (width + out)

    def release(self) -> None:
        super().release()
        self.kept = self.unread = self.bias_kept = None

    def keeps(self, grads: torch.Tensor, rows: int, width: int, out: int) -> bool:
        """Whether the update reads the per-example gradients (``w @ grads``: B·d·p) rather
        than ``Aᵀ (w ⊙ Δ)`` (B·T·d·p): where they take at most half the memory of the rows A
        and Δ held already (a convolution's many positions), so that keeping them does not
        raise the peak."""
        return (
            self.run.writes
            and 2 * grads.numel() <= self.batch * rows * (width + out)
            and grads.numel() <= _BLOCK
        )

    def ghost_flat(self, a: torch.Tensor, d: torch.Tensor, bias: bool) -> torch.Tensor:
        """``(A Aᵀ)∘(Δ Δᵀ)`` for one row per example, (A Aᵀ + 1)∘(Δ Δᵀ) with the bias (whose
        rows are Δ)."""
        self.rule = "ghost (A Aᵀ)∘(Δ Δᵀ)"
        kernel = a @ a.T
        if bias:
            kernel += 1
        return kernel.mul_(d @ d.T)

    def weight_per_example(self) -> torch.Tensor:
        """(B, p, d): ``A_bᵀ Δ_b`` in blocks of examples (bounded transient memory)."""
        a, d = self.rows()
        batch, rows, width = a.shape
        step = max(1, _BLOCK // max(1, rows * width))
        dtype = self.wide(d.dtype)
        parts = [
            torch.bmm(d[s : s + step].to(dtype).transpose(1, 2), a[s : s + step].to(dtype))
            for s in range(0, batch, step)
        ]
        return _cat_rows(parts, 0)  # one block: no copy

    def per_example(self) -> dict[str, torch.Tensor]:
        found = {}
        if "weight" in self.params:
            grads = self.oriented(self.weight_per_example())
            found["weight"] = grads.reshape(self.batch, *self.params["weight"].shape)
        if "bias" in self.params:
            found["bias"] = self.bias_rows()
        return found

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        flat = self.flat()
        if flat is not None:  # one call on 2-D inputs: (w ⊙ Δ)ᵀ A and its column sums
            a, d = flat
            dtype = self.wide(d.dtype)
            wd = d.to(dtype) * weights.to(dtype).unsqueeze(1)
            if "weight" in self.params:
                found["weight"] = self.oriented(wd.T @ a.to(dtype))
            if "bias" in self.params:
                found["bias"] = wd.sum(0)
            return found
        if self.kept is not None:  # w @ the per-example gradients: B·d·p
            kept = self.kept  # (formed in `wide`)
            summed = self.oriented(torch.tensordot(weights.to(kept.dtype), kept, dims=1))
            found["weight"] = summed.reshape(self.params["weight"].shape)
            if "bias" in self.params:
                bias = self.bias_rows()
                found["bias"] = bias.T @ weights.to(bias.dtype)
            return found
        for use in self.uses:
            for key, value in self.weighted(use, weights).items():
                _add(found, key, value)
        if "bias" in self.params and self.bias_kept is not None:
            # the per-example bias gradients that G (or its diagonal) formed: (B, p), where
            # ``Δᵀ w`` would read Δ (B·T·p) again
            found["bias"] = self.bias_kept.T @ weights.to(self.bias_kept.dtype)
        return found

    def weighted(self, use: _Use, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """One call's share of the update: ``Aᵀ (w ⊙ Δ)``, one matmul (and ``Δᵀ w`` for the
        bias, where its per-example gradients were not formed: `bias_kept`)."""
        a, d = self.unfold(use)
        if self.zero_unread:
            a = _unread_rows_zeroed(a, d, self.unread if len(self.uses) == 1 else None)
        dtype = self.wide(d.dtype)
        a, d, w = a.to(dtype), d.to(dtype), weights.to(dtype)
        # w scales the narrower of Δ and A, a new tensor either way; where the other one is
        # a (T, B, ·) tensor seen as (B, T, ·) (attention's [Δq, Δk, Δv], its
        # out-projection's input), the rows are taken in its memory order (t, b), the
        # scaled one written in that order, so that the other one is read with no copy
        # (the product sums over the rows, in either order)
        scale_d = d.shape[-1] <= a.shape[-1]
        other = a if scale_d else d
        found = {}
        if not other.is_contiguous() and other.transpose(0, 1).is_contiguous():
            a, d, rows_w = a.transpose(0, 1), d.transpose(0, 1), w[None, :, None]
            if "weight" in self.params:
                if scale_d:
                    found["weight"] = self.oriented(_rows_of(_scaled(d, rows_w)).T @ _rows_of(a))
                else:
                    found["weight"] = self.oriented(_rows_of(d).T @ _rows_of(_scaled(a, rows_w)))
            if "bias" in self.params and self.bias_kept is None:
                found["bias"] = d.sum(0).T @ w  # each example's rows summed, then ᵀ w
            return found
        # rows (b, t): each example's weight on its T rows (T = 0 or B = 0: no rows)
        w = w[:, None].expand(d.shape[0], d.shape[1]).reshape(-1)
        a, d = _rows_of(a), _rows_of(d)
        if "weight" in self.params:
            if scale_d:
                found["weight"] = self.oriented((d * w[:, None]).T @ a)
            else:
                found["weight"] = self.oriented(d.T @ (a * w[:, None]))
        if "bias" in self.params and self.bias_kept is None:
            found["bias"] = d.T @ w
        return found


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """(R0, R1, k) as (R0·R1, k) rows (a view where its memory allows; R0·R1 = 0 too)."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[-1])


def _scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x * w``, written contiguous in x's dim order (so that `_rows_of` is a view); an
    update, never differentiated (``out=`` refuses inputs that require grad)."""
    with torch.no_grad():
        return torch.mul(x, w, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


def _tiny(layer: _Layer, diagonal: bool) -> bool:
    """Whether ``layer`` is a tiny Linear, formed with the others of its shape (`_tiny_share`,
    `_tiny_update`) rather than alone: a Linear (or HF Conv1D; not a convolution) with one
    call and a weight, whose rows A and Δ (B·T·(d + p)) and per-example weight gradients
    (B·d·p) hold at most `_TINY` elements each, and for which the materialised rule is no
    dearer than the ghost one with every row read (the rule that such a layer takes alone
    anyway, save where many rows are unread; exact either way). Shapes alone: no host read;
    kept on the layer (asked again for G and for the update)."""
    found = layer.tiny.get(diagonal)
    if found is None:
        found = layer.tiny[diagonal] = _tiny_by_shape(layer, diagonal)
    return found


def _tiny_by_shape(layer: _Layer, diagonal: bool) -> bool:
    if type(layer) not in (_Dense, _TransposedDense) or len(layer.uses) != 1:
        return False
    if "weight" not in layer.params:
        return False
    assert isinstance(layer, _Dense)
    batch = layer.batch
    if batch == 0 or layer.params["weight"].numel() == 0:  # (no rows: `dims` cannot tell T)
        return False
    rows, width, out = layer.dims()
    if batch * rows * (width + out) > _TINY or batch * width * out > _TINY:
        return False
    if diagonal:  # the per-layer rule's costs: `_Dense.diagonal`
        return rows * width * out <= rows * rows * (width + out)
    live = batch * rows  # `_Dense.gramian`'s, every row live
    ghost = (live * (live + rows) // 2) * (width + out + 1)
    return batch * rows * width * out + batch * batch * width * out <= ghost


def _tiny_rows(layers: list[_Layer]) -> list[tuple[list[_Dense], torch.Tensor, torch.Tensor]]:
    """Tiny layers (`_tiny`) grouped by shape and dtype: each group's rows stacked, A (n, B,
    T, d) and Δ (n, B, T, p), with the rows no loss reads (Δ_bt all zeros) zeroed in A for
    all of them at once where they have `zero_unread` (T > 1: as `_unread_rows_zeroed`, one
    pass on the device, no host read), in the order the layers came; a group whose rows
    hold more than `_TINY_HELD` elements in several stacks."""
    groups: dict[tuple[object, ...], list[tuple[_Dense, torch.Tensor, torch.Tensor]]] = {}
    # per shape: its current stack's number and the elements of its rows
    stack: dict[tuple[object, ...], tuple[int, int]] = {}
    for layer in layers:
        assert isinstance(layer, _Dense)
        a, d = layer.unfold(layer.uses[0])
        key = (type(layer), a.shape, d.shape, a.dtype, d.dtype, a.device, *layer.params)
        key = (*key, layer.zero_unread)
        number, held = stack.get(key, (0, 0))
        held += a.numel() + d.numel()
        if held > _TINY_HELD and held > a.numel() + d.numel():  # full: a new stack
            number, held = number + 1, a.numel() + d.numel()
        stack[key] = (number, held)
        groups.setdefault((*key, number), []).append((layer, a, d))
    found = []
    for members in groups.values():
        a = torch.stack([m[1] for m in members])
        d = torch.stack([m[2] for m in members])
        if d.shape[2] > 1 and members[0][0].zero_unread:
            a = a.masked_fill(_all_zero(d).unsqueeze(-1), 0)
        found.append(([m[0] for m in members], a, d))
    return found


def _tiny_share(layers: list[_Layer], dtype: torch.dtype, diagonal: bool) -> torch.Tensor:
    """The tiny layers' share of G (B, B), or of its diagonal (B,): per group of one shape,
    the per-example gradients ``A_bᵀ Δ_b`` of all its layers in one product (n·B, p, d),
    with the bias rows (Δ summed over each example's rows) beside them, then their Gram (or
    squared norms) summed over the layers. Each layer's plan says so. Their rows no loss
    reads are zeroed, here and in the update (`zero_unread`)."""
    for layer in layers:
        assert isinstance(layer, _Dense)
        layer.zero_unread = True
    total: torch.Tensor | None = None
    for members, a, d in _tiny_rows(layers):
        n, batch, rows = d.shape[:3]
        size = a.shape[-1] * d.shape[-1]  # (T = 0 too, where -1 cannot tell it)
        wide = members[0].wide(d.dtype)
        a, d = a.to(wide), d.to(wide)
        grads = torch.matmul(d.transpose(-1, -2), a).reshape(n, batch, size)
        if "bias" in members[0].params:
            grads = torch.cat([grads, d.sum(2)], -1)
        grads = grads.to(dtype)
        share = grads.pow(2).sum((0, 2)) if diagonal else torch.matmul(grads, grads.mT).sum(0)
        total = share if total is None else total + share
        for layer in members:
            width, out = a.shape[-1], d.shape[-1]
            rule = f"‖A_bᵀ Δ_b‖² T={rows}" if diagonal else f"A_bᵀ Δ_b T={rows}"
            layer.rule = f"materialised {rule}, one product for {n} tiny layer(s) of its shape"
            layer.materialised_flops = float(batch * rows * width * out)
            layer.ghost_flops = None
    assert total is not None
    return total


def _tiny_update(
    layers: list[_Layer], weights: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tiny layers' shares of the update, ``Aᵀ (w ⊙ Δ)`` and the bias's ``Δᵀ w``, one
    product per group of one shape (their rows zeroed where `zero_unread`, as
    `_Dense.weighted` does): (parameter, its update) pairs."""
    found = []
    for members, a, d in _tiny_rows(layers):
        n, batch, rows, width, out = *d.shape[:3], a.shape[-1], d.shape[-1]
        dtype = members[0].wide(d.dtype)
        wd = (d.to(dtype) * weights.to(dtype)[:, None, None]).reshape(n, batch * rows, out)
        grads = torch.bmm(wd.mT, a.reshape(n, batch * rows, width).to(dtype))
        bias = wd.sum(1) if "bias" in members[0].params else None
        for i, layer in enumerate(members):
            found.append((layer.params["weight"], layer.oriented(grads[i])))
            if bias is not None:
                found.append((layer.params["bias"], bias[i]))
    return found


def _unread_rows_zeroed(
    a: torch.Tensor, d: torch.Tensor, unread: torch.Tensor | None = None
) -> torch.Tensor:
    """A (B, T, d) with the rows whose output gradient Δ_bt is all zeros set to 0: such a
    row adds nothing, even where it holds inf or NaN (torch's dense Δᵀ A gives NaN there),
    so that G, its diagonal (the norms) and the update agree with the ghost products, which
    skip it (`_live_rows`). T = 1 (one row per example) is left as torch computes it. A
    pass over Δ and one over A, on the device (no host read): for a layer formed during the
    backward always (its rows are let go there), else only where G (or its diagonal) came
    out not finite without it. ``unread``: `_all_zero` of d, where it is formed already."""
    if a.shape[1] <= 1 or a.shape[:2] != d.shape[:2]:
        return a
    return a.masked_fill((_all_zero(d) if unread is None else unread).unsqueeze(-1), 0)


def _by_example(x: torch.Tensor, batch: int) -> torch.Tensor:
    """(B, ..., k) as (B, T, k), T the product of the middle dims (B = 0 or T = 0 too, where
    ``reshape(B, -1, k)`` cannot tell T)."""
    return x.reshape(batch, math.prod(x.shape[1:-1]), x.shape[-1])


class _TransposedDense(_Dense):
    """Hugging Face's ``Conv1D`` (GPT-2's projections): a Linear whose weight is stored
    transposed, (d, p), so ``x @ W + b``; the same rules, the weight gradients transposed."""

    transposed = True


class _Conv(_Dense):
    """Conv1d/Conv2d (zeros padding, groups=1): a Linear on the unfolded input for the
    ghost products; torch's own weight-gradient kernel otherwise (the per-example
    gradients as one convolution with the examples as groups, and the update along
    ``w ⊙ Δ``), with no unfolded copy."""

    kind = "conv"

    @property
    def weight(self) -> torch.Tensor:
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def geometry(self) -> tuple[int, list[int], list[int], list[int]]:
        module = self.module
        assert isinstance(module, (nn.Conv1d, nn.Conv2d))
        return (
            len(module.kernel_size),
            list(module.stride),
            list(_padding(module)),
            list(module.dilation),
        )

    def unfold(self, use: _Use) -> tuple[torch.Tensor, torch.Tensor]:
        dims, stride, padding, dilation = self.geometry()
        x = self.input(use)
        if x.ndim != dims + 2:
            self.fail("has an input that", describe(x))
        d = self.delta(use)
        kernel = list(self.weight.shape[2:])
        if dims == 1:  # as a Conv2d of height 1
            x = x.unsqueeze(2)
            kernel, dilation = [1, *kernel], [1, *dilation]
            padding, stride = [0, *padding], [1, *stride]
        a = F.unfold(
            x, tuple(kernel), dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride)
        )
        return a.transpose(1, 2), d.reshape(self.batch, d.shape[1], -1).transpose(1, 2)

    def dims(self) -> tuple[int, int, int]:
        weight = self.weight
        rows = sum(math.prod(use.outputs[0][1][2:]) for use in self.uses)
        return rows, weight[0].numel(), int(weight.shape[0])

    def bias_rows(self) -> torch.Tensor:
        found = [self.delta(use) for use in self.uses]
        sums = [d.flatten(2).sum(2, dtype=self.wide(d.dtype)) for d in found]
        return sum(sums[1:], sums[0])

    def backward_weight(self, d: torch.Tensor, x: torch.Tensor, groups: int) -> torch.Tensor:
        dims, stride, padding, dilation = self.geometry()
        # in the widest of the two dtypes and `wide`'s (under a caller's autocast: Δ in
        # bf16, the recorded input in float32, which the kernel refused)
        dtype = self.wide(torch.promote_types(d.dtype, x.dtype))
        d, x = d.to(dtype), x.to(dtype)
        # (its shape alone is read: detached, so that no graph is recorded around the kernel)
        weight = self.weight.detach().to(dtype)
        if groups > 1:
            weight = weight.repeat(groups, *([1] * (weight.ndim - 1)))
        grads: tuple[torch.Tensor, ...] = torch.ops.aten.convolution_backward(
            d, x, weight, None, stride, padding, dilation, False, [0] * dims, groups,
            [False, True, False],
        )  # fmt: skip
        return grads[1]

    def weight_per_example(self) -> torch.Tensor:
        found = []
        for use in self.uses:  # the examples as the groups of one convolution
            x, d = self.input(use), self.delta(use)
            if self.input_as_kernel(x):
                found.append(self.by_output_kernel(x, d))
                continue
            grads = self.backward_weight(
                d.reshape(1, -1, *d.shape[2:]), x.reshape(1, -1, *x.shape[2:]), self.batch
            )
            found.append(grads.view(self.batch, -1))
        return sum(found[1:], found[0]).view(self.batch, self.weight.shape[0], -1)

    def input_as_kernel(self, x: torch.Tensor) -> bool:
        """Whether `by_output_kernel` forms the per-example gradients: on the CPU, for a
        convolution of stride and dilation 1 on at most `_FEW_CHANNELS` input channels (an
        image's first layer) and at most `_FEW_OUTPUTS` output channels, where the grouped
        weight-gradient kernel with that few channels a group is slow
        (docs/benchmarks_per_example.md, session 13)."""
        _, stride, _, dilation = self.geometry()
        return (
            x.device.type == "cpu"
            and x.shape[1] <= _FEW_CHANNELS
            and self.weight.shape[0] <= _FEW_OUTPUTS
            and self.batch > 0
            and all(s == 1 for s in (*stride, *dilation))
        )

    def by_output_kernel(self, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """(B, p·d) per-example weight gradients of a stride-1, dilation-1 convolution, as
        ONE grouped convolution of the input with each example's Δ as the kernel: the
        input's channels as the batch, the examples as the groups (the same sums over the
        output positions as the weight gradient's, in another order)."""
        dims, _, padding, _ = self.geometry()
        if dims == 1:  # as a Conv2d of height 1
            x, d, padding = x.unsqueeze(2), d.unsqueeze(2), [0, *padding]
        batch, channels, out = x.shape[0], x.shape[1], d.shape[1]
        dtype = self.wide(torch.promote_types(d.dtype, x.dtype))  # (as `backward_weight`)
        grads = F.conv2d(
            x.transpose(0, 1).to(dtype),  # (C, B, H, W)
            d.reshape(batch * out, 1, *d.shape[2:]).to(dtype),
            padding=tuple(padding),
            groups=batch,
        )  # (C, B·p, kh, kw): the kernel's size, at stride and dilation 1
        grads = grads.reshape(channels, batch, out, -1).permute(1, 2, 0, 3)
        return grads.reshape(batch, -1)

    def weighted(self, use: _Use, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        x, d = self.input(use), self.delta(use)
        dtype = self.wide(d.dtype)
        wd = d.to(dtype) * weights.to(dtype).view(-1, *([1] * (d.ndim - 1)))
        found = {}
        if "weight" in self.params:
            found["weight"] = self.backward_weight(wd, x, 1)
        if "bias" in self.params:
            found["bias"] = wd.flatten(2).sum((0, 2))
        return found


class _Embedding(_Layer):
    """Embedding: the Gram of one-hot rows is index equality."""

    kind = "embedding"

    def precheck(self) -> None:
        for use in self.uses:
            shared = _shared_use(use)
            if shared is not None and shared.other is not None:
                raise ValueError(
                    f"{self.run.call}: module {self.name!r} (Embedding) was called with an "
                    "index shared by the batch (dim 0 of size 1), whose (1, ...) output the "
                    f"model uses otherwise than broadcast against the batch (by {shared.other}"
                    "; e.g. .sum(0), [0], .squeeze(0), a slice per example): its per-example "
                    "gradients cannot be told apart there (funcgrad expands such an index to "
                    f"(B, ...) = ({shared.batch}, ...) only for a broadcast such as x + pos "
                    "with x of B rows, B being dim 0 of the model's first tensor argument "
                    "whose dim 0 is not 1; the forward was the model's own). Nothing was "
                    "written. Expand the index "
                    "to the batch yourself (ids.expand(B, -1)), or leave its parameters out "
                    "with inputs=."
                )
            for _, shape, _ in use.outputs:
                if len(shape) and shape[0] == 1 and self.batch != 1:
                    raise ValueError(
                        f"{self.run.call}: module {self.name!r} (Embedding) has an output of "
                        f"shape {tuple(shape)}, an index shared by the batch, but the losses "
                        f"have B = {self.batch} entries. funcgrad expands such an index to "
                        "(B, ...) only during a call of the hooked model that has a tensor "
                        "argument whose dim 0 is not 1: this call was outside it (a submodule "
                        "called directly), or the model's call had none. Nothing was written. "
                        "Expand the index to the batch yourself (ids.expand(B, -1)), or leave "
                        "its parameters out with inputs=."
                    )
        super().precheck()

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        index_parts, d_parts = [], []
        module = self.module
        assert isinstance(module, nn.Embedding)
        for use in self.uses:
            index = self.input(use)
            d = self.delta(use).reshape(self.batch, -1, module.embedding_dim)
            index = index.reshape(self.batch, -1)
            if module.padding_idx is not None:  # its row gets no gradient (a NaN Δ there too)
                d = d.masked_fill((index == module.padding_idx).unsqueeze(-1), 0)
            index_parts.append(index)
            d_parts.append(d)
        return _cat_rows(index_parts), _cat_rows(d_parts)

    def sums(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each example's Δ rows summed per index it uses (its per-example gradient on the
        rows it hits): (R, d) in the work dtype, and each row's example and index, R ≤ B·T
        (the padding index left out: its row gets no gradient)."""
        index, d = self.rows()
        module = self.module
        assert isinstance(module, nn.Embedding)
        vocab, width = self.params["weight"].shape[0], d.shape[-1]
        offsets = torch.arange(self.batch, device=index.device).unsqueeze(1) * vocab
        keys, inverse = torch.unique(index + offsets, return_inverse=True)
        sums = d.new_zeros(keys.shape[0], width, dtype=self.run.dtype)
        sums.index_add_(0, inverse.flatten(), d.reshape(-1, width).to(self.run.dtype))
        examples, indices = keys // vocab, keys % vocab
        if module.padding_idx is not None:
            keep = indices != (module.padding_idx % vocab)
            sums, examples, indices = sums[keep], examples[keep], indices[keep]
        return sums, examples, indices

    def gramian(self) -> torch.Tensor:
        """``G[b, c] = sum_v <g_bv, g_cv>`` over the indices v that both examples use, from
        the pairs of rows with the same index alone: sum_v n_v²·d products (n_v: the
        examples using index v), never the dense (B, vocab·d) per-example gradients nor
        the (BT)² index-equality kernel."""
        sums, examples, indices = self.sums()
        rows, width = sums.shape
        batch = self.batch
        order = torch.argsort(indices, stable=True)
        # row gathers by index_select (torch's advanced indexing is several times slower on
        # the CPU for these (n, d) gathers)
        sums, examples, indices = (t.index_select(0, order) for t in (sums, examples, indices))
        _, counts = torch.unique_consecutive(indices, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        size = torch.repeat_interleave(counts, counts)  # each row's group: its size, start
        start = torch.repeat_interleave(starts, counts)
        pairs = int(size.sum())  # one host read: sum_v n_v², the pairs to form
        self.ghost_flops = float(batch * batch * rows * width)  # the dense Gram, for the plan
        self.materialised_flops = float(pairs * width)
        self.rule = f"pairs of rows with one index ({pairs} pairs, {rows} rows)"
        gram = self.zero()
        flat_gram = gram.view(-1)
        step = _pairs_per_block(sums.numel(), width)
        ends = torch.cumsum(size, 0)
        first = 0
        while first < rows:  # blocks of left rows whose pairs fit in a block
            done = int(ends[first - 1]) if first else 0
            last = min(rows, max(first + 1, int(torch.searchsorted(ends, done + step, right=True))))
            sizes = size[first:last]
            left = torch.repeat_interleave(torch.arange(first, last, device=sums.device), sizes)
            within = torch.arange(left.shape[0], device=sums.device)
            within = within - (torch.cumsum(sizes, 0) - sizes).repeat_interleave(sizes)
            right = start.index_select(0, left) + within
            values = (sums.index_select(0, left) * sums.index_select(0, right)).sum(1)
            where = examples.index_select(0, left) * batch + examples.index_select(0, right)
            flat_gram.index_add_(0, where, values)
            first = last
        return gram

    def diagonal(self) -> torch.Tensor:
        """G's diagonal alone: each example's Δ rows summed per index it uses (B·T·d)."""
        sums, examples, _ = self.sums()
        self.rule = "materialised on the rows each example uses"
        return self.zero_diagonal().index_add_(0, examples, _squares(sums))

    def scatter(self, index: torch.Tensor, d: torch.Tensor, vocab: int) -> torch.Tensor:
        """(B, vocab, width): each example's rows of Δ added at its indices."""
        batch, _, width = d.shape
        offsets = torch.arange(batch, device=index.device).unsqueeze(1) * vocab
        d = d.to(self.wide(d.dtype))
        flat = d.new_zeros(batch * vocab, width)
        flat.index_add_(0, (index + offsets).flatten(), d.reshape(-1, width))
        return flat.view(batch, vocab, width)

    def per_example(self) -> dict[str, torch.Tensor]:
        index, d = self.rows()
        return {"weight": self.scatter(index, d, self.params["weight"].shape[0])}

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        index, d = self.rows()
        weight = self.params["weight"]
        dtype = self.wide(d.dtype)
        wd = d.to(dtype) * weights.to(dtype)[:, None, None]
        grad = torch.zeros(weight.shape, dtype=dtype, device=d.device)
        grad.index_add_(0, index.flatten(), wd.reshape(-1, d.shape[-1]))
        return {"weight": grad}


def _pairs_per_block(elements: int, width: int) -> int:
    """The Embedding's pairs formed at once: a transient of about half the size of its
    summed rows (``elements``), or of `_PAIRS` elements where that is more (3 such
    tensors a block: the two rows of each pair and their product)."""
    return max(1, max(elements // 2, _PAIRS) // max(1, width))


class _Norm(_Layer):
    """LayerNorm / GroupNorm / BatchNorm (eval) affine parameters: (B, C) per-example
    gradients of the scale (``Δ ⊙ x̂`` summed over positions) and the shift (``Δ`` summed)."""

    kind = "norm"
    grads: dict[str, torch.Tensor] | None = None
    # id(use) -> LayerNorm's (mean, rstd) as its forward saved them (`precheck`)
    stats: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def precheck(self) -> None:
        """Before the one backward (which frees them): each LayerNorm call's mean and
        1/std as its forward's ``native_layer_norm`` saved them, so that x̂ is ``(x - mean)
        · rstd`` (two passes) rather than a second layer norm (2-4x slower on a CPU)."""
        super().precheck()
        self.stats = {}
        if type(self.module) is nn.LayerNorm:
            for use in self.uses:
                found = _layer_norm_stats(self.module, use, self.input(use))
                if found is not None:
                    self.stats[id(use)] = found

    def per_example(self) -> dict[str, torch.Tensor]:
        if self.grads is not None:
            return self.grads
        module = self.module
        found: dict[str, torch.Tensor] = {}
        for use in self.uses:
            x = self.input(use)
            d = self.delta(use)
            d = d.to(self.wide(d.dtype))
            stats = getattr(self, "stats", {}).get(id(use))
            if stats is not None:  # x̂ from the forward's own statistics
                assert isinstance(module, nn.LayerNorm)
                normed = x.sub(stats[0]).mul_(stats[1])
                dims = tuple(range(1, x.ndim - len(module.normalized_shape)))
            elif isinstance(module, nn.LayerNorm):
                normed = F.layer_norm(x, module.normalized_shape, eps=module.eps)
                keep = len(module.normalized_shape)
                dims = tuple(range(1, x.ndim - keep))
            else:
                if isinstance(module, nn.GroupNorm):
                    normed = F.group_norm(x, module.num_groups, eps=module.eps)
                else:
                    assert isinstance(module, nn.modules.batchnorm._BatchNorm)
                    shape = (1, -1, *([1] * (x.ndim - 2)))
                    mean, var = module.running_mean, module.running_var
                    assert mean is not None and var is not None
                    normed = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + module.eps)
                dims = tuple(range(2, x.ndim))
            if "weight" in self.params:
                _add(found, "weight", (d * normed).sum(dim=dims) if dims else d * normed)
            if "bias" in self.params:
                _add(found, "bias", d.sum(dim=dims) if dims else d)
        self.rule = "materialised (B, C) affine"
        self.grads = found
        return found

    def gramian(self) -> torch.Tensor:
        grads = self.per_example().values()
        return sum((_gram(g.to(self.run.dtype)) for g in grads), self.zero())

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        grads = self.per_example()
        return {k: torch.tensordot(weights.to(g.dtype), g, dims=1) for k, g in grads.items()}


def _layer_norm_stats(
    module: nn.LayerNorm, use: _Use, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (mean, rstd) that the call's ``native_layer_norm`` saved in its graph node, where
    that node is the output's own and saved this very input (same memory, shape, strides,
    dtype) for this normalized shape, and the statistics have the input's dtype and shape
    (..., 1), and no saved-tensor hook would run to read them; else None (the layer norm
    is then computed again). Read before the backward frees them."""
    if len(use.edges) != 1 or len(use.outputs) != 1:
        return None
    node = use.edges[0].node
    if type(node).__name__ != "NativeLayerNormBackward0" or use.edges[0].output_nr != 0:
        return None
    try:
        raw = [getattr(node, f"_raw_saved_{n}") for n in ("input", "result1", "result2")]
        if any(r.unpack_hook is not None for r in raw):
            # saved-tensor hooks (checkpointing, offloading, the user's own): reading them
            # would run their unpack (a recompute, a copy back) once more; computed again
            return None
        saved = node._saved_input
        mean, rstd = node._saved_result1, node._saved_result2
        shape = tuple(node._saved_normalized_shape)
    except (AttributeError, RuntimeError):  # freed, or another torch's node
        return None
    keep = len(module.normalized_shape)
    want = (*x.shape[: x.ndim - keep], *([1] * keep))
    if (
        shape != tuple(module.normalized_shape)
        or not isinstance(saved, torch.Tensor)
        or saved.data_ptr() != x.data_ptr()
        or saved.shape != x.shape
        or saved.stride() != x.stride()
        or saved.dtype != x.dtype
        or any(t.dtype != x.dtype or tuple(t.shape) != want for t in (mean, rstd))
    ):
        return None
    return mean, rstd


def _padding(module: nn.Conv1d | nn.Conv2d) -> tuple[int, ...]:
    """A convolution's padding as numbers ("valid" is none; "same" is never given here)."""
    if isinstance(module.padding, str):
        return (0,) * len(module.kernel_size)
    return tuple(module.padding)
