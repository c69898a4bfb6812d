"""The Lightning benchmarks run on CPU with tiny settings (smoke tests, no timing claims)."""

from __future__ import annotations

import argparse
import itertools
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


def test_blocks_switch_the_callback_inside_one_fit(bench: Any, tmp_path: Path) -> None:
    out = tmp_path / "lightning.json"
    bench.main(["--tiny", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data["designs"]) == {"blocks", "blocks_null"}
    fits = data["settings"]["fits"]
    for key in ("blocks", "blocks_null"):
        rec = data["designs"][key]
        # Each fit gives its on-blocks, each against its two off neighbours.
        assert len(rec["block_ratios"]) == len(rec["outside_loop_s"]) == fits
        assert all(len(rs) == 2 and all(r > 0 for r in rs) for rs in rec["block_ratios"])
        # The training thread's CPU time, in the same blocks.
        low, high = rec["cpu_iqr"]
        assert 0 < low <= rec["cpu_median_ratio"] <= high
    # Only the switched fits ran the callback; it found the prog_bar syncs of its blocks.
    assert data["designs"]["blocks"]["syncs_found"] > 0
    assert data["designs"]["blocks_null"]["syncs_found"] == 0


def test_block_ratios_compare_each_on_block_with_its_neighbours(bench: Any) -> None:
    # Blocks of 2 steps: on (1, 1), off (2, 2), on (3, 3), off (4.5, 4.5), on, off.
    steps = [(j % 2 == 0, float(j + 1) if j != 3 else 4.5) for j in range(6) for _ in range(2)]
    ratios = bench._block_ratios(steps, 2)
    # Block 0 is left out (warm-up); block 2 against blocks 1 and 3: 3 / sqrt(2 * 4.5).
    assert ratios == [pytest.approx(1.0), pytest.approx(5 / (4.5 * 6) ** 0.5)]


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


def test_pool_refuses_runs_of_two_models(bench: Any, tmp_path: Path) -> None:
    paths = []
    for model in ("mlp", "transformer"):
        path = tmp_path / f"{model}.json"
        path.write_text(json.dumps({"model": model, "settings": {}, "designs": {"blocks": {}}}))
        paths.append(str(path))
    with pytest.raises(SystemExit, match="one model"):
        bench.main(["--pool", *paths])


def test_cycle_ratios_cancel_the_slowdown_after_a_switch(bench: Any) -> None:
    # Blocks of 2 steps, cycling on / off / null / off over a base step of 10. The
    # callback slows its blocks by 3%; a switch slows the block after it by 8%.
    e, s = 1.03, 1.08
    factor = {"on": e * s, "off after on": s, "null": 1.0, "off": 1.0}
    steps: list[tuple[str, float]] = []
    for _ in range(4):
        for label in ("on", "off after on", "null", "off"):
            steps += [(label.split()[0], 10.0 * factor[label])] * 2
    ratios = bench._cycle_ratios(steps, 2)
    # The first cycle is left out (its on-block has no off block before it).
    assert len(ratios["on"]) == len(ratios["null"]) == 3
    assert ratios["on"] == [pytest.approx(e * s**0.5)] * 3
    assert ratios["null"] == [pytest.approx(s**-0.5)] * 3
    assert ratios["on x null"] == [pytest.approx(e)] * 3


def test_cycle_design_runs_one_long_fit(bench: Any, tmp_path: Path) -> None:
    out = tmp_path / "cycle.json"
    bench.main(["--tiny", "--cycles", "3", "--fits", "1", "--out", str(out)])
    rec = json.loads(out.read_text())["designs"]["cycle"]
    for clock in ("wall", "cpu"):
        for key in ("on", "null", "on x null"):
            low, high = rec[f"{clock} {key}"]["iqr"]
            assert 0 < low <= rec[f"{clock} {key}"]["median"] <= high
            ci_low, ci_high = rec[f"{clock} {key}"]["ci95"]
            assert ci_low <= rec[f"{clock} {key}"]["median"] <= ci_high
            assert rec[f"{clock} {key}"]["n"] == 2  # 3 cycles, the first left out
    # The callback ran in its on-blocks and found the prog_bar syncs there.
    assert rec["syncs_found"] > 0
    # The collector's runs by generation and its time, per label.
    for label in ("on", "off"):
        gens = rec[f"gc {label}"]["per_100_steps"]
        assert len(gens) == 3 and min(gens) >= 0 and rec[f"gc {label}"]["mean_us"] >= 0


def test_cycle_fit_counts_the_collectors_runs_in_each_step(bench: Any) -> None:
    import gc

    from _common import lightning_settings

    args = lightning_settings("mlp", 12)
    args.cycles, args.block_len, args.epoch_batches = 2, 2, 4
    args.batch, args.width, args.hidden, args.blocks = 16, 64, 64, 2
    hooks = list(gc.callbacks)
    # A low threshold: the youngest generation is collected many times a step.
    saved = gc.get_threshold()
    gc.set_threshold(50, *saved[1:])
    try:
        fit = bench._cycle_fit(args)
    finally:
        gc.set_threshold(*saved)
    steps = fit["steps"]
    assert len(steps) == 2 * 4 * 2
    assert all(len(gens) == 3 and s >= 0 for _, _, _, s, gens in steps)
    assert sum(gens[0] for *_, gens in steps) >= len(steps)
    assert sum(s for _, _, _, s, _ in steps) > 0
    assert gc.callbacks == hooks  # the collector's hook is gone after the fit


def test_cycle_fit_collect_runs_the_collector_before_every_block(
    bench: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from _common import lightning_settings

    collections: list[int] = []
    real = bench.gc.collect

    def spy(*a: Any) -> int:
        collections.append(len(a))
        return real(*a)

    args = lightning_settings("mlp", 12)
    args.cycles, args.block_len, args.epoch_batches = 2, 2, 4
    args.batch, args.width, args.hidden, args.blocks = 16, 64, 64, 2
    args.collect = True
    monkeypatch.setattr(bench.gc, "collect", spy)
    fit = bench._cycle_fit(args)
    steps = fit["steps"]
    # The warm-up's two, then one at the end of each of the 8 blocks.
    assert len(collections) == 2 + len(steps) // args.block_len
    # The explicit collections are not counted in the steps after them.
    assert all(gens[2] == 0 for *_, gens in steps)


def test_cycle_fit_switches_the_callback_without_memory_sampling(
    bench: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from _common import lightning_settings

    made: list[dict[str, Any]] = []
    real = bench.barrierguard.BarrierGuard

    def spy(**kwargs: Any) -> Any:
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(bench.barrierguard, "BarrierGuard", spy)
    args = lightning_settings("mlp", 12)
    args.cycles, args.block_len, args.epoch_batches = 1, 2, 4
    args.batch, args.width, args.hidden, args.blocks = 16, 64, 64, 2
    args.switch = "memory-off"
    fit = bench._cycle_fit(args)
    assert [kw["memory"] for kw in made] == [False]
    assert [s[0] for s in fit["steps"]] == ["on", "on", "off", "off", "null", "null", "off", "off"]


@pytest.fixture
def cpu_engine_args(monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """A small MLP fit's settings that run the CUDA engine's host side on this CPU."""
    from _common import lightning_settings

    from barrierguard import _env
    from barrierguard.detect import cuda as engine
    from barrierguard.session import guard

    # The switch lasts for the process: undo it after the test.
    for owner, name in ((_env, "cuda_available"), (engine, "_get_mode"), (engine, "_set_mode")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(guard, "_make_timeline", guard._make_timeline)
    args = lightning_settings("mlp", 12)
    args.block_len, args.epoch_batches = 2, 4
    args.batch, args.width, args.hidden, args.blocks = 16, 64, 64, 2
    args.cuda_engine_on_cpu = True
    return args


def test_cycle_fit_runs_the_cuda_engine_on_a_cpu(
    bench: Any, cpu_engine_args: argparse.Namespace
) -> None:
    args = cpu_engine_args
    args.cycles = 1
    fit = bench._cycle_fit(args)
    assert fit["engine"] == "cuda"
    assert fit["syncs"] == 0  # CPU tensors: nothing to record, the wrappers only pass through
    assert len(fit["steps"]) == 8


def test_parts_fit_meters_each_part_in_place_and_removes_the_meters(
    bench: Any, cpu_engine_args: argparse.Namespace
) -> None:
    import torch

    import barrierguard
    from barrierguard.session import guard

    args = cpu_engine_args
    args.parts = 10
    classes = (torch.Tensor, guard.Guard, barrierguard.BarrierGuard)
    before = [dict(vars(c)) for c in classes]
    fit = bench._parts_fit(args)
    assert [dict(vars(c)) for c in classes] == before  # every meter removed
    rows = fit["parts"]
    assert fit["steps"] == 8  # counted after the first block_len steps
    assert rows["optimizer hook"]["calls_per_step"] == 0  # the callback makes the steps
    assert rows["callback: on_train_batch_end, its step()"]["calls_per_step"] == 1
    assert rows["  of which the step boundary"]["calls_per_step"] == 1
    assert rows["wrapper of Tensor.to"]["calls_per_step"] >= 1  # the batch's transfer
    top = sum(r["us_per_step"] for name, r in rows.items() if not name.startswith(" "))
    assert fit["own_us"] == pytest.approx(top) and fit["own_us"] > 0
    assert fit["nested_meters"] >= 1 and fit["meter_us"] > 0 and fit["step_us"] > 0


def test_cycle_ratios_settle_leaves_out_each_blocks_first_steps(bench: Any) -> None:
    # Blocks of 4 steps: a switch makes the first 2 steps of the block after it
    # slow (the on-block and the off block after it), and the callback slows
    # its on-blocks' other steps by 2%.
    steps: list[tuple[str, float]] = []
    for _ in range(4):
        for i, label in enumerate(bench.CYCLE):
            rest = 10.0 * (1.02 if label == "on" else 1.0)
            head = 50.0 if i < 2 else rest
            steps += [(label, head)] * 2 + [(label, rest)] * 2
    settled = bench._cycle_ratios(steps, 4, 2)
    assert settled["on"] == [pytest.approx(1.02)] * 3
    assert settled["on x null"] == [pytest.approx(1.02)] * 3
    assert settled["first"] == [pytest.approx(50.0 / 10.2)] * 3
    # Whole blocks read the switch's slow steps as well.
    whole = bench._cycle_ratios(steps, 4)
    assert "first" not in whole
    assert whole["on"][0] > 1.5


def test_settle_must_be_shorter_than_a_block(bench: Any) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--cycles", "3", "--block-len", "4", "--settle", "4"])


def test_by_sample_fit_notes_the_steps_since_each_memory_sample(bench: Any) -> None:
    from _common import lightning_settings

    args = lightning_settings("mlp", 12)
    args.by_sample, args.epoch_batches = 10, 4
    args.batch, args.width, args.hidden, args.blocks = 16, 64, 64, 2
    fit = bench._by_sample_fit(args)
    since = [k for k, _, _ in fit["steps"]]
    assert len(since) == 10
    assert all(k >= 0 for k in since)
    # Each step is one further from the last sample, or is sampled itself.
    assert all(b in (0, a + 1) for a, b in itertools.pairwise(since))
    assert 0 in since  # a host-only sample costs microseconds: the stride is a few steps
    assert "samples" in fit["sampling"]
    assert fit["sample_own_us"] is not None and fit["sample_own_us"] > 0


def test_by_sample_compares_each_sample_with_the_step_before_it(
    bench: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stride 4: a sampled step of 1.4 ms, one of 1.2 ms after it, then 1.0 ms; the host
    # gets 10% slower half-way (a drift the far group alone would read as the sampler's).
    times = {0: 1.4e-3, 1: 1.2e-3, 2: 1.0e-3, 3: 1.0e-3}
    steps = [(k % 4, times[k % 4] * (1.1 if k >= 27 else 1.0), 5e-4) for k in range(40)]
    monkeypatch.setattr(
        bench, "_in_fresh_process", lambda fit, args, timeout: {"steps": steps, "sampling": "x"}
    )
    args = argparse.Namespace(by_sample=40, block_len=8)
    record = bench._by_sample(args)
    assert record["steps"] == 32 and record["without"] == []
    assert list(record["groups"]) == ["0 (sampled)", "1", "2", "3"]
    assert record["groups"]["0 (sampled)"]["n"] == 8
    around = record["around"]
    assert around["samples"] == 7  # the last sample has no two steps after it
    wall = around["wall"]
    assert wall["median_us"]["0"] == pytest.approx(400.0)
    assert wall["median_us"]["1"] == pytest.approx(200.0)
    assert wall["median_us"]["2"] == pytest.approx(0.0)
    # Slow stretch: 440 / 220 / 0 us; mean excess of the 7 samples (4 fast, 3 slow).
    assert wall["mean_us"]["0"] == pytest.approx((4 * 400 + 3 * 440) / 7)
    # 8 samples in 32 steps, each adding the three steps' excess, over the median step.
    for stat, key in (("median_us", "per_step"), ("mean_us", "per_step_mean")):
        excess = sum(wall[stat].values())
        assert wall[key] == pytest.approx(excess * 8 / 32 / wall["step_us"])
    assert around["cpu"]["mean_us"]["0"] == pytest.approx(0.0)
    # Epochs of 16 steps: the windows holding step 16, 32 or 48 (samples 16, 32) are left out.
    args.epoch_batches = 16
    assert bench._by_sample(args)["around"]["samples"] == 5
    assert bench._since_label(5) == "4-7" and bench._since_label(9) == "8+"
