"""The running guards, and the one path every detected sync takes to them.

Engines install global hooks once, however many guards use them (nested
``watch()`` blocks, a pytest fixture around a user's own guard), and hand each
sync to :func:`emit`, which gives it to every running guard of that engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from barrierguard._frames import Location
    from barrierguard._guard import Guard

__all__ = ["Engine", "attach", "detach", "emit", "running_guards"]


class Engine(Protocol):
    """What an engine does: install its global hooks, and remove them all."""

    name: str

    def install(self) -> None: ...

    def uninstall(self) -> None: ...


_lock = threading.RLock()
_guards: dict[str, tuple[Guard, ...]] = {}
_engines: dict[str, Engine] = {}


def attach(guard: Guard, engine: Engine) -> None:
    """Start delivering ``engine``'s syncs to ``guard``; install it if first."""
    with _lock:
        current = _guards.get(engine.name, ())
        if not current:
            engine.install()
            _engines[engine.name] = engine
        _guards[engine.name] = (*current, guard)


def detach(guard: Guard, engine_name: str) -> None:
    """Stop delivering to ``guard``; uninstall the engine after its last guard."""
    with _lock:
        current = tuple(g for g in _guards.get(engine_name, ()) if g is not guard)
        if current:
            _guards[engine_name] = current
            return
        _guards.pop(engine_name, None)
        engine = _engines.pop(engine_name, None)
    if engine is not None:
        engine.uninstall()


def running_guards() -> tuple[Guard, ...]:
    """Every guard now running, outermost first."""
    with _lock:
        return tuple(g for gs in _guards.values() for g in gs)


def emit(engine_name: str, loc: Location, stall: float | None = None) -> None:
    """Give one sync at ``loc`` to every guard of ``engine_name``, then act.

    ``stall`` is the time the host was blocked in it, in seconds, when measured.

    Recording never raises into training: a fault inside a guard is noted in
    its report. The policy's actions (a warning, a :class:`SyncError`) run
    after every guard has recorded.
    """
    ident = threading.get_ident()
    actions: list[Callable[[], None]] = []
    for guard in _guards.get(engine_name, ()):
        try:
            action = guard._record(loc, ident, stall)
        except Exception as exc:  # never lose the user's run to our own bug
            guard._fault(exc)
            continue
        if action is not None:
            actions.append(action)
    for action in actions:
        action()
