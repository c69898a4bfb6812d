"""The CUDA engine's hook, run on CPU through the fake in ``_fake_cuda``."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
import threading
import traceback
import warnings
from typing import Any

import pytest
import torch

import barrierguard
from _fake_cuda import FakeMode, FakeTensor, unique

HERE = __file__


def _sites(guard: barrierguard.Guard) -> dict[tuple[int, str], barrierguard.Site]:
    return {(s.line, s.kind): s for s in guard.report.sites if s.file == HERE}


def _line(marker: str) -> int:
    with open(HERE) as fh:
        for i, text in enumerate(fh, 1):
            if text.rstrip().endswith(marker) and "_line(" not in text:
                return i
    raise AssertionError(marker)


def test_arms_warn_mode_and_restores_it(fake_cuda: FakeMode) -> None:
    fake_cuda.mode = 0
    with barrierguard.watch(engine="cuda", policy="record"):
        assert fake_cuda.mode == 1
    assert fake_cuda.history == ["warn", 0]


def test_kinds_are_read_from_the_user_line(fake_cuda: FakeMode) -> None:
    t = FakeTensor(2.0)
    sink = io.StringIO()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        t.item()  # L-item
        t.tolist()  # L-tolist
        t.cpu()  # L-cpu
        if t:  # L-bool
            pass
        int(t)  # L-int
        float(t)  # L-float
        text = f"{t:.2f}"  # L-format
        t[0]  # L-index
        t[0] = 1.0  # L-setindex
        print(t, file=sink)  # L-print
        unique(t)  # L-unique
        t.backward()  # L-backward
        del text
    found = {(line, kind) for (line, kind) in _sites(guard)}
    expected = {
        (_line("# L-item"), "item"),
        (_line("# L-tolist"), "tolist"),
        (_line("# L-cpu"), "copy"),
        (_line("# L-bool"), "bool"),
        (_line("# L-int"), "int"),
        (_line("# L-float"), "float"),
        (_line("# L-format"), "format"),
        (_line("# L-index"), "index"),
        (_line("# L-setindex"), "index"),
        (_line("# L-print"), "print"),
        (_line("# L-unique"), "unique"),
        (_line("# L-backward"), "backward"),
    }
    assert found == expected
    site = _sites(guard)[(_line("# L-item"), "item")]
    assert site.function == "test_kinds_are_read_from_the_user_line"
    assert site.code == "t.item()  # L-item"
    assert site.origin == "user"
    assert site.fix.startswith("keep the value on the device")
    assert _sites(guard)[(_line("# L-cpu"), "copy")].detail == "d2h"


def test_sync_warnings_are_swallowed_and_others_pass(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with barrierguard.watch(engine="cuda", policy="record") as guard:
            guard.step()
            t.item()
            warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["unrelated"]


def test_counts_steps_and_rate(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        t.item()  # setup: before the first step
        for _ in range(4):
            guard.step()
            for _ in range(2):
                t.item()
    sites = [s for s in guard.report.sites if s.kind == "item"]
    setup = next(s for s in sites if s.setup_count)
    hot = next(s for s in sites if s.step_count)
    assert (setup.setup_count, setup.step_count) == (1, 0)
    assert hot.step_count == 8 and hot.per_step == 2.0
    assert hot.steps == ((1, 4),)
    assert guard.report.step_syncs == 8


def test_warn_policy_one_warning_per_site_at_user_line(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with pytest.warns(barrierguard.SyncWarning) as caught:  # noqa: SIM117
        with barrierguard.watch(engine="cuda", policy="warn") as guard:
            for _ in range(2):  # two steps: a sync after the last one only is after the loop
                guard.step()
                for _ in range(3):
                    t.item()  # W-site
    ours = [w for w in caught if w.category is barrierguard.SyncWarning]
    assert len(ours) == 1
    assert ours[0].filename == HERE and ours[0].lineno == _line("# W-site")
    message = str(ours[0].message)
    assert "item sync" in message and "Fix:" in message and "allow=['item']" in message


def test_error_policy_raises_from_the_user_line(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with pytest.raises(barrierguard.SyncError) as info:  # noqa: SIM117
        with barrierguard.watch(engine="cuda", policy="error") as guard:
            for _ in range(2):  # raised in its second step, at its line
                guard.step()
                t.item()  # E-site
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.filename == HERE]
    assert frames[-1].lineno == _line("# E-site")
    assert info.value.site is not None and info.value.site["line"] == _line("# E-site")
    assert guard.report.violations[0].reason == "not allowed"
    assert fake_cuda.mode == 0


@pytest.mark.parametrize(
    ("allow", "ok"),
    [
        (["item"], True),
        (["tolist"], False),
        (["user"], True),
        (["framework:lightning"], False),
        (["detect/test_cuda.py:*"], True),
        (["other.py:*"], False),
    ],
)
def test_allow_rules_under_error_policy(fake_cuda: FakeMode, allow: list[str], ok: bool) -> None:
    t = FakeTensor()
    guard = barrierguard.watch(engine="cuda", policy="error", allow=allow)
    try:
        with guard:
            for _ in range(2):
                guard.step()
                t.item()
    except barrierguard.SyncError:
        assert not ok
    else:
        assert ok
        assert guard.report.sites[0].allowed


def test_budget_per_step(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="error", max_syncs_per_step=2) as guard:
        for _ in range(3):
            guard.step()
            t.item()
            t.tolist()
    assert guard.report.ok
    with pytest.raises(barrierguard.SyncError, match="3 syncs in step 2, budget 2"):  # noqa: SIM117
        with barrierguard.watch(engine="cuda", policy="error", max_syncs_per_step=2) as guard:
            for n in (1, 3):
                guard.step()
                for _ in range(n):
                    t.item()


def test_warmup_steps_are_setup(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="error", warmup_steps=2) as guard:
        for _ in range(2):
            guard.step()
            t.item()
    assert guard.report.ok and guard.report.measured_steps == 0
    assert guard.report.sites[0].setup_count == 2


def test_other_thread_recorded_with_name_and_error_deferred(fake_cuda: FakeMode) -> None:
    t = FakeTensor()

    def worker() -> None:
        t.item()

    guard = barrierguard.watch(engine="cuda", policy="error")
    guard.start()
    guard.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", barrierguard.SyncWarning)
        th = threading.Thread(target=worker, name="logger-thread")
        th.start()
        th.join()
    guard.step()  # the step is closed: the worker's sync was in it
    with pytest.raises(barrierguard.SyncError):
        guard.stop()
    site = guard.report.sites[0]
    assert site.threads == ("logger-thread",) and site.function == "worker"
    assert guard.report.violations[0].thread == "logger-thread"


def test_internal_fault_is_reported_not_raised(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from barrierguard.detect import cuda as cuda_engine

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("boom")

    monkeypatch.setattr(cuda_engine, "observe", broken)
    t = FakeTensor(3.0)
    with barrierguard.watch(engine="cuda", policy="error") as guard:
        guard.step()
        assert t.item() == 3.0
    assert any("internal error" in n and "boom" in n for n in guard.report.notes)


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_everything_restored_after_exception(fake_cuda: FakeMode, exc_type: type) -> None:
    saved = (torch.Tensor.__dict__.get("to"), torch.cuda.synchronize, warnings.showwarning)
    with pytest.raises(exc_type), barrierguard.watch(engine="cuda", policy="record"):
        assert "to" in torch.Tensor.__dict__
        raise exc_type("interrupted")
    assert (torch.Tensor.__dict__.get("to"), torch.cuda.synchronize, warnings.showwarning) == saved
    assert fake_cuda.mode == 0


def test_nested_guards_both_record_and_engine_installed_once(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="record") as outer:
        outer.step()
        t.item()
        with barrierguard.watch(engine="cuda", policy="record") as inner:
            inner.step()
            t.tolist()
        assert fake_cuda.mode == 1
    assert fake_cuda.history == ["warn", 0]
    assert {s.kind for s in outer.report.sites} == {"item", "tolist"}
    assert {s.kind for s in inner.report.sites} == {"tolist"}


def test_synchronize_calls_are_recorded(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        torch.cuda.synchronize()  # S-site
    site = guard.report.sites[0]
    assert (site.kind, site.detail, site.line) == ("synchronize", "device", _line("# S-site"))


def test_watch_never_changes_results(fake_cuda: FakeMode) -> None:
    def train() -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        out = []
        for _ in range(10):
            x = torch.randn(32, 8).to("cpu", non_blocking=True)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    bare = train()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        watched = train()
    assert watched == bare
    assert guard.report.steps == 10


def test_optimizers_read_host_step_counters_past_the_item_wrapper(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.optim import adam

    from barrierguard.detect import cuda as cuda_engine

    monkeypatch.setattr(cuda_engine, "_on_device", lambda tensor: tensor.is_cuda)
    original = adam._get_value

    def train() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=False)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).pow(2).sum().backward()
            opt.step()  # one _get_value(step) per parameter
        return [p.detach().clone() for p in model.parameters()]

    bare = train()
    with barrierguard.watch(engine="cuda", policy="record"):
        assert adam._get_value is not original
        wrapper = torch.Tensor.item
        through: list[torch.Tensor] = []

        def counted(self: torch.Tensor) -> object:
            through.append(self)
            return wrapper(self)

        torch.Tensor.item = counted  # type: ignore[method-assign]
        watched = train()
        # The host counters were read, with the same values, and none through the wrapper.
        assert through == []
        assert [torch.equal(a, b) for a, b in zip(watched, bare, strict=True)] == [True, True]
        # Anything but a plain host tensor goes to the original, through the wrapper.
        assert adam._get_value(2.5) == 2.5
        counter = torch.nn.Parameter(torch.tensor(3.0))
        assert adam._get_value(counter) == 3.0
        assert through == [counter]
    assert adam._get_value is original
    assert "item" not in torch.Tensor.__dict__ or torch.Tensor.item is not counted


def test_a_compiled_optimizer_read_of_a_host_step_counter_stays_in_its_graph(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.optim import adam

    from barrierguard.detect import cuda as cuda_engine

    monkeypatch.setattr(cuda_engine, "_on_device", lambda tensor: tensor.is_cuda)

    def bias_correction(step: torch.Tensor) -> Any:
        return 1 - 0.9 ** adam._get_value(step)  # Adam's own use: under dynamo, no read

    torch._dynamo.reset()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        explained = torch._dynamo.explain(bias_correction)(torch.tensor(3.0))
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert guard.report.sites == ()


@pytest.fixture
def scalar_reads(fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch) -> FakeMode:
    """Plain CPU tensors read as CUDA ones on the scalar-read path (the mode faked)."""
    from barrierguard.detect import cuda as cuda_engine

    monkeypatch.setattr(cuda_engine, "_raw_get", fake_cuda.get)
    monkeypatch.setattr(cuda_engine, "_raw_set", fake_cuda.set)
    return fake_cuda


def test_scalar_reads_are_recorded_by_their_wrapper_with_the_mode_off(
    scalar_reads: FakeMode,
) -> None:
    x = torch.ones(1)
    seen: list[int] = []
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        for _ in range(3):
            guard.step()
            x.item()  # S-item
            if x:  # S-bool
                seen.append(scalar_reads.mode)
            float(x)  # S-float
            int(x)  # S-int
        seen.append(scalar_reads.mode)
    sites = _sites(guard)
    assert {(s.line, s.kind, s.count) for s in sites.values()} == {
        (_line("# S-item"), "item", 3),
        (_line("# S-bool"), "bool", 3),
        (_line("# S-float"), "float", 3),
        (_line("# S-int"), "int", 3),
    }
    assert all(s.origin == "user" for s in sites.values())
    # The mode is off only inside the read, on again after it, restored at the end.
    assert seen == [1, 1, 1, 1]
    assert scalar_reads.history[0] == "warn" and scalar_reads.history[-1] == 0
    assert scalar_reads.history[1:-1] == [0, 1] * 12


def test_scalar_read_in_a_helper_is_located_at_each_caller(scalar_reads: FakeMode) -> None:
    def value(t: torch.Tensor) -> float:
        return t.item()  # H-read

    x = torch.ones(1)
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        for _ in range(2):
            guard.step()
            value(x)  # H-one
            value(x)  # H-two
    lines = {(s.line, s.count) for s in guard.report.sites}
    assert (_line("# H-read"), 4) in lines  # the helper is user code: its own line


# A framework's scalar read, 20 of its own frames out of the user's line.
LOGGER_CONNECTOR = "lightning/pytorch/trainer/connectors/logger_connector/result.py"
_FRAMEWORK_READ = compile(
    "def metrics(x):\n"
    "    return x.item()\n"
    "def through(depth, x):\n"
    "    return metrics(x) if depth <= 1 else through(depth - 1, x)\n",
    os.path.join(os.sep, "sp", "site-packages", *LOGGER_CONNECTOR.split("/")),
    "exec",
)


@pytest.mark.parametrize("phases", [True, False], ids=["phase-markers-possible", "none"])
def test_a_framework_read_met_again_replays_the_last_route_and_tells_user_lines_apart(
    scalar_reads: FakeMode, monkeypatch: pytest.MonkeyPatch, phases: bool
) -> None:
    from barrierguard.detect import frameworks, stack

    # With markers possible, the search for a phase runs out past the user's
    # frame: the route holds the frame outward of it.
    monkeypatch.setattr(frameworks, "PHASE_PACKAGES", ("sys",) if phases else ("not-imported",))
    stack.forget()

    namespace: dict[str, Any] = {}
    exec(_FRAMEWORK_READ, namespace)
    through = namespace["through"]
    x = torch.ones(1)
    calls: collections.Counter[Any] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:  # counts calls, adds no frame
        if event == "call":
            calls[frame.f_code] += 1

    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        for _ in range(3):
            through(20, x)  # F-one
            through(20, x)  # F-two
        guard.step()
        sys.setprofile(profile)
        try:
            for _ in range(5):
                through(20, x)  # F-three
        finally:
            sys.setprofile(None)
    counts = {(s.line, s.origin): s.count for s in guard.report.sites}
    assert counts == {
        (_line("# F-one"), "framework:lightning"): 3,
        (_line("# F-two"), "framework:lightning"): 3,
        (_line("# F-three"), "framework:lightning"): 5,
    }
    # Only F-three's first two reads reach observe: the first tries the last
    # route (F-two's), then F-two's and F-one's, and walks; the second tries
    # the last route, then replays its own. The other three replay it alone.
    assert calls[stack.observe.__code__] == 2
    assert calls[stack._replay.__code__] == 3 + 2 + 3
    if phases:  # the route held this test's frame: not kept past the run
        assert stack._anchors.read is None


# The plan of a tallied run: u, a read in user code; f, one in a function it calls; 1 and
# 2, a framework's read from two user lines; s, a step boundary; v / t, the adapter's phase; a / z, an
# allowed() block opened and closed.
_PLAN = "u1s" + "uuuuuu12121212s" * 3 + "v" + "u" * 5 + "t" + "auuuz111" * 2


def _read_in_a_function(x: torch.Tensor) -> None:
    x.item()  # T-function


def _tallied_run(
    x: torch.Tensor, through: Any, fast: bool, plan: str = _PLAN, allow: tuple[str, ...] = ()
) -> tuple[Any, int]:
    """The reads of ``plan``; the report and how many reads reached the guard.

    Not ``fast``: every tally handed out is made stale at once."""
    from barrierguard.detect import hub
    from barrierguard.session.guard import Guard

    calls = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:  # counts calls, adds no frame
        if event == "call":
            calls[frame.f_code] += 1
            if not fast and frame.f_code is Guard.record.__code__:
                hub.invalidate()  # no tally outlives the call that handed it out

    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.1)  # no gradient: its step is its hooks
    with barrierguard.watch(engine="cuda", policy="record", allow=list(allow)) as guard:
        if "o" not in plan:  # "o": the optimizer's steps are the boundaries
            guard.step()
        with contextlib.ExitStack() as blocks:
            for i, event in enumerate(plan):
                if i == 3:
                    sys.setprofile(profile)
                if event == "u":
                    x.item()  # T-user
                elif event == "1":
                    through(20, x)  # T-one
                elif event == "2":
                    through(20, x)  # T-two
                elif event == "f":
                    _read_in_a_function(x)
                elif event == "s":
                    guard.step()
                elif event == "o":
                    opt.step()
                elif event in "vt":
                    guard.set_phase("validate" if event == "v" else None)
                elif event == "a":
                    blocks.enter_context(barrierguard.allowed("item"))
                else:
                    blocks.close()
            sys.setprofile(None)
    return guard.report, calls[Guard.record.__code__]


def _view(report: Any) -> dict[Any, Any]:
    return {
        (s.line, s.origin): (s.count, s.step_count, s.steps, s.phases, s.stall_count)
        for s in report.sites
    }


def _both_ways(plan: str, allow: tuple[str, ...] = ("item", "framework:*")) -> tuple[Any, int, int]:
    """``plan`` run with its tallies standing and with each made stale at once (every read
    allowed, by default): the same report either way; it, and how many reads reached the
    guard each way."""
    namespace: dict[str, Any] = {}
    exec(_FRAMEWORK_READ, namespace)
    x = torch.ones(1)
    fast, fast_calls = _tallied_run(x, namespace["through"], True, plan, allow=allow)
    slow, slow_calls = _tallied_run(x, namespace["through"], False, plan, allow=allow)
    assert _view(fast) == _view(slow)
    assert fast.step_syncs == slow.step_syncs
    assert fast.violations == slow.violations
    return fast, fast_calls, slow_calls


def test_repeats_the_wrapper_counts_itself_match_the_guards_counts(
    scalar_reads: FakeMode,
) -> None:
    # A settled read met again is counted in its site's tally by the wrapper
    # (no call to the guard) until a phase, an allowed() block, another site's
    # count or a step without it makes the tally stale: the report is the one
    # the guard makes when it counts every read itself.
    fast, fast_calls, slow_calls = _both_ways(_PLAN)
    view = _view
    user = view(fast)[(_line("# T-user"), "user")]
    assert user[:4] == (1 + 18 + 5 + 6, 1 + 18 + 6, ((1, 5),), (("validate", 5),))
    assert view(fast)[(_line("# T-one"), "framework:lightning")][:3] == (19, 19, ((1, 5),))
    assert view(fast)[(_line("# T-two"), "framework:lightning")][0] == 12
    assert slow_calls == 18 + 24 + 5 + 12
    # Only a read whose tally went stale reaches the guard (the first one or
    # two after each boundary, phase, block, or read of another site).
    assert fast_calls <= slow_calls - 20


def test_a_read_once_a_step_is_counted_by_its_tally_across_boundaries(
    scalar_reads: FakeMode,
) -> None:
    # The common loop: one read a step (a logged loss), in user code or inside a framework.
    # Once settled, its tally is carried over each boundary that saw it grow (the roll in
    # Guard._advance): the read calls nothing, and the report is the one the guard makes by
    # itself. A step without it, a phase or another site ends the carry; the read after takes
    # one call.
    plan = "u1s" + "us" * 30 + "1s" * 20 + "ss" + "us" * 10 + "v" + "us" * 5 + "t" + "u2s" * 5
    fast, fast_calls, slow_calls = _both_ways(plan)
    user = _view(fast)[(_line("# T-user"), "user")]
    # Counted apart in validate (5): steps 64-68 are not the loop's.
    assert user[:3] == (1 + 30 + 10 + 5 + 5, 1 + 30 + 10 + 5, ((1, 31), (54, 63), (69, 73)))
    assert slow_calls == 30 + 20 + 10 + 5 + 10
    # Not one a step: one or two after each new site, phase and step without the read, and
    # in the last five steps one a read (two sites a step: a thread's wrapper holds one tally).
    assert fast_calls <= 20
    # A read in a function the step calls: a new frame each step, found by its route.
    fast, fast_calls, slow_calls = _both_ways("fs" * 40)
    assert _view(fast)[(_line("# T-function"), "user")][:3] == (40, 40, ((1, 40),))
    assert slow_calls == 40 - 2  # the profile starts at the plan's fourth event
    assert fast_calls <= 2
    # The optimizer's steps as the boundaries: its hook rolls the tally on by itself.
    for plan, line in (("uo" * 40, "# T-user"), ("fo" * 40, "# T-function")):
        fast, fast_calls, slow_calls = _both_ways(plan)
        assert _view(fast)[(_line(line), "user")][:3] == (40, 39, ((1, 39),))
        assert fast_calls <= 3 < slow_calls


def test_a_boundary_visits_only_the_sites_whose_tallies_were_handed_out(
    scalar_reads: FakeMode,
) -> None:
    # Sites settled early and not met since cost a boundary nothing: it rolls on only the
    # tallies handed out (Guard._grown), and the counts are those the guard makes itself.
    plan = "u1fs" * 3 + "us" * 30 + "1s" * 3 + "us" * 5
    fast, fast_calls, slow_calls = _both_ways(plan)
    view = _view(fast)
    assert view[(_line("# T-user"), "user")][:3] == (38, 38, ((1, 33), (37, 41)))
    assert view[(_line("# T-one"), "framework:lightning")][:3] == (6, 6, ((1, 3), (34, 36)))
    assert fast_calls <= 12 < slow_calls

    x = torch.ones(1)
    with barrierguard.watch(engine="cuda", policy="record", allow=["item"]) as guard:
        guard.step()
        for _ in range(3):
            x.item()  # T-early
            _read_in_a_function(x)
            guard.step()
        for _ in range(5):
            x.item()  # T-late
            guard.step()
        grown = [quiet.stats.loc.line for quiet in guard._grown]
    assert grown == [_line("# T-late")]
    assert {s.line: s.count for s in guard.report.sites}[_line("# T-late")] == 5


def test_a_carried_tallys_closed_steps_are_counted_together_as_the_guard_counts_them(
    scalar_reads: FakeMode,
) -> None:
    # A boundary puts a carried tally's closed step aside (the site's counters untouched) and
    # the steps put aside are counted together every few hundred steps and at a report: the
    # report is the one the guard makes when it counts every read itself, violations too.
    from barrierguard.session import guard as guard_module

    steps = guard_module._PAST_STEPS * 4 + 37  # and past the 1,000 violations listed
    for allow in (("item", "framework:*"), ()):
        fast, fast_calls, slow_calls = _both_ways("u1s" + "us" * steps + "1s" * 5, allow=allow)
        user = _view(fast)[(_line("# T-user"), "user")]
        assert user[:3] == (1 + steps, 1 + steps, ((1, 1 + steps),))
        assert fast_calls <= 12 < slow_calls
        if not allow:
            assert len(fast.violations) == guard_module._MAX_VIOLATIONS
            assert [v.step for v in fast.violations] == sorted(v.step for v in fast.violations)
            extra = 2 + steps + 5 - guard_module._MAX_VIOLATIONS
            assert f"{extra} further policy violations" in " ".join(fast.notes)


def test_a_violating_read_once_a_step_is_listed_by_its_tally(scalar_reads: FakeMode) -> None:
    # Under the record policy a read the policy forbids settles at once, as an allowed one
    # does: its tally lists its violations (by step, then by site), with nothing called.
    plan = "u1s" * 5 + "us" * 30 + "1s" * 20 + "fs" * 5
    fast, fast_calls, slow_calls = _both_ways(plan, allow=())
    assert len(fast.violations) == 5 * 2 + 30 + 20 + 5
    assert [v.step for v in fast.violations] == sorted(v.step for v in fast.violations)
    assert not any("further policy violations" in note for note in fast.notes)
    assert slow_calls >= 60 and fast_calls <= 20


def test_a_users_read_found_by_the_last_route_keeps_its_frame_as_the_last(
    scalar_reads: FakeMode,
) -> None:
    # A loop of reads in a new frame whose first read the last read's route answers: that
    # frame is kept as the last read's (as a walk keeps it), so the loop's next reads meet
    # it without the route's probes.
    from barrierguard.detect import stack

    x = torch.ones(1)

    def loop(n: int) -> Any:
        for _ in range(n):
            x.item()  # T-keep
        return sys._getframe()

    with barrierguard.watch(engine="cuda", policy="record", allow=["item"]) as guard:
        for _ in range(2):
            guard.step()
            loop(2)
        guard.step()
        guard.set_phase(None)  # every tally stale: the next read goes to the engine
        assert stack._anchors.last is None  # the last loop's frame returned: dropped
        frame = loop(3)
        assert stack._anchors.last is not None and stack._anchors.last[0] is frame
    (site,) = guard.report.sites
    assert site.count == 7


def test_a_violating_sites_tally_goes_stale_when_an_allowed_block_opens(
    scalar_reads: FakeMode,
) -> None:
    # Past the violation list's 1,000 entries a violating site is settled and
    # its repeats tallied; reads inside allowed() are not violations, so the
    # block must make the wrapper's tally stale.
    x = torch.ones(1)
    plan = "us" + "u" * 1100 + "auuuz" + "u" * 4 + "s" + "u" * 3
    fast, fast_calls = _tallied_run(x, None, True, plan)
    slow, slow_calls = _tallied_run(x, None, False, plan)
    assert _view(fast) == _view(slow)
    assert fast.notes == slow.notes
    assert any("108 further policy violations" in note for note in fast.notes), fast.notes
    assert fast.step_syncs == slow.step_syncs
    assert fast_calls < slow_calls - 90  # the reads past the list, but for a few


def test_no_thread_keeps_a_tally_past_the_run(scalar_reads: FakeMode) -> None:
    from barrierguard.detect import cuda as cuda_engine

    x = torch.ones(1)
    states: list[Any] = []
    done = [threading.Event() for _ in range(3)]
    go = [threading.Event() for _ in range(3)]

    def worker() -> None:
        for k in range(3):  # a step of its own between the main thread's boundaries
            go[k].wait(5)
            for _ in range(4):
                x.item()  # W-read
            done[k].set()
        states.append(cuda_engine._tls.s)

    with barrierguard.watch(engine="cuda", policy="record", allow=["item"]) as guard:
        thread = threading.Thread(target=worker)
        thread.start()
        for k in range(3):
            guard.step()
            go[k].set()
            done[k].wait(5)
        thread.join(5)
        assert states and states[0].hot is not None  # the worker's repeats went to a tally
    assert states[0].hot is None
    (site,) = [s for s in guard.report.sites if s.kind == "item"]
    assert site.count == 12


def test_scalar_read_under_error_policy_raises_at_the_line_with_the_mode_back_on(
    scalar_reads: FakeMode,
) -> None:
    x = torch.ones(1)
    modes: list[int] = []
    with pytest.raises(barrierguard.SyncError) as info:  # noqa: SIM117
        with barrierguard.watch(engine="cuda", policy="error") as guard:
            for _ in range(2):
                guard.step()
                try:
                    x.item()  # R-site
                finally:
                    modes.append(scalar_reads.mode)
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if f.filename == HERE]
    assert frames[-1].lineno == _line("# R-site")
    assert modes == [1, 1]
    assert scalar_reads.mode == 0


def test_scalar_read_under_a_mode_not_ours_takes_the_warning_path(scalar_reads: FakeMode) -> None:
    x = torch.ones(1)
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        scalar_reads.mode = 2  # the user chose "error" meanwhile: left alone
        x.item()
        scalar_reads.mode = 1
    assert scalar_reads.history == ["warn", 0]
    assert not guard.report.sites  # a CPU tensor's read waits for nothing


def test_only_plain_tensors_take_the_scalar_read_path(scalar_reads: FakeMode) -> None:
    class Sub(torch.Tensor):
        pass

    plain, sub = torch.ones(1), torch.ones(1).as_subclass(Sub)
    param = torch.nn.Parameter(torch.ones(1))
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        plain.item()  # P-plain
        param.item()  # P-param
        sub.item()  # may run Python of its own: left to the mode's warning
    assert {s.line for s in _sites(guard).values()} == {_line("# P-plain"), _line("# P-param")}


def test_a_scalar_read_that_fails_on_the_device_is_still_a_sync(scalar_reads: FakeMode) -> None:
    from barrierguard.detect import cuda as cuda_engine
    from barrierguard.detect import hub

    def item(self: torch.Tensor) -> float:
        if self.numel() != 1:
            raise RuntimeError("a Tensor with 2 elements cannot be converted to Scalar")
        raise RuntimeError("operation not permitted when stream is capturing")

    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        read = hub._engines["cuda"]._read  # type: ignore[attr-defined]
        failing = cuda_engine._timed_no_args(item, lambda: False, read)
        with pytest.raises(RuntimeError, match="capturing"):
            failing(torch.ones(1))  # F-read
        with pytest.raises(RuntimeError, match="2 elements"):
            failing(torch.ones(2))  # several values: no read reached the device
        assert scalar_reads.mode == 1
    assert [(s.line, s.kind) for s in guard.report.sites] == [(_line("# F-read"), "call")]


class _OnDevice(torch.Tensor):
    """A host tensor that says it lives on a CUDA device (for the copy wrapper's checks)."""

    is_cuda = property(lambda self: True)  # type: ignore[assignment]
    is_cpu = property(lambda self: False)  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("method", "call", "returns", "expected"),
    [
        ("to", lambda w, h, d: w(h, "cuda", non_blocking=True), "dev", "pageable"),
        ("to", lambda w, h, d: w(h, "cuda", torch.float32, True), "dev", "pageable"),
        ("cuda", lambda w, h, d: w(h, 0, True), "dev", "pageable"),
        ("copy_", lambda w, h, d: w(d, h, True), "dst", "pageable"),
        ("copy_", lambda w, h, d: w(d, src=h, non_blocking=True), "dst", "pageable"),
        ("to", lambda w, h, d: w(d, "cpu", non_blocking=True), "host", "async_d2h"),
        ("copy_", lambda w, h, d: w(h, d, non_blocking=True), "dst", None),  # into a buffer
        ("to", lambda w, h, d: w(h, "cuda"), "dev", None),  # blocking: the mode's to report
        ("to", lambda w, h, d: w(h[:4], "cuda", non_blocking=True), "dev", None),  # small
        ("to", lambda w, h, d: w(h, "cpu", non_blocking=True), "self", None),  # no copy
    ],
)
def test_the_copy_wrapper_judges_a_non_blocking_copy_by_its_arguments(
    method: str, call: Any, returns: str, expected: str | None
) -> None:
    # The tensor comes first in the wrapper's args, non_blocking as a keyword or in
    # any position; a large pageable host source to the device waits, a copy to the
    # host is not ready yet, and copy_ into a host buffer is deliberate.
    from barrierguard.detect import cuda as cuda_engine

    host = torch.zeros(cuda_engine.PAGEABLE_BLOCKING_BYTES // 4 + 1)  # float32: 4 bytes
    dev = torch.zeros(4).as_subclass(_OnDevice)

    def orig(*args: Any, **kwargs: Any) -> Any:
        dst = args[0] if args else kwargs["self"]
        return {"dev": dev, "dst": dst, "host": torch.zeros(4), "self": args[0]}[returns]

    engine = cuda_engine.CudaEngine()
    records: list[tuple[str, str]] = []
    engine._record = lambda kind, detail, stall=None: records.append((kind, detail))  # type: ignore[method-assign]
    wrapper = engine._copy_wrapper(orig, method)
    call(wrapper, host, dev)
    kinds = {
        "pageable": [("copy", "h2d pageable non_blocking")],
        "async_d2h": [("async_d2h", "non_blocking")],
        None: [],
    }
    assert records == kinds[expected]
