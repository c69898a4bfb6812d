"""bench_metrics.py on CPU: every loop, row, probe and fit in its smoke mode, with the
audit engine's sync counts; its CUDA-engine counting through the fake CUDA seam; the
goals it reports. Smoke tests: no timing claims."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from _fake_cuda import FakeMode, FakeTensor

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_metrics

        yield bench_metrics
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def quick(bench: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One ``--quick`` run on CPU: its JSON and what it printed."""
    out = tmp_path_factory.mktemp("metrics") / "metrics.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main(["--device", "cpu", "--quick", "--out", str(out)])
    return json.loads(out.read_text()), printed.getvalue()


def _mechanisms(record: dict[str, Any]) -> set[str]:
    return {m for site in record["sites"] for m in site["mechanisms"]}


def test_metrics_loops_agree_on_the_ratios_they_report(quick: tuple[dict[str, Any], str]) -> None:
    data, _ = quick
    median = data["median_s"]
    assert data["item_over_buffer"] == pytest.approx(median["item"] / median["buffer"])
    assert data["buffer_over_nothing"] == pytest.approx(median["buffer"] / median["nothing"])
    # The top-level keys keep the balanced loop's first three rows, as before.
    balanced = data["loops"]["balanced"]["times_s"]
    assert data["times_s"] == {row: balanced[row] for row in ("nothing", "item", "buffer")}
    assert data["machine"]["device"] == "cpu"


def test_every_loop_times_every_row(bench: Any, quick: tuple[dict[str, Any], str]) -> None:
    data, printed = quick
    assert data["errors"] == []
    assert set(data["loops"]) == {"balanced", "launch"}
    rounds = data["settings"]["repeats"]
    for name, loop in data["loops"].items():
        assert set(loop["times_s"]) == set(bench.ROWS), name
        assert all(len(ts) == rounds and min(ts) > 0 for ts in loop["times_s"].values())
        assert set(loop["ratio_median"]) == set(bench.ROWS) - {"nothing"}
        assert all(us > 0 for us in loop["update_us"].values())
        assert loop["update_us_per_metric"]["buffer"] == pytest.approx(
            loop["update_us"]["buffer"] / 8
        )
        assert f"## {name} loop" in printed
    assert data["loops"]["launch"]["config"]["layers"] >= 1
    assert "the audit engine stands in" in printed and "elapsed:" in printed


def test_counts_are_those_a_gpu_run_should_show(quick: tuple[dict[str, Any], str]) -> None:
    data, _ = quick
    assert data["count_engine"] == "audit"
    for name, loop in data["loops"].items():
        syncs = loop["syncs"]
        per_step = {row: rec["per_step"] for row, rec in syncs.items()}
        assert per_step["nothing"] == 0, name
        assert per_step["item"] == 8  # one .item() per metric
        assert per_step["buffer"] == 0 and syncs["buffer"]["at_end"] == 1  # one transfer
        for row in ("tm_mean", "tm_collection"):  # nan_strategy="warn" checks every update
            assert per_step[row] >= 8 and "nan_check" in _mechanisms(syncs[row])
        assert per_step["tm_mean_disable"] == per_step["tm_collection_disable"] == 0
        assert all(
            rec["measured_steps"] == data["settings"]["count_steps"] for rec in syncs.values()
        )
    probes = data["probes"]
    assert probes["tm_mean_disable_float"]["per_step"] == 8
    assert "metric_python_number" in _mechanisms(probes["tm_mean_disable_float"])
    groups = [
        s
        for s in probes["collection_update_groups"]["sites"]
        if "compute_groups" in s["mechanisms"]
    ]
    assert groups and all(s["setup_count"] and not s["step_count"] for s in groups)
    assert "compute_groups" not in _mechanisms(probes["collection_update_no_groups"])


