"""The examples run (short settings) under ``barrierguard run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from _examples_helpers import EXAMPLES
from barrierguard._cli import main


@pytest.mark.parametrize("name", ["plain_loop.py", "fixed_loop.py"])
def test_example_runs(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    code = main(
        [
            "run",
            "--policy",
            "record",
            "--out",
            str(out),
            str(EXAMPLES / name),
            "--steps",
            "4",
            "--batch",
            "8",
        ]
    )
    assert code == 0
    assert "mean loss" in capsys.readouterr().out
    assert out.exists()
