"""The running recorders, and the one path every detected sync takes to them.

Engines install global hooks once, however many recorders use them (nested
``watch()`` blocks, a pytest fixture around a user's own recorder), and hand each
sync to :func:`emit`, which gives it to every running recorder of that engine.
A recorder is anything with the three methods of :class:`Recorder` (the
session's recorder); the hub knows nothing else of it.
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

    A recorder returns one from ``record`` when the sync was one more of the
    site's last one and nothing needs deciding. Until :data:`epoch` changes,
    an engine that meets the very same sync again on the same thread adds to
    ``n`` and ``stall`` itself, without a call to :func:`emit`; the recorder
    folds the tally into its counters later.
    """

    __slots__ = ("n", "stall")

    def __init__(self) -> None:
        self.n = 0
        self.stall = 0.0


# Changes whenever a tally handed out may no longer stand for the next sync
# (a step boundary, a phase, an allowed() block, a recorder attached or
# detached, another thread's count of a site): engines compare it with the
# value they kept beside the tally.
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
        """Count one sync (located, with its mechanism and phase); return the policy's
        action (a warning, a raise), if any, or the site's :class:`Tally` when
        the sync was a repeat that needs no decision.

        ``again`` marks a further sync inside the same call (``print(t)``
        synchronizes several times): an event of the occurrence already
        counted, not a new one.
        """

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
# The same recorders, each with its record method, looked up once (emit reads
# this alone): CPython 3.11 does not specialize the lookup of a method on the
# session's recorder, an object of many attributes, and every sync makes it.
_deliveries: dict[str, tuple[tuple[Recorder, _Record], ...]] = {}
_engines: dict[str, Engine] = {}
# Per thread ident: what an engine stopped from another thread left behind on
# that thread (state only that thread can remove), run by its next tidy().
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
    """Start delivering ``engine``'s syncs to ``recorder``; install it if first.

    ``recorder.record`` is looked up here, once: every sync calls that method.
    """
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
    if current:
        # The last recorder of this thread left, others run elsewhere: what the
        # engine keeps on this thread alone (a function mode) goes now, since a
        # thread that ends with a function mode on its stack can abort the
        # process.
        release = getattr(engine, "release", None)
        if release is not None:
            release(here)
        return
    engine.uninstall()


def defer(thread_ident: int, cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` at the next :func:`tidy` on the thread ``thread_ident``.

    Nothing is kept for a thread that has already ended.
    """
    if not any(t.ident == thread_ident for t in threading.enumerate()):
        return
    with _lock:
        _left.setdefault(thread_ident, []).append(cleanup)


def tidy() -> None:
    """Run what was deferred to this thread (never raises: it is best effort).

    What was deferred to a thread that has ended is dropped: its state ended
    with it.
    """
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


# ``again`` is not keyword-only: CPython 3.11 specializes no call to a function
# with keyword-only parameters, and every sync makes this call.
def emit(
    engine_name: str, sync: Sync, stall: float | None = None, again: bool = False
) -> Tally | None:
    """Give one ``sync`` to every recorder of ``engine_name``, then act.

    ``stall`` is the time the host was blocked in it, in seconds, when measured;
    ``again`` marks a further sync inside a call already counted.

    Recording never raises into training: a fault inside a recorder is noted in
    its report. The policy's actions (a warning, a :class:`SyncError`) run
    after every recorder has recorded.

    Returns:
        The :class:`Tally` the one recorder counted the sync in, when it is a
        repeat that needs no decision (else ``None``).
    """
    ident = _get_ident()
    actions: list[Callable[[], None]] | None = None
    tally: Tally | None = None
    deliveries = _deliveries.get(engine_name, ())
    for recorder, record in deliveries:
        try:
            action = record(sync, ident, stall, again)
        except Exception as exc:  # never lose the user's run to our own bug
            recorder.fault(exc)
            continue
        if action is None:
            continue
        if isinstance(action, Tally):
            tally = action if len(deliveries) == 1 else None
            continue
        if actions is None:
            actions = []
        actions.append(action)
    if actions is not None:
        for action in actions:
            action()
    return tally