def test_goals_name_the_cheapest_sync_free_torchmetrics_row(
    quick: tuple[dict[str, Any], str],
) -> None:
    data, printed = quick
    for name, entry in data["goals"]["per_loop"].items():
        loop = data["loops"][name]
        assert set(entry["sync_free_torchmetrics"]) == {"tm_mean_disable", "tm_collection_disable"}
        cheapest = entry["cheapest_sync_free"]
        assert entry["host_ratio"] == pytest.approx(
            loop["update_us"][cheapest] / loop["update_us"]["buffer"]
        )
        assert f"{name}: cheapest sync-free torchmetrics = {cheapest}" in printed
    assert isinstance(data["goals"]["host_goal_met"], bool)
    assert isinstance(data["goals"]["balanced_goal_met"], bool)


def test_lightning_fits_time_and_count_every_row(
    bench: Any, quick: tuple[dict[str, Any], str]
) -> None:
    data, printed = quick
    fits = data["lightning"]
    assert set(fits["ms_per_step"]) == set(bench.FIT_ROWS)
    assert set(fits["ratio_median"]) == {"self_log", "buffer"}
    assert all(len(ts) == fits["settings"]["fits"] for ts in fits["times_s"].values())
    assert set(fits["syncs"]) == set(bench.FIT_ROWS)
    for rec in fits["syncs"].values():
        assert rec["measured_steps"] == fits["settings"]["timed_batches"]
    # MetricBuffer's compute() in on_train_epoch_end: its one transfer is at the epoch
    # end, after the loop's last step (counted apart).
    buffer_sites = fits["syncs"]["buffer"]["sites"]
    assert any(
        s["kind"] == "tolist" and s["after_loop"] == 1 and s["step_count"] == 0
        for s in buffer_sites
    )
    assert "## Lightning Trainer.fit" in printed
    assert data["goals"]["lightning"]["self_log_over_nothing"] > 0


def test_counting_under_the_cuda_engine(bench: Any, fake_cuda: FakeMode) -> None:
    t = FakeTensor()

    class TwoReads(bench.Logger):
        def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
            t.item()
            t.item()

        def finish(self) -> dict[str, float]:
            return {"x": t.item()}

    prepared: list[bool] = []
    rec = bench.count_syncs(
        lambda i: {}, TwoReads(), "cuda", warmup=2, steps=5, prepare=lambda: prepared.append(True)
    )
    assert prepared == [True]
    assert rec["engine"] == "cuda" and rec["measured_steps"] == 5
    assert rec["per_step"] == 2.0  # the warm-up steps are setup, the end is apart
    assert rec["at_end"] == 1 and rec["setup"] == 4
    assert bench.where(rec).startswith("test_bench_metrics.py:")


def _loop(update_us: dict[str, float], ratios: dict[str, float], free: set[str]) -> dict[str, Any]:
    syncs = {row: {"per_step": 0.0 if row in free else 16.0} for row in update_us}
    return {"update_us": update_us, "ratio_median": ratios, "syncs": syncs}


def test_goals_from_hand_made_loops(bench: Any) -> None:
    us = {"buffer": 10.0, "tm_mean": 500.0, "tm_mean_disable": 400.0, "tm_collection": 520.0}
    us["tm_collection_disable"] = 25.0
    ratios = {"buffer": 1.005, "tm_mean": 1.9, "tm_mean_disable": 1.3, "tm_collection": 1.9}
    ratios["tm_collection_disable"] = 1.02
    loops = {
        "balanced": _loop(us, ratios, {"buffer", "tm_mean_disable", "tm_collection_disable"}),
        "launch": _loop(us, {**ratios, "buffer": 1.02}, {"buffer", "tm_mean_disable"}),
    }
    g = bench.goals(loops, {"ratio_median": {"self_log": 1.1, "buffer": 1.0}})
    assert g["per_loop"]["balanced"]["cheapest_sync_free"] == "tm_collection_disable"
    assert g["per_loop"]["balanced"]["host_ratio"] == pytest.approx(2.5)
    assert g["per_loop"]["balanced"]["step_ratio"] == pytest.approx(1.02 / 1.005)
    assert g["per_loop"]["launch"]["cheapest_sync_free"] == "tm_mean_disable"
    assert g["host_goal_met"] is False  # 2.5x in the balanced loop
    assert g["balanced_goal_met"] is True
    assert g["lightning"] == {"self_log_over_nothing": 1.1, "buffer_over_nothing": 1.0}
    none_free = bench.goals({"balanced": _loop(us, ratios, {"buffer"})}, None)
    assert "cheapest_sync_free" not in none_free["per_loop"]["balanced"]
    assert "host_goal_met" not in none_free


