"""Per-step timing from CUDA events, with fake events and a fake clock."""

from __future__ import annotations

import pytest

import barrierguard
from _fake_cuda import FakeClock, FakeMode
from barrierguard.session import guard as _guard
from barrierguard.session.timeline import StepTimeline, summarize


class FakeDevice:
    """Events complete when the test says the device has reached them."""

    def __init__(self) -> None:
        self.recorded = 0
        self.reached = 0
        self.stamps: dict[int, float] = {}

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def reach(self, n: int, at: float) -> None:
        """The device reached the n-th recorded event at device time ``at``."""
        self.reached = n
        self.stamps[n] = at


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.index = 0

    def record(self) -> None:
        self.device.recorded += 1
        self.index = self.device.recorded

    def query(self) -> bool:
        return self.index <= self.device.reached

    def elapsed_time(self, other: FakeEvent) -> float:
        return (self.device.stamps[other.index] - self.device.stamps[self.index]) * 1e3


def test_serialized_loop_has_no_run_ahead() -> None:
    clock, device = FakeClock(), FakeDevice()
    tl = StepTimeline(clock=clock, make_event=device.event)
    tl.start(0)
    for step in range(1, 5):
        clock.advance(0.002)
        device.reach(device.recorded, clock.now)  # a sync drained the queue
        tl.on_step(step)
    assert tl.ahead == [0, 0, 0, 0]
    assert tl.device_s == {}  # never ahead: device time unknown
    assert tl.host_s == pytest.approx([0.002] * 4)


def test_pipelined_loop_runs_ahead_and_measures_the_device() -> None:
    clock, device = FakeClock(), FakeDevice()
    tl = StepTimeline(clock=clock, make_event=device.event)
    tl.start(0)
    for step in range(1, 8):
        clock.advance(0.001)
        # the device lags two events behind, at 3 ms per step
        if device.recorded > 2:
            n = device.recorded - 2
            device.reach(n, 0.003 * n)
        tl.on_step(step)
    assert tl.ahead[-1] >= 1
    assert tl.device_s and all(v == pytest.approx(0.003) for v in tl.device_s.values())


@pytest.mark.parametrize(
    ("host", "stall", "device", "saving"),
    [
        ((0.002,) * 4, (0.001,) * 4, {}, 0.004),  # balanced, serialized: save the stall
        ((0.002,) * 4, (0.0,) * 4, {}, 0.0),  # no sync: nothing to save
        ((0.002,) * 4, (0.0015,) * 4, {}, 0.002),  # capped by host busy time
        ((0.002,) * 4, (0.001,) * 4, dict.fromkeys(range(2, 6), 0.0018), 0.0008),
    ],
)
def test_saving_never_exceeds_the_overlap(
    host: tuple[float, ...], stall: tuple[float, ...], device: dict[int, float], saving: float
) -> None:
    # The interval that ends at boundary s was counted as step s - 1.
    t = summarize([2, 3, 4, 5], host, [0, 0, 0, 0], device, [0.0, *stall], 0)
    assert t.saving_s == pytest.approx(saving)
    assert t.serialized is (sum(stall) > 0)
    if t.serialized:
        assert "serialized by its barriers" in t.summary


def test_warmup_steps_are_left_out() -> None:
    host = [0.01, 0.01, 0.002, 0.002]
    t = summarize([1, 2, 3, 4], host, [0, 0, 0, 0], {}, [0.0, 0.0, 0.001, 0.001, 0.05], 1)
    assert t.steps == (3, 4)  # the intervals counted as steps 2 and 3, past the warm-up
    assert t.saving_s == pytest.approx(0.002)


def test_each_interval_takes_the_stall_counted_in_it() -> None:
    # Boundary s ends the interval whose syncs were counted as step s - 1: the 9 ms
    # stall of step 1 belongs to the 10 ms interval that ends at boundary 2.
    t = summarize([2, 3], [0.010, 0.002], [0, 0], {}, [0.0, 0.009, 0.0], 0)
    assert t.stall_s == (0.009, 0.0)
    assert t.saving_s == pytest.approx(0.001)  # capped by that interval's 1 ms of host work


def test_host_ahead_is_said_in_words() -> None:
    t = summarize([1, 2, 3], [0.001] * 3, [2, 2, 2], {}, [0.0] * 4, 0)
    assert not t.serialized and "2 step(s) ahead" in t.summary


