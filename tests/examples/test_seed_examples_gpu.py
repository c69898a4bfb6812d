"""The seed examples on a real GPU under the CUDA engine (small sizes, a few seconds).

PYTHONPATH=src python -m pytest -q tests/examples/test_seed_examples_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

import barrierguard
from _examples_helpers import line_of, load_example, run_example
from _runif import run_if

pytestmark = run_if(min_cuda_gpus=1)

COMMON = ["--device", "cuda", "--engine", "cuda", "--repeats", "2", "--watch-steps", "4"]


def _flagged(report: barrierguard.Report, name: str) -> set[tuple[int, str]]:
    """(line, kind) of the example file's sites in measured steps that are not allowed."""
    return {
        (s.line, s.kind)
        for s in report.sites
        if s.step_count > 0 and not s.allowed and Path(s.file).name == f"{name}.py"
    }


CASES = [
    (
        "async_vs_sync",
        ["--steps", "50", "--size", "64", "--matmul-size", "256", "--matmuls", "4"],
        "sync",
        [("torch.cuda.synchronize()  # the host waits", "synchronize")],
        "async",
    ),
    (
        "logging_item_vs_buffer",
        ["--steps", "10", "--width", "256", "--layers", "2", "--batch", "64"],
        "item",
        [("losses.append(loss.item())", "item")],
        "buffer",
    ),
    (
        "pageable_vs_pinned",
        ["--steps", "6", "--batch", "256", "--width", "256", "--layers", "1"],
        "pageable",
        [("x = x.to(self.device)  #", "copy"), ("y = y.to(self.device)", "copy")],
        "pinned",
    ),
]


@pytest.mark.parametrize(
    ("name", "argv", "bad", "expected", "good"), CASES, ids=[c[0] for c in CASES]
)
def test_seed_example_on_gpu(
    name: str,
    argv: list[str],
    bad: str,
    expected: list[tuple[str, str]],
    good: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    reports = load_example(name, monkeypatch, "seed_gpu").main(
        [*COMMON, *argv, "--report-dir", str(tmp_path)]
    )
    want = {(line_of(name, text), kind) for text, kind in expected}
    assert reports[bad].engine == "cuda"
    assert want <= _flagged(reports[bad], name), reports[bad]
    # The fixed variant has none of those lines (pinning inside the DataLoader is
    # the library's business; the copies themselves must not block).
    assert not want & _flagged(reports[good], name), reports[good]
    if name != "pageable_vs_pinned":
        assert _flagged(reports[good], name) == set(), reports[good]


def test_memory_pileup_on_gpu(tmp_path: Path) -> None:
    proc = run_example(
        "memory_pileup",
        [
            "--device",
            "cuda",
            "--engine",
            "cuda",
            "--steps",
            "40",
            "--width",
            "1024",
            "--report-dir",
            str(tmp_path),
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    pileup = barrierguard.Report.load(tmp_path / "pileup.json").memory
    fixed = barrierguard.Report.load(tmp_path / "detached.json").memory
    assert pileup is not None and fixed is not None
    assert pileup.leak, proc.stdout
    assert "device_allocated" in pileup.growing, proc.stdout
    assert pileup.pattern == "accumulated_graph", proc.stdout
    assert not fixed.leak, proc.stdout
