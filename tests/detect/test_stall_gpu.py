"""Stall, run-ahead and the predicted saving, against kernels of known length."""

from __future__ import annotations

import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import barrierguard
from _runif import run_if

pytestmark = run_if(min_cuda_gpus=1)


@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        samples.append(20_000_000 / start.elapsed_time(end))
    return statistics.median(samples)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


OPS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda x: x.sum().item(),
    "cpu": lambda x: x.cpu(),
    "print": lambda x: print(x[:2], file=io.StringIO()),
    "where": lambda x: torch.where(x > 0),
    "tensor": lambda x: torch.tensor([x[0], x[1]]),
}


@pytest.mark.parametrize("ms", [5, 20, 50])
@pytest.mark.parametrize("op", list(OPS))
def test_stall_matches_the_kernel(op: str, ms: int, cycles_per_ms: float) -> None:
    x = torch.randn(1024, device="cuda")
    OPS[op](x)
    torch.cuda.synchronize()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        OPS[op](x)  # setup: where and tensor are timed from their second sync on
        guard.step()
        torch.cuda._sleep(int(ms * cycles_per_ms))
        OPS[op](x)
        guard.step()  # closes the measured step
    sites = [s for s in guard.report.sites if s.step_count and s.file == __file__]
    assert all(s.stall_count == s.step_count for s in sites), sites
    stall = sum(s.stall_s or 0.0 for s in sites)
    expected = ms / 1e3
    assert abs(stall - expected) <= max(0.10 * expected, 0.2e-3), (op, ms, stall, sites)


def test_stalls_add_up_to_what_the_syncs_cost(cycles_per_ms: float) -> None:
    x = torch.randn(1024, device="cuda")
    one_ms = int(cycles_per_ms)

    def loop(sync: bool, n: int = 40) -> None:
        for _ in range(n):
            _busy(0.003)  # host preparation
            torch.cuda._sleep(one_ms)
            if sync:
                x.sum().item()
            torch.cuda._sleep(one_ms)
            if sync:
                x.cpu()

    loop(True, 3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loop(False)
    torch.cuda.synchronize()
    without = time.perf_counter() - t0
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        t0 = time.perf_counter()
        loop(True)
        guard.step()  # closes the measured step
        torch.cuda.synchronize()
        with_syncs = time.perf_counter() - t0
    stalls = sum(s.stall_s or 0.0 for s in guard.report.sites if s.kind in ("item", "copy"))
    assert abs(stalls - (with_syncs - without)) <= 0.15 * (with_syncs - without), (
        stalls,
        with_syncs,
        without,
    )


def _steps(sync: bool, cycles: int, n: int = 30, host: float = 0.0) -> barrierguard.Report:
    x = torch.randn(1024, device="cuda")
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        for _ in range(n):
            if host:
                _busy(host)
            torch.cuda._sleep(cycles)
            y = x * 2
            if sync:
                y.sum().item()
            guard.step()
        torch.cuda.synchronize()
    return guard.report


def test_run_ahead(cycles_per_ms: float) -> None:
    serial = _steps(True, int(2 * cycles_per_ms)).timeline
    free = _steps(False, int(2 * cycles_per_ms)).timeline
    assert serial is not None and free is not None
    assert statistics.median(serial.ahead) == 0
    assert serial.serialized and "serialized" in serial.summary
    assert statistics.median(free.ahead) >= 1
    assert any(d is not None for d in free.device_s)


def test_predicted_saving_matches_the_measured_speedup(cycles_per_ms: float) -> None:
    # Seed 004's case: host preparation as long as device compute.
    cycles, host, n = int(2 * cycles_per_ms), 0.002, 40
    _steps(False, cycles, 3, host)
    t0 = time.perf_counter()
    synced = _steps(True, cycles, n, host)
    t_sync = time.perf_counter() - t0
    t0 = time.perf_counter()
    _steps(False, cycles, n, host)
    t_free = time.perf_counter() - t0
    assert synced.timeline is not None
    measured = t_sync - t_free
    predicted = synced.timeline.saving_s * n / len(synced.timeline.steps)
    assert abs(predicted - measured) <= 0.20 * measured, (predicted, measured)


def test_timing_adds_no_sync() -> None:
    x = torch.randn(1024, device="cuda")
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(50):
                y = x * 2
                del y
                guard.step()
        finally:
            torch.cuda.set_sync_debug_mode("warn")
    assert guard.report.timeline is not None
    # The first window: the steps that end inside it (the start is its first boundary),
    # less the interval up to the first boundary, which was counted as step 0 (setup).
    from barrierguard.session.timeline import WINDOW

    assert len(guard.report.timeline.steps) == WINDOW - 2


def test_print_behind_a_5ms_kernel_is_one_occurrence_with_the_whole_wait(
    cycles_per_ms: float,
) -> None:
    x = torch.randn(1024, device="cuda")
    print(x[:4], file=io.StringIO())
    torch.cuda.synchronize()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        torch.cuda._sleep(int(5 * cycles_per_ms))
        print(x[:4], file=io.StringIO())  # PRINT-SITE: torch syncs several times inside
        guard.step()  # a step follows: the print was in the loop
    (site,) = [s for s in guard.report.sites if s.step_count and s.file == __file__]
    assert site.kind == "print" and site.count == 1 and site.step_count == 1
    assert site.events > 1  # the raw sync events of the mode, kept apart
    assert site.stall_count == 1 and site.stall_s is not None
    assert abs(site.stall_s - 5e-3) <= 0.10 * 5e-3, site
