"""Per-step timing on a GPU: host time, device time, run-ahead, and the saving.

A timed step end records a pooled CUDA event, polled, never waited on. **Run-ahead**: the
step-end events the device has not reached; **device time**: between two of them, when the
host was ahead; **saving** without the syncs: ``min(stall, wall - max(host busy, device))``,
else at most ``min(stall, host busy)``.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from barrierguard.report.records import Timeline

__all__ = ["BUDGET", "MAX_PERIOD", "PERIOD", "WINDOW", "StepTimeline", "summarize"]

# WINDOW consecutive steps timed every PERIOD steps or more: events cost microseconds a step,
# too much for a launch-bound loop, and a window keeps per-step resolution for run-ahead. The
# period doubles, up to MAX_PERIOD, while a window's own work, counted twice (AFTERMATH: what
# it leaves the steps after it, as memory sampling counts it), is over BUDGET of step time.
WINDOW = 16
PERIOD = 256
MAX_PERIOD = 4096
BUDGET = 0.001
AFTERMATH = 2.0


class _CudaEvent:
    """A timing event recorded on the stream current at start, through the C methods
    (``torch.cuda.Event.record()`` looks the current stream up in Python at every call)."""

    __slots__ = ("_event", "_query", "_record_on", "_stream")

    def __init__(self, stream: Any) -> None:
        import torch

        event_type: Any = torch.cuda.Event
        self._event = event_type(enable_timing=True)
        base: Any = torch._C._CudaEventBase
        self._record_on = base.record
        self._query = base.query
        self._stream = stream

    def record(self) -> None:
        self._record_on(self._event, self._stream)

    def query(self) -> bool:
        return bool(self._query(self._event))

    def elapsed_time(self, other: _CudaEvent) -> float:
        return float(self._event.elapsed_time(other._event))


class StepTimeline:
    """Host time, device time and run-ahead per step (a guard's step listener)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        make_event: Callable[[], Any] | None = None,
        window: int = WINDOW,
        period: int = PERIOD,
    ) -> None:
        self._window = max(1, window)
        self._period = self._least = max(self._window, period)
        self._longest = self._period  # the longest period used, for the report's words
        self._spent = 0.0  # this window's own work so far, in seconds
        self._origin, self._started = 0, False
        self._clock = clock
        self._given_event = self._make_event = make_event
        self._pool: list[Any] = []
        self._pending: collections.deque[tuple[int, Any]] = collections.deque()
        self._done: tuple[int, Any] | None = None
        self._t_prev: float | None = None
        self.steps: list[int] = []
        self.host_s: list[float] = []
        self.ahead: list[int] = []
        self.device_s: dict[int, float] = {}
        self._ahead_at: dict[int, int] = {}

    def _place_event(self, step: int) -> None:
        if self._make_event is None:
            import torch

            stream = torch.cuda.current_stream()
            self._make_event = lambda: _CudaEvent(stream)
        event = self._pool.pop() if self._pool else self._make_event()
        event.record()
        self._pending.append((step, event))

    def start(self, step: int) -> None:
        """Begin timing at boundary ``step`` (the guard started or restarted)."""
        self._t_prev = self._clock()
        if not self._started:
            # Windows follow the guard's own step count, also across restarts.
            self._origin, self._started = step, True
        self._done = None
        self._pending.clear()
        self._pool.clear()
        self._make_event = self._given_event  # None: CUDA events on the stream current now
        self._place_event(step)

    def _retire(self) -> None:
        pending = self._pending
        while pending and pending[0][1].query():
            step, event = pending.popleft()
            done = self._done
            if done is not None:
                # The device was busy all along only if the host was ahead when this step began.
                if done[0] == step - 1 and self._ahead_at.pop(step - 1, 0) >= 1:
                    self.device_s[step] = done[1].elapsed_time(event) / 1e3
                self._pool.append(done[1])
            self._done = (step, event)

    def on_step(self, step: int) -> int:
        """At a step end: host time, retire reached events, measure run-ahead (in a
        window). Returns the step it is next needed at (the guard calls no other).

        Example:
            >>> timeline = StepTimeline(make_event=lambda: None, window=2, period=8)
            >>> [timeline.on_step(step) for step in (1, 2, 7)]
            [2, 7, 8]
        """
        phase = step - self._origin
        if phase >= self._period:  # a window opens: its period from the last one's cost
            self._origin, phase = step, 0
            self._period = self._next_period()
        if phase >= self._window:
            if phase == self._period - 1:
                self._t_prev = self._clock()  # the next step opens a window
                return step + 1
            return self._origin + self._period - 1
        now = self._clock()
        if self._t_prev is None:
            self._t_prev = now
            return step + 1
        self._retire()
        ahead = len(self._pending)
        self._ahead_at[step] = ahead
        self._place_event(step)
        self.steps.append(step)
        self.host_s.append(now - self._t_prev)
        self.ahead.append(ahead)
        # Time our own work out of the next step.
        self._t_prev = self._clock()
        self._spent += self._t_prev - now
        return step + 1

    def _next_period(self) -> int:
        """The least period (doubling from ``period``) that keeps the last window's own work,
        counted ``AFTERMATH`` times, under ``BUDGET`` of its steps' host time."""
        spent, self._spent = self._spent * AFTERMATH, 0.0
        timed = self.host_s[-self._window :]
        period = self._least
        if spent > 0 and timed:
            step_s = statistics.median(timed)
            while period < MAX_PERIOD and spent > BUDGET * step_s * period:
                period *= 2
        self._longest = max(self._longest, period)
        return period

    @property
    def sampling(self) -> str:
        """How steps were chosen for timing, in words."""
        every = str(self._least)
        if self._longest != self._least:
            every += f" to {self._longest}"
        return (
            f"{self._window} consecutive steps every {every} (kept under {BUDGET:.1%} of step time)"
        )

    def stop(self) -> None:
        """Stop timing: read what has completed; pending events are dropped unread."""
        self._retire()
        self._pending.clear()
        self._t_prev = None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _saving(wall: float, device: float | None, stall: float) -> float:
    busy = max(0.0, wall - stall)
    if device is None:
        return min(stall, busy)
    return max(0.0, min(stall, wall - max(busy, device), busy, device))


