"""Attention as its projections: ``nn.MultiheadAttention`` (and so the self-attention of
``nn.TransformerEncoderLayer`` / ``DecoderLayer``) takes the Linear rules on its q/k/v input
projections and its output projection. The attention between them has no parameters and
reads each example alone, so ONE batched backward through it, from the recorded output
gradient, gives every example's projection output gradients ``Δq, Δk, Δv``: the call is
run again (no weight products) on the projected inputs, with identity projections inside
``F.multi_head_attention_forward`` (exact: a product by the identity rounds nothing)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ._layer import _add, _Layer
from ._record import _Use
from ._rules import _Dense

_PARTS = ("q", "k", "v")
_VIEWS = ("TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0")


def _through_views(node: Any) -> Any:
    """The first node below ``node`` that is not a view (a transpose, view or permute with
    one input)."""
    while node is not None and type(node).__name__ in _VIEWS and len(node.next_functions) == 1:
        node = node.next_functions[0][0]
    return node


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two recorded inputs are one tensor (each recorded detached on its own): the
    same memory, seen the same way."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _native_attention(module: nn.Module) -> bool:
    """The nn.MultiheadAttention calls this rule covers: batch_first, no bias_k / bias_v, no
    zero attention row, no dropout drawn (eval, or p = 0); others take the generic rule."""
    return (
        type(module) is nn.MultiheadAttention
        and module.batch_first
        and module.bias_k is None
        and not module.add_zero_attn
        and not (module.training and module.dropout > 0)
    )


class _Attention(_Layer):
    """nn.MultiheadAttention: four Linear layers (q, k, v from the in-projection's rows, and
    the out-projection), each with its own inputs A and output gradients Δ."""

    kind = "attention"
    _parts: list[tuple[str, _Dense]] | None = None

    def weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The q/k/v projection weights and biases (views of in_proj_* where shared)."""
        m = self.module
        assert isinstance(m, nn.MultiheadAttention)
        if m._qkv_same_embed_dim:
            weights = list(m.in_proj_weight.chunk(3))
        else:
            weights = [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]
        biases: list[torch.Tensor | None] = (
            [None] * 3 if m.in_proj_bias is None else list(m.in_proj_bias.chunk(3))
        )
        return weights, biases

    def precheck(self) -> None:
        super().precheck()
        for use in self.uses:
            self.inner(use)

    def inner(self, use: _Use) -> None:
        """Before the one backward: the gradient edges of the q, k, v heads that
        ``F.scaled_dot_product_attention`` got in the forward's own graph (its node saves
        them), and the out-projection's input (saved by its product), so that the one
        backward gives Δq, Δk, Δv and no second pass through the attention is needed. Only
        where the graph is the one ``F.multi_head_attention_forward`` builds for a call
        that returns no weights (out-projection product, views, one attention node),
        checked node by node with the shapes; else nothing (`recompute` then)."""
        m = self.module
        assert isinstance(m, nn.MultiheadAttention)
        if len(use.outputs) != 1 or use.outputs[0][0] != 0 or not use.edges:
            return
        batch, length, width = use.outputs[0][1]
        heads = m.num_heads
        node = _through_views(use.edges[0].node)
        name = type(node).__name__
        if name == "AddmmBackward0":
            attended, weight = node._saved_mat1, node._saved_mat2
        elif name == "MmBackward0":
            attended, weight = node._saved_self, node._saved_mat2
        else:
            return
        if (
            attended is None  # saved only where the other side needs grad: frozen weight
            or weight is None
            or attended.shape != (length * batch, width)
            or weight.shape != (width, width)
            or weight.data_ptr() != m.out_proj.weight.data_ptr()
            or attended.grad_fn is None
        ):
            return
        sdpa = _through_views(attended.grad_fn)
        if not type(sdpa).__name__.startswith("ScaledDotProduct") or not all(
            hasattr(sdpa, f"_saved_{n}") for n in ("query", "key", "value")
        ):
            return
        if getattr(sdpa, "_saved_dropout_p", 0.0) != 0.0:
            return
        heads_qkv = [getattr(sdpa, f"_saved_{n}") for n in ("query", "key", "value")]
        shapes = [(t.grad_fn is not None, t.ndim, tuple(t.shape[:2])) for t in heads_qkv]
        if any(shape != (True, 4, (batch, heads)) for shape in shapes):
            return  # (B, heads, T, d / heads) each
        edges = [get_gradient_edge(t) for t in heads_qkv]
        if len({(e.node, e.output_nr) for e in edges}) != 3:
            return  # one tensor as two of q, k, v: its edge would get their sum
        # The packed edge lies below the q, k, v heads: the backward reaches it anyway only
        # where the attention's input needs a gradient (a trainable layer below); else its
        # nodes (three zero-filled selects, a copy) would run for it alone.
        packed = _packed_edge(heads_qkv, length, batch, width) if use.upstream else None
        use.inner_edges = edges if packed is None else [packed]
        # (T·B, d) rows, t-major: to (B, T, d)
        use.inner_input = attended.detach().view(length, batch, width).transpose(0, 1)

    def from_graph(self, use: _Use) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(A, Δ) for q, k, v and the out-projection from the one backward (`inner`)."""
        if not use.inner_edges or use.inner_input is None:
            return None
        m = self.module
        assert isinstance(m, nn.MultiheadAttention)
        bound = inspect.signature(m.forward).bind(*use.args, **use.kwargs)
        arg = bound.arguments
        inputs = [arg["query"], arg["key"], arg["value"]]
        found = []
        if len(use.inner_deltas) == 1:  # [Δq, Δk, Δv] (T, B, 3·d): `_packed_edge`
            packed = use.inner_deltas[0]
            width = m.embed_dim
            x = inputs[0]
            self.check_batched(x, "has an input that")
            if packed is None:
                packed = x.new_zeros(x.shape[1], x.shape[0], 3 * width)
            elif packed.shape != (x.shape[1], x.shape[0], 3 * width):
                return None  # not the gradient `inner` expected: the recompute instead
            packed = packed.transpose(0, 1)  # (B, T, 3·d), a view
            found = [(x, packed[..., i * width : (i + 1) * width]) for i in range(3)]
            return [*found, (use.inner_input, self.delta(use, 0))]
        for x, d in zip(inputs, use.inner_deltas):
            self.check_batched(x, "has an input that")
            if d is None:
                d = x.new_zeros(x.shape[0], x.shape[1], m.embed_dim)
            else:  # (B, heads, T, d / heads) -> (B, T, d)
                d = d.transpose(1, 2).reshape(d.shape[0], d.shape[2], m.embed_dim)
            found.append((x, d))
        return [*found, (use.inner_input, self.delta(use, 0))]

    def recompute(self, use: _Use) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A, Δ) for q, k, v and the out-projection, from one batched backward of the
        attention alone along the recorded output gradients (where the one backward did not
        give them: `inner`)."""
        taken = self.from_graph(use)
        if taken is not None:
            return taken
        m = self.module
        assert isinstance(m, nn.MultiheadAttention)
        bound = inspect.signature(m.forward).bind(*use.args, **use.kwargs)
        bound.apply_defaults()
        arg = bound.arguments
        inputs = [arg["query"], arg["key"], arg["value"]]
        for x in inputs:
            self.check_batched(x, "has an input that")
        weights, biases = self.weights()
        width = m.embed_dim
        eye = torch.eye(width, dtype=inputs[0].dtype, device=inputs[0].device)
        with torch.enable_grad():
            projected = [
                F.linear(x, w.detach(), None if b is None else b.detach()).requires_grad_()
                for x, w, b in zip(inputs, weights, biases)
            ]
            fast = _attend(m, projected, arg, len(use.outputs) > 1)
            query, key, value = (p.transpose(0, 1) for p in projected)
            attended, attention = fast if fast is not None else F.multi_head_attention_forward(
                query, key, value, width, m.num_heads, None, None, None, None, False, 0.0,
                eye, None, training=False, key_padding_mask=arg["key_padding_mask"],
                need_weights=arg["need_weights"], attn_mask=arg["attn_mask"],
                use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
                v_proj_weight=eye, average_attn_weights=arg["average_attn_weights"],
                is_causal=arg["is_causal"],
            )  # fmt: skip
            if fast is None:
                attended = attended.transpose(0, 1)  # (B, T, d): the out-projection's input
            d_out = self.delta(use, 0)
            outs, cotangents = [attended], [d_out @ m.out_proj.weight.detach().to(d_out.dtype)]
            if len(use.outputs) > 1 and attention is not None:  # the weights' gradient too
                outs.append(attention)
                cotangents.append(self.delta(use, 1))
            grads = torch.autograd.grad(outs, projected, cotangents, allow_unused=True)
        found = [
            (x, torch.zeros_like(p) if g is None else g)
            for x, p, g in zip(inputs, projected, grads)
        ]
        return [*found, (attended.detach(), d_out)]

    def parts(self) -> list[tuple[str, _Dense]]:
        """The Linear layers, each over every call of the module, as (part, layer): q, k, v
        and the out-projection; or, for self-attention with the packed in-projection (q, k
        and v from one input, ``in_proj_weight``), one "qkv" layer of 3·d outputs, whose
        Δ is [Δq, Δk, Δv] (its per-example gradient is the packed weight's: the ghost
        products share the input's kernel ``A_b A_bᵀ`` across q, k and v)."""
        if self._parts is not None:
            return self._parts
        m = self.module
        assert isinstance(m, nn.MultiheadAttention)
        rows = [self.recompute(use) for use in self.uses]
        weights, biases = self.weights()
        out = m.out_proj
        shared = m._qkv_same_embed_dim
        merged = shared and all(_same(r[0][0], r[1][0]) and _same(r[0][0], r[2][0]) for r in rows)
        params: list[tuple[str, torch.Tensor, torch.Tensor | None, list[Any]]] = []
        if merged:
            qkv = [(r[0][0], _joined([r[0][1], r[1][1], r[2][1]])) for r in rows]
            params.append(("qkv", m.in_proj_weight, m.in_proj_bias, qkv))
        else:
            for i, part in enumerate(_PARTS):
                params.append((part, weights[i], biases[i], [r[i] for r in rows]))
        params.append(("out", out.weight, out.bias, [r[3] for r in rows]))
        parts = []
        for part, weight, bias, found in params:
            weight_name, bias_name = self.names(part)
            uses = [_Use(m, (a,), {}, [], [(0, d.shape, d.dtype)], [], [], [d]) for a, d in found]
            selected = {}
            if weight_name in self.params:
                selected["weight"] = weight
            if bias is not None and bias_name in self.params:
                selected["bias"] = bias
            if selected:
                layer = _Dense(self.run, m, uses, selected)
                layer.name = f"{self.name}.{part}"
                parts.append((part, layer))
        self._parts = parts
        for use in self.uses:  # the (B, heads, T, d / heads) Δ: read into the parts now
            use.inner_deltas = [None] * len(use.inner_deltas)
        return parts

    def names(self, part: str) -> tuple[str, str]:
        """The module's parameter names of a part's weight and bias."""
        if part == "out":
            return "out_proj.weight", "out_proj.bias"
        m = self.module
        assert isinstance(m, nn.MultiheadAttention)
        weight = "in_proj_weight" if m._qkv_same_embed_dim else f"{part}_proj_weight"
        if part == "qkv":
            return "in_proj_weight", "in_proj_bias"
        return weight, "in_proj_bias"

    def gramian(self) -> torch.Tensor:
        found = sum((layer.gramian() for _, layer in self.parts()), self.zero())
        self.rule = self.summary()
        return found

    def diagonal(self) -> torch.Tensor:
        found = sum((layer.diagonal() for _, layer in self.parts()), self.zero_diagonal())
        self.rule = self.summary()
        return found

    def release(self) -> None:
        super().release()
        self._parts = None  # its four Linear layers' rows

    def summary(self) -> str:
        return "; ".join(f"{part}: {layer.rule}" for part, layer in self.parts())

    def assemble(self, pieces: list[tuple[str, dict[str, torch.Tensor]]], dim: int) -> Any:
        """Each parameter's gradient from its parts (q, k, v rows of the in-projection
        stacked along ``dim``, the per-example batch dim before it)."""
        stacked: dict[str, list[torch.Tensor]] = {}
        for part, found in pieces:
            weight, bias = self.names(part)
            for key, value in found.items():
                stacked.setdefault(weight if key == "weight" else bias, []).append(value)
        result: dict[str, torch.Tensor] = {}
        for name, values in stacked.items():
            joined = values[0] if len(values) == 1 else torch.cat(values, dim)
            _add(result, name, joined)
        return result

    def per_example(self) -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = self.assemble(
            [(part, layer.per_example()) for part, layer in self.parts()], 1
        )
        return result

    def update(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = self.assemble(
            [(part, layer.update(weights)) for part, layer in self.parts()], 0
        )
        return result


def _packed_edge(
    heads: list[torch.Tensor], length: int, batch: int, width: int
) -> GradientEdge | None:
    """The gradient edge of the packed in-projection's output ``proj`` (T, B, 3·d), whose
    gradient is [Δq, Δk, Δv] in one tensor, where the q, k, v heads that the attention node
    saved were cut from it as ``F.multi_head_attention_forward`` cuts them for
    self-attention (``_in_projection_packed``: ``proj.unflatten(-1, (3, d)).unsqueeze(0)
    .transpose(0, -2).squeeze(-2).contiguous()``, then ``[0]``, ``[1]``, ``[2]``, then
    views), checked node by node with the shapes; else None (the three heads' own edges).
    Reading Δ there holds the one (T, B, 3·d) gradient that the in-projection's backward
    reads anyway, not the three heads' gradients beside it (peak memory), and needs no
    copy to join them."""
    selects = [_through_views(t.grad_fn) for t in heads]
    for i, node in enumerate(selects):
        if (
            type(node).__name__ != "SelectBackward0"
            or getattr(node, "_saved_dim", None) != 0
            or getattr(node, "_saved_index", None) != i
            or tuple(getattr(node, "_saved_self_sym_sizes", ())) != (3, length, batch, width)
            or len(node.next_functions) != 1
        ):
            return None
    if len({id(node.next_functions[0][0]) for node in selects}) != 1:
        return None
    node = selects[0].next_functions[0][0]
    for name in ("CloneBackward0", "SqueezeBackward1", "TransposeBackward0", "UnsqueezeBackward0"):
        if type(node).__name__ != name or len(node.next_functions) != 1:
            return None
        node = node.next_functions[0][0]
    if (
        type(node).__name__ != "ViewBackward0"
        or tuple(getattr(node, "_saved_self_sym_sizes", ())) != (length, batch, 3 * width)
        or len(node.next_functions) != 1
        or node.next_functions[0][0] is None
    ):
        return None
    below, output_nr = node.next_functions[0]
    return GradientEdge(below, output_nr)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts, -1)``, as a view where the parts lie side by side in one tensor's
    memory (the slices of `_packed_edge`'s [Δq, Δk, Δv]), else a copy."""
    first = parts[0]
    step = first.shape[-1] * first.stride(-1)
    adjacent = all(
        p.shape == first.shape
        and p.stride() == first.stride()
        and p.dtype == first.dtype
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.storage_offset() == first.storage_offset() + i * step
        for i, p in enumerate(parts)
    )
    if not adjacent or first.stride(-1) != 1:
        return torch.cat(parts, -1)
    shape = (*first.shape[:-1], first.shape[-1] * len(parts))
    return first.as_strided(shape, first.stride(), first.storage_offset())


def _attend(
    m: nn.MultiheadAttention, projected: list[torch.Tensor], arg: dict[str, Any], weights_read: bool
) -> tuple[torch.Tensor, None] | None:
    """The attention between the projections, (B, T, d), by one
    ``F.scaled_dot_product_attention`` on the projected heads, without the identity
    projections of ``F.multi_head_attention_forward``: for the common calls alone (no
    attention weights returned, no ``attn_mask`` nor ``is_causal``, a padding mask or
    none); None for the others (the general call then). The padding mask is merged as
    ``F.multi_head_attention_forward`` merges it: an additive (B, 1, 1, S) mask, -inf
    where True for a boolean one."""
    if weights_read or arg["need_weights"] or arg["attn_mask"] is not None or arg["is_causal"]:
        return None
    query, key, value = projected
    pad = arg["key_padding_mask"]
    batch, length, width = query.shape
    heads = m.num_heads
    mask = None
    if pad is not None:
        if pad.shape != (batch, key.shape[1]):
            return None
        if pad.dtype == torch.bool:
            mask = torch.zeros(pad.shape, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill_(pad, float("-inf"))
        elif pad.is_floating_point():
            mask = pad.to(query.dtype)
        else:
            return None
        mask = mask.view(batch, 1, 1, -1)

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, x.shape[1], heads, width // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(query), split(key), split(value), mask)
    return out.transpose(1, 2).reshape(batch, length, width), None
