"""Reversible attribute patches: every one is undone, in reverse order."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
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
        self._held: list[tuple[Any, str, object]] | None = None

    def set(self, owner: Any, name: str, value: object) -> None:
        """Set ``owner.name = value``, remembering what was there before."""
        if self._held is not None:
            self._held.append((owner, name, value))
            return
        self._stack.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Make the :meth:`set` calls inside at its exit, one after the other (none if it raises).

        A class's attribute cache takes a new version at each lookup that follows a change to
        the class, and CPython 3.13 stops caching a class that has used 1,000: reading every
        original first and then changing the class without a lookup between the changes costs
        ``torch.Tensor`` one version a start instead of one a patch.

        Example:
            >>> import types
            >>> ns = types.SimpleNamespace(f=1)
            >>> p = Patches()
            >>> with p.deferred():
            ...     p.set(ns, "f", 2)
            ...     ns.f  # not yet
            1
            >>> ns.f
            2
        """
        held: list[tuple[Any, str, object]] = []
        self._held = held
        try:
            yield
        finally:
            self._held = None
        for owner, name, value in held:
            self.set(owner, name, value)

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
