"""Memory per step: the sampler, the probes, the policy, the report."""

from __future__ import annotations

import json
import warnings
import xml.dom.minidom
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch

import barrierguard
from barrierguard.report.render.console import render_memory
from barrierguard.report.render.memory_chart import render_svg
from barrierguard.session import memory as _memory
from barrierguard.session.memory import MemoryMonitor, ProbeSet, Sampler, format_bytes
from barrierguard.session.options import parse_bytes

MB = 1_000_000
BASE = 500 * MB


# -- sizes -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512KB", 512_000),
        ("1MB", 1_000_000),
        ("1.5MiB", 1_572_864),
        ("2 gb", 2_000_000_000),
        ("100", 100),
        ("64B", 64),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_bytes(text: object, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("bad", ["1 MBs", "MB", "", "-1MB", "1e6", -5, 1.5, True, None, [1]])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(barrierguard.BarrierGuardError) as info:
        parse_bytes(bad)
    assert repr(bad) in str(info.value) and "'1.5MiB'" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_growth_per_step": "lots"}, "max_growth_per_step='lots'"),
        ({"memory": "yes"}, "memory='yes'"),
        ({"memory_every": 0}, "memory_every=0"),
        ({"memory_children": 1}, "memory_children=1"),
    ],
)
def test_watch_rejects_bad_memory_options(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(barrierguard.BarrierGuardError, match=needle):
        barrierguard.watch(**kwargs)  # type: ignore[arg-type]


def test_watch_unknown_option_suggests_memory_name() -> None:
    with pytest.raises(TypeError, match="max_growth_per_step"):
        barrierguard.watch(max_growth=1)


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (999, "999 B"), (1500, "1.50 KB"), (-2 * MB, "-2.00 MB")]
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


# -- the sampler ----------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _probe_costing(clock: Clock, cost_s: float) -> Callable[[], Mapping[str, int]]:
    def probe() -> Mapping[str, int]:
        clock.now += cost_s
        return {"host_rss": BASE}

    return probe


@pytest.mark.parametrize(
    ("step_s", "cost_s", "stride"),
    [
        # 1 ms step, 19 us sample, counted twice (AFTERMATH): 0.1 % budget -> every 38th step
        (1e-3, 19e-6, 38),
        (1e-3, 1e-6, 2),
        (0.1, 40e-6, 1),
        (1e-5, 40e-6, _memory.MAX_STRIDE),
    ],
)
def test_adaptive_stride_keeps_the_budget(step_s: float, cost_s: float, stride: int) -> None:
    clock = Clock()
    sampler = Sampler({"host": _probe_costing(clock, cost_s)}, clock=clock)
    taken = []
    for step in range(1, 2000):  # the ramp reaches a stride of 256 by step 1,020
        clock.now += step_s
        if sampler.on_step(step):
            taken.append(step)
    assert sampler.stride == stride
    assert taken[-1] - taken[-2] == stride


def test_adaptive_stride_counts_the_samplers_own_bookkeeping() -> None:
    # A free probe, but 15 us of the sampler's work before it (here: reading the probes'
    # setup time): the step pays it, so the stride keeps it under the budget too.
    clock = Clock()

    class Slow:
        @property
        def setup_s(self) -> float:
            clock.now += 15e-6
            return 0.0

        def __call__(self) -> Mapping[str, int]:
            return {"host_rss": BASE}

    sampler = Sampler({"host": Slow()}, clock=clock)
    for step in range(1, 400):
        clock.now += 1e-3
        sampler.on_step(step)
    assert sampler.stride == 30  # 15 us, counted twice, over 0.1 % of 1 ms


def test_adaptive_stride_ramps_up_so_a_short_run_gets_a_verdict() -> None:
    # A 1 ms step and a 20 us sample: the budget's stride is 40, reached by doubling at
    # most every RAMP samples, so 30 steps hold enough samples for a verdict.
    clock = Clock()
    sampler = Sampler({"host": _probe_costing(clock, 20e-6)}, clock=clock)
    sampler.sample(0)  # the baseline, as MemoryMonitor.start takes it
    gaps = []
    for step in range(1, 31):
        clock.now += 1e-3
        if sampler.on_step(step):
            gaps.append(step - sampler.steps[-2])
    assert gaps == [1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4]
    assert len(sampler.steps) - 1 >= _memory.MIN_SAMPLES


