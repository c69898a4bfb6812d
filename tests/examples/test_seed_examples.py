"""The seed examples, with short settings on CPU: each variant's report says what it should.

The audit engine is asked for by name, so these run the same on a GPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import barrierguard
from _examples_helpers import line_of, load_example, run_example

COMMON = ["--device", "cpu", "--engine", "audit", "--repeats", "1", "--watch-steps", "4"]


def _flagged(report: barrierguard.Report) -> set[tuple[str, int, str]]:
    """(file name, line, kind) of the sites in measured steps that are not allowed."""
    return {
        (Path(s.file).name, s.line, s.kind)
        for s in report.sites
        if s.step_count > 0 and not s.allowed
    }


CASES: list[tuple[str, list[str], str, list[tuple[str, str]], str]] = [
    (
        "async_vs_sync",
        ["--steps", "20", "--size", "16", "--matmul-size", "32", "--matmuls", "2"],
        "sync",
        [("torch.cuda.synchronize()  # the host waits", "synchronize")],
        "async",
    ),
    (
        "logging_item_vs_buffer",
        ["--steps", "4", "--width", "32", "--layers", "1", "--batch", "8", "--host-ms", "0.2"],
        "item",
        [("losses.append(loss.item())", "item")],
        "buffer",
    ),
    (
        "pageable_vs_pinned",
        ["--steps", "4", "--batch", "16", "--width", "32", "--layers", "1"],
        "pageable",
        [("x = x.to(self.device)  #", "copy"), ("y = y.to(self.device)", "copy")],
        "pinned",
    ),
]


@pytest.mark.parametrize(
    ("name", "argv", "bad", "expected", "good"), CASES, ids=[c[0] for c in CASES]
)
def test_seed_example_reports(
    name: str,
    argv: list[str],
    bad: str,
    expected: list[tuple[str, str]],
    good: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = load_example(name, monkeypatch, "seed")
    reports = module.main([*COMMON, *argv, "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| variant" in out  # the example's own timing table
    want = {(f"{name}.py", line_of(name, text), kind) for text, kind in expected}
    assert _flagged(reports[bad]) == want
    assert _flagged(reports[good]) == set()
    assert reports[bad].engine == "audit"
    saved = barrierguard.Report.load(tmp_path / f"{bad}.json")
    assert _flagged(saved) == want


def test_memory_pileup_verdicts(tmp_path: Path) -> None:
    # RSS is the whole process's: run where no other test's memory moves it.
    proc = run_example(
        "memory_pileup",
        [
            "--device",
            "cpu",
            "--engine",
            "audit",
            "--steps",
            "30",
            "--width",
            "512",
            "--report-dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "table.json"),
        ],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    pileup = barrierguard.Report.load(tmp_path / "pileup.json").memory
    fixed = barrierguard.Report.load(tmp_path / "detached.json").memory
    assert pileup is not None and fixed is not None
    assert pileup.leak and pileup.pattern == "accumulated_graph"
    assert "`total_loss`" in pileup.evidence
    assert not fixed.leak
    table: dict[str, Any] = json.loads((tmp_path / "table.json").read_text())
    assert [row[5] for row in table["rows"]] == ["LEAK", "no leak"]
