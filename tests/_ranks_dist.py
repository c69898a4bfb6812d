"""A 2-rank gloo job on CPU for the distributed tests: the worker and its launcher.

Kept in its own module (like ``_metrics_dist``) so spawned processes import the
worker by name. Each rank trains a few steps with a ``dist.barrier()`` and an
``all_gather_object`` at its own lines, and rank 0 alone reads the loss and
synchronizes (the rank-asymmetric lines); every rank saves its report with
``watch(out=...)``, and rank 0 also merges them in process.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import barrierguard
from _spawn import free_port, spawn

STEPS = 4
SYNC_WAIT_S = 0.05  # what rank 0's synchronize() 'waits' for its device
HERE = __file__


def line(marker: str) -> int:
    """The line of this file that ends with ``marker``."""
    with open(HERE) as fh:
        for i, text in enumerate(fh, 1):
            if text.rstrip().endswith(marker) and "line(" not in text:
                return i
    raise AssertionError(marker)


def _fake_cuda() -> Any:
    """Run the CUDA engine on this CPU process (what the ``fake_cuda`` fixture does)."""
    from _fake_cuda import FakeMode, InstantEvent, _registered
    from barrierguard import _env
    from barrierguard.detect import cuda as cuda_engine
    from barrierguard.session import guard as guard_module
    from barrierguard.session.timeline import StepTimeline

    mode = FakeMode()
    _env.cuda_available = lambda: True  # type: ignore[assignment]
    cuda_engine._get_mode = mode.get
    cuda_engine._set_mode = mode.set
    cuda_engine._on_device = lambda tensor: True
    guard_module._make_timeline = lambda: StepTimeline(make_event=InstantEvent)
    return _registered()


def _train(rank: int, out: str, engine: str) -> barrierguard.Report:
    torch.manual_seed(0)
    device = torch.device("cpu")  # the device-agnostic script's device
    model = torch.nn.Linear(8, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = barrierguard.watch(
        policy="record", engine=engine, memory=False, out=os.path.join(out, "bg.json")
    )
    # Both ranks enter the watched loop together, so a late start of one
    # process is not charged to the other's first barrier.
    dist.barrier()
    guard.start()
    try:
        for step in range(STEPS):
            loss = model(torch.randn(4, 8, device=device)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            dist.barrier()  # L-barrier
            seen: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(seen, {"rank": rank, "step": step})  # L-object
            if rank == 0:
                loss.item()  # L-item
                torch.cuda.synchronize()  # L-sync
    finally:
        report = guard.stop()
    return report


def worker(rank: int, world: int, port: int, out: str, engine: str) -> None:
    """One rank: train, save its report (watch(out=...)), rank 0 merges in process."""
    from barrierguard.session import rank_reports

    # The audit never calls the real synchronize; the CUDA engine times this one.
    torch.cuda.synchronize = lambda device=None: time.sleep(SYNC_WAIT_S)  # type: ignore[assignment]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        if engine == "cuda":
            with _fake_cuda():
                report = _train(rank, out, engine)
        else:
            report = _train(rank, out, engine)
        merged = rank_reports.merge(report)
        if merged is not None:
            merged.save(os.path.join(out, "merged.json"))
    finally:
        dist.destroy_process_group()


def run_world(out: Path, engine: str, world: int = 2, timeout_s: float = 120.0) -> None:
    """Spawn ``world`` gloo ranks of :func:`worker` writing under ``out``; wait for them."""

    def done() -> bool:
        return (out / "merged.json").exists() and len(list(out.glob("bg.rank*.json"))) == world

    args = (world, free_port(), str(out), engine)
    spawn(worker, args, world, timeout_s=timeout_s, what=f"{world} gloo ranks", done=done)