def summarize(
    steps: Sequence[int],
    host_s: Sequence[float],
    ahead: Sequence[int],
    device_s: dict[int, float],
    step_stall: Sequence[float],
    warmup: int,
    sampling: str = "",
) -> Timeline:
    """The timeline of the measured steps, the saving, and a verdict in words (``steps[i]``
    ended the interval timed in ``host_s[i]``, whose syncs count in step ``steps[i] - 1``)."""
    rows = [
        (s, h, a, device_s.get(s), step_stall[s - 1] if s - 1 < len(step_stall) else 0.0)
        for s, h, a in zip(steps, host_s, ahead, strict=True)
        if s - 1 > warmup
    ]
    if not rows:
        return Timeline(summary="no measured step was timed")
    kept, host, ahead_, device, stall = (tuple(column) for column in zip(*rows, strict=True))
    saving = sum(_saving(h, d, s) for h, d, s in zip(host, device, stall, strict=True) if s > 0)
    total, stall_total = sum(host), sum(stall)
    median_ahead = statistics.median(ahead_)
    per_step = total / len(rows)
    stall_per = stall_total / len(rows)
    serialized = median_ahead == 0 and stall_total > 0.05 * total
    if serialized:
        summary = (
            f"serialized by its barriers: the host is never ahead of the device "
            f"(median run-ahead 0 steps) and waits {_ms(stall_per)} of each "
            f"{_ms(per_step)} step in syncs; removing them could save about "
            f"{_ms(saving / len(rows))} per step ({saving / total:.0%} of the run)"
        )
    elif median_ahead >= 1:
        summary = (
            f"the host runs {median_ahead:g} step(s) ahead of the device: the queue stays "
            f"full and the device sets the pace; syncs cost {_ms(stall_per)} per step"
        )
    else:
        summary = (
            f"the device keeps up with the host (median run-ahead 0 steps, "
            f"{_ms(stall_per)} per step waiting in syncs): the host sets the pace"
        )
    return Timeline(
        steps=kept,
        host_s=host,
        stall_s=stall,
        device_s=device,
        ahead=ahead_,
        saving_s=saving,
        saving_fraction=saving / total if total > 0 else 0.0,
        serialized=serialized,
        summary=summary,
        sampling=sampling,
    )
