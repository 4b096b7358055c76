"""Sync policies: every collective funcgrad makes, in one place (docs/scaling.md says what
each level sends).

:class:`Sync` (no distribution: every collective the identity), :class:`GroupSync` (a
ProcessGroup), :class:`DDPSync`, :class:`FSDPSync`. Every call agrees first
(:meth:`Sync.agree`, one all-gather before any backward), so a mistake on one rank is a
clear error on every rank, not a hang; the weights (and an aggregator's update) are the
first rank's on every rank (:meth:`Sync.first_rank_of`, :meth:`Sync.check_ranks`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from . import _graph, _weighting
from ._errors import first_line
from ._tree import is_differentiable
from ._types import Tensors
from ._validate import as_tensors, values_readable


class Sync:
    """No distribution: nothing is communicated."""

    size = 1
    # Whether one backward through the shared part averages its gradients across ranks
    # (DDP's reducer); else funcgrad averages what it computes.
    reduces_backward = False

    def __init__(self, call: str) -> None:
        self.call = call
        self.bytes = 0  # sent per rank in this call (payloads), for the stats

    def agree(self, facts: dict[str, Any] | None, error: BaseException | None) -> None:
        """Raise the local error, if any (with ranks: on every rank, after comparing the
        facts that must match)."""
        if error is not None:
            raise error

    def features_gramian(self, local: torch.Tensor) -> torch.Tensor:
        """The global ``V V^T`` from this rank's."""
        return local

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Around the k backwards of the losses to ``through`` (the cheap part)."""
        yield

    @contextlib.contextmanager
    def reducing_backward(self) -> Iterator[None]:
        """Around the one backward whose gradients the wrap reduces (DDP, FSDP)."""
        yield

    def average(self, tensors: Sequence[torch.Tensor]) -> Tensors:
        """The average over the ranks of every tensor."""
        return tuple(tensors)

    def sum_over_shards(self, gramian: torch.Tensor) -> torch.Tensor:
        """The Gramian of the whole parameters from this rank's part of it (the identity
        where every rank holds all of them)."""
        return gramian

    def from_first_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """The first rank's tensor on every rank (an aggregator's update)."""
        return tensor

    def first_rank_of(
        self, compute: Callable[[], torch.Tensor], size: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first rank's ``compute()`` (``size`` numbers: the weights) on every rank (with
        ranks: in ``like``'s dtype, the same on every rank) and a flag per rank that raised
        (None: no ranks), which the caller passes to :meth:`check_ranks` before it uses the
        result (after reading them with its own read of the weights, where it has one)."""
        return compute(), None

    def check_ranks(self, flags: torch.Tensor | None) -> None:
        """An error on every rank where ``flags`` (of :meth:`first_rank_of`) says that the
        computation raised on some rank (one read)."""

    # -- the questions backward asks, answered by each policy --------------------------

    def by_backward(self, one_pull: bool) -> bool:
        """Whether the update comes from ONE backward of ``w @ V`` through the wrap, which
        averages it (else :meth:`write`); ``one_pull``: the update is that pull anyway (level
        ``"features"`` or no weighting), not ``w @ P``."""
        return self.reduces_backward

    def check_inputs(self, inputs: Any, through: Any) -> None:
        """Before the graph is walked: what this policy refuses of ``inputs`` and
        ``through`` (nothing, without a wrap)."""

    def configure(
        self, shared: Sequence[torch.Tensor], level: str, rule: _weighting.Rule, checkpoint: bool
    ) -> None:
        """Once the shared leaves are known (before any backward): how this policy will
        run, or a ValueError for what it cannot (nothing, without a wrap)."""

    def task_gradients(
        self, outputs: Tensors, cotangents: Tensors, retain_graph: bool, pull: Callable[[], Tensors]
    ) -> Tensors:
        """The k per-task gradients of the shared leaves (leaves (k, ...)), global:
        ``pull()`` pulls the cotangents back through the shared part on this rank (the
        engine's batched pull), averaged over the ranks."""
        return self.average(pull())

    def write(self, leaves: Sequence[torch.Tensor], update: Tensors) -> None:
        """``.grad += update`` on the shared leaves (see :func:`accumulate`), then their
        post-accumulate-grad hooks, once each."""
        with _ACCUMULATING:  # (see accumulate)
            for leaf, u in zip(leaves, update):
                _accumulate(leaf, u)
        post_accumulate(leaves)


