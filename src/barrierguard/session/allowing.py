"""Allow rules where the code is: ``# barrierguard: allow`` (or ``allow[item, BG301]``) on
a line, read when a guard first sees the site, and ``with allowed(...):`` in this thread.
"""

from __future__ import annotations

import linecache
import re
import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from barrierguard._errors import BarrierGuardError
from barrierguard.detect import hub
from barrierguard.detect.kinds import KINDS, kind_named

__all__ = ["admits", "allowed", "inline_allowed"]

_INLINE = re.compile(r"#\s*barrierguard:\s*allow\b(?:\[([^\]]*)\])?")


def inline_allowed(file: str, line: int, kind: str) -> bool:
    """Whether ``file``'s ``line`` carries a ``# barrierguard: allow`` comment for ``kind``
    (no name: every kind; a name neither a kind nor a code allows nothing)."""
    text = linecache.getline(file, line)
    found = _INLINE.search(text) if "barrierguard" in text else None
    if found is None:
        return False
    names = (found.group(1) or "").strip()
    return not names or any(kind_named(name.strip()) == kind for name in names.split(","))


@dataclass(slots=True, eq=False)
class _Scope:
    kinds: frozenset[str]
    first_only: bool
    seen: set[Hashable] = field(default_factory=set)


class _Local(threading.local):
    # A class-level default: no AttributeError to catch per sync in a thread without blocks.
    scopes: list[_Scope] | None = None


_TLS = _Local()
# allowed() blocks open in all threads (counted before one opens, after it closes): while
# none is, a settled site's count reads no thread-local.
open_blocks = 0
_open_lock = threading.Lock()


def admits(key: Hashable, kind: str) -> bool:
    """Whether an open ``allowed()`` block of this thread admits this sync at site ``key``."""
    for scope in reversed(_TLS.scopes or ()):
        if scope.kinds and kind not in scope.kinds:
            continue
        if not scope.first_only:
            return True
        if key not in scope.seen:
            scope.seen.add(key)
            return True
    return False


@contextmanager
def allowed(*kinds: str, first_only: bool = False) -> Iterator[None]:
    """Allow the syncs made inside the block (in this thread), for every running guard.

    They are still counted and reported, but not held against the policy or the per-step
    budget. Blocks nest; an inner block adds to the outer ones.

    Args:
        *kinds: Kinds (``"item"``) or rule codes (``"BG101"``) to allow; none: every kind.
        first_only: Admit only the first sync of each site in this block; a second one is
            a violation (a deliberate read, once).

    Raises:
        BarrierGuardError: For a name that is neither a kind nor a rule code.

    Example:
        >>> import barrierguard
        >>> with barrierguard.watch(policy="error") as guard:
        ...     with barrierguard.allowed("item", first_only=True):
        ...         pass
    """
    if not isinstance(first_only, bool):
        raise BarrierGuardError(f"allowed(first_only={first_only!r}): expected True or False")
    named = set()
    for name in kinds:
        kind = kind_named(name.strip()) if isinstance(name, str) else None
        if kind is None:
            raise BarrierGuardError(
                f"allowed({name!r}): expected a kind such as 'item' or a rule code such as "
                f"'BG101' (docs/rules.md); the kinds are {', '.join(sorted(KINDS))}"
            )
        named.add(kind)
    scope = _Scope(frozenset(named), first_only)
    scopes = _TLS.scopes
    if scopes is None:
        scopes = _TLS.scopes = []
    global open_blocks
    with _open_lock:
        open_blocks += 1
    hub.invalidate()  # the engines' tallies: a repeat may now be admitted
    scopes.append(scope)
    try:
        yield
    finally:
        scopes.remove(scope)
        with _open_lock:
            open_blocks -= 1
        hub.invalidate()
