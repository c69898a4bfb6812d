"""Real training loops on CPU, judged on the process's real RSS.

Each retained step holds several megabytes (activations saved for backward),
far above RSS noise and the 1 MB default threshold, so the verdicts do not
depend on allocator luck.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import barrierguard

STEPS = 30
WIDTH = 512


def _loop(kind: str) -> barrierguard.Report:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)
    )
    total_loss: torch.Tensor | float = 0.0
    buffer = None
    with barrierguard.watch(policy="record", memory_every=1, warmup_steps=2) as guard:
        for step in range(1, STEPS + 1):
            x = torch.randn(WIDTH, WIDTH)
            loss = model(x).square().mean()
            if kind == "leak":
                # Backward on a running total that is never detached (gradient
                # accumulation gone wrong): every step's graph and saved
                # activations stay alive through it.
                total_loss += loss
            elif kind == "detach":
                total_loss += loss.detach()
            else:
                loss.backward()
                model.zero_grad(set_to_none=True)
                if step == 3:
                    buffer = torch.ones(16_000_000)  # 64 MB, once, in step 3
            guard.step()
        del buffer
    return guard.report


def _loop_in_fresh_process(kind: str, tmp_path: Path) -> barrierguard.Report:
    # RSS is the whole process's: run the loop where no other test's threads,
    # caches or garbage can move it.
    out = tmp_path / "report.json"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_memory_loops as m; "
        "m._loop(sys.argv[2]).save(sys.argv[3])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), kind, str(out)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return barrierguard.Report.load(out)


@pytest.mark.parametrize(("kind", "leak"), [("leak", True), ("detach", False), ("buffer", False)])
def test_rss_verdict(kind: str, leak: bool, tmp_path: Path) -> None:
    report = _loop_in_fresh_process(kind, tmp_path)
    memory = report.memory
    assert memory is not None, report
    print(report)
    assert memory.leak is leak, memory.reason
    if leak:
        assert memory.growing == ("host_rss",)
        assert memory.slopes["host_rss"] > 2_000_000
        assert memory.pattern == "accumulated_graph"
        assert "`total_loss`" in memory.evidence
    else:
        assert memory.pattern is None
    if kind == "buffer":
        jumps = dict(memory.step_changes.get("host_rss", ()))
        assert jumps.get(3, 0) > 50_000_000, memory.step_changes
