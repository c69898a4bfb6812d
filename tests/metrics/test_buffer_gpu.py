"""MetricBuffer on CUDA: no sync in 1124 logged steps, one transfer in compute(), NCCL ranks."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from _metrics_dist import assert_same, reference, run_world
from _runif import run_if
from barrierguard import MetricBuffer
from barrierguard.metrics.buffer import BLOCK_STEPS

SPECS: dict[str, Any] = {
    "loss": ("mean", "weighted"),
    "acc": ("mean", "weighted"),
    "ppl": "mean",
    "tokens": ("sum", "weighted"),
    "grad_norm": "max",
    "loss_min": "min",
    "scale": "last",
    "steps": "count",
}
NAMES = tuple(SPECS)
STEPS = BLOCK_STEPS + 100  # folds inside the loop, and one in compute()
SYNC_MESSAGE = "called a synchronizing CUDA operation"


def _reference(name: str, xs: list[float], ws: list[float]) -> float:
    red, weighted = (SPECS[name], False) if isinstance(SPECS[name], str) else (SPECS[name][0], True)
    w = ws if weighted else [1.0] * len(xs)
    if red == "mean":
        return sum(a * b for a, b in zip(xs, w, strict=True)) / sum(w)
    if red == "sum":
        return sum(a * b for a, b in zip(xs, w, strict=True))
    if red == "count":
        return sum(w)
    return {"min": min, "max": max}[red](xs) if red in ("min", "max") else xs[-1]


def _weight(i: int) -> float:
    """Step ``i``'s weight: 8.0 is logged as a device tensor, the others as Python numbers."""
    kind = (i // 100) % 3
    return 8.0 if kind == 0 else 32.0 if kind == 1 else 16.0 + i % 3


@run_if(min_cuda_gpus=1)
@pytest.mark.parametrize("nan", ["propagate", "ignore", "error"])
def test_steps_of_8_metrics_never_sync_and_compute_transfers_once(nan: str) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    # Made before sync-debug mode is on: creating them is not what is under test.
    base = torch.randn(STEPS, len(NAMES), device=device, generator=gen)
    weight_tensor = torch.full((), 8, device=device, dtype=torch.long)
    buf = MetricBuffer(SPECS, nan=nan)
    side = MetricBuffer({"lr": "last", "per_step": "cat"}, nan=nan)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(STEPS):
            # Views into base, and into a row of its own: copied when logged either way.
            row = base[i] if i % 3 else base[i].clone()
            values = dict(zip(NAMES, row.unbind(0), strict=True))
            # Python weights in some blocks of steps, a device weight in the others
            # (a change of kind folds the rows in), and varying Python weights.
            w = _weight(i)
            buf.update(**values, n=weight_tensor if w == 8.0 else w)
            side.update(lr=0.1 / (i + 1), per_step=row)  # slow path: a number and a cat
    finally:
        torch.cuda.set_sync_debug_mode(previous)

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = buf.compute()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if SYNC_MESSAGE in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in caught]

    table = base.double().cpu().tolist()
    ws = [_weight(i) for i in range(STEPS)]
    for j, name in enumerate(NAMES):
        want = _reference(name, [r[j] for r in table], ws)
        assert math.isclose(out[name], want, rel_tol=1e-9, abs_tol=1e-9), (name, out[name], want)
    side_out = side.compute()
    assert side_out["lr"] == 0.1 / STEPS
    assert side_out["per_step"].device == device
    assert torch.equal(side_out["per_step"], base.reshape(-1))


@run_if(min_cuda_gpus=2)
def test_two_nccl_ranks_match_one_process(tmp_path: Path) -> None:
    want = reference(torch.device("cpu"))
    got = run_world(2, "nccl", tmp_path / "rank0.json", timeout_s=180.0)
    assert_same(got, want, world=2)


@run_if(min_cuda_gpus=1)
def test_integer_counts_beside_a_bfloat16_loss_stay_exact_without_a_sync() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    loss = torch.full((), 0.5, device=device, dtype=torch.bfloat16)
    tokens = torch.full((), 3001, device=device, dtype=torch.long)
    buf = MetricBuffer({"loss": "mean", "tokens": "sum"})
    steps = 2 * BLOCK_STEPS + 88  # two folds inside the loop, and one in compute()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            buf.update(loss=loss, tokens=tokens)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert buf.compute() == {"loss": 0.5, "tokens": 3001.0 * steps}
