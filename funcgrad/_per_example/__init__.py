"""Per-example heads: the Gramian of the per-example gradients of a batch's losses, and the
weighted update, from ONE backward of ``losses.sum()`` (ghost products).

Loss b reads only example b, so one backward of the losses, along all ones, gives every
example's output gradient at every layer: row b of the layer's output gradient, ``Δ_b``.
With the layer's input rows ``A_b`` (recorded by a forward hook), the per-example gradient
of a Linear weight is ``Δ_bᵀ A_b``, so the Gramian is ``(A Aᵀ) ∘ (Δ Δᵀ)`` layer by layer and
the weighted update ``Aᵀ (w ⊙ Δ)``: one matmul, as a plain backward's weight gradient.

The modules, as the stages of a call:

- ``_front``: the public functions; ``_recorder``: `PerExample`, whose hooks record the
  forward; ``_record``: the records, and the one backward that collects the output gradients;
- ``_run``: one call (validate, collect, the layers' rules, weigh, apply ``.grad``);
  ``_checks``: the refusals of the recorded graph, before any pass;
- ``_layer``: the layer base and the ghost products; ``_rules``: Linear (and HF Conv1D),
  Conv, Embedding, norms; ``_attention``: nn.MultiheadAttention as its projections;
  ``_generic``: any other module (vmap or a loop), recurrent modules; ``_choose``: which;
- ``_independence``: the check that loss b reads example b alone.
"""

from ._front import backward_from_losses as backward_from_losses
from ._front import per_example as per_example
from ._front import per_example_clip as per_example_clip
from ._front import per_example_gramian as per_example_gramian
from ._front import per_example_norms as per_example_norms

# Looked up here by `_run` on each call, so that a test can switch the check off.
from ._independence import _independence_due as _independence_due
from ._layer import PerExamplePlan as PerExamplePlan
from ._recorder import PerExample as PerExample
