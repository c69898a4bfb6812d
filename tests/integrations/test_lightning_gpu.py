"""The Lightning callback on real GPUs: the pinned-memory advice, and a 2-GPU DDP merge.

Run on a GPU machine:
    PYTHONPATH=src python -m pytest -q -s tests/integrations/test_lightning_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import barrierguard
from _runif import run_if
from barrierguard import Report

pl = pytest.importorskip("lightning.pytorch")

# 128 x 8192 float32 = 4 MiB per batch: above the 2 MiB under which a pageable
# non_blocking copy does not make the host wait (PAGEABLE_BLOCKING_BYTES).
WIDTH = 8192
BATCH = 128


def _fit(tmp_path: Path, pin_memory: bool) -> Report:
    from _lightning_helpers import TinyModule, loaders, trainer

    cb = barrierguard.BarrierGuard(engine="cuda", policy="record", save_report=False)
    train, _ = loaders(width=WIDTH, n=8 * BATCH, batch=BATCH, pin_memory=pin_memory)
    pl.seed_everything(0, verbose=False)
    t = trainer(tmp_path, [cb], accelerator="gpu", devices=1, max_epochs=1, deterministic=False)
    t.fit(TinyModule(width=WIDTH), train)
    return cb.report


def _batch_copies(report: Report) -> list[barrierguard.Site]:
    return [
        s
        for s in report.sites
        if s.kind == "copy" and any(m.startswith("batch_transfer") for m, _ in s.mechanisms)
    ]


@run_if(min_cuda_gpus=1)
def test_default_dataloader_gets_the_pin_memory_advice(tmp_path: Path) -> None:
    report = _fit(tmp_path, pin_memory=False)
    copies = _batch_copies(report)
    assert copies, f"no batch copy found:\n{report}"
    assert sum(s.count for s in copies) >= 8  # one 4 MiB input per batch
    assert all("pin_memory=True" in s.fix for s in copies)
    assert report.steps == 8


@run_if(min_cuda_gpus=1)
def test_pinned_dataloader_has_no_batch_copy_sync(tmp_path: Path) -> None:
    report = _fit(tmp_path, pin_memory=True)
    assert not _batch_copies(report), str(report)
    assert report.steps == 8


@run_if(min_cuda_gpus=2)
def test_two_gpu_ddp_fit_gives_a_merged_report(tmp_path: Path) -> None:
    from _lightning_helpers import fit

    out = tmp_path / "merged.json"
    cb = barrierguard.BarrierGuard(engine="cuda", policy="record", save_report=str(out))
    fit(
        tmp_path,
        [cb],
        accelerator="gpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        deterministic=False,
    )
    report = Report.load(out)
    print(report)
    assert len(report.ranks) == 2
    assert [r.steps for r in report.ranks] == [2, 2]
    assert all(r.engine == "cuda" for r in report.ranks)
    assert any({r for r, _ in s.rank_counts} == {0, 1} for s in report.sites)
