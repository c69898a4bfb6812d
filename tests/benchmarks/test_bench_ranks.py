"""The distributed benchmark runs on CPU (smoke tests, no timing claims): bench_ranks.py
under torchrun with 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def test_ranks_runs_under_torchrun_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    argv = ["--device", "cpu", "--steps", "4", "--warmup", "1", "--repeats", "1"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(BENCH / "bench_ranks.py"),
            *argv,
            "--configs",
            "1x1",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing is marked measured" in proc.stdout
    data = json.loads((tmp_path / "ranks.json").read_text())
    (result,) = data["results"]
    assert result["names_the_line_on_rank_0_only"]
    assert result["fired_on"] == [0] and result["asymmetric"]
    assert result["measured"] is False and result["ratio"] is None
    assert result["gating_site_without_the_line"] == []
    reports = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert reports == [
        "1x1_with0.merged.json",
        "1x1_with0.rank0.json",
        "1x1_with0.rank1.json",
        "1x1_without0.merged.json",
        "1x1_without0.rank0.json",
        "1x1_without0.rank1.json",
    ]


def test_ranks_refuses_to_run_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delenv("RANK", raising=False)
    import bench_ranks

    with pytest.raises(SystemExit, match="launch it with torchrun"):
        bench_ranks.main(["--out", "x"])


def test_ranks_compares_the_estimate_with_the_measured_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_ranks

    line = bench_ranks.log_line()

    def run(step0: float, step1: float, cost: float | None) -> dict[str, object]:
        gate = None
        if cost is not None:
            gate = {
                "location": f"bench_ranks.py:{line}",
                "line": line,
                "kind": "item",
                "code": "x",
                "ranks": [0],
                "asymmetric": True,
                "job_cost_s": cost,
                "stall_per_step_s": {0: cost},
            }
        return {"step_s": [step0, step1], "report": {"gating": gate, "wait_s": {1: cost}}}

    runs = {
        "with": [run(0.0135, 0.0134, 0.0050), run(0.0136, 0.0135, 0.0048)],
        "without": [run(0.0085, 0.0085, None), run(0.0086, 0.0086, None)],
    }
    got = bench_ranks.summarize("8x5", runs, measured=True)
    assert got["names_the_line_on_rank_0_only"] and got["gating_site_without_the_line"] == []
    assert got["estimated_cost_to_rank1_s"] == pytest.approx(0.0049)
    assert got["rank1_difference_s"] == pytest.approx(0.01345 - 0.00855)
    assert got["ratio"] == pytest.approx(1.0)
    assert got["within_tolerance"] is True