# One accumulate at a time (two threads' backwards on shared parameters, Hogwild-style, lost
# an update), as torch's AccumulateGrad holds a lock per leaf.
_ACCUMULATING = threading.RLock()


def accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """``leaf.grad += grad``, as autograd's AccumulateGrad does without ``create_graph``
    (docs/reliability.md, ".grad presets"), one thread at a time. A first ``.grad`` is its
    own, never ``grad`` (which someone else may hold, a hook that logs it, say): a
    copy-on-write clone (:func:`_copy_on_write`) where ``grad`` spans its whole storage with
    the leaf's strides on the CPU, else a copy in the leaf's layout."""
    with _ACCUMULATING:
        _accumulate(leaf, grad)


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.requires_grad:  # (a graph of the results: never into .grad)
        grad = grad.detach()
    current = leaf.grad
    if current is not None:
        if current.layout != torch.strided and grad.layout == torch.strided:
            leaf.grad = grad + current
        else:
            with torch.no_grad():
                current.add_(grad)
        return
    want = getattr(leaf, "grad_dtype", None)  # (set on the leaf: torch casts a new .grad)
    if want is not None and grad.dtype != want:
        grad = grad.to(want)
    if grad.layout != torch.strided:  # sparse (nn.Embedding(sparse=True)): a copy of the
        leaf.grad = grad.clone()  # touched rows, as torch copies one held elsewhere
        return
    # (no data_ptr() here: on a copy-on-write tensor it makes the copy)
    whole = (
        _copy_on_write(grad)
        and grad.untyped_storage().nbytes() == grad.nbytes
        and (grad._base is None or grad.is_contiguous())  # (a view of all its storage)
        and _obeys_layout(grad, leaf)
    )
    clone = _lazy_clone(grad) if whole else None
    leaf.grad = clone if clone is not None else _in_layout_of(grad, leaf)


_LAZY_CLONE: Any = getattr(torch, "_lazy_clone", None)


def _copy_on_write(grad: torch.Tensor) -> bool:
    """Whether ``grad`` can be given a copy-on-write clone (``torch._lazy_clone``: copied only
    when one of two live sides writes): plain CPU tensors only (where it is exercised)."""
    return _LAZY_CLONE is not None and grad.is_cpu and type(grad) is torch.Tensor


def _lazy_clone(grad: torch.Tensor) -> torch.Tensor | None:
    """``torch._lazy_clone(grad)``, or None where torch cannot share the storage (memory it
    did not allocate: ``from_numpy``, DLPack, shared memory)."""
    try:
        return cast(torch.Tensor, _LAZY_CLONE(grad))
    except RuntimeError:
        return None


