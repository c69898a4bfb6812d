"""The overhead benchmarks of watch(), memory sampling and the audit run on CPU with tiny
settings (smoke tests, no timing claims); the GPU-only ones refuse a CPU machine.
``bench_metrics.py`` has its own tests (test_bench_metrics.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def _bench_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))


def _run(main: Any, argv: list[str], tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "out.json"
    main([*argv, "--out", str(out)])
    data: dict[str, Any] = json.loads(out.read_text())
    assert data["machine"]["device"] == "cpu"
    return data


def test_core_times_every_variant_against_bare(tmp_path: Path) -> None:
    import bench_core

    argv = ["--device", "cpu", "--layers", "1", "--width", "32", "--steps", "2", "--pairs", "3"]
    ov = _run(bench_core.main, argv, tmp_path)["overhead"]
    assert set(ov["ratio_median"]) == {"watch", "watch_no_memory"}
    assert all(len(rs) == 3 and all(r > 0 for r in rs) for rs in ov["ratios"].values())
    assert ov["start_stop_us"] > 0
    # The host CPU time: one block per variant and round, paired with bare's.
    assert set(ov["thread_us_per_step"]) == {"bare", "watch", "watch_no_memory"}
    assert all(us > 0 for us in ov["thread_us_per_step"].values())
    assert set(ov["added_thread_us_quartiles"]) == {"watch", "watch_no_memory"}
    for name, (low, high) in ov["added_thread_us_quartiles"].items():
        assert low <= ov["added_thread_us_median"][name] <= high
    for name, (low, high) in ov["ratio_ci95"].items():
        assert low <= ov["ratio_median"][name] <= high


def test_core_settles_each_block_apart_from_its_timed_steps(tmp_path: Path) -> None:
    import bench_core

    argv = ["--device", "cpu", "--layers", "1", "--width", "32", "--steps", "2", "--pairs", "3"]
    ov = _run(bench_core.main, [*argv, "--settle", "4"], tmp_path)["overhead"]
    # overhead() asserts each guard counted its settle steps as steps (4 + 2 a block).
    assert ov["settle"] == 4
    assert set(ov["first_steps_added_us"]) == {"watch", "watch_no_memory"}
    for name, (low, high) in ov["whole_ratio_ci95"].items():
        assert low <= ov["whole_ratio_median"][name] <= high
    assert ov["steps_per_block"] == 2


def test_core_times_a_tensor_method_after_restarts_in_fresh_processes(tmp_path: Path) -> None:
    import bench_core

    argv = ["--device", "cpu", "--sync-stand-in", "--restarts", "3", "--pairs", "0"]
    rs = _run(bench_core.main, argv, tmp_path)["restarts"]
    assert rs["restarts"] == 3
    for label in ("together", "one by one"):
        assert rs[label]["before_ns"] > 0 and rs[label]["after_ns"] > 0
        version = rs[label]["tensor_version"]
        assert version is None or isinstance(version, int)


@pytest.mark.parametrize(
    ("n", "ranks"),
    # Conover's ranks, counted from 1: floor(n/2 - 0.98 sqrt(n)), ceil(1 + n/2 + 0.98 sqrt(n)).
    [(10, (1, 10)), (40, (13, 28)), (100, (40, 61)), (200, (86, 115))],
)
def test_median_ci_takes_the_binomial_ranks(n: int, ranks: tuple[int, int]) -> None:
    from _common import median_ci

    values = [float(v) for v in range(1, n + 1)]
    assert median_ci(values[::-1]) == [float(r) for r in ranks]  # sorted first


def test_memory_times_the_probes_and_the_sampler(tmp_path: Path) -> None:
    import bench_memory

    argv = ["--device", "cpu", "--layers", "1", "--width", "32", "--steps", "2", "--pairs", "3"]
    data = _run(bench_memory.main, [*argv, "--calls", "5"], tmp_path)
    assert "psutil Process.memory_info().rss" in data["probe_us"]
    assert data["sample"]["us_per_sample"] > 0
    assert set(data["overhead"]["ratio_median"]) == {
        "watch_no_memory",
        "watch_memory",
        "watch_memory_every_step",
    }
    assert data["no_sync"] == {"checked": False, "why": "needs CUDA"}


def test_memory_aftermath_splits_each_reads_added_time(tmp_path: Path) -> None:
    import bench_memory

    argv = ["--device", "cpu", "--layers", "1", "--width", "32", "--steps", "2", "--pairs", "0"]
    data = _run(bench_memory.main, [*argv, "--aftermath", "3"], tmp_path)
    am = data["aftermath"]
    reads = {"pread /proc/self/statm", "one whole sample (the sampler's)"}  # no CUDA reads here
    assert set(am["added_us"]) == set(am["own_us"]) == set(am["after_us"]) == reads
    assert len(am["ratios"]["pread /proc/self/statm"]) == 3
    for name in reads:
        assert am["own_us"][name] > 0
        assert am["after_us"][name] == pytest.approx(am["added_us"][name] - am["own_us"][name])
    assert "overhead" not in data and "probe_us" not in data  # --pairs 0: the aftermath only


def test_audit_times_a_step_with_no_sync(tmp_path: Path) -> None:
    import bench_audit

    argv = ["--steps", "2", "--pairs", "3", "--batch", "8", "--configs", "32x1", "--threads", "0"]
    argv += ["--gpt-pairs", "1", "--depths", "3", "--calls", "20", "--read-pairs", "1"]
    argv += ["--clock", "thread"]
    data = _run(bench_audit.main, argv, tmp_path)
    run, gpt = data["runs"]
    assert set(run["ratio_median"]) == {"audit", "noop_mode"}
    assert data["headline_ratio"] == run["ratio_median"]["audit"]
    assert gpt["model"] == "mingpt-nano" and data["gpt_ratio"] == gpt["ratio_median"]["audit"]
    (read,) = data["reads"]
    assert read["depth"] == 3 and read["calls"] == 20


def test_core_meters_each_part_of_a_step_in_place(
    fake_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench_core

    from barrierguard.detect import cuda as cuda_engine

    # Host tensors stay host tensors: the optimizer's step counters pass through.
    monkeypatch.setattr(cuda_engine, "_on_device", lambda tensor: tensor.is_cuda)
    import torch

    from barrierguard.session.guard import Guard

    before = dict(vars(torch.Tensor)), dict(vars(Guard))
    pp = bench_core.parts("cpu", 5, 1, 32)
    assert (dict(vars(torch.Tensor)), dict(vars(Guard))) == before  # meters removed
    rows = pp["parts"]
    assert pp["steps"] == 6 * 5
    assert rows["optimizer hook (with the boundary)"]["calls_per_step"] == 1
    # The boundary's own work runs only when due: the first step's (its listeners').
    assert 0 < rows["  of which the boundary's work when due"]["calls_per_step"] < 1
    assert rows["wrapper of Tensor.to"]["calls_per_step"] == 1
    # Adam reads each parameter's host step counter past the item() wrapper.
    assert "wrapper of Tensor.item" not in rows
    named = sum(r["us_per_step"] for name, r in rows.items() if not name.startswith(" "))
    assert pp["named_us_per_step"] == pytest.approx(named)
    assert pp["meter_us"] > 0 and set(pp["thread_us_per_step"]) == {"bare", "watch"}


def test_instructions_workload_runs_both_parts_without_valgrind(
    capfd: pytest.CaptureFixture[str],
) -> None:
    import bench_instructions

    bench_instructions.main(["--no-valgrind", "--tiny"])
    out = capfd.readouterr().out
    # Each part's workload ran to its end and printed one label per mark.
    assert (
        "LABELS - user_bare - user_watched - framework_bare - framework_watched"
        " - copy_bare - copy_watched" in out
    )
    assert (
        "LABELS - steps_bare - steps_memory=False - steps_memory=False,_a_sync_recorded_first"
        " - steps_memory_sampling_on - steps_memory=False,_a_read_each_step_in_a_function_bare"
        " - steps_memory=False,_a_read_each_step_in_a_function"
        " - steps_memory=False,_a_read_each_step_in_a_helper_of_the_step_function_bare"
        " - steps_memory=False,_a_read_each_step_in_a_helper_of_the_step_function" in out
    )
    assert out.count("LABELS - on switch off switch on switch") == 2  # memory off, then on


def test_instructions_count_each_part_by_its_label() -> None:
    import bench_instructions

    stdout = "noise\nLABELS - user_bare - user_watched\nmore noise\n"
    assert bench_instructions.parse(stdout, [9, 100, 1, 400]) == {
        "-": [9, 1],
        "user bare": [100],
        "user watched": [400],
    }
    with pytest.raises(RuntimeError, match="4 labels for 3 dumps"):
        bench_instructions.parse(stdout, [9, 100, 1])


def test_instructions_per_read_and_per_step_leave_the_setup_block_out() -> None:
    import argparse

    import bench_instructions

    args = argparse.Namespace(reads=10, block_len=2, steps=4)
    reads = {
        "user bare": [1000],
        "user watched": [3000],
        "framework bare": [5000],
        "framework watched": [9000],
        "copy bare": [200],
        "copy watched": [700],
    }
    # The first on-block holds the fit's setup: far larger, left out.
    fit = {"on": [10**6, 240, 260], "off": [200, 200, 220], "switch": [5, 70, 5, 70]}
    steps = {
        "steps bare": [400],
        "steps memory=False": [480],
        "steps memory sampling on": [500],
        # A read each step: against its own bare steps, which read too.
        f"steps {bench_instructions.READ} bare": [600],
        f"steps {bench_instructions.READ}": [640],
    }
    record = bench_instructions._summarise(args, reads, steps, {"memory=False": fit})
    assert record["per_read"]["user"] == {"bare": 100, "watched": 300, "added": 200}
    assert record["per_read"]["framework"]["added"] == 400
    assert record["per_copy"] == {"bare": 20, "watched": 70, "added": 50}
    del reads["copy bare"], reads["copy watched"]  # a result from before the copy part
    assert bench_instructions._summarise(args, reads, steps, {})["per_copy"] is None
    assert record["per_step"]["memory=False"] == {"bare": 100, "watched": 120, "added": 20}
    assert record["per_step"]["memory sampling on"]["added"] == 25
    assert record["per_step"][bench_instructions.READ] == {"bare": 150, "watched": 160, "added": 10}
    step = record["lightning_per_step"]["memory=False"]
    assert (step["on"], step["off"], step["added"]) == (125, 100, 25)
    assert step["ratio"] == 1.25
    assert (step["switch_off"], step["switch_on"]) == (5, 70)
