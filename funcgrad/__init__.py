"""funcgrad: gradients of many cheap heads on one expensive function, with f run once.

``y = f(x)`` is slow, the heads ``z_i = g_i(y)`` are cheap, and every ``dz_i/dx`` is wanted.
By the chain rule each head contributes only a cotangent on y, and f's pullback is linear,
so funcgrad builds it once with ``torch.func`` and sends through f only the directions
that the shapes require.
"""

import contextlib
import typing
from importlib.metadata import PackageNotFoundError, version

from . import attribution as attribution  # funcgrad.attribution.token_attr, plan
from ._bridge import grads
from ._combine import CombinedHeads, combine_heads
from ._config import CheckMode, checking, set_check
from ._counting import HostReadCounter, PassCounter
from ._errors import BatchingMismatchError, FuncgradWarning, ReleasedPullbackError
from ._heads import ComposedHeads, StackedHeads, compose_heads, stacked_heads
from ._memory import memory_budget
from ._multitask import SecondBackwardError, backward
from ._per_example import (
    PerExample,
    per_example,
    per_example_clip,
    per_example_gramian,
    per_example_norms,
)
from ._plan import Plan
from ._projector import DualConeProjector, MGDAWeighting
from ._pullback import Pullback, PullbackStats, pullback
from ._types import ChunkSize, InputsLike, Level, ProcessGroupLike, Strategy, Weighting

try:
    __version__ = version("funcgrad")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    # transforms
    "pullback",
    "compose_heads",
    "stacked_heads",
    "grads",
    # multi-task weighting
    "backward",
    "combine_heads",
    "DualConeProjector",
    "MGDAWeighting",
    # per-example heads
    "per_example",
    "per_example_gramian",
    "per_example_norms",
    "per_example_clip",
    # their objects
    "Pullback",
    "PullbackStats",
    "ComposedHeads",
    "CombinedHeads",
    "StackedHeads",
    "PerExample",
    "Plan",
    "PassCounter",
    "HostReadCounter",
    # the types of their arguments
    "Weighting",
    "ProcessGroupLike",
    "InputsLike",
    "Strategy",
    "Level",
    "ChunkSize",
    "CheckMode",
    # settings, errors and warnings
    "set_check",
    "checking",
    "memory_budget",
    "ReleasedPullbackError",
    "BatchingMismatchError",
    "SecondBackwardError",
    "FuncgradWarning",
]

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and "__annotations__" in vars(_obj):
        # typing.get_type_hints(cls) looks names up in cls.__module__'s namespace: resolve
        # the class's annotations in the module that wrote them, before it is renamed.
        # (One that cannot resolve stays as written: tests/test_typing.py names it.)
        with contextlib.suppress(NameError, TypeError, AttributeError):
            _obj.__annotations__ = {
                key: hint
                for key, hint in typing.get_type_hints(_obj).items()
                if key in vars(_obj)["__annotations__"]
            }
    with contextlib.suppress(AttributeError, TypeError):  # report the public module
        _obj.__module__ = "funcgrad"
del _name, _obj
