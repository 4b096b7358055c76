"""Checked by mypy (see pyproject), never run: a typo in a string option is a type error.

Each ignore below must stay needed: with ``warn_unused_ignores``, mypy fails if the public
signature stops rejecting the typo.
"""

import torch

import funcgrad

heads = [lambda y: y.sum()]
funcgrad.compose_heads(torch.sin, heads, strategy="jacobain")  # type: ignore[call-overload]
funcgrad.combine_heads(torch.sin, heads, level="feature")  # type: ignore[arg-type]
funcgrad.combine_heads(torch.sin, heads, strategy="vjpp")  # type: ignore[arg-type]
funcgrad.backward([torch.zeros(())], through=torch.zeros(()), level="param")  # type: ignore[arg-type]
values, grads = funcgrad.compose_heads(torch.sin, heads)(torch.zeros(2))
values, grads, aux = funcgrad.compose_heads(torch.sin, heads, has_aux=True)(torch.zeros(2))

# The typed arguments of backward and combine_heads (funcgrad._types): a function from the
# Gramian to weights, or a TorchJD object (an nn.Module from a tensor to a tensor); a
# ProcessGroup or a DDP/FSDP module; inputs as tensors, a Module or named parameters.
model = torch.nn.Linear(2, 2)
features = model(torch.zeros(3, 2))
losses = [features.sum(), features.pow(2).sum()]


def uniform(gramian: torch.Tensor) -> torch.Tensor:
    return torch.ones(len(gramian))


weighting: funcgrad.Weighting = uniform
funcgrad.backward(losses, through=features, weighting=weighting)
funcgrad.backward(losses, through=features, weighting=torch.nn.Softmax(dim=0))
funcgrad.backward(losses, through=features, inputs=model)
funcgrad.backward(losses, through=features, inputs=model.parameters())
funcgrad.backward(losses, through=features, inputs=model.named_parameters())
funcgrad.backward(losses, through=features, inputs={"weight": model.weight})
funcgrad.backward(losses, through=features, process_group=model)
funcgrad.combine_heads(torch.sin, heads, uniform)
if torch.distributed.is_available():
    group = torch.distributed.new_group()
    funcgrad.backward(losses, through=features, process_group=group)
    funcgrad.combine_heads(torch.sin, heads, process_group=group)
funcgrad.backward(losses, through=features, weighting="upgrad")  # type: ignore[arg-type]
funcgrad.backward(losses, through=features, process_group="nccl")  # type: ignore[arg-type]
funcgrad.backward(losses, through=features, inputs=3)  # type: ignore[arg-type]
funcgrad.combine_heads(torch.sin, heads, weighting=2.0)  # type: ignore[arg-type]
funcgrad.combine_heads(torch.sin, heads, process_group=0)  # type: ignore[arg-type]
try:
    funcgrad.backward(losses, through=features)
except funcgrad.SecondBackwardError as error:
    message: str = str(error)
# TorchJD's objects as they are (the test extra): a Weighting, and an Aggregator.
from torchjd.aggregation import UPGrad, UPGradWeighting  # noqa: E402

funcgrad.backward(losses, through=features, weighting=UPGradWeighting())
funcgrad.backward(losses, through=features, weighting=UPGrad())

# compose_heads' return types by the kind of heads: a mapping gives dicts keyed like it, a
# sequence (a ModuleList, stacked_heads) a tensor of values; has_aux adds aux.
x = torch.zeros(2)
named_values, named_grads = funcgrad.compose_heads(torch.sin, {"sum": heads[0]})(x)
by_name: dict[str, torch.Tensor] = named_values
grads_by_name: dict[str, object] = named_grads
stacked_values, _ = funcgrad.compose_heads(torch.sin, heads)(x)
as_tensor: torch.Tensor = stacked_values
named_values, named_grads, aux = funcgrad.compose_heads(torch.sin, {"a": heads[0]}, has_aux=True)(x)
wrong: torch.Tensor = funcgrad.compose_heads(torch.sin, {"a": heads[0]})(x)[0]  # type: ignore[assignment]
wrong_too: dict[str, torch.Tensor] = funcgrad.compose_heads(torch.sin, heads)(x)[0]  # type: ignore[assignment]
modules = torch.nn.ModuleList([torch.nn.Linear(2, 1)])
module_values, _ = funcgrad.compose_heads(torch.sin, modules)(x)
as_tensor = module_values
module_dict = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 1)})
by_name, _ = funcgrad.compose_heads(torch.sin, module_dict)(x)
stacked = funcgrad.stacked_heads(lambda a, y: a * y.sum(), torch.ones(3))
stacked_out, _ = funcgrad.compose_heads(torch.sin, stacked)(x)
as_tensor = stacked_out
funcgrad.combine_heads(torch.sin, modules)
funcgrad.combine_heads(torch.sin, module_dict)
