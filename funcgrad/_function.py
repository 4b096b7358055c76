"""f as torch.func sees it: a function of a flat tuple of tensors returning a flat tuple.

Inputs and outputs are flattened with optree at this boundary (see ``_tree``), and every
check on them is made here so that the user gets one clear message, not autograd's.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from . import _coords, _tree
from ._errors import describe
from ._graph import edge, hook_or_function, nodes
from ._types import Tensors
from ._validate import check_primal_leaves, outside_transforms, values_readable


def result_graph(create_graph: bool, leaves: Sequence[torch.Tensor]) -> Any:
    """The context the entry points compute their results in: ``torch.no_grad()`` (no graph
    of the results, as ``create_graph=False``), unless ``create_graph`` or a torch.func
    transform around the call needs that graph. (torch.func's transforms inside ignore the
    outer ``no_grad``: f still sees grad mode enabled inside ``vjp``.)"""
    if create_graph or (not torch.compiler.is_compiling() and not outside_transforms(leaves)):
        return contextlib.nullcontext()
    return torch.no_grad()


class ReplacedTorchFunction(TypeError):
    """A torch function or method that f reached was replaced by a Python function (a patch,
    a wrapper) that funcgrad's watched run cannot call as eager would (see
    :func:`eager_function`)."""


# The types of torch's C functions and methods: a mode handed one calls what eager calls.
_C_TYPES = frozenset(
    (
        types.BuiltinFunctionType,
        types.MethodDescriptorType,
        types.WrapperDescriptorType,
        types.MethodWrapperType,
    )
)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# torch's own Python functions seen by a mode, by id (never hashes a user's callable), kept
_OWN: dict[int, Any] = {}
_HANDLE = torch.overrides.handle_torch_function.__code__
# The namespaces torch's C code looks function names up in at call time (besides
# torch.Tensor), with their C functions as funcgrad's import found them.
_C_MODULES = tuple(
    getattr(torch._C, name) for name in ("_nn", "_linalg", "_fft", "_special", "_nested", "_sparse")
)
_C_NAMESPACES = tuple(
    (module, {k: v for k, v in vars(module).items() if type(v) in _C_TYPES})
    for module in _C_MODULES
)
_FUNCTION_OF: dict[types.CodeType, Any] = {}


def _torch_code(code: types.CodeType) -> bool:
    return code.co_filename.startswith(_TORCH_DIR)


def eager_function(func: Any, caller: types.FrameType, args: Any, kwargs: Any) -> Any:
    """The function eager would have run where a TorchFunctionMode is handed ``func`` (not
    torch's C function nor its known Python one); ``caller``: the frame that called the
    mode's ``__torch_function__``.

    torch hands a mode what it finds under the called name at call time (a Python torch
    function's module global, or ``torch.Tensor``'s / a C namespace's attribute), so a
    replacement that wraps the original would run twice. Assumptions, each checked: a Python
    function dispatched from torch's own code was dispatched by that torch function (found by
    its code: ``__wrapped__`` chain, else the one function with that code; called only where
    the arguments bind to it); one dispatched from C replaced an attribute of
    ``torch.Tensor`` (original: ``torch._C.TensorBase``'s) or of a C namespace as funcgrad's
    import found it. A user's own overridable function is returned as it is; anything else
    is refused (:class:`ReplacedTorchFunction`), never run twice."""
    # (a wrapt-style proxy forwards its wrapped function's __module__ and __code__)
    proxy = (
        type(func) not in (types.FunctionType, types.MethodType)
        and hasattr(func, "__wrapped__")
        and (type(func).__module__ or "").split(".")[0] != "torch"
    )
    code = None if proxy else _code_of(func)
    if code is None and not proxy:
        own = (getattr(func, "__module__", None) or type(func).__module__ or "").split(".")[0]
        if own == "torch":
            return func
    elif code is not None and _torch_code(code) and _torch_code(_code_of(_end(func)) or code):
        if type(func) is types.FunctionType:  # (not a bound method: made anew each time)
            _OWN[id(func)] = func
        return func
    if caller.f_code in _RESOLVED:  # (a mode handing its op on: func was found there)
        return func
    if caller.f_code is _HANDLE:  # a Python function's handle_torch_function
        dispatcher = caller.f_back
        if dispatcher is None or dispatcher.f_code is code or not _torch_code(dispatcher.f_code):
            return func
        original = _function_of(dispatcher.f_code, func)
        if original is not None and dispatcher.f_globals.get(dispatcher.f_code.co_name) is not func:
            try:  # (it dispatched another name than its own: its arguments must fit it)
                inspect.signature(original).bind(*args, **(kwargs or {}))
            except (TypeError, ValueError):
                original = None
        where = f"{dispatcher.f_code.co_name} ({dispatcher.f_code.co_filename})"
    else:  # torch's C code looked func up by name
        original, where = _c_original(func)
    if original is None:
        raise ReplacedTorchFunction(
            f"the torch function {where} was replaced by a Python function that is not "
            f"torch's ({type(func).__name__} {_name(func)}): funcgrad watches f's first call "
            "of a shape with a TorchFunctionMode, which torch hands the replacement, and "
            "calling it would apply it twice. Nothing was differentiated or written. Restore "
            "torch's function around the call, or install the replacement with "
            "functools.wraps(original) (or, for a C function, after funcgrad is imported: "
            "funcgrad then knows the original)."
        )
    return original


def _end(func: Any) -> Any:
    """The end of ``func``'s ``__wrapped__`` chain (under a torch decorator: the user's)."""
    for _ in range(100):
        wrapped = getattr(func, "__wrapped__", None)
        if wrapped is None:
            break
        func = wrapped
    return func


def _code_of(func: Any) -> types.CodeType | None:
    """The code a callable runs (through methods, partials, its class's ``__call__``); None
    for C callables."""
    for _ in range(10):
        if isinstance(func, functools.partial):
            func = func.func
            continue
        code = getattr(getattr(func, "__func__", func), "__code__", None)
        if isinstance(code, types.CodeType):
            return code
        call = next(
            (vars(k)["__call__"] for k in type(func).__mro__ if "__call__" in vars(k)), None
        )
        code = getattr(call, "__code__", None)
        return code if isinstance(code, types.CodeType) else None
    return None


def _name(func: Any) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _function_of(code: types.CodeType, func: Any) -> Any:
    """The one function object whose code is ``code`` (a torch function's), or None."""
    found = _FUNCTION_OF.get(code)
    if found is not None:
        return found
    wrapped = func
    for _ in range(100):  # (functools.wraps chains)
        wrapped = getattr(wrapped, "__wrapped__", None)
        if wrapped is None:
            break
        if getattr(wrapped, "__code__", None) is code:
            found = wrapped
            break
    if found is None:
        functions = [
            f
            for f in gc.get_referrers(code)
            if type(f) is types.FunctionType and f.__code__ is code
        ]
        if len(functions) != 1:
            return None
        found = functions[0]
    _FUNCTION_OF[code] = found
    return found


def _c_original(func: Any) -> tuple[Any, str]:
    """The C function whose name's lookup gave ``func`` (or None), and where it lives."""
    where = (
        f"{getattr(func, '__name__', '?')!r} (looked up by torch's C code: no attribute of "
        "torch.Tensor nor of torch._C's namespaces holds the replacement)"
    )
    original, name = None, None
    for candidate, value in vars(torch.Tensor).items():
        if value is func:
            name = candidate
            break
    else:  # (a descriptor, a wrapt proxy, makes a new object on each lookup: by its name)
        named = getattr(func, "__name__", None)
        if isinstance(named, str) and named in vars(torch.Tensor):
            fresh = getattr(torch.Tensor, named, None)
            wrapped = getattr(func, "__wrapped__", None)
            if fresh is func or (
                wrapped is not None
                and type(fresh) is type(func)
                and getattr(fresh, "__wrapped__", None) is wrapped
            ):
                name = named
    if name is not None:
        where = f"torch.Tensor.{name}"
        original = vars(torch._C.TensorBase).get(name)
    else:
        for module, originals in _C_NAMESPACES:
            for candidate, value in vars(module).items():
                if value is func:
                    name, where = candidate, f"{module.__name__}.{candidate}"
                    original = originals.get(candidate)
                    break
            if name is not None:
                break
    if type(original) not in _C_TYPES:
        wrapped = func  # (functools.wraps of the original, possibly of another wrapper)
        for _ in range(100):
            wrapped = getattr(wrapped, "__wrapped__", None)
            if wrapped is None or type(wrapped) in _C_TYPES:
                break
        ok = (
            name is not None
            and type(wrapped) in _C_TYPES
            and getattr(wrapped, "__name__", 0) == name
        )
        original = wrapped if ok else None
    return original, where


class _Draws(TorchFunctionMode):
    """Records each ``torch.Generator`` passed (``generator=``) the first time, with its state
    before that draw; given ``flat``, whether f registered a tensor hook (``flat.hooked``),
    ran an RNN (``flat.rnn``) or a training batch norm (``flat.norm``); given ``threads``
    (eager autograd only), the nodes of what torch functions return (see :func:`foreign`)."""

    def __init__(
        self,
        seen: dict[torch.Generator, torch.Tensor],
        flat: FlatFunction | None = None,
        threads: Threads | None = None,
    ) -> None:
        super().__init__()
        self.seen = seen
        self.flat = flat
        self.threads = threads
        # (grad mode as f last set it; torch turns it off itself in a Function's forward)
        self.grad_mode = torch.is_grad_enabled()
        self.level = _current_level()  # (a transform's inside f, a nested call's: not f's)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if type(func) not in _C_TYPES and id(func) not in _OWN:  # (a replaced torch function)
            func = eager_function(func, sys._getframe(1), args, kwargs)
        kwargs = kwargs or {}
        threads = self.threads
        if threads is None or not threads.on:
            return self._watched(func, types, args, kwargs)
        # (Threads.check and .made inlined: once per op of f on a watched call)
        if _current_level() is not None:  # a transform inside f: see Threads
            threads.off()
            return self._watched(func, types, args, kwargs)
        nodes = threads.nodes
        for value in args:
            if isinstance(value, torch.Tensor):
                node = value.grad_fn
                if node is not None and node not in nodes:
                    threads.unseen_tensor(value, node)
            elif isinstance(value, (list, tuple)):
                threads.check(value)
        if kwargs:
            threads.check(kwargs.values())
        result = self._watched(func, types, args, kwargs)
        if isinstance(result, torch.Tensor):
            node = result.grad_fn
            if node is not None:
                nodes.add(node)
                if not torch.is_grad_enabled():  # (an autograd.Function's forward)
                    threads.plain[id(result)] = weakref.ref(result)
            else:
                threads.plain[id(result)] = weakref.ref(result)
        else:
            threads.made(result)
        # (in place, ``mul_``, ``out=``: the written tensor's and its base's nodes are new)
        for value in args:
            if isinstance(value, torch.Tensor):
                threads.written(value)
        if kwargs:
            out = kwargs.get("out")
            if isinstance(out, torch.Tensor):
                threads.written(out)
        return result

    def _watched(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        flat = self.flat
        if flat is not None:
            name = getattr(func, "__name__", "")
            if func is torch.Tensor.register_hook:
                flat.hooked = True
            elif name in _RNN_FUNCTIONS:
                flat.rnn = True
            elif name == "batch_norm" and (args[5] if len(args) > 5 else kwargs.get("training")):
                flat.norm = True
            elif name == "_set_grad_enabled" and args:
                self.grad_mode = bool(args[0])
            if (
                flat.grad_on
                and not flat.no_grad
                and not torch.is_grad_enabled()
                and _current_level() == self.level
            ):
                # (inside a Function's forward entered in grad mode: its jvp is its own)
                flat.no_grad = _requires_grad(args, kwargs, flat.forward_mode) and (
                    not self.grad_mode or torch.is_inference_mode_enabled()
                )
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator not in self.seen:
            self.seen[generator] = generator.get_state()
        return func(*args, **kwargs)


def _requires_grad(args: Any, kwargs: dict[str, Any], forward_mode: bool) -> bool:
    """Whether a tensor argument of an op (or one in a list of them) requires grad, or in
    forward mode carries a tangent (a parameter's requires_grad is then no derivative)."""
    for value in (*args, *kwargs.values()):
        values = value if isinstance(value, (list, tuple)) else (value,)
        for v in values:
            if isinstance(v, torch.Tensor) and (
                _dual(v) if forward_mode else v.requires_grad or _dual(v)
            ):
                return True
    return False


def _dual(tensor: torch.Tensor) -> bool:
    dual = torch.autograd.forward_ad.unpack_dual(tensor)  # type: ignore[no-untyped-call]
    return dual.tangent is not None


class Threads:
    """Whether part of f ran in another thread, on a watched run on eager autograd (torch.func
    and modes hold for the calling thread only: under torch.func a worker's result is a
    constant, a silently wrong gradient). ASSUMPTION: a tensor that reaches f's ops or output
    with a node no torch function on this thread returned, and whose graph reaches this
    call's fresh leaves, was made by another thread (captured tensors cannot reach them).
    Off (``on`` False) once f runs a torch.func transform itself (its results would look
    foreign)."""

    __slots__ = ("nodes", "on", "plain", "unseen")

    def __init__(self, leaves: Sequence[torch.Tensor]) -> None:
        # (held until the call ends: a freed node object's replacement would look unseen)
        self.nodes: set[Any] = {t.grad_fn for t in leaves if t.grad_fn is not None}
        # (returned without a node, weakly: an autograd.Function's output gets one later)
        self.plain: dict[int, weakref.ref[torch.Tensor]] = {}
        self.unseen: list[torch.Tensor] = []
        self.on = True

    def off(self) -> None:
        """No evidence from this call (a transform inside f: see the class)."""
        self.on = False
        self.unseen.clear()

    def check(self, values: Any) -> None:
        """Keep each tensor among ``values`` (and in a list or tuple among them) whose
        autograd node no watched torch function returned."""
        for value in values:
            if isinstance(value, torch.Tensor):
                node = value.grad_fn
                if node is not None and node not in self.nodes:
                    self.unseen_tensor(value, node)
            elif isinstance(value, (list, tuple)):
                self.check(value)

    def written(self, value: torch.Tensor) -> None:
        """After a watched op: the nodes of ``value`` and of its base (an op may have
        written into them in place), as seen."""
        node = value.grad_fn
        if node is not None:
            self.nodes.add(node)
        base = value._base
        if base is not None and base.grad_fn is not None:
            self.nodes.add(base.grad_fn)

    def unseen_tensor(self, value: torch.Tensor, node: Any) -> None:
        """Keep ``value``, whose ``node`` no watched function returned, unless it is an
        autograd.Function's output or a view of a seen base (whose node torch remade)."""
        if isinstance(node, BackwardCFunction):
            ref = self.plain.get(id(value))
            if ref is not None and ref() is value:
                self.nodes.add(node)
                return
        base = value._base
        if base is not None and base.grad_fn is not None and base.grad_fn in self.nodes:
            self.nodes.add(node)
            return
        self.unseen.append(value)
        self.nodes.add(node)  # (kept once)

    def made(self, result: Any) -> None:
        """Record the autograd nodes of the tensors a torch function returned."""
        if isinstance(result, torch.Tensor):
            node = result.grad_fn
            if node is not None:
                self.nodes.add(node)
            else:
                self.plain[id(result)] = weakref.ref(result)
        elif isinstance(result, (list, tuple)):
            for value in result:
                self.made(value)


def foreign(threads: Threads, outputs: Sequence[Any], leaves: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor that no torch function on the calling thread returned reached one
    (or is among f's ``outputs``) with a graph that reaches ``leaves``, this call's own
    differentiated leaves: part of f ran in another thread (see :class:`Threads`). One
    walk of the graph below those tensors, on a watched call only."""
    if not threads.on:
        return False
    threads.check(outputs)
    if not threads.unseen:
        return False
    targets = {edge(t)[0] for t in leaves if t.requires_grad}
    return any(node in targets for node in nodes(t.grad_fn for t in threads.unseen))


@contextlib.contextmanager
def _module_hooks_watched(flat: FlatFunction, transformed: bool) -> Iterator[None]:
    """Under a torch.func transform (``transformed``: no hook node enters a graph there), a
    global module forward pre-hook, for the calling thread, setting ``flat.hooked`` where f
    calls a module with a backward hook on a differentiated positional input. Not on eager
    autograd, where the graph shows the hook (and it would make ``torch.compile`` warn)."""
    if not transformed:
        yield
        return
    caller = threading.get_ident()

    def seen(module: torch.nn.Module, args: Any) -> None:
        if flat.hooked or threading.get_ident() != caller or not _has_backward_hooks(module):
            return
        if any(
            isinstance(t, torch.Tensor)
            and (t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t))
            for t in _tree.flatten(args)[0]
        ):
            flat.hooked = True

    handle = torch.nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        yield
    finally:
        handle.remove()


def _has_backward_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs a backward hook: its own or a global one."""
    hooks = torch.nn.modules.module
    return bool(
        module._backward_hooks
        or module._backward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def _module_tree_hooked(f: Any) -> bool:
    """Whether f is a module (:func:`module_of`) with a backward hook on a submodule, or a
    global one: an old-style hook sits on a node that neither the mode nor a graph walk
    sees (not seen on modules that f calls without owning them)."""
    module = module_of(f)
    if module is None:
        return False
    return any(_has_backward_hooks(part) for part in module.modules())


def module_hook_in_graph(outputs: Any) -> tuple[bool, bool]:
    """Whether the graph of ``outputs`` holds a module's backward hook node, and a custom
    autograd.Function not known to be linear in its cotangent (not torch's own): no torch
    function names either, so only a walk of the graph (on a watched call) sees them."""
    leaves, _ = _tree.flatten(outputs)
    return hook_or_function(t.grad_fn for t in leaves if isinstance(t, torch.Tensor))


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def module_of(f: Any) -> torch.nn.Module | None:
    """The nn.Module that f is, or whose bound method it is (through any
    ``functools.partial``), else None."""
    while isinstance(f, functools.partial):
        f = f.func
    owner = f.__self__ if inspect.ismethod(f) else f
    return owner if isinstance(owner, torch.nn.Module) else None


def modules_of(f: Any) -> tuple[torch.nn.Module, ...]:
    """The nn.Modules that f names now (a name rebound later is not followed): in its
    closure cells and the globals its code (nested code included) reads, one level into a
    container or an object's attributes, a partial's arguments, and the same of the
    functions found there, up to three deep (``lambda x: model(x)``, ``partial(run, m)``)."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()

    def hold(value: Any, into: bool) -> list[Any]:
        if isinstance(value, torch.nn.Module):
            found[id(value)] = value
        elif into and isinstance(value, (list, tuple)):
            return [v for item in value for v in hold(item, False)]
        elif into and isinstance(value, dict):
            return [v for item in value.values() for v in hold(item, False)]
        held = []
        if into and not isinstance(value, (types.ModuleType, types.FunctionType)):
            attributes = getattr(value, "__dict__", {}).values()
            held = [v for item in attributes for v in hold(item, False)]
        return [value, *held] if callable(value) else held

    def scan(g: Any, depth: int) -> None:
        if id(g) in seen or depth > 3:
            return
        seen.add(id(g))
        more: list[Any] = []
        while isinstance(g, functools.partial):
            for value in (*g.args, *g.keywords.values()):
                more += hold(value, True)
            g = g.func
        more += [w] if (w := getattr(g, "__wrapped__", None)) is not None else []
        code = getattr(g, "__code__", None)
        if isinstance(code, types.CodeType):
            for cell in getattr(g, "__closure__", None) or ():
                more += hold(_cell_contents(cell), True)
            names = getattr(g, "__globals__", {})
            for name in _names(code):
                more += hold(names.get(name), True)
        for value in more:
            if isinstance(value, (types.FunctionType, functools.partial)) or hasattr(
                value, "__wrapped__"
            ):
                scan(value, depth + 1)

    scan(f, 0)
    return tuple(found.values())


def _names(code: types.CodeType) -> list[str]:
    """The global names a code object and the code objects it holds (comprehensions, nested
    functions, lambdas) read."""
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [*code.co_names, *(name for c in nested for name in _names(c))]


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell: a name bound later)
        return None


class HookState:
    """Whether the module hooks that can reach f's graph (global ones, and those of the
    submodules of :func:`module_of` f, else of :func:`modules_of` f), or the training flags
    of f's own submodules, changed since the last look: a plan made under the hooks and
    draws of the watched call (a linear pullback, eager autograd for dropout) is then
    watched again (docs/reliability.md). Cheap: the hook dicts are read only where
    ``RemovableHandle.next_id`` moved. Not seen: a hook dict written without a handle, a
    submodule holding a hook attached after the last look, a module reached by a longer
    route than :func:`modules_of` follows, a tensor hook (seen on the watched call only),
    a submodule attached after the last listing, draws switched on some other way."""

    __slots__ = ("_counter", "_hooks", "_modes", "_modules", "_own", "_parts")

    def __init__(self, f: Any) -> None:
        own = module_of(f)
        self._own = own is not None  # (training flags: of f's own submodules only)
        modules = (own,) if own is not None else modules_of(f)
        self._modules = tuple(weakref.ref(module) for module in modules)
        self._counter = RemovableHandle.next_id
        self._parts: tuple[torch.nn.Module, ...] = ()
        # (a closure's modules are read at the first look: a fresh closure never pays)
        self._hooks = self._fingerprint() if self._own else None
        self._modes = self._training()

    def _fingerprint(self) -> tuple[tuple[int, ...], ...]:
        hooks = torch.nn.modules.module
        dicts: list[Any] = [
            hooks._global_forward_pre_hooks,
            hooks._global_forward_hooks,
            hooks._global_backward_pre_hooks,
            hooks._global_backward_hooks,
        ]
        parts = tuple(
            part
            for ref in self._modules
            if (module := ref()) is not None
            for part in module.modules()
        )
        # (f's own module's only: a closure's are held weakly, keeping no model alive)
        self._parts = parts if self._own else ()
        for part in parts:
            dicts.extend(getattr(part, name) for name in _MODULE_HOOKS)
        # (Each handle's id is new: the keys tell a hook removed and another added.)
        return tuple(tuple(d) for d in dicts)

    def _training(self) -> tuple[bool, ...]:
        return tuple(part.training for part in self._parts) if self._own else ()

    def changed(self) -> bool:
        """Whether the hooks or the training flags changed since the last call (no host
        read, no tensor)."""
        modes = self._training()
        moved = modes != self._modes
        self._modes = modes
        counter = RemovableHandle.next_id
        if self._hooks is None:  # the first look at a closure's modules
            self._hooks = self._fingerprint()
            moved = moved or counter != self._counter  # (a hook since: perhaps on them)
            self._counter = counter
            return moved
        if counter == self._counter:
            return moved
        self._counter = counter
        hooks = self._fingerprint()
        if hooks != self._hooks:
            self._hooks = hooks
            moved = True
        self._modes = self._training()
        return moved


# The torch functions of nn.RNN, nn.LSTM and nn.GRU (fused on eager autograd; vmap batches
# their backward badly).
_RNN_FUNCTIONS = frozenset(["lstm", "gru", "rnn_tanh", "rnn_relu"])


_current_level = torch._C._functorch.maybe_current_level


def _threads_watch(leaves: Sequence[torch.Tensor]) -> Threads | None:
    """A :class:`Threads` where f runs on eager autograd (no transform, no functorch or fake
    leaf, some leaf requiring grad), else None (nothing can be told under torch.func)."""
    if _current_level() is not None or not any(t.requires_grad for t in leaves):
        return None
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) or is_fake(t) for t in leaves):
        return None
    return Threads(leaves)


class Writes(Exception):
    """Internal: f was stopped before it wrote into a tensor it did not make (see
    :class:`NoOutsideWrites`)."""


# The in-place methods that torch functions name without a trailing underscore.
_IN_PLACE_DUNDERS = frozenset(
    [
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__imatmul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
    ]
)


class NoOutsideWrites(_Draws):
    """:class:`_Draws`, and f stopped (:class:`Writes`, before the op runs) where, under
    ``torch.inference_mode``, it would write into a tensor it did not make in this run (not
    an inference tensor, or an argument): in place (trailing underscore, ``x[i] = ...``,
    ``+=``), ``out=``, ``inplace=True``, a norm's running statistics, ``max_norm``."""

    def __init__(self, seen: dict[torch.Generator, torch.Tensor], args: Sequence[Any]) -> None:
        super().__init__(seen)
        self.args = {id(t) for t in args if isinstance(t, torch.Tensor)}

    def _outside(self, value: Any) -> bool:
        if isinstance(value, (tuple, list)):
            return any(self._outside(v) for v in value)
        return isinstance(value, torch.Tensor) and (
            not value.is_inference() or id(value) in self.args
        )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if type(func) not in _C_TYPES and id(func) not in _OWN:  # (a replaced torch function)
            func = eager_function(func, sys._getframe(1), args, kwargs)
        try:
            kind = _WRITE_KINDS.get(func)
            if kind is None:
                kind = _WRITE_KINDS[func] = _write_kind(getattr(func, "__name__", ""))
        except TypeError:  # (a user's unhashable callable)
            kind = _write_kind(getattr(func, "__name__", ""))
        if kind == _IN_PLACE:  # (nn.init passes its tensor by keyword)
            first = args[0] if args else next(iter((kwargs or {}).values()), None)
            if self._outside(first):
                raise Writes(func.__name__)
        elif kind == _NORM:
            # (F.batch_norm's training, F.instance_norm's use_input_stats: argument 5)
            flag = (kwargs or {}).get("training", (kwargs or {}).get("use_input_stats"))
            if flag is None:
                flag = args[5] if len(args) > 5 else "instance_norm" in func.__name__
            if flag:
                raise Writes(func.__name__)
        elif kind == _EMBEDDING and (kwargs or {}).get("max_norm") is not None:
            raise Writes(func.__name__)  # (it renormalises the weight rows in place)
        elif kind == _RANDOM:  # a generator passed positionally (torch.poisson(rates, g))
            for arg in args:
                if isinstance(arg, torch.Generator) and arg not in self.seen:
                    self.seen[arg] = arg.get_state()
        if not kwargs:
            return func(*args)
        if ("out" in kwargs and self._outside(kwargs["out"])) or (
            kwargs.get("inplace") is True and args and self._outside(args[0])
        ):  # (F.relu(x, inplace=True), F.dropout(..., inplace=True))
            raise Writes(getattr(func, "__name__", ""))
        return super().__torch_function__(func, types, args, kwargs)


# The modes that hand an op on to another's __torch_function__ (func already resolved)
_RESOLVED = frozenset((NoOutsideWrites.__torch_function__.__code__,))

_PLAIN, _IN_PLACE, _NORM, _EMBEDDING, _RANDOM = 0, 1, 2, 3, 4
_WRITE_KINDS: dict[Any, int] = {}
# The random functions that take a generator positionally (torch.poisson, torch.binomial).
_POSITIONAL_GENERATOR = ("poisson", "binomial")


def _write_kind(name: str) -> int:
    """Whether a torch function writes into its first argument, updates a norm's running
    statistics (where training), renormalises an embedding, may take a generator
    positionally, or none of these, by its name (an ATen overload's without its
    ``.overload``: ``add_.Tensor``)."""
    name = name.split(".")[0]
    if (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS:
        return _IN_PLACE
    if "batch_norm" in name or "instance_norm" in name:
        return _NORM
    if name == "embedding":
        return _EMBEDDING
    if any(draw in name for draw in _POSITIONAL_GENERATOR):
        return _RANDOM
    return _PLAIN


class Random(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records whether f ran an op that draws random numbers (ATen's ``nondeterministic_seeded``
    tag: dropout's bernoulli, rand*, normal, multinomial, ...), at the level torch.func
    transforms dispatch to, so that it also sees them inside ``vjp``."""

    def __init__(self, flat: FlatFunction) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.flat = flat

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.flat.drew = True
        return func(*args, **(kwargs or {}))


class FlatFunction:
    """``f(*args)`` as a function of the flat leaves of the arguments in ``argnums``."""

    def __init__(
        self,
        f: Callable[..., Any],
        args: Sequence[Any],
        argnums: tuple[int, ...],
        has_aux: bool,
        call: str,
        hint: str = "pass it through a non-differentiated argument (see `argnums`)",
    ) -> None:
        self.f, self.args, self.argnums, self.has_aux = f, list(args), argnums, has_aux
        self.call = call
        self.in_defs: list[Any] = []
        self.counts: list[int] = []
        # (every differentiated argument a bare tensor: no flatten; not in compiled code)
        self._bare = not torch.compiler.is_compiling() and all(
            _tree.is_differentiable(args[a]) for a in argnums
        )
        if self._bare:
            self.leaves: Tensors = tuple(args[a] for a in argnums)
            self.in_defs, self.counts = [_tree.LEAF] * len(argnums), [1] * len(argnums)
        else:
            flat_leaves: list[torch.Tensor] = []
            for a in argnums:
                leaves, treedef = _tree.flatten(args[a])
                check_primal_leaves(leaves, treedef, f"argument {a}", call, hint)
                self.in_defs.append(treedef)
                self.counts.append(len(leaves))
                flat_leaves.extend(leaves)
            self.leaves = tuple(flat_leaves)
            self._bare = all(treedef.is_leaf() for treedef in self.in_defs)
        self._n: int | None = None
        self._readable: bool | None = None
        self.out_def: Any = None
        self.out_bare = False  # f returned a bare tensor (out_def is a leaf)
        self._out_tree: Any = None
        self._aux_def: Any = None
        self._aux_static: list[Any] = []
        # While ``watch`` (off where a caller knows f draws from none; never in compiled
        # code): the generators f drew from, with their state before its first draw (for a
        # re-run of f), and what the run saw: random draws, a tensor hook, a custom Function
        # not known to be linear, an RNN, a training batch norm, part of f in another thread
        # (see Threads), an op in no-grad mode on a tensor requiring grad in a run begun in
        # grad mode (autograd's constant, forward mode's derivative: see Facts.no_grad).
        self.watch = True
        self.generators: dict[torch.Generator, torch.Tensor] = {}
        self.drew = False
        self.hooked = False
        self.custom = False
        self.rnn = False
        self.norm = False
        self.threads = False
        self.grad_on = False
        self.no_grad = False
        self.forward_mode = False  # (a watched forward-mode call: only tangents count)

    @property  # (by hand: functools.cached_property takes a lock dynamo cannot trace)
    def n(self) -> int:
        """The real size of the differentiated leaves (complex entries count twice)."""
        if self._n is None:
            self._n = _coords.real_size(self.leaves)
        return self._n

    @property
    def readable(self) -> bool:
        """``values_readable(self.leaves)``, looked up once per call."""
        if self._readable is None:
            self._readable = values_readable(self.leaves)
        return self._readable

    def split_inputs(self, leaves: Sequence[Any]) -> list[Any]:
        """Flat input leaves (or gradients of them) back into one tree per argnum."""
        if self._bare:
            return list(leaves)
        trees, start = [], 0
        for treedef, count in zip(self.in_defs, self.counts):
            trees.append(_tree.unflatten(treedef, leaves[start : start + count]))
            start += count
        return trees

    def __call__(self, *leaves: torch.Tensor) -> Any:
        args = list(self.args)
        for a, tree in zip(self.argnums, self.split_inputs(leaves)):
            args[a] = tree
        watching = self.watch and not torch.compiler.is_compiling()
        try:
            if watching:
                threads = _threads_watch(leaves)
                self.grad_on = torch.is_grad_enabled()
                with (
                    _Draws(self.generators, self, threads),
                    Random(self),
                    _module_hooks_watched(self, _current_level() is not None),
                ):
                    result = self.f(*args)
                hook, function = module_hook_in_graph(result)
                self.hooked = self.hooked or hook or _module_tree_hooked(self.f)
                self.custom = self.custom or function
                if threads is not None:
                    outputs = result[0] if self.has_aux and isinstance(result, tuple) else result
                    self.threads = self.threads or foreign(
                        threads, _tree.flatten(outputs)[0], leaves
                    )
            else:
                result = self.f(*args)
        except Exception as error:
            error.add_note(f"{self.call}: raised by f, called with {len(args)} argument(s).")
            if isinstance(self.f, torch.nn.Module) and isinstance(error, TypeError):
                error.add_note(
                    "f is an nn.Module: it takes its inputs, not its parameters. To "
                    "differentiate its parameters, pass f=lambda params, x: "
                    "torch.func.functional_call(module, params, (x,)) with "
                    "params=dict(module.named_parameters())."
                )
            raise
        if self.has_aux:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(
                    f"{self.call}: with has_aux=True, f must return a pair (output, aux), got "
                    f"{describe(result)}. Return `out, aux` or pass has_aux=False."
                )
            result, aux = result
        # (a bool: in compiled code the tree specs are dynamo's, not comparable with LEAF)
        self.out_bare = _tree.is_differentiable(result)
        if self.out_bare and not torch.compiler.is_compiling():  # (usual)
            self.out_def = _tree.LEAF
            return (result,) if not self.has_aux else self._with_aux((result,), aux)
        out_leaves, self.out_def = _tree.flatten(result)
        # (compiled: the tree itself, re-specced by outputs(): a dynamo spec carried over a
        # graph break, or used under torch.func, unflattens a dict wrongly)
        if torch.compiler.is_compiling():
            self._out_tree = result
        if not out_leaves:
            raise TypeError(f"{self.call}: f returned no tensor (got {describe(result)}).")
        for index, leaf in enumerate(out_leaves):
            if not _tree.is_differentiable(leaf):
                path = _tree.leaf_path(self.out_def, index)
                raise TypeError(
                    f"{self.call}: f's output, leaf {path}, must be a floating-point or complex "
                    f"tensor, got {describe(leaf)}. Return only differentiable tensors from f "
                    "and put anything else in aux (has_aux=True)."
                )
        if not self.has_aux:
            return tuple(out_leaves)
        return self._with_aux(tuple(out_leaves), aux)

    def _with_aux(self, out_leaves: Tensors, aux: Any) -> Any:
        # torch.func carries only tensors as aux; the rest is kept here, it has no level.
        aux_leaves, self._aux_def = _tree.flatten(aux)
        self._aux_static = [None if isinstance(x, torch.Tensor) else x for x in aux_leaves]
        return tuple(out_leaves), tuple(x for x in aux_leaves if isinstance(x, torch.Tensor))

    def rebuild_aux(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        return _tree.unflatten(
            self._aux_def, [next(it) if x is None else x for x in self._aux_static]
        )

    def outputs(self, out_leaves: Sequence[torch.Tensor]) -> Any:
        if self._out_tree is not None and torch.compiler.is_compiling():
            return _tree.unflatten(_tree.flatten(self._out_tree)[1], out_leaves)
        return _tree.unflatten(self.out_def, out_leaves)
