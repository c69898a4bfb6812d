"""Memory growth on a real GPU, judged on device memory, with no sync added.

Every loop runs under ``torch.cuda.set_sync_debug_mode("error")``: any
synchronization, the loops' own or one added by the memory sampler (allocator
stats, NVML, the cause finder), would raise. The guard uses ``engine="audit"``
so that the CUDA engine does not switch the mode to "warn" for its own use.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import barrierguard
from _runif import run_if

pytestmark = run_if(min_cuda_gpus=1)

WIDTH = 1024  # one [WIDTH, WIDTH] float32 activation is 4 MB


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)
    ).cuda()


def _run(
    body: Callable[[int, torch.Tensor], None],
    steps: int = 30,
    every: int | None = 1,
    threshold: str = "1MB",
) -> barrierguard.Report:
    x = torch.randn(WIDTH, WIDTH, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    # From here on any synchronization raises: the loop's, or one of barrierguard's.
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # warm-up outside the guard: cuBLAS handles, kernels, allocator
            body(0, x)
        with barrierguard.watch(
            policy="record",
            engine="audit",
            memory_every=every,
            warmup_steps=2,
            max_growth_per_step=threshold,
        ) as guard:
            for step in range(1, steps + 1):
                body(step, x)
                guard.step()
        report = guard.report  # the verdict and the cause finder run here, still in "error"
    finally:
        torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    print(report)
    assert not report.notes or all("internal error" not in n for n in report.notes), report.notes
    return report


def test_accumulated_loss_leaks_on_the_device() -> None:
    model = _model()
    state: dict[str, torch.Tensor | float] = {"total_loss": 0.0}

    def body(step: int, x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        state["total_loss"] += loss  # keeps every graph alive

    report = _run(body)
    memory = report.memory
    assert memory is not None and memory.leak, memory
    assert "device_allocated" in memory.growing
    assert memory.slopes["device_allocated"] > 4_000_000
    assert memory.pattern == "accumulated_graph", memory.evidence


def test_detached_loss_does_not_leak() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    total = torch.zeros((), device="cuda")

    def body(step: int, x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total.add_(loss.detach())

    report = _run(body)
    memory = report.memory
    assert memory is not None and not memory.leak, memory.reason
    assert abs(memory.slopes["device_allocated"]) < 100_000


def test_one_buffer_at_step_3_is_a_step_change() -> None:
    model = _model()
    kept: list[torch.Tensor] = []

    def body(step: int, x: torch.Tensor) -> None:
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        if step == 3:
            kept.append(torch.ones(64 * 2**20, device="cuda"))  # 256 MB, once

    report = _run(body)
    memory = report.memory
    assert memory is not None and not memory.leak, memory.reason
    jumps = dict(memory.step_changes.get("device_allocated", ()))
    assert jumps.get(3, 0) >= 256 * 2**20, memory.step_changes


@pytest.mark.parametrize(
    ("every", "steps", "rows", "threshold"),
    [
        (1, 30, WIDTH, "1MB"),  # 4 MiB a step, sampled every step
        # Adaptive sampling on a fast step samples sparsely (every 256 steps at
        # most): a longer run, 1 MiB a step.
        (None, 4000, WIDTH // 4, "256KB"),
    ],
)
def test_list_of_cuda_tensors_leaks(
    every: int | None, steps: int, rows: int, threshold: str
) -> None:
    model = _model()
    outputs: list[torch.Tensor] = []

    def body(step: int, x: torch.Tensor) -> None:
        with torch.no_grad():
            outputs.append(model(x[:rows]))  # rows x WIDTH floats a step, never released

    report = _run(body, steps=steps, every=every, threshold=threshold)
    memory = report.memory
    assert memory is not None and memory.leak, memory
    if every is None:
        assert memory.sampling.startswith("adaptive"), memory.sampling
    assert "device_allocated" in memory.growing
    assert memory.slopes["device_allocated"] == pytest.approx(rows * WIDTH * 4, rel=0.05)
    assert memory.pattern == "tensor_list", memory.evidence
    assert "`outputs`" in memory.evidence and "cuda:0" in memory.evidence


def test_device_series_and_notes() -> None:
    model = _model()

    def body(step: int, x: torch.Tensor) -> None:
        model(x)

    report = _run(body, steps=5)
    memory = report.memory
    assert memory is not None
    assert {"host_rss", "device_allocated", "device_reserved"} <= set(memory.series)
    assert all(v is not None and v > 0 for v in memory.series["device_allocated"])
    if "device_used" not in memory.series:
        # The report says why, once.
        assert sum("device_used" in n for n in memory.notes) == 1, memory.notes
