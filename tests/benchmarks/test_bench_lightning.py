"""The Lightning benchmarks run on CPU with tiny settings (smoke tests, no timing claims)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_lightning

    return bench_lightning


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_interleaved_fits_write_both_columns(bench: Any, model: str, tmp_path: Path) -> None:
    out = tmp_path / "lightning.json"
    bench.main(["--tiny", "--model", model, "--design", "interleaved", "--out", str(out)])
    data = json.loads(out.read_text())
    rec = data["designs"]["interleaved"]
    assert set(data["designs"]) == {"interleaved"}
    assert len(rec["ratios"]) == len(rec["step_ratios"]) == data["settings"]["rounds"]
    assert all(r > 0 for r in rec["ratios"])
    # The guarded fit found the prog_bar conversion of every training step (audit engine).
    assert rec["syncs_found"] >= data["settings"]["steps"]
    assert data["settings"]["model"] == model


def test_lockstep_runs_both_rows_in_two_processes(bench: Any, tmp_path: Path) -> None:
    out = tmp_path / "lightning.json"
    bench.main(["--tiny", "--design", "lockstep", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data["designs"]) == {"lockstep", "lockstep_null"}
    rounds = data["settings"]["rounds"]
    for key in ("lockstep", "lockstep_null"):
        rec = data["designs"][key]
        assert len(rec["bare_s"]) == len(rec["guarded_s"]) == rounds
        assert all(t > 0 for t in rec["bare_s"] + rec["guarded_s"])
    # Only the row with the callback finds syncs.
    assert data["designs"]["lockstep"]["syncs_found"] >= data["settings"]["steps"]
    assert data["designs"]["lockstep_null"]["syncs_found"] == 0


def test_parts_benchmark_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_lightning_parts
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench_lightning_parts.main([])
    with pytest.raises(ValueError, match="unknown part 'nope'; expected one of null, hooks"):
        bench_lightning_parts._switch("nope", {})