def test_unknown_loop_is_a_usage_error(bench: Any) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--quick", "--loops", "wide"])


@pytest.mark.filterwarnings("ignore:called a synchronizing CUDA operation")
def test_fits_counted_under_the_cuda_engine_leave_the_clock_out(
    bench: Any, fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The timing callback's synchronize is a sync the CUDA engine counts: a fake one here.
    clock_syncs: list[int] = []

    def fake_sync() -> None:
        clock_syncs.append(1)
        FakeTensor().item()

    class ReadingBuffer(bench.MetricBuffer):
        def compute(self) -> dict[str, Any]:
            FakeTensor().item()  # the one transfer compute() makes on a GPU
            return super().compute()

    monkeypatch.setattr(bench, "sync", fake_sync)
    monkeypatch.setattr(bench, "MetricBuffer", ReadingBuffer)
    args = bench.parse_args(["--device", "cpu", "--quick"])
    settings = bench.fit_settings(args)
    loader = bench.lightning_loader(settings)
    bench.quiet_lightning()
    records = bench.count_fit_syncs(args, settings, loader, "cuda")
    assert not clock_syncs
    for row, rec in records.items():
        assert rec["engine"] == "cuda" and rec["measured_steps"] == args.fit_steps
        assert rec["per_step"] == 0 and rec["setup"] == 0
        assert rec["at_epoch_end"] == (1 if row == "buffer" else 0), row
    bench.run_fit("nothing", settings, loader, args.fit_warmup)  # timed: it synchronizes
    assert len(clock_syncs) == 2


def test_host_rows_time_the_floors_and_the_buffer(quick: tuple[dict[str, Any], str]) -> None:
    data, printed = quick
    hosts = data["host_rows"]
    assert set(hosts["update_us"]) == {"refs_floor", "copy_floor", "buffer"}
    assert all(us > 0 for us in hosts["update_us"].values())
    us = hosts["update_us"]
    assert hosts["floor_ratio"] == pytest.approx(us["buffer"] / us["refs_floor"])
    assert "host time a step, no loop around it" in printed


def test_the_keep_rule_is_judged_against_the_deferred_design(bench: Any) -> None:
    def loop(buffer_over_floor: float) -> dict[str, Any]:
        us = {"buffer": buffer_over_floor * 10.0, "refs_floor": 10.0, "copy_floor": 6.0}
        return {**_loop(us, {"buffer": 1.0}, {"buffer"}), "ms_per_step": {"nothing": 1.0}}

    previous = bench.PREVIOUS_FLOOR_RATIO
    ok = bench.goals({"balanced": loop(1.05 * previous["balanced"])}, None)
    assert ok["per_loop"]["balanced"]["floor_ratio"] == pytest.approx(1.05 * previous["balanced"])
    assert ok["per_loop"]["balanced"]["floor_rule_met"] is True
    assert ok["floor_rule_met"] is True
    missed = bench.goals(
        {"balanced": loop(1.05 * previous["balanced"]), "launch": loop(1.2 * previous["launch"])},
        None,
    )
    assert missed["per_loop"]["launch"]["floor_rule_met"] is False
    assert missed["floor_rule_met"] is False


def test_out_dir_gets_the_log_and_the_json(
    bench: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    with contextlib.redirect_stdout(io.StringIO()):
        bench.main(["--device", "cpu", "--quick", "--loops", "", "--fits", "0"])
    assert "host time a step" in (tmp_path / "out" / "bench_metrics.log").read_text()
    assert "host_rows" in json.loads((tmp_path / "out" / "metrics.json").read_text())
