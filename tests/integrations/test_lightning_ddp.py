"""A 2-process DDP fit on CPU (gloo): rank 0 merges both ranks' reports, and each rank
writes its own, which merge offline into the same report."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.spawn import ProcessExitedException

import barrierguard
from _gate_helpers import barrierguard_cli
from barrierguard import Report
from barrierguard.cli.gate import merge_files

pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def test_ddp_spawn_fit_merges_both_ranks(tmp_path: Path) -> None:
    from _lightning_helpers import fit

    out = tmp_path / "merged.json"
    cb = barrierguard.BarrierGuard(
        policy="record",
        print_report=False,
        save_report=str(out),
        rank_reports=str(tmp_path / "ranks" / "bg-{rank}.json"),
    )
    try:
        fit(tmp_path, [cb], strategy="ddp_spawn", devices=2, max_epochs=1, deterministic=False)
    except ProcessExitedException as exc:
        # Seen once in about 20 runs: a spawned rank aborts while its
        # interpreter exits ("terminate called without an active exception",
        # from a C++ thread of torch.distributed), after the fit and the merge
        # are done. The merged report is what this test checks.
        if "SIGABRT" not in str(exc) or not out.exists():
            raise
        warnings.warn(f"a spawned rank aborted at exit after the fit: {exc}", stacklevel=1)
    report = Report.load(out)
    assert len(report.ranks) == 2
    # 64 samples, batch 16, split over 2 ranks: 2 training batches per rank.
    assert [r.steps for r in report.ranks] == [2, 2]
    assert report.steps == 2
    transfer = [s for s in report.sites if any(m.startswith("prog_bar") for m, _ in s.mechanisms)]
    assert transfer, "the prog_bar conversion was not found"
    for site in transfer:
        ranks = dict(site.rank_counts)
        assert set(ranks) == {0, 1} and all(n > 0 for n in ranks.values())
        assert site.count == sum(ranks.values())
    assert all(r.memory is not None for r in report.ranks)  # memory per rank
    assert any("merged from 2 ranks" in n for n in report.notes)
    # Every rank also wrote its own file; merged offline, they give the same report.
    files = [str(tmp_path / "ranks" / f"bg-{r}.json") for r in (1, 0)]
    assert merge_files(files) == report


# A Lightning fit whose DDP launcher re-executes this script for rank 1.
DDP_SCRIPT = """\
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
"""


def test_run_follows_the_ranks_that_lightning_relaunches(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = barrierguard_cli(
        "run", "--policy", "record", "--out", str(out), str(script), cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.glob("r.*.json"))
    assert files == ["r.rank0.json", "r.rank1.json"], proc.stderr[-3000:]
    assert "2 of 2 rank reports written" in proc.stderr
    merged = merge_files([str(tmp_path / name) for name in files])
    # 24 samples, batch 4, split over 2 ranks: 3 training batches per rank.
    assert [(r.rank, r.steps) for r in merged.ranks] == [(0, 3), (1, 3)]
    assert [s.rank for s in merged.rank_summaries] == [0, 1]
    assert not os.environ.get("BARRIERGUARD_FOLLOW")
