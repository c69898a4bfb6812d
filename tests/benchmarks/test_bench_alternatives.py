"""The alternatives benchmark runs on CPU with tiny settings (a smoke test, no timing claims)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_run_writes_every_shape_and_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_alternatives

    out = tmp_path / "alternatives.json"
    bench_alternatives.main(["--device", "cpu", "--quick", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert set(data["shapes"]) == {"launch", "balanced", "device"}
    for shape, res in data["shapes"].items():
        assert set(res["ratio_median"]) == {
            "watch",
            "torch.profiler",
            "DeviceStatsMonitor",
            ".item() logging",
        }, shape
        assert all(r > 0 for rs in res["ratios"].values() for r in rs)
        assert all(len(rs) == res["rounds"] for rs in res["ratios"].values())
        # The guard saw every optimizer step of its blocks (one warm-up block + the rounds)
        # and no step shape has a line that would synchronize on a GPU.
        assert res["watch_steps_seen"] == res["steps_per_block"] * (res["rounds"] + 1)
        assert res["watch_engine"] == "audit"
        assert res["watch_sites"] == []
    assert printed.count("| variant") == 3
    assert "machine" in data and data["device"] == "cpu"
    assert "lightning" not in data


def test_unknown_shape_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_alternatives

    with pytest.raises(SystemExit):
        bench_alternatives.main(["--device", "cpu", "--quick", "--shapes", "wide"])
    sys.modules.pop("bench_alternatives", None)
