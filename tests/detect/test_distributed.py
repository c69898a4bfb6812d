"""The host barriers of torch.distributed, in a 1-rank gloo group, under both engines."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import barrierguard
from _fake_cuda import FakeMode, _sync
from barrierguard.detect import distributed

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")

HERE = __file__


def _line(marker: str) -> int:
    with open(HERE) as fh:
        for i, text in enumerate(fh, 1):
            if text.rstrip().endswith(marker) and "_line(" not in text:
                return i
    raise AssertionError(marker)


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _collectives(report: barrierguard.Report) -> dict[int, str]:
    return {s.line: s.detail for s in report.sites if s.kind == "collective" and s.file == HERE}


def _loop(device: torch.device) -> None:
    host = torch.ones(3)
    on_device = torch.ones(3, device=device)
    dist.barrier()  # L-barrier
    seen: list[Any] = [None]
    dist.all_gather_object(seen, {"a": 1})  # L-gather-object
    objects: list[Any] = [{"b": 2}]
    dist.broadcast_object_list(objects, src=0)  # L-broadcast-object
    dist.all_reduce(host)  # L-all-reduce-host
    dist.all_reduce(on_device)  # L-all-reduce-device
    work = dist.all_reduce(host, async_op=True)  # L-async
    work.wait()  # L-wait
    dist.barrier(async_op=True).wait()  # L-barrier-wait
    distributed_c10d.all_gather([torch.zeros(3)], host)  # L-c10d


EXPECTED = {
    "# L-barrier": "barrier",
    "# L-gather-object": "all_gather_object",
    "# L-broadcast-object": "broadcast_object_list",
    "# L-all-reduce-host": "all_reduce (gloo)",
    "# L-wait": "wait (all_reduce, gloo)",
    "# L-barrier-wait": "wait (barrier)",
    "# L-c10d": "all_gather (gloo)",
}


def test_audit_reports_host_barriers_at_the_users_lines(group: None) -> None:
    with barrierguard.watch(engine="audit", policy="record", memory=False) as guard:
        # A device-agnostic script on CPU: device= tensors stand for GPU ones,
        # whose NCCL collectives do not block the host.
        _loop(torch.device("cpu"))
    found = _collectives(guard.report)
    assert found == {_line(m): d for m, d in EXPECTED.items()}
    assert _line("# L-all-reduce-device") not in found
    assert _line("# L-async") not in found  # the wait blocks, not the call
    # What all_gather_object does inside (pickling, copies, reads) is part of it.
    assert not [s for s in guard.report.sites if s.origin != "user"]
    site = next(s for s in guard.report.sites if s.detail == "barrier")
    assert site.fix.startswith("take it out of the training loop")
    assert site.blocking and site.stall_s is None  # the audit times nothing


def test_cuda_engine_times_the_wait(group: None, fake_cuda: FakeMode) -> None:
    with barrierguard.watch(engine="cuda", policy="record", memory=False) as guard:
        guard.step()  # a measured step: stalls are kept per site
        host = torch.ones(3)
        dist.barrier()  # L-cuda-barrier
        dist.all_reduce(host)  # L-cuda-all-reduce
        dist.all_reduce(host, async_op=True).wait()  # L-cuda-wait
        guard.step()
    found = _collectives(guard.report)
    assert found == {
        _line("# L-cuda-barrier"): "barrier",
        _line("# L-cuda-all-reduce"): "all_reduce (gloo)",
        _line("# L-cuda-wait"): "wait (all_reduce, gloo)",
    }
    sites = [s for s in guard.report.sites if s.kind == "collective"]
    assert all(s.stall_s is not None and s.stall_s >= 0 for s in sites)


def test_syncs_inside_a_recorded_call_are_part_of_it(
    group: None, fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = distributed_c10d.all_gather_object

    def syncing_gather(*args: Any, **kwargs: Any) -> Any:
        _sync()  # a device read inside the call (NCCL's size exchange)
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed_c10d, "all_gather_object", syncing_gather)
    monkeypatch.setattr(dist, "all_gather_object", syncing_gather)
    with barrierguard.watch(engine="cuda", policy="record", memory=False) as guard:
        seen: list[Any] = [None]
        dist.all_gather_object(seen, 1)  # L-quiet
        _sync()  # L-outside
    assert {(s.line, s.kind) for s in guard.report.sites if s.file == HERE} == {
        (_line("# L-quiet"), "collective"),
        (_line("# L-outside"), "call"),  # outside the call: a site of its own
    }
    assert not distributed.quiet()


def test_a_scalar_read_inside_a_recorded_call_is_part_of_it(
    group: None, fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from barrierguard.detect import cuda as cuda_engine

    # Plain CPU tensors read as CUDA ones on the scalar-read path.
    monkeypatch.setattr(cuda_engine, "_raw_get", fake_cuda.get)
    monkeypatch.setattr(cuda_engine, "_raw_set", fake_cuda.set)
    real = distributed_c10d.all_gather_object
    x = torch.ones(1)
    inside: list[tuple[int, bool]] = []

    def reading_gather(*args: Any, **kwargs: Any) -> Any:
        inside.append((distributed._quiet_threads, distributed.quiet()))
        x.item()  # a scalar read inside the call
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed_c10d, "all_gather_object", reading_gather)
    monkeypatch.setattr(dist, "all_gather_object", reading_gather)
    with barrierguard.watch(engine="cuda", policy="record", memory=False) as guard:
        for _ in range(2):
            seen: list[Any] = [None]
            dist.all_gather_object(seen, 1)  # L-read-quiet
            x.item()  # L-read-outside
    assert {(s.line, s.kind, s.count) for s in guard.report.sites if s.file == HERE} == {
        (_line("# L-read-quiet"), "collective", 2),
        (_line("# L-read-outside"), "item", 2),
    }
    # Quiet inside, counted among the quiet threads; neither once out.
    assert inside == [(1, True), (1, True)]
    assert distributed._quiet_threads == 0 and not distributed.quiet()


def test_nothing_is_recorded_outside_a_guard(group: None) -> None:
    before = dist.barrier
    with barrierguard.watch(engine="audit", policy="record", memory=False):
        assert dist.barrier is not before
        assert distributed_c10d.barrier is dist.barrier
    assert dist.barrier is before


def test_policy_error_raises_at_the_barrier(group: None) -> None:
    guard = barrierguard.watch(engine="audit", policy="error", memory=False)
    with pytest.raises(barrierguard.SyncError, match="collective"), guard:
        for _ in range(2):
            guard.step()
            dist.barrier()
