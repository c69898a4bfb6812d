"""After the loop: the syncs that follow the last step, held until a step proves them in it.

At a *loop site* (one a closed step saw) the policy acts at once; another site's syncs are
*held* (:class:`OpenStep`) until the next boundary. Those still held at ``stop()``, or after
a ``DataLoader`` ran out, are ``"after-loop"``: counted apart, not judged (docs/ci-gate.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from barrierguard.detect.patch import Patches
from barrierguard.session.site_stats import SiteStats

__all__ = ["AFTER_LOOP", "Held", "OpenStep", "unwatch_loaders", "watch_loaders"]

AFTER_LOOP = "after-loop"  # the phase of the syncs after a loop's last step
KEPT = 1000  # violations a held site keeps in detail per step (the report lists as many)


@dataclass
class Held:
    """One site's syncs in the open step: how many, and the policy's pending verdict."""

    stats: SiteStats
    count: int = 0
    blocking: int = 0
    stall: float = 0.0
    stall_count: int = 0
    # Its violations in this step, (step, reason, thread), the first KEPT; the rest counted.
    violations: list[tuple[int, str, str]] = field(default_factory=list)
    more_violations: int = 0
    # Its first non-blocking sync (a race, not a violation), for the warn policy.
    race: tuple[int, str, str] | None = None

    def first_event(self) -> tuple[int, str, str, bool] | None:
        """The policy acts once per site and step: on its first violation, else its race."""
        if self.violations:
            return (*self.violations[0], True)
        return None if self.race is None else (*self.race, False)


class OpenStep:
    """The syncs of sites not yet known to be in the loop, since the latest boundary."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[object, Held] = {}

    def hold(self, stats: SiteStats, stall: float | None) -> None:
        """Note one sync of ``stats``'s site in the open step (counted there for now)."""
        held = self.held.get(stats.loc.key)
        if held is None:
            held = self.held[stats.loc.key] = Held(stats)
        held.count += 1
        held.blocking += stats.blocking
        if stall is not None:
            held.stall += stall
            held.stall_count += 1

    def pend(self, stats: SiteStats, step: int, reason: str, thread: str, violation: bool) -> None:
        """Keep the policy's verdict on a held sync until the step is closed."""
        held = self.held[stats.loc.key]
        if not violation:
            if held.race is None:
                held.race = (step, reason, thread)
        elif len(held.violations) < KEPT:
            held.violations.append((step, reason, thread))
        else:
            held.more_violations += 1

    def close(self) -> list[Held]:
        """A boundary closed the step: its held sites are loop sites. Returns them."""
        held = list(self.held.values())
        self.held.clear()
        for h in held:
            h.stats.in_loop = True
        return held

    def finish(self, step: int, per_step: list[int], step_stall: list[float]) -> int:
        """``stop()``: move the held syncs of ``step`` to :data:`AFTER_LOOP`; returns how many."""
        for h in self.held.values():
            s = h.stats
            s.step_count -= h.count
            s.stall -= h.stall
            s.stall_count -= h.stall_count
            s.phases[AFTER_LOOP] = s.phases.get(AFTER_LOOP, 0) + h.count
            per_step[step] -= h.blocking
            step_stall[step] -= h.stall
            if s.ranges and s.ranges[-1] == [step, step]:
                s.ranges.pop()
            elif s.ranges and s.ranges[-1][1] == step:
                s.ranges[-1][1] = step - 1
        moved = sum(h.count for h in self.held.values())
        self.held.clear()
        return moved


# -- the end of a DataLoader's epoch ---------------------------------------
_lock = threading.Lock()
_listeners: list[Callable[[], None]] = []
_patches = Patches()


def watch_loaders(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever a ``DataLoader`` iterator runs out, until unwatched (once,
    however often it is watched)."""
    with _lock:
        if listener in _listeners:
            return
        _listeners.append(listener)
        if len(_listeners) > 1:
            return
        from torch.utils.data.dataloader import _BaseDataLoaderIter

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
