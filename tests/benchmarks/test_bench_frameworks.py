"""Smoke test of bench_frameworks.py: the in-process cases run on CPU (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
