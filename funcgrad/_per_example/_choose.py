"""The choice of a module's rule, by its class: only torch's own forward (and Hugging
Face's Conv1D) takes a native rule; a subclass with its own forward is generic."""

from __future__ import annotations

import torch
from torch import nn

from ._attention import _Attention, _native_attention
from ._generic import _Generic, _Recurrent
from ._layer import _Layer
from ._rules import _Conv, _Dense, _Embedding, _Norm, _TransposedDense


def _overrides(module: nn.Module, base: type) -> bool:
    return getattr(type(module), "forward", None) is not getattr(base, "forward", None)


def _layer_class(module: nn.Module) -> type[_Layer]:
    """The rule of a module, by its class: only torch's own forward (a subclass with its
    own forward, such as a LoRA Linear, is materialised as any other module; so is a
    module whose instance has a forward of its own, ``module.forward = ...``: the class's
    rule gave G 54 off on a Linear patched to use twice its weight)."""
    if "forward" in vars(module):
        return _Generic
    if type(module) in (nn.RNN, nn.GRU, nn.LSTM) and module.batch_first:
        return _Recurrent
    if _native_attention(module):
        return _Attention
    if any(name not in ("weight", "bias") for name, _ in module.named_parameters(recurse=False)):
        # its forward reads other tensors than its parameters (torch.nn.utils.weight_norm's
        # weight_g / weight_v make `weight` in a pre-hook): the generic rule runs that
        return _Generic
    if isinstance(module, nn.Linear) and not _overrides(module, nn.Linear):
        return _Dense
    if _is_hf_conv1d(module):
        return _TransposedDense
    if (
        type(module) in (nn.Conv1d, nn.Conv2d)
        and module.groups == 1
        and module.padding_mode == "zeros"
        and (not isinstance(module.padding, str) or module.padding == "valid")
    ):
        return _Conv
    if type(module) is nn.Embedding:
        return _Embedding
    if type(module) in (nn.LayerNorm, nn.GroupNorm) or (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    ):
        return _Norm
    return _Generic


def _is_hf_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` itself (``addmm(bias, x, weight)``, weight (d, p)), by its
    class, without importing transformers; a subclass with its own forward is generic."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__ == "transformers.pytorch_utils"
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
    )