@pytest.fixture
def guard_timeline(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> tuple[FakeClock, FakeDevice]:
    """The guard's timeline runs on a fake clock and fake device events."""
    clock, device = FakeClock(), FakeDevice()
    monkeypatch.setattr(
        _guard, "_make_timeline", lambda: StepTimeline(clock=clock, make_event=device.event)
    )
    return clock, device


def test_guard_reports_the_timeline(guard_timeline: tuple[FakeClock, FakeDevice]) -> None:
    clock, _ = guard_timeline
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        for _ in range(3):
            clock.advance(0.001)
            guard.step()
    timeline = guard.report.timeline
    # The interval up to the first boundary was counted as step 0, setup.
    assert timeline is not None and timeline.steps == (2, 3)
    again = barrierguard.Report.from_dict(guard.report.to_dict()).timeline
    assert again == timeline
    assert "timing:" in str(guard.report)


def test_no_timeline_without_the_cuda_engine() -> None:
    with barrierguard.watch(engine="audit", policy="record") as guard:
        guard.step()
    assert guard.report.timeline is None


def test_only_steps_in_a_window_are_timed() -> None:
    clock, device = FakeClock(), FakeDevice()
    tl = StepTimeline(clock=clock, make_event=device.event, window=3, period=10)
    tl.start(0)
    for step in range(1, 25):
        clock.advance(0.001)
        device.reach(device.recorded, clock.now)
        tl.on_step(step)
    assert tl.steps == [1, 2, 10, 11, 12, 20, 21, 22]
    assert tl.host_s == pytest.approx([0.001] * len(tl.steps))
    assert device.recorded == 1 + len(tl.steps)


def test_the_first_window_reports_its_steps_past_setup(
    guard_timeline: tuple[FakeClock, FakeDevice],
) -> None:
    from barrierguard.session.timeline import WINDOW

    clock, device = guard_timeline
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        for _ in range(50):
            clock.advance(0.001)
            device.reach(device.recorded, clock.now)
            guard.step()
    timeline = guard.report.timeline
    # Boundaries 1 .. WINDOW - 1 end inside the first window; the interval up to
    # boundary 1 was counted as step 0, setup.
    assert timeline is not None and timeline.steps == tuple(range(2, WINDOW))


def test_each_step_end_names_the_next_step_the_timeline_needs() -> None:
    # The guard calls it at no other step: outside a window, one call per period.
    clock, device = FakeClock(), FakeDevice()
    tl = StepTimeline(clock=clock, make_event=device.event, window=3, period=10)
    tl.start(0)
    asked = [tl.on_step(step) for step in (1, 2, 3, 9, 10, 11, 12, 13)]
    assert asked == [2, 3, 9, 10, 11, 12, 13, 19]
    assert tl.steps == [1, 2, 10, 11, 12]


@pytest.mark.parametrize("own_us", [0.0, 10.0])
def test_the_period_doubles_while_a_windows_own_work_is_over_its_budget(own_us: float) -> None:
    from barrierguard.session.timeline import AFTERMATH, BUDGET

    clock, device = FakeClock(), FakeDevice()

    def event() -> FakeEvent:
        made = FakeEvent(device)
        record = made.record

        def costly_record() -> None:  # a timed step's own work
            clock.advance(own_us * 1e-6)
            record()

        made.record = costly_record  # type: ignore[method-assign]
        return made

    tl = StepTimeline(clock=clock, make_event=event, window=4, period=8)
    tl.start(0)
    due, opened = 1, []
    for step in range(1, 200):
        clock.advance(0.001)  # 1 ms steps: the budget is 1 us a step
        device.reach(device.recorded, clock.now)
        if step == due:
            due = tl.on_step(step)
            if tl.steps and tl.steps[-1] == step and step - 1 not in tl.steps:
                opened.append(step)
    # Each window's own work is timed out of its steps (start()'s, in the first, is not).
    assert tl.host_s[1:] == pytest.approx([0.001] * (len(tl.steps) - 1))
    if not own_us:
        assert opened == [1, *range(8, 200, 8)]
        assert tl.sampling.startswith("4 consecutive steps every 8 ")
        return
    # The first window times steps 1-3 (start() was its step 0): 3 x 10 us, counted
    # AFTERMATH times, is 60 steps' budget, so the next period is 64; the window at 8 times
    # 4 steps, 80 steps' budget, so 128.
    assert AFTERMATH == 2.0 and BUDGET == 0.001
    assert opened == [1, 8, 72]
    assert tl.sampling.startswith("4 consecutive steps every 8 to 128")
