"""The guard's lifecycle and steps, on CPU."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import barrierguard
from _fake_cuda import FakeMode, FakeTensor
from _runif import run_if


def _sgd() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_optimizer_steps_are_steps() -> None:
    model, opt = _sgd()
    with barrierguard.watch(policy="record") as guard:
        for _ in range(5):
            _train_step(model, opt)
    assert guard.report.steps == 5
    _train_step(model, opt)  # after stop: not counted, hook removed
    assert guard.report.steps == 5


def test_two_optimizers_make_one_step() -> None:
    gen, opt_g = _sgd()
    disc, opt_d = _sgd()
    with barrierguard.watch(policy="record") as guard:
        for _ in range(3):
            _train_step(disc, opt_d)
            _train_step(gen, opt_g)
    assert guard.report.steps == 3


def test_layer_wise_optimizers_count_every_step() -> None:
    first, opt_a = _sgd()
    second, opt_b = _sgd()
    with barrierguard.watch(policy="record") as guard:
        for _ in range(30):
            _train_step(first, opt_a)
        for _ in range(30):
            _train_step(second, opt_b)
    assert guard.report.steps == 60
    assert len(guard.report.syncs_per_step) == 61


def test_gan_optimizers_after_a_generator_warmup_make_one_step_each_iteration() -> None:
    gen, opt_g = _sgd()
    disc, opt_d = _sgd()
    with barrierguard.watch(policy="record") as guard:
        for _ in range(2):
            _train_step(gen, opt_g)  # the generator alone first
        for _ in range(3):
            _train_step(disc, opt_d)
            _train_step(gen, opt_g)
    assert guard.report.steps == 5


def test_manual_steps_take_over_from_optimizer_steps() -> None:
    model, opt = _sgd()
    with barrierguard.watch(policy="record") as guard:
        for _ in range(4):
            _train_step(model, opt)
            _train_step(model, opt)  # gradient accumulation-like: 2 optimizer steps
            guard.step()
    # The two optimizer steps before the first step() call counted; then only step().
    assert guard.report.steps == 6


def test_start_twice_is_an_error_that_says_how_to_fix_it() -> None:
    guard = barrierguard.watch(policy="record")
    with guard, pytest.raises(barrierguard.BarrierGuardError, match="already running"):
        guard.start()


def test_restart_adds_to_the_same_report(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    guard = barrierguard.watch(engine="cuda", policy="record")
    for _ in range(2):
        with guard:
            guard.step()
            t.item()
    assert guard.report.steps == 2
    assert guard.report.sites[0].count == 2
    assert not guard.is_running


def test_decorator_forms(fake_cuda: FakeMode) -> None:
    t = FakeTensor()

    @barrierguard.watch(engine="cuda", policy="record")
    def train() -> float:
        for _ in range(2):
            barrierguard_guard.step()
            value = t.item()
        return value

    barrierguard_guard = train.guard  # type: ignore[attr-defined]
    assert train() == 1.0
    assert train.guard.report.step_syncs == 2  # type: ignore[attr-defined]

    @barrierguard.watch
    def bare() -> int:
        return 3

    assert bare() == 3
    assert isinstance(bare.guard, barrierguard.Guard)  # type: ignore[attr-defined]


def test_report_is_available_while_running(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        t.item()
        assert guard.is_running
        assert guard.report.step_syncs == 1
    assert guard.report.duration_s > 0


def test_no_step_boundary_is_noted(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="error") as guard:
        t.item()  # no step ever: setup, never an error
    assert guard.report.ok
    assert any("no step boundary" in n for n in guard.report.notes)


def test_syncs_per_step_series(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        t.item()
        for n in (2, 0, 1):
            guard.step()
            for _ in range(n):
                t.item()
    assert guard.report.syncs_per_step == (1, 2, 0, 1)


def test_violations_are_listed_per_step_and_threads_listed_once(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    calls = []
    real = threading.enumerate

    def enumerate_threads() -> list[threading.Thread]:
        calls.append(1)
        return real()

    monkeypatch.setattr(threading, "enumerate", enumerate_threads)
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        for _ in range(5):
            guard.step()
            t.item()
    violations = guard.report.violations
    assert [v.step for v in violations] == [1, 2, 3, 4, 5]
    assert {(v.kind, v.reason, v.thread) for v in violations} == {
        ("item", "not allowed", threading.current_thread().name)
    }
    assert violations[0].file == guard.report.sites[0].file
    # The thread's name was looked up once, not at every violating sync.
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("engine", "device"),
    [("audit", "cpu"), pytest.param("cuda", "cuda", marks=run_if(min_cuda_gpus=1))],
)
def test_same_seed_same_losses_with_and_without_watch(engine: str, device: str) -> None:
    def train() -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        model = model.to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        out = []
        for _ in range(5):
            loss = model(torch.randn(32, 8).to(device)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    bare = train()
    with barrierguard.watch(engine=engine, policy="record"):
        watched = train()
    assert watched == bare


@pytest.mark.parametrize("threads", [1, 2])
def test_settled_sites_count_as_the_full_path_does(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    import threading

    from barrierguard.session.guard import Guard

    def run() -> dict[str, object]:
        t = FakeTensor()

        def read() -> None:
            t.bool()  # one site, read inside and outside an allowed() block

        t.bool = t.__bool__  # type: ignore[attr-defined]
        guard = barrierguard.watch(engine="cuda", policy="record", allow=["tolist"], memory=False)
        snapshots = []
        with guard:
            for step in range(400):
                guard.step()
                for _ in range(3):
                    t.item()
                t.tolist()  # allowed
                read()
                if step % 7 == 0:
                    with barrierguard.allowed("item"):
                        t.item()
                    with barrierguard.allowed():
                        read()
                read()
                if step % 50 == 0 and threads == 2:
                    worker = threading.Thread(target=t.item, name="reader")
                    worker.start()
                    worker.join()
                if step % 97 == 0:  # a report while running, mid-step
                    mid = guard.report.to_dict()
                    mid.pop("duration_s")
                    mid.pop("timeline", None)  # times, on a machine with CUDA
                    snapshots.append(mid)
        out = guard.report.to_dict()
        out.pop("duration_s")
        out.pop("timeline", None)
        out["snapshots"] = snapshots
        out["settled"] = len(guard._quiet)
        return out

    settled = run()
    # The allowed site and, under the record policy, the violating ones (listed by their
    # tallies, by step then by site, as the full path lists them).
    assert settled.pop("settled") == 2 + threads
    monkeypatch.setattr(Guard, "_settle", lambda self, stats: None)
    full = run()
    assert full.pop("settled") == 0
    assert settled == full
    assert max(s["count"] for s in settled["sites"]) > 1000  # type: ignore[index]


def test_a_threads_tally_is_counted_by_that_thread_or_at_the_end(fake_cuda: FakeMode) -> None:
    import queue
    import threading

    t = FakeTensor()
    todo: queue.Queue[int] = queue.Queue()
    done: queue.Queue[None] = queue.Queue()

    def reader() -> None:
        while (n := todo.get()) > 0:
            for _ in range(n):
                t.item()
            done.put(None)

    def read(n: int) -> None:
        todo.put(n)
        done.get(timeout=30)

    worker = threading.Thread(target=reader, name="reader")
    guard = barrierguard.watch(engine="cuda", policy="record", allow=["item"], memory=False)
    with guard:
        worker.start()
        guard.step()
        read(1)
        guard.step()  # the site is confirmed in the loop (and allowed: it settles)
        read(4)  # settles, is counted, then tallied twice... or more
        tallied = sum(q.n for q in guard._quiet.values())
        mid = guard.report.sites[0].count
        todo.put(0)  # the reader ends
        worker.join()
    assert tallied > 0
    # A report from another thread leaves the reader's tally alone (no race on it)...
    assert mid == 5 - tallied
    # ... and the end counts it.
    assert guard.report.sites[0].count == 5


def test_a_settled_sites_tally_keeps_timed_and_untimed_repeats_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from barrierguard.detect.frames import Location
    from barrierguard.detect.stack import Sync
    from barrierguard.session.guard import Guard

    me = threading.get_ident()
    sync = Sync(Location("/w/train.py", 7, "main", "item", "", "user"))
    stalls = [0.5, 0.25, 0.125, None, 0.125, None, None, 0.0625]

    def run() -> tuple[dict[str, Any], int]:
        guard = barrierguard.watch(policy="record", engine="audit", allow=["item"], memory=False)
        tallied = 0
        for _ in range(4):
            guard.step()
            for stall in stalls:
                guard.record(sync, me, stall)
            tallied = max(tallied, sum(q.n for q in guard._quiet.values()))
        guard.step()
        out = guard.report.to_dict()
        out.pop("duration_s")
        return out, tallied

    settled, tallied = run()
    # Every sync of a step once its tally is carried over a boundary (the roll in _advance); in
    # the first settled step, all but the one that settled the site.
    assert tallied == len(stalls)
    monkeypatch.setattr(Guard, "_settle", lambda self, stats: None)
    full, none = run()
    assert none == 0
    assert settled == full
    (site,) = settled["sites"]
    assert site["count"] == 4 * len(stalls)
    assert site["stall_count"] == 4 * 5  # the timed ones only


def test_a_quiet_boundary_is_one_call_and_a_walk_makes_the_next_one_forget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With nothing kept by a walk, nothing folded and no listener due, an optimizer's
    # boundary does its work in the hook alone; after a walk it drops what was kept.
    from barrierguard.detect import stack

    forgets: list[bool] = []
    forget = stack.forget
    monkeypatch.setattr(
        stack,
        "forget",
        lambda live=False, origin=None: forgets.append(live) or forget(live, origin),
    )
    model, opt = _sgd()
    with barrierguard.watch(policy="record", memory=False) as guard:
        boundaries: list[int] = []
        work = guard._boundary
        monkeypatch.setattr(
            guard, "_boundary", lambda *args: boundaries.append(args[0]) or work(*args)
        )
        stack.forget()
        forgets.clear()
        for _ in range(4):
            _train_step(model, opt)
        assert guard.report.steps == 4
        # The first step's boundary learns the optimizer and asks the listeners; then none.
        assert boundaries == [1]
        assert forgets == []  # nothing kept: no call
        stack.observe(sys._getframe(), "item")  # a walk keeps this frame
        _train_step(model, opt)
        assert boundaries == [1, 5]
        assert forgets == [True]
        assert stack._anchors.last is not None  # this frame is live: kept
    assert guard.report.steps == 5


def test_a_quiet_step_call_does_no_boundary_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # step(), which the callbacks call, takes the optimizer hook's quiet path: with nothing
    # kept, folded or due, its boundary is Guard._advance alone.
    with barrierguard.watch(policy="record", memory=False) as guard:
        boundaries: list[int] = []
        work = guard._boundary
        monkeypatch.setattr(
            guard, "_boundary", lambda *args: boundaries.append(args[0]) or work(*args)
        )
        for _ in range(5):
            guard.step()
        assert boundaries == [1]  # the first asks the listeners
    assert guard.report.steps == 5


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "boundary-wrapped"])
def test_a_boundary_finding_the_held_frames_where_they_were_is_skipped_and_a_finished_one_dropped(
    monkeypatch: pytest.MonkeyPatch, wrapped: bool
) -> None:
    # After a walk, one boundary checks what it kept and settles (a new stack.settled); while
    # no walk follows, the hook finds those frames where they were and calls nothing (the
    # same one). Once the frame that kept them has returned, the next boundary drops it. The
    # depths count from the hook's frame: a wrapper around the boundary (a meter) moves none.
    from barrierguard.detect import stack

    model, opt = _sgd()
    frames: list[Any] = []

    def epoch(steps: int) -> list[Any]:
        frames.append(sys._getframe())
        stack.observe(sys._getframe(), "item")  # a walk keeps this frame
        seen = []
        for _ in range(steps):
            _train_step(model, opt)
            seen.append(stack.settled)
        return seen

    with barrierguard.watch(policy="record", memory=False) as guard:
        _train_step(model, opt)  # the first boundary learns the optimizer
        boundaries: list[int] = []
        if wrapped:
            work = guard._boundary
            monkeypatch.setattr(
                guard, "_boundary", lambda *args: boundaries.append(args[0]) or work(*args)
            )
        seen = epoch(4)
        assert seen[0] is not None and id(frames[0]) in dict(seen[0])
        assert all(s is seen[0] for s in seen)  # the three after the first: no forget()
        assert stack._anchors.last is not None and stack._anchors.last[0] is frames[0]
        _train_step(model, opt)  # epoch's frame has returned
        assert stack._anchors.last is None
        assert stack.settled is not None and id(frames[0]) not in dict(stack.settled)
        seen = epoch(2)
        assert seen[0] is not None and id(frames[1]) in dict(seen[0])
        assert seen[1] is seen[0]
        assert stack._anchors.last is not None and stack._anchors.last[0] is frames[1]
        assert boundaries == ([2, 6, 7] if wrapped else [])
    assert guard.report.steps == 8
    assert stack.settled is None


def test_a_manual_step_finding_its_kept_frames_skips_forget_and_a_finished_one_is_dropped() -> None:
    # step()'s boundary probes the kept frames where the last one found them, as the optimizer
    # hook does, and calls forget() only when one has moved or returned.
    from barrierguard.detect import stack

    frames: list[Any] = []

    def epoch(guard: Any, steps: int) -> list[Any]:
        frames.append(sys._getframe())
        stack.observe(sys._getframe(), "item")  # a walk keeps this frame
        seen = []
        for _ in range(steps):
            guard.step()
            seen.append(stack.settled)
        return seen

    with barrierguard.watch(policy="record", memory=False) as guard:
        guard.step()
        seen = epoch(guard, 4)
        assert seen[0] is not None and id(frames[0]) in dict(seen[0])
        assert all(s is seen[0] for s in seen)  # the three after the first: no forget()
        guard.step()  # epoch's frame has returned
        assert stack._anchors.last is None
        assert stack.settled is not None and id(frames[0]) not in dict(stack.settled)
    assert guard.report.steps == 6


def test_a_step_listener_is_called_at_the_step_it_asks_for() -> None:
    # A listener returns the step it is next needed at (None: the next one); the
    # steps in between call nothing. A listener that fails is asked again next step,
    # and a restart asks every listener anew.
    calls: dict[str, list[int]] = {"every": [], "sparse": [], "broken": []}

    def every(step: int) -> None:
        calls["every"].append(step)

    def sparse(step: int) -> int:
        calls["sparse"].append(step)
        return step + 4

    def broken(step: int) -> int:
        calls["broken"].append(step)
        if step == 2:
            raise RuntimeError("boom")
        return 2 if step == 1 else step + 100

    guard = barrierguard.watch(policy="record", memory=False)
    for listener in (every, sparse, broken):
        guard.add_step_listener(listener)
    with guard:
        for _ in range(9):
            guard.step()
    assert calls["every"] == list(range(1, 10))
    assert calls["sparse"] == [1, 5, 9]
    assert calls["broken"] == [1, 2, 3]
    with guard:
        for _ in range(3):
            guard.step()
    assert calls["sparse"] == [1, 5, 9, 10]
    assert calls["broken"] == [1, 2, 3, 10]
    assert calls["every"] == list(range(1, 13))
    assert sum("RuntimeError: boom" in n for n in guard.report.notes) == 1


def test_a_sites_steps_stay_ranges_in_order_whatever_order_they_are_counted_in() -> None:
    # A tally's closed steps are counted after a later sync of the same site (another
    # thread's): a site's ranges of steps stay merged and in order either way.
    import random

    from barrierguard.session.guard import _add_step

    rng = random.Random(0)
    for _ in range(300):
        steps = rng.sample(range(60), rng.randint(1, 40))
        steps += rng.sample(steps, len(steps) // 3)  # a step counted twice
        rng.shuffle(steps)
        ranges: list[list[int]] = []
        for step in steps:
            _add_step(ranges, step)
        want: list[list[int]] = []
        for step in sorted(set(steps)):
            if want and want[-1][1] == step - 1:
                want[-1][1] = step
            else:
                want.append([step, step])
        assert ranges == want, steps
