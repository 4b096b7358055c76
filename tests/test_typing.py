"""Every public object's annotations are readable at runtime by ``typing.get_type_hints``
(typeguard, beartype, pydantic and docs generators rely on it)."""

from __future__ import annotations

import inspect
import typing

import pytest

import funcgrad

_DUNDERS = ("__init__", "__call__", "__enter__", "__exit__", "__iter__", "__len__")


def _annotated(obj):
    """(label, object) for ``obj`` and, for a class, each public method and property of it
    and of its funcgrad bases."""
    name = getattr(obj, "__name__", repr(obj))
    found = [(name, obj)]
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            if not klass.__module__.startswith("funcgrad"):
                continue
            for attr, member in vars(klass).items():
                if attr.startswith("_") and attr not in _DUNDERS:
                    continue
                if isinstance(member, property):
                    member = member.fget
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member):
                    found.append((f"{name}.{attr}", member))
    return found


PUBLIC = [getattr(funcgrad, name) for name in funcgrad.__all__]
ROUTINES = [obj for obj in PUBLIC if inspect.isfunction(obj) or inspect.isclass(obj)]
ALIASES = [name for name in funcgrad.__all__ if not inspect.isclass(getattr(funcgrad, name))]
ALIASES = [name for name in ALIASES if not inspect.isfunction(getattr(funcgrad, name))]


@pytest.mark.parametrize("obj", ROUTINES, ids=lambda obj: obj.__name__)
def test_every_public_function_class_and_method_has_readable_type_hints(obj):
    for label, target in _annotated(obj):
        try:
            typing.get_type_hints(target)
        except Exception as error:  # the label says which one
            raise AssertionError(f"typing.get_type_hints({label}) raised {error!r}") from error


@pytest.mark.parametrize("name", ALIASES)
def test_every_public_type_alias_works_inside_a_union(name):
    """``alias | None`` in a signature (as backward's ``process_group``) must evaluate."""

    def uses(value: None) -> None: ...

    uses.__annotations__ = {"value": f"{name} | None"}
    hint = typing.get_type_hints(uses, globalns=vars(funcgrad))["value"]
    assert type(None) in typing.get_args(hint)


def test_the_loops_above_see_the_api():
    assert {"backward", "Pullback", "Plan"} <= {obj.__name__ for obj in ROUTINES}
    assert {"ProcessGroupLike", "ChunkSize", "Weighting"} <= set(ALIASES)
    labels = [label for obj in ROUTINES for label, _ in _annotated(obj)]
    assert "Pullback.many" in labels and "Pullback.rank" in labels