def test_fixed_stride_and_decimation() -> None:
    sampler = Sampler({"host": lambda: {"host_rss": BASE}}, every=1, max_samples=16)
    for step in range(1, 100):
        sampler.on_step(step)
    assert len(sampler.steps) < 16
    assert sampler.stride >= 8
    assert sampler.steps == sorted(sampler.steps)
    assert len(sampler.values["host_rss"]) == len(sampler.steps)


def test_failing_probe_is_dropped_with_one_note() -> None:
    calls = {"n": 0}

    def flaky() -> Mapping[str, int]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("gone")
        return {"device_used": 7}

    sampler = Sampler({"host": lambda: {"host_rss": 1}, "nvml": flaky}, every=1)
    for step in range(6):
        sampler.on_step(step)
    assert sampler.values["device_used"] == [7, 7, None, None, None, None]
    assert sampler.values["host_rss"] == [1] * 6
    assert len(sampler.notes) == 1 and "nvml" in sampler.notes[0] and "gone" in sampler.notes[0]


def test_series_appearing_later_are_aligned() -> None:
    state = {"ready": False}

    def later() -> Mapping[str, int]:
        return {"device_used": 5} if state["ready"] else {}

    sampler = Sampler({"nvml": later}, every=1)
    sampler.on_step(1)
    state["ready"] = True
    sampler.on_step(2)
    assert sampler.steps == [1, 2]
    assert sampler.values == {"device_used": [None, 5]}


# -- the guard, with fake probes ----------------------------------------------------
class FakeMemory:
    """Probes whose values follow a function of the guard's step."""

    def __init__(self, fn: Callable[[int], int], notes: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.step = 0
        self.extra_notes = notes
        self.closed = 0

    def probes(self, notes: list[str], **_: object) -> ProbeSet:
        notes.extend(n for n in self.extra_notes if n not in notes)
        fake = self

        class Probe:
            def __call__(self) -> Mapping[str, int]:
                return {"host_rss": fake.fn(fake.step)}

            def close(self) -> None:
                fake.closed += 1

        return ProbeSet({"host": Probe()}, {"host_rss": "fake"}, notes, lambda: ("host_rss",))


@pytest.fixture
def fake_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeMemory]]:
    def make(fn: Callable[[int], int], notes: tuple[str, ...] = ()) -> FakeMemory:
        fake = FakeMemory(fn, notes)
        monkeypatch.setattr(_memory, "default_probes", fake.probes)
        return fake

    yield make


def _run(guard: barrierguard.Guard, fake: FakeMemory, steps: int) -> None:
    for _ in range(steps):
        fake.step += 1
        guard.step()


