"""Strict JSON <-> frozen dataclass conversion for the bundle contract.

``encode`` turns a dataclass into plain JSON values (tuples become lists). ``decode`` does the reverse
from a type annotation and refuses anything it does not expect: an unknown key, a missing key, a value
of the wrong type. Supported annotations: ``int``, ``float``, ``str``, ``bool``, ``X | None``,
``tuple[X, ...]``, ``tuple[X, Y]``, ``dict[str, X]`` and nested frozen dataclasses. The standard library
only: the runtime decodes manifests on nodes that have nothing else.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from ovshard.errors import BundleError

T = TypeVar("T")


def encode(value: Any) -> Any:
    """A dataclass (or a value inside one) as JSON-ready dicts, lists and scalars, in field order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _fail(where: str, expected: str, value: Any) -> BundleError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return BundleError(f"{where}: expected {expected}, found {shown}")


def decode(tp: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as an instance of annotation ``tp``; BundleError naming ``where`` if not."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, where)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return decode(inner[0], value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise _fail(where, "a list", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _fail(where, f"a list of {len(args)} values", value)
        return tuple(decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(where, "an object", value)
        return {str(k): decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    return _decode_scalar(tp, value, where)


def _decode_scalar(tp: Any, value: Any, where: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(where, "true or false", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(where, "an integer", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(where, "a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(where, "a string", value)
        return value
    raise TypeError(f"{where}: schema.decode does not support the annotation {tp!r}")


def _decode_dataclass(cls: type[T], value: Any, where: str) -> T:
    if not isinstance(value, dict):
        raise _fail(where, f"an object ({cls.__name__})", value)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise BundleError(f"{where}: unknown key {unknown[0]!r}; expected only {', '.join(fields)}")
    hints, kwargs = _hints(cls), {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = decode(hints[name], value[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise BundleError(f"{where}: the key {name!r} is missing")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise BundleError(f"{where}: {e}") from e
