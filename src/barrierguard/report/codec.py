"""One JSON codec for the frozen record dataclasses, driven by their fields and type hints.

Fields are written in declaration order and read back to their type; unknown keys are
ignored and missing ones take the default, so other releases' files still read. Field
metadata: ``OMIT_EMPTY``/``OMIT_NONE`` (or ``{"omit": f}``, ``f(record, value)``) leave
the key out, ``AS_MAP`` writes pairs ``((key, value), ...)`` as an object, ``{"key": NAME}``
renames the key. A list element that does not read raises ``ValueError("[INDEX]: ERROR")``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["AS_MAP", "OMIT_EMPTY", "OMIT_NONE", "Record", "from_json", "to_json"]

T = TypeVar("T")
R = TypeVar("R", bound="Record")

OMIT_EMPTY: Mapping[str, Any] = {"omit": lambda _record, value: not value}
OMIT_NONE: Mapping[str, Any] = {"omit": lambda _record, value: value is None}
AS_MAP: Mapping[str, Any] = {"as_map": True}

_HINTS: dict[type, dict[str, Any]] = {}


def to_json(record: Any) -> dict[str, Any]:
    """``record`` (a dataclass instance) as plain JSON-able data."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        omit = f.metadata.get("omit")
        if omit is not None and omit(record, value):
            continue
        key = f.metadata.get("key", f.name)
        out[key] = _encode(dict(value) if f.metadata.get("as_map") else value)
    return out


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return to_dict() if callable(to_dict) else to_json(value)
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def from_json(cls: type[T], data: Any) -> T:
    """Rebuild a ``cls`` record from :func:`to_json` output.

    Raises:
        KeyError: A field without a default is missing.
        TypeError, ValueError: A value does not have its field's type.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    hints = _HINTS[cls]
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = f.metadata.get("key", f.name)
        if key not in data:
            if f.init and f.default is f.default_factory is dataclasses.MISSING:
                raise KeyError(key)
            continue
        raw = list(dict(data[key]).items()) if f.metadata.get("as_map") else data[key]
        kwargs[f.name] = _decode(hints[f.name], raw)
    return cls(**kwargs)


def _decode(hint: Any, raw: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, raw)
    if origin is tuple:
        if not isinstance(raw, list | tuple):
            raise TypeError(f"expected a list, got {type(raw).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_element(args[0], i, v) for i, v in enumerate(raw))
        return tuple(_decode(a, v) for a, v in zip(args, raw, strict=True))
    if origin in (Mapping, dict) or hint in (Mapping, dict):
        key, value = args or (Any, Any)
        return {_decode(key, k): _decode(value, v) for k, v in dict(raw).items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        from_dict = getattr(hint, "from_dict", None)
        return from_dict(raw) if callable(from_dict) else from_json(hint, raw)
    if hint in (int, float, str, bool):
        return hint(raw)
    return raw


def _element(hint: Any, index: int, raw: Any) -> Any:
    try:
        return _decode(hint, raw)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"[{index}]: {err!r}") from err


class Record:
    """A base for the frozen record dataclasses: ``to_dict``/``from_dict`` through this codec."""

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON-able data."""
        return to_json(self)

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """Rebuild the record from :meth:`to_dict` output."""
        return from_json(cls, data)
