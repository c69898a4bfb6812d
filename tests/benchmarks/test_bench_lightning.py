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


def test_blocks_switch_the_callback_inside_one_fit(bench: Any, tmp_path: Path) -> None:
    out = tmp_path / "lightning.json"
    bench.main(["--tiny", "--design", "blocks", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data["designs"]) == {"blocks", "blocks_null"}
    fits = data["settings"]["block_fits"]
    for key in ("blocks", "blocks_null"):
        rec = data["designs"][key]
        # Each fit gives its on-blocks, each against its two off neighbours.
        assert len(rec["block_ratios"]) == len(rec["outside_loop_s"]) == fits
        assert all(len(rs) == 2 and all(r > 0 for r in rs) for rs in rec["block_ratios"])
    # Only the switched fits ran the callback; it found the prog_bar syncs of its blocks.
    assert data["designs"]["blocks"]["syncs_found"] > 0
    assert data["designs"]["blocks_null"]["syncs_found"] == 0


def test_block_ratios_compare_each_on_block_with_its_neighbours(bench: Any) -> None:
    # Blocks of 2 steps: on (1, 1), off (2, 2), on (3, 3), off (4.5, 4.5), on, off.
    steps = [(j % 2 == 0, float(j + 1) if j != 3 else 4.5) for j in range(6) for _ in range(2)]
    ratios = bench._block_ratios(steps, 2)
    # Block 0 is left out (warm-up); block 2 against blocks 1 and 3: 3 / sqrt(2 * 4.5).
    assert ratios == [pytest.approx(1.0), pytest.approx(5 / (4.5 * 6) ** 0.5)]
    assert bench._pair_means([1.21, 1.0, 4.0, 1.0]) == [pytest.approx(1.1), pytest.approx(2.0)]


def test_pool_joins_the_blocks_rows_of_two_runs(bench: Any, tmp_path: Path) -> None:
    def run(name: str, ratios: list[list[float]]) -> str:
        rec = {
            "block_ratios": ratios,
            "step_off_s": 0.01,
            "step_on_s": 0.0101,
            "outside_loop_s": [0.5] * len(ratios),
            "syncs_found": 7,
        }
        path = tmp_path / name
        designs = {"blocks": rec, "blocks_null": {**rec, "syncs_found": 0}}
        path.write_text(json.dumps({"model": "m", "settings": {}, "designs": designs}))
        return str(path)

    out = tmp_path / "pooled.json"
    bench.main(["--pool", run("a.json", [[1.0, 1.02]]), run("b.json", [[1.04]]), "--out", str(out)])
    rec = json.loads(out.read_text())["designs"]["blocks"]
    assert rec["block_ratios"] == [[1.0, 1.02], [1.04]]
    assert rec["median_ratio"] == pytest.approx(1.02)
    assert rec["syncs_found"] == 7


def test_odd_rounds_are_refused(bench: Any) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--rounds", "3"])


def test_parts_benchmark_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_lightning_parts
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench_lightning_parts.main([])
    with pytest.raises(ValueError, match="unknown part 'nope'; expected one of null, hooks"):
        bench_lightning_parts._switch("nope", {})


def test_costs_benchmark_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_lightning_costs
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench_lightning_costs.main([])
