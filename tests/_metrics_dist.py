"""Shared by the distributed MetricBuffer tests: the data, one worker, and the launcher.

Kept in its own module (like ``_runif``) so spawned processes can import the worker
by name, and so the gloo (CPU) and NCCL (GPU) tests feed exactly the same data.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from _spawn import free_port, spawn
from barrierguard import MetricBuffer

SPECS: dict[str, Any] = {
    "loss": ("mean", "weighted"),
    "acc": "mean",
    "tokens": ("sum", "weighted"),
    "total": "sum",
    "samples": ("count", "weighted"),
    "steps": "count",
    "best": "min",
    "worst": "max",
    "lr": "last",
    "rare": "max",  # logged by the first half of the data only: one rank never sees it
    "per_sample": "cat",
}
STEPS = 40


def step_values(i: int) -> tuple[dict[str, Any], int]:
    """Values of step ``i``: deterministic, a mix of floats, ints and non-finite ones."""
    gen = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(6, generator=gen, dtype=torch.float64)
    values: dict[str, Any] = {
        "loss": float(x[0]) + 2.0,
        "acc": float(x[1] > 0),
        "tokens": float(x[2]) * 100,
        "total": float(x[3]),
        "samples": 1.0,
        "steps": 1.0,
        "best": float(x[4]),
        "worst": float(x[5]),
        "lr": 0.1 / (i + 1),
    }
    if i == 5:
        values["loss"] = math.nan  # exercises nan="ignore"
    if i == 33:
        values["worst"] = math.inf
    if i < STEPS // 2:
        values["rare"] = float(i)
    return values, 1 + i % 5


def log_steps(buf: MetricBuffer, steps: range, device: torch.device) -> None:
    for i in steps:
        values, n = step_values(i)
        # Tensors on even steps, Python numbers on odd ones; a device weight every third.
        logged: dict[str, Any] = {
            k: torch.tensor(v, dtype=torch.float64).to(device) if i % 2 == 0 else v
            for k, v in values.items()
        }
        weight: Any = torch.tensor(n).to(device) if i % 3 == 0 else n
        logged["per_sample"] = torch.full((2,), float(i), device=device)
        buf.update(**logged, n=weight)


def reference(device: torch.device) -> dict[str, Any]:
    """One process over all the data, no torch.distributed."""
    buf = MetricBuffer(SPECS, nan="ignore")
    log_steps(buf, range(STEPS), device)
    return _jsonable(buf.compute())


def _jsonable(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu().tolist() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


def worker(rank: int, world: int, port: int, out: str, backend: str) -> None:
    """One rank: log its contiguous share of the steps, compute, rank 0 writes JSON."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    torch.distributed.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        buf = MetricBuffer(SPECS, nan="ignore")
        share = STEPS // world
        log_steps(buf, range(rank * share, (rank + 1) * share), device)
        result = _jsonable(buf.compute())
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


def run_world(world: int, backend: str, out: Path, timeout_s: float = 120.0) -> dict[str, Any]:
    """Spawn ``world`` ranks, wait for them (killing them past ``timeout_s``), read rank 0."""
    args = (world, free_port(), str(out), backend)
    spawn(worker, args, world, timeout_s=timeout_s, what=f"{world} {backend} ranks")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def assert_same(got: dict[str, Any], want: dict[str, Any], world: int) -> None:
    """Running reductions equal to 1e-9; ``cat`` is local, so rank 0 holds its share only."""
    assert set(got) == set(want)
    for name, value in want.items():
        if name == "per_sample":
            share = len(value) // world
            assert got[name] == value[:share]
        elif isinstance(value, float) and math.isnan(value):
            assert math.isnan(got[name]), name
        else:
            assert math.isclose(got[name], value, rel_tol=1e-9, abs_tol=1e-9), (name, got, want)
