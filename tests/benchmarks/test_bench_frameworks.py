"""Smoke test of bench_frameworks.py: the in-process cases run on CPU (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from barrierguard import Report, Site
from barrierguard.report.records import Timeline

ROOT = Path(__file__).resolve().parents[2]


def test_loop_cases_run_and_find_their_syncs(tmp_path: Path) -> None:
    out = tmp_path / "frameworks.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_frameworks.py"),
        "--smoke",
        "--cases",
        "torchmetrics",
        "clip_grad",
        "--rounds",
        "1",
        "--loop-steps",
        "3",
        "--out",
        str(out),
    ]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    cases = json.loads(out.read_text())["cases"]
    assert cases["torchmetrics"]["removed"] == ["nan_check"]
    assert cases["clip_grad"]["removed"] == ["clip_grad_nonfinite"]
    assert cases["torchmetrics"]["syncs_per_step_after"] == {}
    assert "| case " in proc.stdout
    assert cases["torchmetrics"]["predicted_saving_ms"] is None  # the audit times nothing
    assert cases["torchmetrics"]["stall_ms"] == 0.0
    # The loops' host reads, timed without barrierguard: the default has 8 NaN checks more.
    tm = cases["torchmetrics"]
    assert tm["reads_ms_before"] > tm["reads_ms_after"] >= 0.0
    assert tm["saving_besides_reads_ms"] == pytest.approx(
        tm["measured_saving_ms"] - (tm["reads_ms_before"] - tm["reads_ms_after"])
    )
    assert "saved besides reads ms" in proc.stdout


def test_timed_reads_times_the_outer_read_and_restores_the_methods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_frameworks
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in bench_frameworks.READS}
    spent: list[float] = []
    t = torch.tensor([1.5])
    with pytest.raises(ZeroDivisionError), bench_frameworks.timed_reads(spent):
        assert f"{t.item():.1f}" == "1.5"
        assert bool(t) and float(t) == 1.5
        format(t.sum(), ".1f")  # __format__ is not wrapped: its item() inside is the read
        raise ZeroDivisionError
    assert len(spent) == 4 and all(s >= 0.0 for s in spent)
    for name, orig in originals.items():
        assert getattr(torch.Tensor, name) is orig
    assert "cpu" not in vars(torch.Tensor)  # inherited from the C base, and still only there


def _site(kind: str, mechanism: str, stall: float) -> Site:
    return Site(
        file="train.py",
        line=1,
        function="main",
        code="",
        kind=kind,
        origin="user",
        count=10,
        step_count=10,
        stall_s=stall,
        mechanisms=((mechanism, 10),),
    )


def test_the_prediction_is_the_timelines_saving_shared_by_stall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_frameworks

    report = Report(
        engine="cuda",
        detection=True,
        policy="record",
        sites=(_site("bool", "loss_nan_filter", 0.003), _site("item", "hf_logging", 0.001)),
        timeline=Timeline(steps=(1, 2, 3, 4), saving_s=0.008),
    )
    # 2 ms saving per timed step; the removed site holds 3/4 of the stall.
    got = bench_frameworks._report_saving_ms(report, {"loss_nan_filter"})
    assert got == pytest.approx(1.5)
    assert bench_frameworks._report_saving_ms(report, {"nothing"}) == 0.0
    assert bench_frameworks._stall_ms(report, {"loss_nan_filter"}) == pytest.approx(
        3.0
    )  # per measured step: none here
    no_timeline = Report(engine="audit", detection=True, policy="record")
    assert bench_frameworks._report_saving_ms(no_timeline, {"loss_nan_filter"}) is None