def _obeys_layout(grad: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether ``grad`` has the strides autograd gives a new ``.grad`` of ``leaf``
    (``obeys_layout_contract``: the leaf's, on every dim of size > 1, for a dense leaf)."""
    if leaf.is_contiguous():  # (the usual case; is_contiguous ignores size-1 dims)
        return grad.is_contiguous()
    return all(
        n == 1 or a == b for n, a, b in zip(leaf.shape, grad.stride(), leaf.stride(), strict=True)
    )


def _in_layout_of(grad: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """A copy of ``grad`` with ``leaf``'s strides (``empty_like`` keeps a dense leaf's
    strides, else gives the nearest memory format), as autograd's ``clone_obey_contract``."""
    out = torch.empty_like(leaf, dtype=grad.dtype, device=grad.device)
    return out.copy_(grad)


def check_presets(leaves: Sequence[tuple[str, torch.Tensor]], call: str) -> None:
    """Before anything runs: a ValueError for a ``.grad`` (of the (name, leaf) pairs) that
    torch's own backward cannot accumulate into either, and refuses only after writing
    other leaves: not floating, an inference tensor, expanded (stride 0)."""
    for name, leaf in leaves:
        grad = leaf.grad
        if grad is not None and not is_differentiable(grad):
            raise ValueError(
                f"{call}: the .grad of {name} (shape {tuple(leaf.shape)}) is of dtype "
                f"{grad.dtype}, which a floating-point gradient cannot be added into (torch's "
                "backward raises there too, after writing other leaves). Nothing was run or "
                "written. Set it to None, or to a floating-point tensor."
            )
        if grad is not None and grad.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(
                f"{call}: the .grad of {name} (shape {tuple(leaf.shape)}) was made under "
                "torch.inference_mode(), and an inference tensor cannot be updated in place "
                "outside it (torch's backward raises there too, after writing other leaves). "
                "Nothing was run or written. Set it to None (or zero_grad()) first."
            )
        if grad is None or grad.layout != torch.strided:
            continue
        dims = [d for d, (n, s) in enumerate(zip(grad.shape, grad.stride())) if s == 0 and n > 1]
        if dims:
            raise ValueError(
                f"{call}: the .grad of {name} (shape {tuple(leaf.shape)}) is expanded: stride 0 "
                f"in dim {dims[0]} (strides {tuple(grad.stride())}), so several of its elements "
                "share one memory location and nothing can be accumulated into it (torch's "
                "backward raises there too, after writing other leaves). Nothing was run or "
                f"written. Give it its own memory (.grad = .grad.clone()) or set it to None."
            )


@contextlib.contextmanager
def post_accumulate_held(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """Holds back the leaves' post-accumulate-grad hooks (the dicts torch reads emptied, then
    refilled) around backwards whose ``.grad`` is not final (FSDP's one per task)."""
    held = [(leaf, dict(leaf._post_accumulate_grad_hooks or {})) for leaf in leaves]
    for leaf, hooks in held:
        if hooks:
            leaf._post_accumulate_grad_hooks.clear()
    try:
        yield
    finally:
        for leaf, hooks in held:
            if hooks:
                leaf._post_accumulate_grad_hooks.update(hooks)


def post_accumulate(leaves: Sequence[torch.Tensor]) -> None:
    """Fire each leaf's post-accumulate-grad hooks once, in order, on its final ``.grad``, as
    torch's backward does (optimizers-in-backward and FSDP rely on them)."""
    seen: set[int] = set()
    for leaf in leaves:
        hooks = leaf._post_accumulate_grad_hooks
        if id(leaf) in seen or not hooks:
            continue
        seen.add(id(leaf))
        for hook in tuple(hooks.values()):  # (a hook may remove itself)
            hook(leaf)


class GroupSync(Sync):
    """The ranks of a ``torch.distributed`` ProcessGroup."""

    def __init__(self, group: Any, call: str) -> None:
        super().__init__(call)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{call}: `process_group` was given but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group first, or pass process_group=None."
            )
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"{call}: `process_group` must be a torch.distributed ProcessGroup (such as "
                "torch.distributed.group.WORLD), the DistributedDataParallel module of the "
                "shared encoder, or the shared encoder after FSDP2's fully_shard, got "
                f"{type(group).__name__}."
            )
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.source = dist.get_global_rank(group, 0)

    def agree(self, facts: dict[str, Any] | None, error: BaseException | None) -> None:
        mine = (type(self).__name__, facts, None if error is None else first_line(error))
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, mine, group=self.group)
        if error is not None:
            raise error
        for rank, (_, _, message) in enumerate(gathered):
            if message is not None:
                raise RuntimeError(
                    f"{self.call}: rank {rank} of `process_group` failed its checks "
                    f"({message}); every rank stops here, before anything is communicated "
                    "or written. Fix the input on that rank."
                )
        # Every rank compares every rank with the first, so all raise alike (or none does).
        policy, reference, _ = gathered[0]
        diffs = []
        for rank, (their_policy, theirs, _) in enumerate(gathered[1:], start=1):
            if their_policy != policy:
                diffs.append(f"wrap: {their_policy} on rank {rank} vs {policy} on rank 0")
            diffs += [
                f"{label}: {theirs.get(label)!r} on rank {rank} vs {value!r} on rank 0"
                for label, value in reference.items()
                if theirs.get(label) != value
            ]
        if diffs:
            raise ValueError(
                f"{self.call}: the ranks of `process_group` disagree ({'; '.join(diffs)}). "
                "Every rank must pass the same losses (same k, keys in the same order), the "
                "same `through` structure and the same model; nothing was communicated or "
                "written."
            )

    def _sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def features_gramian(self, local: torch.Tensor) -> torch.Tensor:
        # Each rank's features enter the global loss with a factor 1/R.
        return self._sum(local) / self.size**2

    def average(self, tensors: Sequence[torch.Tensor]) -> Tensors:
        """In one flat buffer per dtype."""
        result: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = self._sum(torch.cat([tensors[i].reshape(-1) for i in indices])) / self.size
            for i, part in zip(indices, torch.split(flat, [tensors[i].numel() for i in indices])):
                result[i] = part.view_as(tensors[i])
        return tuple(t for t in result if t is not None)  # every entry is set above

    def from_first_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=self.source, group=self.group)
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def first_rank_of(
        self, compute: Callable[[], torch.Tensor], size: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The first rank's result and which ranks raised travel in ONE all-reduce (where a
        # broadcast would carry the result alone), so that a rank whose weighting raised
        # does not leave the others waiting in a collective (until the group's timeout).
        if not values_readable([like]):  # (inside a transform: no value can be read)
            result = compute()
            return (self.from_first_rank(result) if size else result), None
        mine: torch.Tensor | None = None
        error: Exception | None = None
        try:
            mine = compute()
        except Exception as caught:
            error = caught
        payload = torch.zeros(size + self.size, dtype=torch.float64, device=like.device)
        if mine is None:
            payload[size + self.rank] = 1
        elif self.rank == 0:
            payload[:size].copy_(mine.detach().reshape(-1))
        else:  # -0.0, the exact additive identity (+0.0 would turn the first rank's -0.0 to +0.0)
            payload[:size] = -0.0
        payload = self._sum(payload)
        if error is not None:
            raise error
        assert mine is not None
        # The same values in the same dtype on every rank (G's, not each rank's weighting's),
        # so that every rank finds them finite or none.
        first = payload[:size].view(mine.shape).to(mine.device, like.dtype)
        if not mine.requires_grad:
            return (mine if self.rank == 0 and mine.dtype == like.dtype else first), payload[size:]
        kept = mine.to(like.dtype).clone()  # its graph (create_graph), with the first rank's values
        with torch.no_grad():
            kept.copy_(first)
        return kept, payload[size:]

    def check_ranks(self, flags: torch.Tensor | None) -> None:
        if flags is not None and flags.any():  # (one read)
            failed = flags.nonzero().flatten().tolist()
            raise RuntimeError(
                f"{self.call}: the weighting raised on group rank(s) {failed} of "
                "`process_group` (see the error there); every rank stops here, before anything "
                "is written."
            )


class DDPSync(GroupSync):
    """The ranks of a DistributedDataParallel encoder: where its parameters are exactly the
    shared leaves, its reducer averages the one backward funcgrad runs through it (its
    communication hooks apply); otherwise funcgrad averages every gradient itself, as for a
    ProcessGroup, and runs no backward through the reducer."""

    reduces_backward = True

    def __init__(self, module: torch.nn.parallel.DistributedDataParallel, call: str) -> None:
        super().__init__(module.process_group, call)
        self.module = module

    def configure(
        self, shared: Sequence[torch.Tensor], level: str, rule: _weighting.Rule, checkpoint: bool
    ) -> None:
        """Decide, from the shared leaves, whether DDP's reducer can do the averaging, and
        refuse what it cannot then reduce."""
        wrapped = {id(p) for p in self.module.parameters() if p.requires_grad}
        exact = wrapped == {id(x) for x in shared}
        static = bool(getattr(self.module, "static_graph", False))
        if static and (level == "params" or not exact):
            why = (
                "at level='params' the per-task gradients are pulled through the module, "
                "and with static_graph its reducer acts on every backward through it"
                if exact
                else "its parameters are not exactly the shared leaves, so funcgrad must "
                "average some gradients itself and skip DDP's backward, which a static graph "
                "does not allow"
            )
            raise ValueError(
                f"{self.call}: DistributedDataParallel(static_graph=True) is not supported "
                f"here: {why}. Use static_graph=False, or level='features' with the DDP "
                "module wrapping exactly the shared model."
            )
        self.reduces_backward = exact
        if exact and checkpoint:
            raise ValueError(
                f"{self.call}: a DDP-wrapped encoder with a reentrant checkpoint inside "
                "(torch.utils.checkpoint with use_reentrant=True) is not supported: DDP's "
                "reducer would see one backward per direction. Checkpoint with "
                "use_reentrant=False."
            )
        if exact and not rule.update_is_weighted:
            raise ValueError(
                f"{self.call}: {type(rule.fn).__name__} returns an update that is not w @ P "
                "(it has no weights, or forward hooks of its own), but a DDP-wrapped encoder "
                "needs one (its reducer averages the backward of w @ V). Use a weighted "
                "aggregator without hooks on itself (hooks on its weighting are fine), or pass "
                "the process group itself and a plain encoder."
            )


class FSDPSync(GroupSync):
    """The ranks of an FSDP2 (``fully_shard``) encoder, with one wrap or per-layer wraps,
    sharded over a 1-D device mesh. Its reduce-scatter averages the gradients of each
    backward through it into each rank's shard (a DTensor ``.grad`` on the sharded
    parameter)."""

    reduces_backward = True

    def __init__(self, module: torch.nn.Module, call: str) -> None:
        meshes = {id(p.device_mesh): p.device_mesh for p in _sharded_params(module)}
        mesh = next(iter(meshes.values()), None)
        if mesh is None or len(meshes) > 1 or mesh.ndim != 1:
            got = (
                "no sharded parameter"
                if mesh is None
                else f"{len(meshes)} device meshes"
                if len(meshes) > 1
                else f"a {mesh.ndim}-D mesh"
            )
            raise ValueError(
                f"{call}: `process_group` is an FSDP module, which must be sharded over one "
                "1-D device mesh (fully_shard(module, mesh=init_device_mesh(device, "
                f"(world_size,)))), got {got}. HSDP (a 2-D mesh) is not supported."
            )
        super().__init__(mesh.get_group(), call)
        self.module = module
        self._reached: list[bool] = []  # which parameters the per-task backwards reached

    def by_backward(self, one_pull: bool) -> bool:
        """One backward of ``w @ V`` through FSDP (it reduce-scatters) where the update is
        one pull; else funcgrad writes each rank's shards of ``w @ P``."""
        return one_pull

    def check_inputs(self, inputs: Any, through: Any) -> None:
        """Before the graph is walked: FSDP updates every parameter of the module, and the
        graph must show them."""
        through = as_tensors(through, "through", self.call)
        if inputs is not None:
            raise ValueError(
                f"{self.call}: with an FSDP module as `process_group`, `inputs` must be None: "
                "every parameter of the FSDP module is updated."
            )
        if _graph.scan(through).checkpoint:
            raise ValueError(
                f"{self.call}: the FSDP module runs a reentrant checkpoint "
                "(torch.utils.checkpoint with use_reentrant=True), whose graph hides the "
                "parameters inside it; checkpoint with use_reentrant=False (or FSDP's "
                "checkpoint_wrapper)."
            )

    def configure(
        self, shared: Sequence[torch.Tensor], level: str, rule: _weighting.Rule, checkpoint: bool
    ) -> None:
        """The shared leaves must be parameters of the module (found by identity in FSDP's
        private state; by shape where that is not found); at the params level, FSDP must
        reduce each backward's gradients."""
        own = _unsharded_params([self.module])
        why = None
        if len(_sharded_params(self.module)) != len(list(self.module.parameters())):
            why = "every parameter of the module must be sharded by FSDP (no ignored_params)"
        elif own is not None and any(id(x) not in own for x in shared):
            shapes = [tuple(x.shape) for x in shared if id(x) not in own]
            why = (
                f"`through` depends on leaves that are not parameters of this FSDP module "
                f"(shapes {shapes}): an input that requires grad, a side branch, or another "
                "model (a copy of it, a second tower). Compute `through` with this module "
                "from inputs that do not require grad, or pass the FSDP module that computed it"
            )
        elif own is None and not {tuple(x.shape) for x in shared} <= {
            tuple(p.shape) for p in self.module.parameters()
        }:
            why = "`through` depends on leaves that are not parameters of this FSDP module"
        elif level == "params" and not _reduces_gradients(self.module):
            why = (
                "level='params' needs FSDP to reduce every backward's gradients, but "
                "set_requires_gradient_sync(False) is in force (gradient accumulation): use "
                "level='features', or synchronise every micro-batch"
            )
        elif rule.needs_jacobian:
            why = (
                "a weighting that reads the whole Jacobian would gather every task's "
                "gradient of every parameter on each rank; use a Gramian weighting (such as "
                "TorchJD's UPGradWeighting or MGDAWeighting, or UPGrad())"
            )
        if why is not None:
            raise ValueError(f"{self.call}: with an FSDP module as `process_group`, {why}.")

    def _reset(self) -> None:
        """FSDP's public recovery after a backward that raised (its pre-backward hook has
        run, its end-of-backward callback has not)."""
        root: Any = self.module
        with contextlib.suppress(Exception):  # the error being raised is the one to see
            root.reset_iter_state()

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """During the k backwards of ``dL_i/dfeatures`` (each fires FSDP's pre-backward
        all-gather), resharding is put off and none is FSDP's last backward, so what they
        gathered stays for the real backward; the settings, read from FSDP's private state,
        are put back after (where not found, nothing is changed: it only saves traffic)."""
        settings = _backward_settings(self.module)
        root: Any = self.module
        if settings is not None:
            for module in settings[1]:
                module.set_reshard_after_backward(False, recurse=False)
            root.set_is_last_backward(False)
        try:
            yield
        except BaseException:
            self._reset()
            raise
        finally:
            if settings is not None:
                root.set_is_last_backward(settings[0])
                for module, setting in settings[1].items():
                    module.set_reshard_after_backward(setting, recurse=False)

    def _trained(self) -> list[Any]:
        """The sharded parameters that get gradients."""
        return [p for p in _sharded_params(self.module) if p.requires_grad]

    @contextlib.contextmanager
    def _grads_set_aside(self) -> Iterator[list[Any]]:
        """The ``.grad`` held before the body, set aside and added to what the body leaves; if
        the body raises, FSDP is reset and every ``.grad`` is as it was."""
        params = self._trained()
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        with post_accumulate_held(params):  # (FSDP fires them per backward, before the add)
            try:
                yield params
            except BaseException:
                self._reset()
                for p, grad in zip(params, held):
                    p.grad = grad
                raise
        for p, grad in zip(params, held):
            if grad is not None:
                p.grad = grad if p.grad is None else grad.add_(p.grad)

    @contextlib.contextmanager
    def reducing_backward(self) -> Iterator[None]:
        """Around the one backward through FSDP (features level); then the post-accumulate-
        grad hooks of the parameters it wrote, once each, on their final ``.grad``."""
        with self._grads_set_aside() as params:
            yield
        post_accumulate([p for p in params if p.grad is not None])

    def task_gradients(
        self, outputs: Tensors, cotangents: Tensors, retain_graph: bool, pull: Callable[[], Tensors]
    ) -> Tensors:
        """Each sharded parameter's local shard of the k averaged per-task gradients,
        (k, *shard shape): one FSDP backward per task (FSDP has no batched backward), each
        ``.grad`` read and cleared."""
        k = cotangents[0].shape[0]
        with self._grads_set_aside() as params:
            rows: list[list[torch.Tensor]] = [[] for _ in params]
            self._reached = [False] * len(params)
            for i in range(k):
                retain = retain_graph or i < k - 1
                try:
                    torch.autograd.backward(
                        outputs, [c[i] for c in cotangents], retain_graph=retain
                    )
                except Exception as error:
                    if i == 0:
                        raise
                    raise RuntimeError(
                        f"{self.call}: at level='params' with an FSDP module, funcgrad runs "
                        "one FSDP backward per task on one retained graph; the second one "
                        f"failed ({first_line(error)}). Something in the encoder does not "
                        "support several backwards on one graph (such as "
                        "torch.distributed._composable.checkpoint): use level='features', or "
                        "checkpoint with torch.utils.checkpoint(use_reentrant=False) or "
                        "checkpoint_wrapper."
                    ) from error
                for j, (row, p) in enumerate(zip(rows, params)):
                    self._reached[j] |= p.grad is not None
                    local = (p if p.grad is None else p.grad).to_local().detach()  # (shard)
                    row.append(local.clone() if p.grad is not None else torch.zeros_like(local))
                    p.grad = None
        return tuple(torch.stack(row) for row in rows)

    def sum_over_shards(self, gramian: torch.Tensor) -> torch.Tensor:
        return self._sum(gramian)

    def write(self, leaves: Sequence[torch.Tensor], update: Tensors) -> None:
        """``.grad += update`` on each rank's shards (``update``: the local shards, in the
        order of :meth:`task_gradients`)."""
        from torch.distributed.tensor import DTensor

        for p, local, reached in zip(self._trained(), update, self._reached):
            if not reached:  # unused by the forward: its .grad stays, as with plain FSDP
                continue
            spec: Any = p
            grad = DTensor.from_local(
                local.detach().to(p.dtype),
                spec.device_mesh,
                spec.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            p.grad = grad if p.grad is None else p.grad.add_(grad)
        post_accumulate([p for p, reached in zip(self._trained(), self._reached) if reached])


# The sharded parameters of each FSDP module (its optimizer's): after a forward the root
# holds the unsharded ones, and ``reshard()`` (one more all-gather) is run once per module.
_SHARDED: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def _sharded_params(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.tensor import DTensor  # (imported late: slow to import)

    params = list(module.parameters())
    if all(isinstance(p, DTensor) for p in params):
        _SHARDED[module] = params
        return params
    if module in _SHARDED:
        return _SHARDED[module]
    parts: list[Any] = list(module.modules())
    for part in parts:
        if _is_fsdp(part):
            part.reshard()
    params = [p for p in module.parameters() if isinstance(p, DTensor)]
    _SHARDED[module] = params
    return params


def _backward_settings(module: torch.nn.Module) -> tuple[bool, dict[Any, bool]] | None:
    """(is the next backward the last one, each FSDP module's reshard-after-backward) from
    FSDP's private state, or None where it is not found."""
    reshard: dict[Any, bool] = {}
    parts: list[Any] = list(module.modules())
    try:
        last = bool(parts[0]._get_fsdp_state()._state_ctx.is_last_backward)
        for part in parts:
            if _is_fsdp(part):
                groups = part._get_fsdp_state()._fsdp_param_groups
                values = {bool(group.reshard_after_backward) for group in groups}
                if len(values) > 1:
                    return None
                reshard[part] = values.pop() if values else True
    except AttributeError:
        return None
    return last, reshard


def _fsdp_params(modules: Any) -> Iterator[tuple[Any, Any]]:
    """(param group, FSDPParam) of every FSDP module among ``modules`` (FSDP's private
    state: AttributeError where it is not found)."""
    for part in modules:
        if _is_fsdp(part):
            for group in part._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    yield group, fsdp_param


def _unsharded_params(roots: Any) -> dict[int, str] | None:
    """id -> name of the unsharded parameters (those in the autograd graph after a
    forward) of every FSDP module under ``roots``; None where FSDP's private state is not
    found."""
    try:
        return {
            id(fsdp_param._unsharded_param): str(fsdp_param._param_fqn or "?")
            for root in roots
            for _, fsdp_param in _fsdp_params(root.modules())
            if hasattr(fsdp_param, "_unsharded_param")
        }
    except AttributeError:
        return None


def _reduces_gradients(module: torch.nn.Module) -> bool:
    """False where ``set_requires_gradient_sync(False)`` is in force on a part of it."""
    try:
        return all(group.reduce_grads for group, _ in _fsdp_params(module.modules()))
    except AttributeError:
        return True


def check_fsdp_leaves(
    shared: Sequence[torch.Tensor], own: Sequence[Sequence[torch.Tensor]], sync: Sync
) -> None:
    """Refuse an FSDP2 parameter among the leaves whose gradients funcgrad writes itself:
    only FSDP's own backward reaches the sharded parameter."""
    if "torch.distributed.fsdp" not in sys.modules or not dist.is_initialized():
        return
    from torch.distributed._composable_state import _module_state_mapping

    found = _unsharded_params([m for m in list(_module_state_mapping) if _is_fsdp(m)]) or {}
    if not found:
        return
    shared_fix = (
        "their gradients must come from FSDP's own backward, which shards them. Pass "
        "process_group=<the fully_shard-ed shared encoder>."
    )
    heads_fix = (
        "funcgrad computes the heads' gradients itself and cannot write them into FSDP's "
        "shards. Keep the task heads out of fully_shard (replicated on every rank)."
    )
    checks = [] if isinstance(sync, FSDPSync) else [("the shared leaves", shared, shared_fix)]
    checks += [(f"the task-specific leaves of loss {i}", x, heads_fix) for i, x in enumerate(own)]
    for what, leaves, fix in checks:
        names = [found[id(x)] for x in leaves if id(x) in found]
        if names:
            listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ValueError(
                f"{sync.call}: {what} include parameters of an FSDP2 module ({listed}); {fix}"
            )


def first_sharded(leaves: Sequence[torch.Tensor]) -> int | None:
    """The index of the first DTensor among ``leaves`` (None if none is)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.tensor import DTensor

    return next((i for i, x in enumerate(leaves) if isinstance(x, DTensor)), None)


def _is_fsdp(value: Any) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule  # (imported late: slow to import)

    return isinstance(value, FSDPModule)


def policy(process_group: Any, call: str, *, allow_modules: bool = True) -> Sync:
    """The Sync policy for a ``process_group`` argument."""
    if process_group is None:
        return Sync(call)
    if _is_fsdp(process_group):
        if not allow_modules:
            raise TypeError(
                f"{call}: `process_group` must be a ProcessGroup here, got an FSDP module. "
                "combine_heads differentiates f's explicit parameters with torch.func, which "
                "does not see FSDP's sharding: use funcgrad.backward with "
                "process_group=<the FSDP encoder> for sharded training."
            )
        return FSDPSync(process_group, call)
    if isinstance(process_group, torch.nn.parallel.DistributedDataParallel):
        if not allow_modules:
            raise TypeError(
                f"{call}: `process_group` must be a ProcessGroup here (f is a function, "
                "not a DDP module); pass ddp.process_group."
            )
        return DDPSync(process_group, call)
    return GroupSync(process_group, call)
