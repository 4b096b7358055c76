"""y's size without a real forward of f: f on fake tensors (shapes only), or one real
forward that leaves no trace (generators restored, writes made on copies). ``plan()`` uses
them; a call never does."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import _coords, _function
from ._errors import first_line
from ._function import FlatFunction
from ._linearize import RandomState

# A fake run of f (shapes only) stops past this many ops (a Python loop of small ops would
# cost many eager forwards: docs/planning.md); plan() then runs one real forward instead.
FAKE_RUN_OPS = 50


class _Stop(Exception):
    """Internal: a shape-only run of f went past its budget."""


class _OpBudget(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Stops f after ``limit`` ops."""

    def __init__(self, limit: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.left = limit

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _Stop
        return func(*args, **(kwargs or {}))


class _NoMutation(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every op that would write into a tensor f did not create (a buffer's running
    statistics, a captured state) on a copy of it instead: a forward run under it leaves no
    trace (its values may differ from a real forward's; its shapes do not)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: set[int] = set()

    def _foreign(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and (
            value.untyped_storage().data_ptr() not in self.made
        )

    def _own(self, value: Any) -> Any:
        """``value`` to write into: a copy where it is foreign (each of a list's tensors, for
        ``Tensor(a!)[]``: the ``_foreach_*_`` ops)."""
        if isinstance(value, (list, tuple)):
            return type(value)(self._own(v) for v in value)
        return value.clone() if self._foreign(value) else value

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = list(args), dict(kwargs or {})
        if "batch_norm" in func.__name__:  # updates the running statistics (args 3 and 4)
            # in training mode without saying so in its schema
            for i in (3, 4):
                if i < len(args) and self._foreign(args[i]):
                    args[i] = args[i].clone()
        if func._schema.is_mutable:
            for i, argument in enumerate(func._schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                if argument.kwarg_only:
                    if argument.name in kwargs:
                        kwargs[argument.name] = self._own(kwargs[argument.name])
                elif i < len(args):
                    args[i] = self._own(args[i])
        out = func(*args, **kwargs)
        # A view (select, for x[i] = v) shares its input's storage: it is made only where
        # that input was.
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage().data_ptr()
                if storage not in given:
                    self.made.add(storage)
        return out


def output_size(flat: FlatFunction, limit: int | None = FAKE_RUN_OPS) -> int | None:
    """m = real numel of f's output without running f's ops for real: f on fake tensors
    (shapes only, no data; no tensor written, since torch.func refuses in-place updates of
    captured buffers, and no generator advanced), for at most ``limit`` ops. f's Python body
    does run (up to the limit): Python state it changes changes. None where that cannot
    tell (data-dependent Python in f, a long Python loop, ...). Eager mode only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    watch, flat.watch = flat.watch, False  # fake draws: nothing for RandomState to restore
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [mode.from_tensor(leaf) for leaf in flat.leaves]
            with contextlib.ExitStack() as stack:
                if limit is not None:
                    stack.enter_context(_OpBudget(limit))
                stack.enter_context(_function.Random(flat))  # does f draw? (random ops)
                out = torch.func.vjp(flat, *fakes, has_aux=flat.has_aux)[0]
        return _coords.real_size(out)
    except Exception:  # any failure only means the shape is not known in advance
        return None
    finally:
        flat.watch = watch


def forward_size(flat: FlatFunction) -> int:
    """m from one real forward of f that leaves no trace, the random number generators
    restored (the default ones and every ``torch.Generator`` f draws from). First in
    inference mode, f stopped before it writes into a tensor it did not make (a buffer, a
    counter: :class:`~funcgrad._function.NoOutsideWrites`): inference mode records no graph,
    so it costs about 2 eager forwards on a Python loop of small ops (docs/planning.md),
    and less on larger ops. Where f writes such a tensor, every such write made on a copy
    (BatchNorm's running statistics in training mode) at ~4 eager forwards; where f needs
    gradients inside, the vjp of f (it refuses most such writes, and then that copy)."""
    rng = RandomState(flat, inputs=False)

    def output(*leaves: torch.Tensor) -> Any:
        # Only the explicit generators f draws from are watched (for rng.restore), not
        # which ops draw: nothing here records that, and a dispatch mode on every op cost
        # several of f's forwards on a Python loop of small ops (docs/planning.md).
        watch, flat.watch = flat.watch, False
        try:
            with _function._Draws(flat.generators) if watch else contextlib.nullcontext():
                result = flat(*leaves)
        finally:
            flat.watch = watch
        return result[0] if flat.has_aux else result

    def in_inference_mode() -> Any:
        watch, flat.watch = flat.watch, False
        try:
            with torch.inference_mode(), _function.NoOutsideWrites(flat.generators, flat.leaves):
                result = flat(*flat.leaves)
        finally:
            flat.watch = watch
        return result[0] if flat.has_aux else result

    def on_copies() -> Any:
        rng.restore()
        with torch.no_grad(), _NoMutation():
            return output(*flat.leaves)

    try:
        try:
            out = in_inference_mode()
        except _function.Writes:  # (torch.func lets some writes through: x[i] = 1.0)
            out = on_copies()
        except RuntimeError:  # f needs gradients inside
            rng.restore()
            try:
                out = torch.func.vjp(output, *flat.leaves)[0]
            except RuntimeError:
                try:
                    out = on_copies()
                except RuntimeError as error:  # (gradients of a tensor f captured, say)
                    raise RuntimeError(
                        "plan(): y's size could not be found before a call: f raised in "
                        "inference mode, under torch.func.vjp and under no_grad (last: "
                        f"{first_line(error)}). f may take gradients of a tensor it "
                        "captured, which plan() does not run (gradients inside f would "
                        "write .grad and state). Call the function once: plan() then "
                        "answers from what that call measured."
                    ) from error
    finally:
        rng.restore()
    return _coords.real_size(out)