def test_record_policy_reports_the_leak(fake_memory: Callable[..., FakeMemory]) -> None:
    fake = fake_memory(lambda s: BASE + 2 * MB * s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with barrierguard.watch(policy="record", memory_every=1) as guard:
            _run(guard, fake, 40)
    memory = guard.report.memory
    assert memory is not None and memory.leak and memory.growing == ("host_rss",)
    assert memory.slopes["host_rss"] == pytest.approx(2 * MB)
    assert memory.steps == tuple(range(41)) and len(memory.series["host_rss"]) == 41
    assert fake.closed == 1


def test_warn_policy_warns_once(fake_memory: Callable[..., FakeMemory]) -> None:
    fake = fake_memory(lambda s: BASE + 2 * MB * s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with barrierguard.watch(policy="warn", memory_every=1) as guard:
            _run(guard, fake, 80)
    ours = [w for w in caught if issubclass(w.category, barrierguard.MemoryGrowthWarning)]
    assert len(ours) == 1
    assert "host_rss grew 2.00 MB/step" in str(ours[0].message)


def test_error_policy_raises_at_the_step(fake_memory: Callable[..., FakeMemory]) -> None:
    fake = fake_memory(lambda s: BASE + 2 * MB * s)
    with pytest.raises(barrierguard.MemoryGrowthError) as info:  # noqa: SIM117
        with barrierguard.watch(policy="error", memory_every=1) as guard:
            _run(guard, fake, 200)
    # The first check comes after 16 samples (baseline + 15 steps).
    assert guard.steps == 15 and not guard.is_running
    assert info.value.memory is not None and info.value.memory["leak"] is True
    assert fake.closed == 1


def test_error_policy_raises_at_stop_for_a_late_verdict(
    fake_memory: Callable[..., FakeMemory],
) -> None:
    fake = fake_memory(lambda s: BASE + 2 * MB * s)
    guard = barrierguard.watch(policy="error", memory_every=1)
    guard.start()
    _run(guard, fake, 12)  # too few samples for the in-run check
    with pytest.raises(barrierguard.MemoryGrowthError, match="over the run"):
        guard.stop()
    assert not guard.is_running


def test_no_memory_error_over_a_user_exception(fake_memory: Callable[..., FakeMemory]) -> None:
    fake = fake_memory(lambda s: BASE + 2 * MB * s)
    with pytest.raises(KeyError), barrierguard.watch(policy="error", memory_every=1) as guard:
        _run(guard, fake, 12)
        raise KeyError("user")
    assert fake.closed == 1 and guard.report.memory is not None


@pytest.mark.parametrize("policy", ["warn", "error"])
def test_flat_and_step_change_pass_the_policy(
    fake_memory: Callable[..., FakeMemory], policy: str
) -> None:
    fake = fake_memory(lambda s: BASE + (200 * MB if s >= 3 else 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with barrierguard.watch(policy=policy, memory_every=1) as guard:
            _run(guard, fake, 100)
    memory = guard.report.memory
    assert memory is not None and not memory.leak
    assert "step changes, not leaks" in memory.reason and "at step 3" in memory.reason


def test_threshold_comes_from_the_policy(fake_memory: Callable[..., FakeMemory]) -> None:
    fake = fake_memory(lambda s: BASE + 2 * MB * s)
    with barrierguard.watch(policy="record", memory_every=1, max_growth_per_step="4MB") as guard:
        _run(guard, fake, 40)
    memory = guard.report.memory
    assert memory is not None and not memory.leak and memory.threshold == 4 * MB


def test_memory_off(fake_memory: Callable[..., FakeMemory]) -> None:
    fake = fake_memory(lambda s: BASE)
    with barrierguard.watch(policy="record", memory=False) as guard:
        _run(guard, fake, 3)
    assert guard.report.memory is None
    assert "memory" not in guard.report.to_dict()
    with pytest.raises(barrierguard.BarrierGuardError, match="memory=False"):
        guard.report.save_memory_chart("unused.svg")


def test_restart_adds_to_the_same_series(fake_memory: Callable[..., FakeMemory]) -> None:
    fake = fake_memory(lambda s: BASE)
    guard = barrierguard.watch(policy="record", memory_every=1)
    for _ in range(2):
        guard.start()
        _run(guard, fake, 3)
        guard.stop()
    memory = guard.report.memory
    assert memory is not None and memory.steps == (0, 1, 2, 3, 4, 5, 6)
    assert fake.closed == 2


def test_absent_series_are_noted_once(fake_memory: Callable[..., FakeMemory]) -> None:
    note = "device memory series absent: CUDA is not available here"
    fake = fake_memory(lambda s: BASE, notes=(note,))
    guard = barrierguard.watch(policy="record", memory_every=1)
    for _ in range(2):
        with guard:
            _run(guard, fake, 2)
    memory = guard.report.memory
    assert memory is not None and memory.notes == (note,)
    assert str(guard.report).count(note) == 1


def test_real_probes_on_this_machine_note_missing_devices() -> None:
    with barrierguard.watch(policy="record", memory_every=1) as guard:
        for _ in range(3):
            guard.step()
    memory = guard.report.memory
    assert memory is not None
    assert all(v is not None and v > 0 for v in memory.series["host_rss"])
    if not torch.cuda.is_available():
        assert set(memory.series) == {"host_rss"}
        assert any("CUDA is not available" in n for n in memory.notes)


# -- the report --------------------------------------------------------------------
def _leaky_report(fake_memory: Callable[..., FakeMemory]) -> barrierguard.Report:
    fake = fake_memory(lambda s: BASE + 2 * MB * s)
    with barrierguard.watch(policy="record", memory_every=1) as guard:
        _run(guard, fake, 30)
    return guard.report


def test_json_round_trip_and_shape(fake_memory: Callable[..., FakeMemory], tmp_path: Path) -> None:
    report = _leaky_report(fake_memory)
    path = tmp_path / "r.json"
    report.save(path)
    data = json.loads(path.read_text())
    memory = data["memory"]
    assert memory["leak"] is True
    assert memory["steps"][:3] == [0, 1, 2]
    assert memory["series"]["host_rss"][1] == BASE + 2 * MB
    assert memory["slopes"]["host_rss"] == pytest.approx(2 * MB)
    assert memory["growth_began_at"]["host_rss"] == 1
    assert memory["peak"]["host_rss"] == BASE + 60 * MB
    assert data["schema"] == "barrierguard.report/1"
    assert barrierguard.Report.load(path) == report


def test_reports_without_memory_stay_valid() -> None:
    old = barrierguard.Report(engine="none", detection=False, policy="record").to_dict()
    assert "memory" not in old
    assert barrierguard.Report.from_dict(old).memory is None


def test_console_section(fake_memory: Callable[..., FakeMemory]) -> None:
    text = str(_leaky_report(fake_memory))
    assert "memory per step (every 1 step(s); 31 samples):" in text
    assert "+2.000 MB/step from step 1  GROWING" in text
    assert "verdict: LEAK" in text


def test_svg_chart(fake_memory: Callable[..., FakeMemory], tmp_path: Path) -> None:
    report = _leaky_report(fake_memory)
    path = tmp_path / "memory.svg"
    report.save_memory_chart(path)
    doc = xml.dom.minidom.parse(str(path))
    assert doc.documentElement.tagName == "svg"
    lines = doc.getElementsByTagName("polyline")
    assert len(lines) == 1
    assert len(lines[0].getAttribute("points").split()) == 31
    assert "growth from step 1" in path.read_text()


def test_svg_chart_of_missing_values() -> None:
    memory = barrierguard.MemoryReport(
        steps=(0, 1, 2), series={"device_used": (None, None, None), "host_rss": (1, None, 3)}
    )
    doc = xml.dom.minidom.parseString(render_svg(memory))
    assert len(doc.getElementsByTagName("polyline")) == 1
    assert "never read" in render_svg(memory)
    assert any("never read" in line for line in render_memory(memory))


def test_explain_failure_becomes_a_note() -> None:
    def broken(steps: int, frame: object) -> None:
        raise RuntimeError("boom")

    def probes(notes: list[str]) -> ProbeSet:
        return ProbeSet(
            {"h": lambda: {"host_rss": BASE + MB * step[0]}}, {}, notes, lambda: ("host_rss",)
        )

    step = [0]
    monitor = MemoryMonitor(
        probes, policy="record", threshold=MB // 2, warmup=0, every=1, explain_fn=broken
    )
    monitor.start(0)
    for s in range(1, 20):
        step[0] = s
        monitor.on_step(s)
    memory = monitor.report()
    assert memory.leak and memory.pattern is None
    assert any("boom" in n for n in memory.notes)
    monitor.finish(20, act=False)


def test_workers_probe_sums_the_rss_of_child_processes() -> None:
    import subprocess
    import sys

    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    try:
        own = psutil.Process(child.pid).memory_info().rss
        assert own > 0 and _memory._WorkersRss()()["workers_rss"] >= own
    finally:
        child.kill()
        child.wait()


def test_the_monitor_names_its_next_sample_to_the_guard() -> None:
    # Between two samples the guard calls nothing: each call names the next sample.
    def probes(notes: list[str]) -> ProbeSet:
        return ProbeSet({"h": lambda: {"host_rss": BASE}}, {}, notes, lambda: ("host_rss",))

    monitor = MemoryMonitor(probes, policy="record", threshold=MB, warmup=0, every=4)
    assert monitor.on_step(1) is None  # not started: asked again next step
    monitor.start(0)
    asked = {step: monitor.on_step(step) for step in (1, 2, 6)}
    assert asked == {1: 5, 2: 5, 6: 10}
    assert monitor.sampler.steps == [0, 1, 6]
    monitor.finish(7, act=False)
