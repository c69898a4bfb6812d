"""The running recorders, and the one path every detected sync takes to them.

Engines install their global hooks once, however many recorders use them, and hand each
sync to :func:`emit`, which gives it to every running :class:`Recorder` of that engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from barrierguard.detect.stack import Sync

__all__ = [
    "Engine",
    "Recorder",
    "Tally",
    "attach",
    "defer",
    "detach",
    "emit",
    "fault",
    "invalidate",
    "note",
    "running_recorders",
    "tidy",
]


class Tally:
    """A settled site's count of repeats, which an engine may add to itself.

    ``record`` returns one for a repeat that needs no decision. Until :data:`epoch`
    changes, an engine meeting the same sync again on that thread adds to ``n`` and
    ``stall`` itself, without :func:`emit`; the recorder folds it in later.
    """

    __slots__ = ("n", "stall")

    def __init__(self) -> None:
        self.n = 0
        self.stall = 0.0


# Changes whenever a tally handed out may no longer stand for the next sync (a step
# boundary, a phase, a recorder attached, ...): engines keep it beside the tally.
epoch = 0


def invalidate() -> None:
    """Make every tally handed out by :func:`emit` stale (see :class:`Tally`)."""
    global epoch
    epoch += 1


class Recorder(Protocol):
    """What the hub delivers to: one method per sync, one per internal fault, one per note."""

    def record(
        self, sync: Sync, ident: int, stall: float | None = None, again: bool = False
    ) -> Callable[[], None] | Tally | None:
        """Count one sync; return the policy's action, or the site's :class:`Tally`.

        ``again`` marks a further sync inside a call already counted (``print(t)``)."""

    def fault(self, exc: BaseException) -> None:
        """Note a fault of barrierguard's own, without raising into training."""

    def note(self, text: str) -> None:
        """Add a note for the report (once per text)."""


class Engine(Protocol):
    """What an engine does: install its global hooks, and remove them all."""

    name: str

    def install(self) -> None: ...

    def uninstall(self) -> None: ...


# A recorder's record method (see Recorder.record).
_Record = Callable[[Sync, int, float | None, bool], "Callable[[], None] | Tally | None"]

_lock = threading.RLock()
_get_ident = threading.get_ident
_recorders: dict[str, tuple[Recorder, ...]] = {}
# The same, each with its record method looked up once (not specialized by CPython 3.11).
_deliveries: dict[str, tuple[tuple[Recorder, _Record], ...]] = {}
_engines: dict[str, Engine] = {}
# Per thread ident: what an engine stopped elsewhere left on it, run by its next tidy().
_left: dict[int, list[Callable[[], None]]] = {}


def _set_recorders(engine_name: str, recorders: tuple[Recorder, ...]) -> None:
    """Make ``recorders`` those of ``engine_name`` (none: it has none left); under the lock."""
    if recorders:
        _recorders[engine_name] = recorders
        _deliveries[engine_name] = tuple((g, g.record) for g in recorders)
    else:
        _recorders.pop(engine_name, None)
        _deliveries.pop(engine_name, None)


def attach(recorder: Recorder, engine: Engine) -> None:
    """Start delivering ``engine``'s syncs to ``recorder``; install it if first."""
    with _lock:
        invalidate()
        current = _recorders.get(engine.name, ())
        if not current:
            engine.install()
            _engines[engine.name] = engine
        _set_recorders(engine.name, (*current, recorder))


def detach(recorder: Recorder, engine_name: str) -> None:
    """Stop delivering to ``recorder``; uninstall the engine after its last recorder."""
    here = threading.get_ident()
    with _lock:
        invalidate()
        current = tuple(g for g in _recorders.get(engine_name, ()) if g is not recorder)
        _set_recorders(engine_name, current)
        if current:
            engine = _engines.get(engine_name)
            if any(getattr(g, "_thread_ident", None) == here for g in current):
                return
        else:
            engine = _engines.pop(engine_name, None)
    if engine is None:
        return
    if not current:
        engine.uninstall()
    elif (release := getattr(engine, "release", None)) is not None:
        # This thread's last recorder left: what the engine keeps on it goes now (a
        # function mode aborts the process if its thread ends with it).
        release(here)


def defer(thread_ident: int, cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` at the next :func:`tidy` on ``thread_ident`` (if it still runs)."""
    if not any(t.ident == thread_ident for t in threading.enumerate()):
        return
    with _lock:
        _left.setdefault(thread_ident, []).append(cleanup)


def tidy() -> None:
    """Run what was deferred to this thread, best effort; drop what ended threads left."""
    if not _left:
        return
    alive = {t.ident for t in threading.enumerate()}
    with _lock:
        todo = _left.pop(threading.get_ident(), [])
        for ident in [i for i in _left if i not in alive]:
            del _left[ident]
    for cleanup in todo:
        try:
            cleanup()
        except Exception:  # nothing left to report it to; the state was inert
            continue


def running_recorders() -> tuple[Recorder, ...]:
    """Every recorder now running, outermost first."""
    with _lock:
        return tuple(g for gs in _recorders.values() for g in gs)


def fault(engine_name: str, exc: BaseException) -> None:
    """Report a fault of ``engine_name``'s own to its recorders (never raised)."""
    for recorder in _recorders.get(engine_name, ()):
        recorder.fault(exc)


def note(engine_name: str, text: str) -> None:
    """Give a note to every recorder of ``engine_name`` (for their reports)."""
    for recorder in _recorders.get(engine_name, ()):
        recorder.note(text)


# ``again`` is not keyword-only: CPython 3.11 specializes no call with keyword-only ones.
def emit(
    engine_name: str, sync: Sync, stall: float | None = None, again: bool = False
) -> Tally | None:
    """Give one ``sync`` to every recorder of ``engine_name``, then run their actions.

    ``stall`` is the host's blocked seconds, when measured; ``again`` as in
    :meth:`Recorder.record`. A recorder's fault is noted, never raised.

    Returns:
        The :class:`Tally` the one recorder counted a repeat in, else ``None``.
    """
    ident = _get_ident()
    actions: list[Callable[[], None]] | None = None
    tally: Tally | None = None
    for recorder, record in _deliveries.get(engine_name, ()):
        try:
            action = record(sync, ident, stall, again)
        except Exception as exc:  # never lose the user's run to our own bug
            recorder.fault(exc)
            continue
        if action is not None:
            if isinstance(action, Tally):
                tally = action
                continue
            if actions is None:
                actions = []
            actions.append(action)
    if actions is not None:
        for action in actions:
            action()
    if tally is not None and len(_deliveries.get(engine_name, ())) > 1:
        return None  # an engine's tally stands for one recorder's count
    return tally
