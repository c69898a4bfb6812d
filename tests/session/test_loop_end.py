"""After the loop: syncs that follow the last step are counted apart, never failed."""

from __future__ import annotations

import warnings

import pytest
import torch

import barrierguard
from _fake_cuda import FakeMode, FakeTensor
from barrierguard.session import loop_end


def _after_loop(site: barrierguard.Site) -> int:
    return dict(site.phases).get(loop_end.AFTER_LOOP, 0)


def test_a_read_after_the_last_step_is_after_the_loop(fake_cuda: FakeMode) -> None:
    total = FakeTensor(6.0)
    with barrierguard.watch(engine="cuda", policy="error") as guard:
        for _ in range(4):
            guard.step()
        mean = total.item() / 4  # the advised fix: one read after the loop
    report = guard.report
    assert mean == 1.5
    assert report.ok and report.step_syncs == 0
    (site,) = report.sites
    assert (site.count, site.step_count, _after_loop(site), site.steps) == (1, 0, 1, ())
    assert report.syncs_per_step == (0, 0, 0, 0, 0)


def test_a_read_in_the_loop_raises_at_its_line_in_the_second_step(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    seen = []
    guard = barrierguard.watch(engine="cuda", policy="error")
    with pytest.raises(barrierguard.SyncError, match="in step 2") as info, guard:
        for i in range(5):
            guard.step()
            seen.append(i)
            t.item()  # in the loop
    # Raised by the sync itself (the traceback's last user frame is this test's line).
    assert seen == [0, 1]
    frames = [f for f in _tb_files(info.value) if f.endswith("test_loop_end.py")]
    assert frames, "the traceback should pass through the sync's line"
    assert [v.step for v in guard.report.violations] == [1, 2]


def _tb_files(err: BaseException) -> list[str]:
    out = []
    tb = err.__traceback__
    while tb is not None:
        out.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return out


def test_a_site_seen_in_one_step_raises_at_the_next_boundary_but_one(
    fake_cuda: FakeMode,
) -> None:
    t = FakeTensor()
    guard = barrierguard.watch(engine="cuda", policy="error").start()
    try:
        guard.step()
        t.item()  # step 1 only
        guard.step()  # closes step 1: the violation is recorded, the error is due
        assert [v.step for v in guard.report.violations] == [1]
        with pytest.raises(barrierguard.SyncError, match=r"step 1 .*t\.item\(\)"):
            guard.step()  # it did not fire again at its line: raised here
    finally:
        guard._stop(act=False)


def test_a_due_error_is_raised_at_the_next_boundary_when_no_listener_is_due(
    fake_cuda: FakeMode,
) -> None:
    # Past the step timeline's first window, memory sampling off: no listener is due for a
    # while, and the boundary that finds an error due still raises it (Guard._work_at).
    t = FakeTensor()
    guard = barrierguard.watch(engine="cuda", policy="error", memory=False).start()
    try:
        for _ in range(40):
            guard.step()
        assert guard._work_at > guard.steps + 1
        t.item()  # held: its site is new
        guard.step()  # closes step 40: the violation is recorded, the error is due
        with pytest.raises(barrierguard.SyncError, match=r"step 40 .*t\.item\(\)"):
            guard.step()
    finally:
        guard._stop(act=False)


def test_a_due_error_left_at_stop_is_raised_by_stop(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    guard = barrierguard.watch(engine="cuda", policy="error").start()
    guard.step()
    t.item()
    guard.step()
    with pytest.raises(barrierguard.SyncError, match="in step 1"):
        guard.stop()
    assert not guard.is_running


def test_a_two_step_loop_still_fails(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    guard = barrierguard.watch(engine="cuda", policy="error")
    with pytest.raises(barrierguard.SyncError, match="in step 1"), guard:
        for _ in range(2):
            t.item()
            opt.step()


def test_a_loop_of_one_step_says_the_policy_judged_nothing(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="error") as guard:
        t.item()
        guard.step()
        t.item()
    assert guard.report.ok
    assert any("judged no step" in n for n in guard.report.notes)


def test_warn_policy_warns_once_when_the_step_closes(fake_cuda: FakeMode) -> None:
    t = FakeTensor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with barrierguard.watch(engine="cuda", policy="warn") as guard:
            for _ in range(3):
                guard.step()
                t.item()
    sync_warnings = [w for w in caught if issubclass(w.category, barrierguard.SyncWarning)]
    assert len(sync_warnings) == 1
    assert [v.step for v in guard.report.violations] == [1, 2, 3]


def test_budget_counts_the_open_step_and_after_the_loop_is_free(fake_cuda: FakeMode) -> None:
    t, u = FakeTensor(), FakeTensor()
    with barrierguard.watch(engine="cuda", policy="error", max_syncs_per_step=1) as guard:
        for _ in range(3):
            guard.step()
            t.item()  # within the budget of one per step
        for _ in range(2):
            u.item()  # after the loop: outside any step's budget
    report = guard.report
    assert report.ok
    by_line = {s.line: s for s in report.sites}
    assert sorted(_after_loop(s) for s in by_line.values()) == [0, 2]
    assert report.syncs_per_step == (0, 1, 1, 1)


def test_a_read_once_per_epoch_after_the_data_ran_out_never_fails() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(6, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model = torch.nn.Linear(2, 1).to("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with barrierguard.watch(engine="audit", policy="error") as guard:
        for _ in range(3):
            total = torch.zeros((), device="cpu")
            for (x,) in loader:
                loss = model(x.to("cpu")).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.detach()
            print(f"epoch loss {(total / 3).item():.3f}")  # once per epoch
    report = guard.report
    assert report.ok, report.violations
    (read,) = [s for s in report.sites if s.kind == "item"]
    assert (read.count, read.step_count, _after_loop(read)) == (3, 0, 3)
    # DataLoader iteration is restored.
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    assert not hasattr(_BaseDataLoaderIter.__next__, "__wrapped__")


def test_loaders_are_watched_only_while_no_phase_is_named() -> None:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    def watched() -> bool:
        return hasattr(_BaseDataLoaderIter.__next__, "__wrapped__")

    data = torch.utils.data.TensorDataset(torch.randn(4, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model = torch.nn.Linear(2, 1).to("cpu")
    guard = barrierguard.watch(engine="audit", policy="record", memory=False)
    guard.set_phase("train")  # as a framework's adapter does before it starts the guard
    guard.start()
    try:
        assert not watched()  # its phases name the loop's end: no wrapper on each batch
        guard.set_phase(None)
        guard.set_phase(None)  # watched once
        assert watched()
        for (x,) in loader:
            loss = model(x.to("cpu")).pow(2).mean()
            guard.step()
        loss.item()  # after the data ran out, no phase named
    finally:
        guard.stop()
    assert not watched()
    (read,) = [s for s in guard.report.sites if s.kind == "item"]
    assert _after_loop(read) == 1


def test_a_read_in_the_loop_of_a_dataloader_still_fails() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model = torch.nn.Linear(2, 1).to("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = barrierguard.watch(engine="audit", policy="error")
    with pytest.raises(barrierguard.SyncError, match="item sync"), guard:
        for _ in range(2):
            for (x,) in loader:
                loss = model(x.to("cpu")).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss.item()


@pytest.mark.parametrize("kept", [loop_end.KEPT, 2])
def test_every_held_violation_of_a_site_is_counted(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch, kept: int
) -> None:
    # A new site syncing three times in its first step is held until the step closes:
    # all three are violations, listed as far as KEPT allows, counted past it.
    monkeypatch.setattr(loop_end, "KEPT", kept)
    t = FakeTensor()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        for _ in range(3):
            guard.step()
            for _ in range(3):
                t.item()
        guard.step()
    report = guard.report
    (site,) = report.sites
    assert site.step_count == 9 and report.step_syncs == 9
    assert [v.step for v in report.violations] == [1] * min(3, kept) + [2] * 3 + [3] * 3
    extra = [n for n in report.notes if "further policy violations" in n]
    assert extra == (
        [] if kept >= 3 else ["1 further policy violations were counted but not listed"]
    )
