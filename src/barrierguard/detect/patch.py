"""Reversible attribute patches: every one is undone, in reverse order."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, cast

__all__ = ["Patches", "drop_filter"]

_MISSING = object()


class Patches:
    """A stack of ``setattr`` patches that :meth:`undo` reverts exactly.

    Example:
        >>> import types
        >>> ns = types.SimpleNamespace(f=1)
        >>> p = Patches()
        >>> p.set(ns, "f", 2); p.set(ns, "g", 3)
        >>> (ns.f, ns.g)
        (2, 3)
        >>> p.undo(); (ns.f, hasattr(ns, "g"))
        (1, False)
    """

    def __init__(self) -> None:
        self._stack: list[tuple[Any, str, object]] = []

    def set(self, owner: Any, name: str, value: object) -> None:
        """Set ``owner.name = value``, remembering what was there before."""
        self._stack.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def undo(self) -> None:
        """Restore every patched attribute, last patch first."""
        while self._stack:
            owner, name, old = self._stack.pop()
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, old)


def drop_filter(entry: Any, home: list[Any] | None = None) -> None:
    """Remove one entry of ``warnings.filters`` (if still there), as a context exit would.

    ``home`` is the list it was added to: a ``catch_warnings()`` entered since works on a
    copy and puts ``home`` back at its exit, so the entry leaves both."""
    current = cast("list[Any]", warnings.filters)
    for filters in (current,) if home is None or home is current else (current, home):
        with contextlib.suppress(ValueError):
            filters.remove(entry)
    mutated = getattr(warnings, "_filters_mutated", None)
    if mutated is not None:
        mutated()
