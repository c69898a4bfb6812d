"""bench_optimizer.py runs on CPU with tiny settings (a smoke test, no timing claim)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_optimizer

    return bench_optimizer


def test_rounds_give_the_time_watch_adds_to_an_optimizer_step(bench: Any, tmp_path: Path) -> None:
    out = tmp_path / "optimizer.json"
    bench.main(
        [
            "--device",
            "cpu",
            "--params",
            "4",
            "--size",
            "8",
            "--steps",
            "3",
            "--pairs",
            "2",
            "--out",
            str(out),
        ]
    )
    rec = json.loads(out.read_text())["optimizer"]
    assert set(rec) == {"foreach"}  # fused=True is a GPU row
    row = rec["foreach"]
    assert row["bare_us"] > 0 and row["watch_us"] > 0
    low, high = row["added_us_quartiles"]
    assert low <= row["added_us_median"] <= high
