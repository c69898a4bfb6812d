"""Allow rules where the code is, on a real GPU under the CUDA engine."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import barrierguard
from _runif import run_if

pytestmark = run_if(min_cuda_gpus=1)


def test_inline_and_scoped_allow_on_the_gpu() -> None:
    x = torch.ones(64, device="cuda")
    x.sum().item()  # warm-up: lazy init outside the guard
    torch.cuda.synchronize()
    with barrierguard.watch(engine="cuda", policy="error") as guard:
        guard.step()
        for _ in range(3):
            y = (x * 2).sum()
            y.item()  # barrierguard: allow[BG101]
            with barrierguard.allowed("item", first_only=True):
                float(y.item())
            guard.step()
    report = guard.report
    assert report.engine == "cuda"
    assert report.violations == ()
    items = [s for s in report.sites if s.kind == "item"]
    assert len(items) == 2
    assert sum(s.allowed for s in items) == 1  # the inline one; the block admits per occurrence
    assert all(s.rule == "BG101" for s in items)
