"""How a guard is entered and left: ``with``, the decorator, re-entry and threads.

The entry that started a guard stops it. Entered again from its thread, a call runs inside
the outer watch; from another thread, unwatched, with a note (docs/guide.md).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from barrierguard._errors import BarrierGuardError
from barrierguard.detect import hub

__all__ = ["decorate", "enter", "leave"]

F = TypeVar("F", bound=Callable[..., Any])

_OWN, _NESTED, _ASIDE = "own", "nested", "aside"


class Guard(Protocol):
    """What this module uses of a :class:`~barrierguard.Guard` (which imports it)."""

    _life: Any
    _entries: threading.local
    is_running: bool
    _thread_ident: int | None

    def start(self) -> Any: ...
    def stop(self) -> Any: ...
    def abandon(self) -> Any: ...
    def note(self, text: str) -> None: ...
    def _thread_name(self, ident: int) -> str: ...
    def _before_call(self, func: Any, args: Any, kwargs: Any) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> None: ...


def enter(guard: Guard) -> None:
    """Enter ``guard`` (``with``, a decorated call): start it, or join it."""
    entries: list[str] = guard._entries.__dict__.setdefault("stack", [])
    with guard._life:
        if not guard.is_running:
            guard.start()
            entries.append(_OWN)
            return
        owner = guard._thread_ident
    if owner == threading.get_ident():
        entries.append(_NESTED)
        return
    entries.append(_ASIDE)
    guard.note(
        f"thread {threading.current_thread().name!r} entered this guard while it ran in "
        f"thread {guard._thread_name(owner or 0)!r}: it was not started twice, and that call "
        "ran unwatched (a guard watches the thread that started it; give each thread its "
        "own watch())"
    )


def leave(guard: Guard, failed: bool) -> None:
    """Leave ``guard``: the entry that started it stops it (``failed``: on an exception)."""
    entries: list[str] = guard._entries.__dict__.setdefault("stack", [])
    # No entry here: a generator closed by the garbage collector in another thread.
    kind = entries.pop() if entries else _OWN
    if kind != _OWN:
        return
    try:
        # An exception on its way out is not hidden behind a deferred policy error.
        if failed:
            guard.abandon()
        else:
            guard.stop()
    finally:
        # stop() from another thread may leave this thread's engine state (per thread).
        hub.tidy()


def decorate(guard: Guard, func: F) -> F:
    """Wrap ``func`` so that each call runs watched (generators and coroutines too).

    Raises:
        BarrierGuardError: For an async generator function.
    """
    name = getattr(func, "__qualname__", repr(func))
    if inspect.isasyncgenfunction(func):
        raise BarrierGuardError(
            f"@watch cannot watch the async generator function {name}(): use "
            "'with watch(...):' around the loop that consumes it"
        )

    def watched_gen(*args: Any, **kwargs: Any) -> Any:
        with guard:
            return (yield from func(*args, **kwargs))

    async def watched_coro(*args: Any, **kwargs: Any) -> Any:
        with guard:
            return await func(*args, **kwargs)

    def watched_call(*args: Any, **kwargs: Any) -> Any:
        with guard:
            guard._before_call(func, args, kwargs)
            return func(*args, **kwargs)

    watched: Any = watched_call
    if inspect.isgeneratorfunction(func):
        watched = watched_gen
    elif inspect.iscoroutinefunction(func):
        watched = watched_coro
    watched = functools.wraps(func)(watched)
    watched.guard = guard
    return cast(F, watched)
