"""After the loop: the syncs that follow the last step, held until a step proves them in it.

A guard counts steps at step boundaries (``optimizer.step()``, ``guard.step()``),
so while the loop runs it cannot know whether the interval after the latest
boundary is the start of another step or what follows the loop (a final read
of a metric, a print of the result, a save). The rule (docs/ci-gate.md):

* a site whose syncs fell in a step that a later boundary closed is a *loop
  site*: its syncs count in their step and the policy acts at once, at the
  line, as before;
* any other site's syncs after the latest boundary are *held*: counted in the
  open step for now, its policy verdict kept back. The next boundary confirms
  them: the site becomes a loop site, its violations are recorded with their
  step, a warning is given, and under ``error`` the error is raised at the
  site's line when it fires in the next step (or, when it does not, at the
  boundary after that, or at ``stop()``, naming the line);
* what is still held at ``stop()`` was after the loop: moved to the phase
  ``"after-loop"``, counted apart and never held against the policy;
* once a ``DataLoader`` ran out (an epoch's data is done), the syncs of sites
  that are not loop sites are ``"after-loop"`` at once, up to the next
  boundary: a read once per epoch, after the epoch's last step, never fails.

:class:`OpenStep` keeps the held syncs; :func:`watch_loaders` tells when a
``DataLoader``'s iterator ran out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from barrierguard.detect.patch import Patches
from barrierguard.session.site_stats import SiteStats

__all__ = ["AFTER_LOOP", "Held", "OpenStep", "unwatch_loaders", "watch_loaders"]

AFTER_LOOP = "after-loop"
"""The phase of the syncs after a loop's last step (or after an epoch's data ran out)."""


@dataclass
class Held:
    """One site's syncs in the open step: how many, and the policy's pending verdict."""

    stats: SiteStats
    count: int = 0
    blocking: int = 0
    stall: float = 0.0
    stall_count: int = 0
    # (step, reason, thread, violation): the first policy event of the site in
    # this step (a violation, or a race warning when not a violation).
    pending: list[tuple[int, str, str, bool]] = field(default_factory=list)


class OpenStep:
    """The syncs of sites not yet known to be in the loop, since the latest boundary.

    Example:
        >>> from barrierguard.detect.frames import Location
        >>> loc = Location("/w/t.py", 9, "item", "user", "main")
        >>> stats = SiteStats(loc, allowed=False, blocking=True)
        >>> open_step = OpenStep()
        >>> open_step.hold(stats, None)
        >>> [h.count for h in open_step.close()], stats.in_loop
        ([1], True)
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[object, Held] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, stats: SiteStats, stall: float | None) -> None:
        """Note one sync of ``stats``'s site in the open step (counted there for now)."""
        held = self._held.get(stats.loc.key)
        if held is None:
            held = self._held[stats.loc.key] = Held(stats)
        held.count += 1
        if stats.blocking:
            held.blocking += 1
        if stall is not None:
            held.stall += stall
            held.stall_count += 1

    def pend(self, stats: SiteStats, step: int, reason: str, thread: str, violation: bool) -> None:
        """Keep the policy's verdict on a held sync until the step is closed."""
        held = self._held[stats.loc.key]
        if not held.pending:
            held.pending.append((step, reason, thread, violation))
        elif violation and not held.pending[0][3]:
            held.pending[0] = (step, reason, thread, violation)

    def close(self) -> list[Held]:
        """A boundary closed the step: its held sites are loop sites. Returns them."""
        held = list(self._held.values())
        self._held.clear()
        for h in held:
            h.stats.in_loop = True
        return held

    def finish(self, step: int, per_step: list[int], step_stall: list[float]) -> int:
        """``stop()``: move the held syncs of ``step`` to :data:`AFTER_LOOP`; returns how many."""
        moved = 0
        for h in self._held.values():
            s = h.stats
            s.step_count -= h.count
            s.stall -= h.stall
            s.stall_count -= h.stall_count
            s.phases[AFTER_LOOP] = s.phases.get(AFTER_LOOP, 0) + h.count
            per_step[step] -= h.blocking
            step_stall[step] -= h.stall
            if s.ranges and s.ranges[-1][1] == step:
                if s.ranges[-1][0] == step:
                    s.ranges.pop()
                else:
                    s.ranges[-1][1] = step - 1
            moved += h.count
        self._held.clear()
        return moved


# -- the end of a DataLoader's epoch ---------------------------------------
_lock = threading.Lock()
_listeners: list[Callable[[], None]] = []
_patches = Patches()


def watch_loaders(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever a ``DataLoader`` iterator runs out, until unwatched."""
    with _lock:
        _listeners.append(listener)
        if len(_listeners) > 1:
            return
        try:
            from torch.utils.data.dataloader import _BaseDataLoaderIter
        except ImportError:  # pragma: no cover - torch without its data package
            return
        original = _BaseDataLoaderIter.__next__

        def __next__(self: Any) -> Any:
            try:
                return original(self)
            except StopIteration:
                for call in tuple(_listeners):
                    call()
                raise

        __next__.__wrapped__ = original  # type: ignore[attr-defined]
        _patches.set(_BaseDataLoaderIter, "__next__", __next__)


def unwatch_loaders(listener: Callable[[], None]) -> None:
    """Stop calling ``listener``; the last one restores ``DataLoader`` iteration."""
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners:
            _patches.undo()
