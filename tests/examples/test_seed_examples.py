"""The seed examples: each variant's report says what it should, on CPU and on a GPU.

On CPU the audit engine is asked for by name (short settings), so that case runs the
same on a GPU machine; the ``cuda`` case runs the CUDA engine on a real GPU (small
sizes, a few seconds) and is skipped without one:

PYTHONPATH=src python -m pytest -q tests/examples/test_seed_examples.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import barrierguard
from _examples_helpers import line_of, load_example, run_example
from _runif import run_if

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=run_if(min_cuda_gpus=1))]
COMMON = {
    "cpu": ["--device", "cpu", "--engine", "audit", "--repeats", "1", "--watch-steps", "4"],
    "cuda": ["--device", "cuda", "--engine", "cuda", "--repeats", "2", "--watch-steps", "4"],
}
ENGINE = {"cpu": "audit", "cuda": "cuda"}


def _flagged(report: barrierguard.Report, name: str) -> set[tuple[int, str]]:
    """(line, kind) of the example file's sites in measured steps that are not allowed."""
    return {
        (s.line, s.kind)
        for s in report.sites
        if s.step_count > 0 and not s.allowed and Path(s.file).name == f"{name}.py"
    }


# name, its arguments on cpu and on cuda, the bad variant, its expected lines, the good one.
CASES: list[tuple[str, dict[str, list[str]], str, list[tuple[str, str]], str]] = [
    (
        "async_vs_sync",
        {
            "cpu": ["--steps", "20", "--size", "16", "--matmul-size", "32", "--matmuls", "2"],
            "cuda": ["--steps", "50", "--size", "64", "--matmul-size", "256", "--matmuls", "4"],
        },
        "sync",
        [("torch.cuda.synchronize()  # the host waits", "synchronize")],
        "async",
    ),
    (
        "logging_item_vs_buffer",
        {
            "cpu": [
                "--steps",
                "4",
                "--width",
                "32",
                "--layers",
                "1",
                "--batch",
                "8",
                "--host-ms",
                "0.2",
            ],
            "cuda": ["--steps", "10", "--width", "256", "--layers", "2", "--batch", "64"],
        },
        "item",
        [("losses.append(loss.item())", "item")],
        "buffer",
    ),
    (
        "pageable_vs_pinned",
        {
            "cpu": ["--steps", "4", "--batch", "16", "--width", "32", "--layers", "1"],
            "cuda": ["--steps", "6", "--batch", "256", "--width", "256", "--layers", "1"],
        },
        "pageable",
        [("x = x.to(self.device)  #", "copy"), ("y = y.to(self.device)", "copy")],
        "pinned",
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("name", "argv", "bad", "expected", "good"), CASES, ids=[c[0] for c in CASES]
)
def test_seed_example_reports(
    device: str,
    name: str,
    argv: dict[str, list[str]],
    bad: str,
    expected: list[tuple[str, str]],
    good: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = load_example(name, monkeypatch, f"seed_{device}")
    reports = module.main([*COMMON[device], *argv[device], "--report-dir", str(tmp_path)])
    assert "| variant" in capsys.readouterr().out  # the example's own timing table
    want = {(line_of(name, text), kind) for text, kind in expected}
    assert reports[bad].engine == ENGINE[device]
    if device == "cpu":
        assert _flagged(reports[bad], name) == want
        saved = barrierguard.Report.load(tmp_path / f"{bad}.json")
        assert _flagged(saved, name) == want
    else:
        assert want <= _flagged(reports[bad], name), reports[bad]
    # The fixed variant has none of those lines (on a GPU, pinning inside the
    # DataLoader is the library's business; the copies themselves must not block).
    assert not want & _flagged(reports[good], name), reports[good]
    if device == "cpu" or name != "pageable_vs_pinned":
        assert _flagged(reports[good], name) == set(), reports[good]


@pytest.mark.parametrize("device", DEVICES)
def test_memory_pileup_verdicts(device: str, tmp_path: Path) -> None:
    # RSS is the whole process's: run where no other test's memory moves it.
    size = ["--steps", "30", "--width", "512"] if device == "cpu" else ["--steps", "40"]
    if device == "cuda":
        size += ["--width", "1024"]
    proc = run_example(
        "memory_pileup",
        [
            *("--device", device, "--engine", ENGINE[device], *size),
            *("--report-dir", str(tmp_path), "--json", str(tmp_path / "table.json")),
        ],
        timeout=120 if device == "cpu" else 300,
    )
    assert proc.returncode == 0, proc.stderr
    pileup = barrierguard.Report.load(tmp_path / "pileup.json").memory
    fixed = barrierguard.Report.load(tmp_path / "detached.json").memory
    assert pileup is not None and fixed is not None
    assert pileup.leak and pileup.pattern == "accumulated_graph", proc.stdout
    assert not fixed.leak, proc.stdout
    if device == "cuda":
        assert "device_allocated" in pileup.growing, proc.stdout
    else:
        assert "`total_loss`" in pileup.evidence
    table: dict[str, Any] = json.loads((tmp_path / "table.json").read_text())
    assert [row[5] for row in table["rows"]] == ["LEAK", "no leak"]
