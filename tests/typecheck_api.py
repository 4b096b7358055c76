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
