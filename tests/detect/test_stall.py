"""Stall time per site: taken around the call, since the warning comes after the wait."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

import barrierguard
from _fake_cuda import FakeClock, FakeMode, blocking_call, blocking_item
from barrierguard.detect import cuda as cuda_engine

ON_DEMAND_CALLS = cuda_engine.TIMED_ON_DEMAND.values()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(cuda_engine, "_clock", fake)
    return fake


def test_stall_is_the_time_inside_the_call(
    fake_cuda: FakeMode, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.Tensor, "item", blocking_item(clock, 0.020))
    x = torch.ones(())
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        for _ in range(3):
            x.item()
            clock.advance(0.5)  # host work between syncs is not stall
            guard.step()
    site = next(s for s in guard.report.sites if s.kind == "item")
    assert site.stall_count == 3
    assert site.stall_s == pytest.approx(0.060)


def test_host_tensor_reads_are_not_timed(
    fake_cuda: FakeMode, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # item() on a host tensor cannot wait for the device: the wrapper skips the
    # clock (optimizers call it for every parameter, every step).
    monkeypatch.setattr(cuda_engine, "_on_device", lambda tensor: tensor.is_cuda)
    monkeypatch.setattr(torch.Tensor, "item", blocking_item(clock, 0.020))
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        torch.ones(()).item()  # the fake still 'syncs': it is recorded, untimed
        guard.step()
    site = next(s for s in guard.report.sites if s.kind == "item")
    assert site.count == 1
    assert site.stall_count == 0


@pytest.mark.parametrize(
    ("first", "timed"), [(1.0, False), (3, False), (True, False), ([1.0], True), ((1,), True)]
)
def test_a_call_on_a_python_number_is_not_timed(
    clock: FakeClock, first: object, timed: bool
) -> None:
    # torch.tensor(1.0) reads no device value (optimizers call it every step):
    # the timed wrapper passes it on without the clock; a list may hold tensors.
    seen: list[object] = []

    def orig(*args: object, **kwargs: object) -> None:
        seen.append(cuda_engine._tls.s.t0)

    cuda_engine._timed(orig, lambda: False)(first, device="cpu")
    assert (seen[0] is not None) is timed
    assert cuda_engine._tls.s.t0 is None


def test_nested_syncs_are_counted_once(
    fake_cuda: FakeMode, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # format() calls item() inside: only the outermost call keeps time, and a
    # second sync inside it counts from the end of the first.
    monkeypatch.setattr(torch.Tensor, "item", blocking_item(clock, 0.010))
    x = torch.ones(())
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        f"{x:.2f}"  # Tensor.__format__ -> item(): one sync of 10 ms
        guard.step()
    sites = [s for s in guard.report.sites if s.step_count]
    assert len(sites) == 1 and sites[0].kind == "format"
    assert sites[0].stall_s == pytest.approx(0.010)


def test_untimed_sync_has_no_stall(fake_cuda: FakeMode, clock: FakeClock) -> None:
    from _fake_cuda import FakeTensor

    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        FakeTensor().item()  # not a torch call: nothing timed its entry
    site = guard.report.sites[0]
    assert site.stall_s is None and site.stall_count == 0


def test_sites_rank_by_stall(
    fake_cuda: FakeMode, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.Tensor, "item", blocking_item(clock, 0.050))
    from _fake_cuda import FakeTensor

    x = torch.ones(())
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        for _ in range(5):
            FakeTensor().tolist()  # frequent but untimed
        x.item()  # rare but slow
        guard.step()
    ranked = guard.report.ranked()
    assert ranked[0].kind == "item"
    assert "stalled 50.00 ms in all" in str(guard.report)


# (owner, name, the call, its kind): TIMED_ON_DEMAND's calls, each met three times.
ON_DEMAND = [
    (torch, "tensor", lambda x, m: torch.tensor([x, x]), "copy"),
    (torch, "where", lambda x, m: torch.where(m), "nonzero"),
    (torch, "allclose", lambda x, m: torch.allclose(x, x), "compare"),
    (torch, "repeat_interleave", lambda x, m: torch.repeat_interleave(x, m), "repeat_interleave"),
]


@pytest.mark.parametrize(
    ("owner", "name", "call", "kind"), ON_DEMAND, ids=[c[1] for c in ON_DEMAND]
)
def test_a_call_that_seldom_syncs_is_timed_once_it_has_synced(
    fake_cuda: FakeMode,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
    call: Any,
    kind: str,
) -> None:
    # Unwrapped until its first sync (optimizers call torch.tensor(1.0) every step); that
    # sync is untimed, the next ones are timed.
    monkeypatch.setattr(owner, name, blocking_call(clock, 0.005))
    x = torch.ones(4)
    mask = torch.ones(4, dtype=torch.bool)
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        before = getattr(owner, name)
        assert isinstance(before, types.FunctionType) and before.__name__ == "blocking"
        for _ in range(3):
            call(x, mask)
        assert getattr(owner, name).__wrapped__ is before  # timed from the first sync on
        guard.step()
    assert getattr(owner, name) is before
    site = next(s for s in guard.report.sites if s.kind == kind)
    assert site.count == 3 and site.stall_count == 2
    assert site.stall_s == pytest.approx(0.010)


def test_a_call_that_seldom_syncs_passes_no_wrapper_until_then(fake_cuda: FakeMode) -> None:
    before = [
        (owner, name, vars(owner).get(name)) for calls in ON_DEMAND_CALLS for owner, name in calls
    ]
    with barrierguard.watch(engine="cuda", policy="record"):
        assert [(owner, name, vars(owner).get(name)) for owner, name, _ in before] == before
    assert [(owner, name, vars(owner).get(name)) for owner, name, _ in before] == before


def test_indexing_is_recorded_untimed_and_tensor_stays_no_sequence(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Python __getitem__ on torch.Tensor would set its sq_item slot for good: every tensor
    # a sequence to CPython, and torch.tensor([a, b]) of 0-d tensors raising TypeError, during
    # the run and after it. No indexing call is wrapped, even with every on-demand kind timed.
    import ctypes

    from barrierguard.detect import hub

    x = torch.arange(4.0)

    def protocols() -> list[int]:  # how CPython's C API sees a tensor
        api, obj = ctypes.pythonapi, ctypes.py_object(x)
        return [f(obj) for f in (api.PySequence_Check, api.PyMapping_Check, api.PyIndex_Check)]

    before = protocols()
    with barrierguard.watch(engine="cuda", policy="record"):
        engine = hub._engines["cuda"]
        for kind in cuda_engine.TIMED_ON_DEMAND:
            engine._timed_kinds.add(kind)
            for owner, name in cuda_engine.TIMED_ON_DEMAND[kind]:
                engine._time(owner, (name,))
        assert "__getitem__" not in vars(torch.Tensor)
        assert "__setitem__" not in vars(torch.Tensor)
        assert protocols() == before
        assert torch.tensor([x[0], x[1]]).tolist() == [0.0, 1.0]
    assert protocols() == before == [0, 1, 1]
    assert torch.tensor([x[0], x[1]]).tolist() == [0.0, 1.0]


def test_one_call_that_syncs_many_times_is_one_occurrence(
    fake_cuda: FakeMode,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # print(t) synchronizes about ten times inside torch's formatting: the user
    # wrote one barrier, whose stall is the whole wait (here 5 ms, then host work).
    from _fake_cuda import syncing_repr

    monkeypatch.setattr(torch.Tensor, "__repr__", syncing_repr(clock, 0.005, 10))
    x = torch.ones(())
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        for _ in range(2):
            print(x)
            guard.step()
    (site,) = [s for s in guard.report.sites if s.step_count]
    assert site.kind == "print"
    assert site.count == 2 and site.step_count == 2 and site.per_step == pytest.approx(2 / 3)
    assert site.events == 20
    assert site.stall_count == 2 and site.stall_s == pytest.approx(0.010)
    assert site.to_dict()["events"] == 20
    assert "stalled 10.00 ms in all, 5.000 ms per occurrence" in str(guard.report)


@pytest.mark.parametrize("times", [1, 3])
def test_a_copy_is_named_and_timed_from_its_wrappers_frame(
    fake_cuda: FakeMode, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, times: int
) -> None:
    # The copy wrapper sets nothing on the thread: a sync inside the copy finds the
    # wrapper's frame, the call's direction and its start. Further syncs in the same
    # copy are the same occurrence; the next copy is timed anew.
    from _fake_cuda import blocking_copy

    monkeypatch.setattr(torch.Tensor, "to", blocking_copy(clock, 0.005, times))
    x = torch.ones(2, device="meta")
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        for _ in range(2):
            x.to("cpu")  # C-site
            clock.advance(1.0)  # host work between copies is not stall
        guard.step()
    (site,) = [s for s in guard.report.sites if s.step_count]
    assert (site.kind, site.detail, site.code) == ("copy", "d2h", 'x.to("cpu")  # C-site')
    assert site.count == 2 and site.stall_count == 2
    assert site.stall_s == pytest.approx(0.010)
    assert cuda_engine._tls.s.t0 is None
