"""Type checks for the fields of the frozen config dataclasses.

Every config (``ModelConfig``, ``EngineConfig``, the ``RLConfig`` sections, the trainer's) calls
:func:`check_field_types` first in ``__post_init__``, so a value of the wrong type fails where it is
made, naming the class, the field and the value, instead of flowing on: a string ``"false"`` is
truthy, a float ``64.5`` where an int is due truncates somewhere later. The rules follow the
annotations: ``bool`` only from ``bool``; ``int`` from integers, never ``bool`` or a float; ``float``
from any real number but ``bool``; ``str``; an ``Enum`` from its members; ``X | None``; ``tuple[X, ...]``
and fixed-length tuples element by element; a nested dataclass by its class. Annotations this module
does not know (``Any``, callables, arrays) are not checked.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import numbers
import types
import typing
from typing import Any


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or isinstance(tp, typing.TypeVar):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return not args or (len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args)))
    if origin is typing.Literal:
        return value in args
    if origin is not None or not isinstance(tp, type):
        return True  # callables, generics we do not check
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if tp is str or issubclass(tp, enum.Enum) or dataclasses.is_dataclass(tp):
        return isinstance(value, tp)
    return True


class FieldTypeError(TypeError, ValueError):
    """A config field holds a value of the wrong type (a ``ValueError`` too: callers that report bad
    configuration values catch that)."""


def _name(tp: Any) -> str:
    name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def check_field_types(obj: Any) -> None:
    """Raises :class:`FieldTypeError` naming ``Class.field``, the expected type and the value for the first
    field of the dataclass instance ``obj`` whose value does not match its annotation (module note)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in hints and not _matches(value, hints[f.name]):
            raise FieldTypeError(f"{type(obj).__name__}.{f.name} must be {_name(hints[f.name])}, got {value!r}")


__all__ = ["FieldTypeError", "check_field_types"]
