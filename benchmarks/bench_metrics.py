"""Logging 8 metrics per step: ``MetricBuffer`` against ``.item()``, torchmetrics and Lightning.

Question:
    A loop that logs 8 metrics per step with ``.item()`` waits for the device at
    every step; ``MetricBuffer`` keeps them on the device until ``compute()``.
    What users already log with does not call ``.item()`` either: torchmetrics'
    ``MeanMetric`` and Lightning's ``self.log(..., on_epoch=True)``. Which of
    them synchronize, how much host time do their 8 updates cost per step, and
    how fast is each loop against one that logs nothing? Does ``MetricBuffer``
    earn its place next to a sync-free torchmetrics configuration (goals: at
    least 3x less host time per step in the 8 updates, and within 1% of no
    logging in the balanced loop)?

Design:
    Two plain loops, each step ending in 8 scalar metric tensors (one small
    matmul, so every row computes the same values):

    * ``balanced``: host preparation (a busy-wait of ``--host-ms``, standing for
      batch building) and device compute (``torch.cuda._sleep`` calibrated to
      ``--device-ms``). Host and device overlap, so a sync costs the overlap it
      destroys, and host work added by logging hides behind the device;
    * ``launch``: a small MLP's SGD step of many small kernels, sized to about
      ``--launch-ms`` (``_common.build_shape``): the host's launch rate sets the
      pace, so every microsecond of logging shows.

    The rows (the same in both loops):

    * ``nothing``: computes the metrics and drops them;
    * ``item``: ``running[k] += value.item()`` for each of the 8 metrics;
    * ``buffer``: ``MetricBuffer.update(...)`` every step (weighted means, sum,
      max, min, last, count: more work than 8 plain means), ``compute()`` at the end;
    * ``copy_floor``: not a logger but a floor for ``MetricBuffer``'s design: one
      ``torch._foreach_copy_`` a step of the 8 tensors into the next row of a
      preallocated float64 block, and a column sum every ``BLOCK_STEPS`` steps,
      with none of the checks, weights or reductions that make ``MetricBuffer``
      correct; what ``buffer`` costs beyond it is their price;
    * ``refs_floor``: the floor of the earlier, deferred design, kept as a yardstick
      between runs (this host's timings move by up to 2x between leases): it keeps
      references to the 8 tensors and sums them with one ``torch.stack`` every 1024
      steps. ``buffer``'s host time over this row's compares runs of different
      designs on different leases (``goals``: ``floor_ratio``);
    * ``tm_mean``: 8 torchmetrics ``MeanMetric()`` (default ``nan_strategy``,
      ``"warn"``), ``update(value)`` each;
    * ``tm_mean_disable``: the same with ``nan_strategy="disable"``;
    * ``tm_collection``, ``tm_collection_disable``: those 8 metrics held in a
      ``MetricCollection`` (default ``compute_groups``), each updated through it
      (``collection[name].update(value)``: ``collection.update(x)`` would give
      every member the same value), ``collection.compute()`` at the end.

    Host rows, first: ``refs_floor``, ``copy_floor`` and ``buffer`` log the same
    precomputed metrics with no loop around them, ``--steps`` steps a block and
    ``settle()``, timed with the thread's CPU clock (``host_rows`` in the JSON):
    the rows' own host time, steady on a shared host, and on a CPU (``--device
    cpu --loops '' --fits 0``) a check of the per-step path that needs no GPU.

    Each row logs one block of ``--steps`` steps, then calls its end-of-epoch
    reduction (``compute()``, or the ``.item()`` means); a block is timed with a
    device sync only before and after it. After a ``--warmup``-step block per
    row, ``--repeats`` paired rounds run every row once, in an order that
    rotates by one row each round; the figures are medians over rounds and the
    median of each round's ratio to ``nothing`` (with its IQR). Host time of the
    updates: ``time.perf_counter`` around the 8 updates of every step (no
    synchronize inside; for a row that syncs it includes the wait), summed over
    the timed blocks and divided by their steps. Deferred work is in it too:
    after its last step, a row that defers work does it (``settle()``:
    ``MetricBuffer`` and the floors fold their last rows or references in)
    under the same clock, apart from its ``compute()``'s transfer and wait,
    which are in the ``end ms`` column; all of it is in the block's time.

    Pace: which side sets the pace of the ``nothing`` row. The host's time per
    step is the block's time until its last step is queued; the device's (the
    balanced loop only) is the step's kernels queued back to back, timed with
    CUDA events. Where the host is slower, the step pays every microsecond of
    host time that logging adds; where the device is slower, logging's host
    time hides behind it, up to the difference.

    Lightning: a real ``Trainer.fit`` of ``bench_lightning``'s host-bound MLP
    (AdamW, bf16-mixed on a GPU, pinned DataLoader; no progress bar, logger,
    checkpointing or model summary) whose ``training_step`` derives 8 values
    from the loss and logs them with ``self.log(name, value, on_step=False,
    on_epoch=True)`` (``self_log``), with ``MetricBuffer.update`` computed in
    ``on_train_epoch_end`` (``buffer``), or not at all (``nothing``). Each fit
    runs ``--fit-warmup`` + ``--fit-steps`` batches in one epoch; a callback
    synchronizes after the warm-up batches and at ``on_train_end``, and the
    time between, epoch end included, over ``--fit-steps`` is the time per
    step. ``--fits`` paired rounds of the three fits, in rotating order, after
    ``--fit-warm-fits`` untimed fits of each. Without CUDA the fits are a smoke
    run: a tiny model on the CPU, one round, no warm-up fit.

    Syncs: after all timing (the engine patches torch), one short pass per row
    under ``barrierguard.watch(engine="cuda", policy="record", memory=False)``:
    ``guard.step()`` before each step, the first ``--count-warmup`` steps are
    setup, then ``report.step_syncs / report.measured_steps`` over
    ``--count-steps`` steps; the syncs of the end-of-epoch reduction are
    counted apart. Fits are counted the same way (``guard.step()`` at each batch
    start, warm-up batches as setup, the epoch end apart). Three count-only
    probes show the torchmetrics mechanisms no timed row has: a Python float
    given to ``MeanMetric.update``, and ``MetricCollection.update`` with
    ``compute_groups`` on and off. On a machine without CUDA the audit engine
    counts instead (it says so): it reasons which lines would sync on a GPU.

    Output: a table per loop (ms per step, ratio to ``nothing``, host us per
    step in the 8 updates, ms of the end-of-epoch reduction, syncs per step, at
    the end and in setup, and where) with the balanced loop's pace,
    the probes, the fits, and the goals. The JSON keeps this script's earlier
    top-level keys (``times_s``, ``median_s``, ``ms_per_step``,
    ``item_over_buffer``, ``buffer_over_nothing``) for the balanced loop's
    ``nothing``, ``item`` and ``buffer`` rows; the rest is under ``loops``,
    ``probes``, ``lightning`` and ``goals``.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_metrics.py --out benchmarks/results/h200/metrics.json \\
        | tee benchmarks/results/h200/metrics.txt

    (``bash benchmarks/run_all.sh benchmarks/results/h200`` runs it with the rest
    of the suite and keeps the printed tables in ``metrics.txt``.) Expected to
    take 4-5 minutes on the H200 at the defaults; the script prints its elapsed
    time. A shorter run (about 3 minutes)::

        PYTHONPATH=src python benchmarks/bench_metrics.py --repeats 8 --fits 3 \\
            --out benchmarks/results/h200/metrics.json | tee benchmarks/results/h200/metrics.txt

    With ``$OUT`` set, everything printed also goes to ``$OUT/bench_metrics.log``
    and the JSON to ``$OUT`` under the name ``--out`` gives (default ``metrics.json``).
    ``goals.floor_rule_met`` says whether ``MetricBuffer``'s host time over
    ``refs_floor``'s is within ``FLOOR_RULE`` (1.10x) of the deferred design's.

    The balanced loop with the device's side longer (the printed pace says which
    side set it; about 2 minutes)::

        PYTHONPATH=src python benchmarks/bench_metrics.py --loops balanced --device-ms 1.15 \\
            --fits 0 --out benchmarks/results/h200/metrics_device_ms_1.15.json

    ``benchmarks/results/h200/metrics_8023cfb.json`` and
    ``benchmarks/results/h200/metrics_8023cfb_device_ms_1.15.json`` are these two
    commands run at ``8023cfb``, with the earlier, deferred design of
    ``MetricBuffer``; ``metrics.json`` and ``metrics.txt`` are the shorter command
    at 5e9cb33, with the block design;
    ``benchmarks/results/h200/metrics_693d1a3.json`` and
    ``benchmarks/results/h200/metrics_693d1a3_device_ms_1.15.json`` are these two
    commands run at commit ``693d1a3`` on another lease of an H200;
    ``benchmarks/results/h200/metrics_a39d41b.json`` and
    ``benchmarks/results/h200/metrics_a39d41b_device_ms_1.15.json`` at ``a39d41b``, and
    ``benchmarks/results/h200/metrics_56f8456.json`` and
    ``benchmarks/results/h200/metrics_56f8456_device_ms_1.15.json`` at ``56f8456``,
    whose host time leaves out the fold that ``compute()`` begins with.

    CPU smoke run (seconds; the times mean nothing there, the audit engine counts)::

        PYTHONPATH=src python benchmarks/bench_metrics.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    build_shape,
    busy_wait,
    lightning_loader,
    lightning_settings,
    lightning_trainer,
    median,
    paired_rounds,
    paired_summary,
    quiet_lightning,
    sleep_cycles_per_ms,
    sync,
    table,
    write,
)

import barrierguard
from barrierguard import MetricBuffer
from barrierguard.metrics.slots import BLOCK_STEPS

SPECS: dict[str, Any] = {
    "loss": ("mean", "weighted"),
    "acc": ("mean", "weighted"),
    "ppl": "mean",
    "tokens": ("sum", "weighted"),
    "grad_norm": "max",
    "loss_min": "min",
    "scale": "last",
    "steps": "count",
}
NAMES = tuple(SPECS)
BATCH = 32

ROWS: dict[str, str] = {
    "nothing": "computes the 8 metrics and drops them",
    "item": "running[k] += value.item() for each metric",
    "buffer": "MetricBuffer.update(...) every step, compute() at the end",
    "copy_floor": (
        "a floor, not a logger: one _foreach_copy_ a step into a float64 block, a column "
        "sum every BLOCK_STEPS steps; no checks, weights or reductions"
    ),
    "refs_floor": (
        "the earlier design's floor, a yardstick between runs: keeps references to the 8 "
        "tensors, one torch.stack and a column sum every 1024 steps"
    ),
    "tm_mean": "8 torchmetrics MeanMetric() (default nan_strategy='warn')",
    "tm_mean_disable": "8 MeanMetric(nan_strategy='disable')",
    "tm_collection": "the 8 MeanMetric() in a MetricCollection, updated per member",
    "tm_collection_disable": "the 8 MeanMetric(nan_strategy='disable') in a MetricCollection",
}
ORIGINAL_ROWS = ("nothing", "item", "buffer")  # the top-level keys keep these, as before
TM_ROWS = ("tm_mean", "tm_mean_disable", "tm_collection", "tm_collection_disable")
PROBES: dict[str, str] = {
    "tm_mean_disable_float": "8 MeanMetric(nan_strategy='disable').update(<Python float>)",
    "collection_update_groups": (
        "MetricCollection of 8 MeanMetric(nan_strategy='disable'), "
        "collection.update(x) (compute_groups=True, the default)"
    ),
    "collection_update_no_groups": "the same with compute_groups=False",
}
FIT_ROWS: dict[str, str] = {
    "nothing": "the 8 values are computed and dropped",
    "self_log": "self.log(name, value, on_step=False, on_epoch=True) for each",
    "buffer": "MetricBuffer.update(...), compute() in on_train_epoch_end",
}
HOST_TARGET = 3.0  # cheapest sync-free torchmetrics / MetricBuffer, host time of the updates
BALANCED_TARGET = 1.01  # MetricBuffer / nothing per step in the balanced loop
# MetricBuffer's host time over refs_floor's with the earlier, deferred design
# (benchmarks/results/h200/metrics.json at 8023cfb: 18.2 / 8.1 us and 34.6 / 13.0 us;
# 2.19 and 2.68 in the 693d1a3 run). The new design keeps its place if it stays within
# 10% of these.
PREVIOUS_FLOOR_RATIO = {"balanced": 2.26, "launch": 2.65}
FLOOR_RULE = 1.10


# -- the steps ----------------------------------------------------------------------


class DeviceWork:
    """About ``device_ms`` of device time per step, ending in 8 scalar metric tensors."""

    def __init__(self, device: torch.device, device_ms: float) -> None:
        self.device = device
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.randn(len(NAMES), 64, generator=gen).to(device)
        self.x = torch.randn(64, generator=gen).to(device)
        self.cycles = 0
        self.cpu_reps = 0
        if device.type == "cuda":
            self.cycles = max(1, int(device_ms * sleep_cycles_per_ms()))
        else:
            self.cpu_reps = self._calibrate_cpu(device_ms)

    def _calibrate_cpu(self, device_ms: float) -> int:
        a = torch.randn(64, 64)
        t0 = time.perf_counter()
        for _ in range(50):
            a @ a
        per = (time.perf_counter() - t0) / 50
        self.cpu_a = a
        return max(1, int(device_ms / 1000 / per))

    def claim(self) -> None:
        """Move the metrics' inputs to the device again: a no-op on a GPU.

        The audit engine learns what lives on the device by watching the moves,
        so a count on a CPU calls this inside its guard.
        """
        self.weight = self.weight.to(self.device)
        self.x = self.x.to(self.device)

    def compute(self) -> None:
        """The step's device work: the calibrated sleep kernel (matmuls on a CPU)."""
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        else:
            for _ in range(self.cpu_reps):
                self.cpu_a @ self.cpu_a

    def step(self, i: int) -> dict[str, torch.Tensor]:
        """The device part of a balanced step: the work, then the metrics."""
        self.compute()
        return self.metrics(i)

    def metrics(self, i: int) -> dict[str, torch.Tensor]:
        """The 8 metric values of step ``i``: three small kernels, eight 0-d views."""
        out = torch.tanh(self.weight @ (self.x * (1.0 + 1e-3 * (i % 7))))
        return dict(zip(NAMES, out.unbind(0), strict=True))


Loop = Callable[[int], dict[str, torch.Tensor]]


def balanced_loop(work: DeviceWork, host_ms: float) -> Loop:
    """Host preparation, then the device work: they overlap when nothing syncs."""

    def step(i: int) -> dict[str, torch.Tensor]:
        busy_wait(host_ms)
        return work.step(i)

    return step


def launch_loop(work: DeviceWork, args: argparse.Namespace) -> tuple[Loop, dict[str, Any]]:
    """A launch-bound SGD step of a small MLP, then the metrics."""
    shape = argparse.Namespace(
        device=str(work.device), launch_width=args.launch_width, launch_ms=args.launch_ms
    )
    train, config = build_shape(shape, "launch")

    def step(i: int) -> dict[str, torch.Tensor]:
        train()
        return work.metrics(i)

    return step, config


# -- the rows: ways of logging the 8 metrics ----------------------------------------


class Logger:
    """One way of logging the step's metrics: ``log`` every step, ``finish`` at epoch end."""

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        pass

    def settle(self) -> None:
        """Work deferred to the end of the block that is host time of logging."""

    def finish(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        pass


class ItemLogger(Logger):
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.running = dict.fromkeys(NAMES, 0.0)
        self.steps = 0

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        running = self.running
        for name, value in metrics.items():
            running[name] += value.item()  # the barrier everyone writes
        self.steps += 1

    def finish(self) -> dict[str, float]:
        return {k: v / max(1, self.steps) for k, v in self.running.items()}


class BufferLogger(Logger):
    def __init__(self) -> None:
        self.buf = MetricBuffer(SPECS, default=None)

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        self.buf.update(**metrics, n=n)

    def settle(self) -> None:
        self.buf._fold_all()  # the fold compute() begins with, timed apart from its transfer

    def finish(self) -> dict[str, float]:
        return self.buf.compute()

    def reset(self) -> None:
        self.buf.reset()


class CopyFloorLogger(Logger):
    """``MetricBuffer``'s design with everything that makes it correct taken out.

    One copy kernel a step into a preallocated float64 block, a column sum when
    it is full: no metadata checks, no weights or per-metric reductions. What
    ``MetricBuffer`` costs beyond this row is the price of those.
    """

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None
        self.rows: list[list[torch.Tensor]] = []
        self.reset()

    def reset(self) -> None:
        self.total: torch.Tensor | None = None
        self.steps = 0

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        values = list(metrics.values())
        if self.block is None:
            self.block = torch.zeros(
                (BLOCK_STEPS, len(values)), dtype=torch.float64, device=values[0].device
            )
            self.rows = [list(row.unbind(0)) for row in self.block]
        torch._foreach_copy_(self.rows[self.steps], values)
        self.steps += 1
        if self.steps == BLOCK_STEPS:
            self._fold()

    def settle(self) -> None:
        self._fold()

    def _fold(self) -> None:
        if self.steps and self.block is not None:
            part = self.block[: self.steps].sum(0)
            self.total = part if self.total is None else self.total + part
            self.steps = 0

    def finish(self) -> dict[str, float]:
        self._fold()
        if self.total is None:
            return {}
        return dict(zip(NAMES, self.total.tolist(), strict=True))


class FloorLogger(Logger):
    """The earlier, deferred design's floor: references kept, stacked every 1024 steps.

    Kept as a yardstick between runs: ``MetricBuffer``'s host time over this
    row's compares designs measured on different leases.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.refs: list[torch.Tensor] = []
        self.total: torch.Tensor | None = None
        self.steps = 0

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        self.refs.extend(metrics.values())
        self.steps += 1
        if self.steps == 1024:
            self._fold()

    def settle(self) -> None:
        self._fold()

    def _fold(self) -> None:
        if self.refs:
            part = torch.stack(self.refs).view(-1, len(NAMES)).sum(0)
            self.total = part if self.total is None else self.total + part
            self.refs, self.steps = [], 0

    def finish(self) -> dict[str, float]:
        self._fold()
        if self.total is None:
            return {}
        return dict(zip(NAMES, self.total.tolist(), strict=True))


class MeanMetricLogger(Logger):
    """8 torchmetrics ``MeanMetric``, alone or held in a ``MetricCollection``."""

    def __init__(self, device: torch.device, nan_strategy: str, collection: bool) -> None:
        from torchmetrics import MeanMetric, MetricCollection

        metrics = {name: MeanMetric(nan_strategy=nan_strategy) for name in NAMES}
        self.collection: Any = None
        if collection:
            self.collection = MetricCollection(metrics).to(device)
        else:
            self.metrics = {name: m.to(device) for name, m in metrics.items()}

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        if self.collection is not None:
            collection = self.collection
            for name, value in metrics.items():
                collection[name].update(value)
        else:
            members = self.metrics
            for name, value in metrics.items():
                members[name].update(value)

    def finish(self) -> dict[str, float]:
        if self.collection is not None:
            return {k: v.item() for k, v in self.collection.compute().items()}
        return {k: m.compute().item() for k, m in self.metrics.items()}

    def reset(self) -> None:
        if self.collection is not None:
            self.collection.reset()
        else:
            for m in self.metrics.values():
                m.reset()


class FloatMeanMetricLogger(MeanMetricLogger):
    """Probe: each ``MeanMetric`` gets a Python float (a number the host already has)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, "disable", collection=False)
        self.k = 0

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        self.k += 1
        for m in self.metrics.values():
            m.update(0.5 * (self.k % 3))


class SharedCollectionLogger(Logger):
    """Probe: ``MetricCollection.update(x)``, which gives every member the same value."""

    def __init__(self, device: torch.device, compute_groups: bool) -> None:
        from torchmetrics import MeanMetric, MetricCollection

        self.collection = MetricCollection(
            {name: MeanMetric(nan_strategy="disable") for name in NAMES},
            compute_groups=compute_groups,
        ).to(device)

    def log(self, metrics: dict[str, torch.Tensor], n: int) -> None:
        self.collection.update(metrics["loss"])

    def finish(self) -> dict[str, float]:
        return {k: v.item() for k, v in self.collection.compute().items()}

    def reset(self) -> None:
        self.collection.reset()


def make_logger(name: str, device: torch.device) -> Logger:
    """The logger of a row (``ROWS``) or probe (``PROBES``)."""
    if name == "nothing":
        return Logger()
    if name == "item":
        return ItemLogger()
    if name == "buffer":
        return BufferLogger()
    if name == "refs_floor":
        return FloorLogger()
    if name == "copy_floor":
        return CopyFloorLogger()
    if name in TM_ROWS:
        return MeanMetricLogger(
            device,
            "disable" if name.endswith("_disable") else "warn",
            collection=name.startswith("tm_collection"),
        )
    if name == "tm_mean_disable_float":
        return FloatMeanMetricLogger(device)
    if name in ("collection_update_groups", "collection_update_no_groups"):
        return SharedCollectionLogger(device, compute_groups=name == "collection_update_groups")
    raise ValueError(f"unknown row {name!r}")


# -- timing the plain loops ---------------------------------------------------------


def run_block(step: Loop, logger: Logger, steps: int) -> tuple[float, float, float]:
    """One block of ``steps`` steps, then ``finish()``, between two device syncs.

    Returns the block's seconds, the host seconds spent logging (``perf_counter``
    around each step's ``log`` and the ``settle()`` after the last, no synchronize
    inside) and the seconds from the last step to the end (``settle()``,
    ``finish()`` and the final sync).
    """
    logger.reset()
    clock = time.perf_counter
    spent = 0.0
    sync()
    t0 = clock()
    for i in range(steps):
        metrics = step(i)
        t = clock()
        logger.log(metrics, BATCH)
        spent += clock() - t
    t = clock()
    logger.settle()
    spent += clock() - t
    t1 = clock()
    logger.finish()
    sync()
    t2 = clock()
    return t2 - t0, spent, t2 - t1


def time_loop(
    step: Loop,
    device: torch.device,
    rows: Sequence[str],
    args: argparse.Namespace,
    device_step: Loop | None = None,
) -> dict[str, Any]:
    """Paired rounds of every row on one loop, after a warm-up block each.

    With ``device_step`` (the step's device work alone) the record's ``pace`` also
    has the device's time per step, beside the host's: whichever is longer sets
    the pace of the ``nothing`` row.
    """
    loggers = {name: make_logger(name, device) for name in rows}
    for name in rows:
        run_block(step, loggers[name], args.warmup)
    spent: dict[str, list[float]] = {name: [] for name in rows}
    finish: dict[str, list[float]] = {name: [] for name in rows}

    def run(name: str) -> float:
        seconds, in_updates, tail = run_block(step, loggers[name], args.steps)
        spent[name].append(in_updates)
        finish[name].append(tail)
        return seconds

    rounds = paired_rounds(list(rows), run, args.repeats)
    summary = paired_summary(rounds, rows, args.steps, base="nothing")
    times = {name: [r[name] for r in rounds] for name in rows}
    # The host's time per step: until the last step of a block is queued, before its
    # finish() and final sync (the host never waits on the device in the nothing row).
    host_ms = (
        median([t - tail for t, tail in zip(times["nothing"], finish["nothing"], strict=True)])
        * 1e3
        / args.steps
    )
    median_s = {name: median(ts) for name, ts in times.items()}
    update_us = {name: sum(s) / (len(s) * args.steps) * 1e6 for name, s in spent.items()}
    return {
        "times_s": times,
        "median_s": median_s,
        "ms_per_step": {k: 1000 * v / args.steps for k, v in median_s.items()},
        "ratio_median": summary["ratio_median"],
        "ratio_quartiles": summary["ratio_quartiles"],
        "ratios": summary["ratios"],
        "update_us": update_us,
        "update_us_per_metric": {k: v / len(NAMES) for k, v in update_us.items()},
        "finish_ms": {name: median(ts) * 1e3 for name, ts in finish.items()},
        "pace": {
            "host_ms_per_step": host_ms,
            "device_ms_per_step": None
            if device_step is None or device.type != "cuda"
            else device_pace(device_step, args.steps),
        },
    }


HOST_ROWS = ("refs_floor", "copy_floor", "buffer")


def host_rows(work: DeviceWork, args: argparse.Namespace) -> dict[str, Any]:
    """The logging rows' own host time, with no loop around them.

    Each row logs the same precomputed metrics (``--steps`` steps a block, then
    ``settle()``), timed with the thread's CPU clock (another process on a shared
    host does not count), ``--repeats`` rounds in rotating order; medians.
    """
    metrics = [work.metrics(i) for i in range(args.steps)]
    sync()
    loggers = {name: make_logger(name, work.device) for name in HOST_ROWS}
    clock = time.thread_time_ns

    def run(name: str) -> float:
        logger = loggers[name]
        logger.reset()
        log = logger.log
        t0 = clock()
        for m in metrics:
            log(m, BATCH)
        logger.settle()
        spent = clock() - t0
        logger.finish()
        sync()
        return spent / 1e3 / args.steps

    for name in HOST_ROWS:
        run(name)
    us: dict[str, list[float]] = {name: [] for name in HOST_ROWS}
    for k in range(max(args.repeats, 3)):
        for name in HOST_ROWS[k % 3 :] + HOST_ROWS[: k % 3]:
            us[name].append(run(name))
    update_us = {name: median(v) for name, v in us.items()}
    return {
        "update_us": update_us,
        "rounds_us": us,
        "floor_ratio": update_us["buffer"] / update_us["refs_floor"],
        "over_copy_floor_us": update_us["buffer"] - update_us["copy_floor"],
    }


def device_pace(device_step: Loop, steps: int, repeats: int = 3) -> float:
    """The device's ms per step: the step's kernels alone, queued back to back.

    The median of ``repeats`` blocks of ``steps`` steps, timed with CUDA events
    after a warm-up block; with no host work between them the device never idles.
    """
    ms = []
    for i in range(steps):
        device_step(i)
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(steps):
            device_step(i)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end) / steps)
    return median(ms)


# -- counting syncs -----------------------------------------------------------------


def _short(path: str | None) -> str | None:
    """A framework file as ``package/module.py`` (the part after site-packages)."""
    if not path:
        return None
    parts = Path(path).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    return "/".join(parts[-2:])


def _sites(report: barrierguard.Report) -> list[dict[str, Any]]:
    """The report's sites, costliest first, as plain data."""
    return [
        {
            "line": s.location,
            "framework": (
                f"{_short(s.framework_file)}:{s.framework_line}" if s.framework_file else None
            ),
            "kind": s.kind,
            "blocking": s.blocking,
            "mechanisms": dict(s.mechanisms),
            "count": s.count,
            "setup_count": s.setup_count,
            "step_count": s.step_count,
            "after_loop": dict(s.phases).get("after-loop", 0),
            "events": max(s.events, s.count),
        }
        for s in report.ranked()
    ]


def _setup_syncs(report: barrierguard.Report) -> int:
    return sum(s.setup_count for s in report.sites if s.blocking)


def _sync_record(
    engine: str, during: barrierguard.Report, final: barrierguard.Report
) -> dict[str, Any]:
    """Syncs per measured step (``during``: before the end-of-epoch reduction) and at the end."""
    measured = during.measured_steps
    return {
        "engine": engine,
        "measured_steps": measured,
        "per_step": during.step_syncs / measured if measured else float("nan"),
        "at_end": final.total_syncs - during.total_syncs,  # after the loop: counted apart
        "setup": _setup_syncs(final),
        "sites": _sites(final),
    }


def count_syncs(
    step: Loop,
    logger: Logger,
    engine: str,
    warmup: int,
    steps: int,
    prepare: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Syncs of one row under barrierguard: per step, at ``finish()``, and in setup.

    ``guard.step()`` opens each step, so step ``i`` of the loop is the guard's
    step ``i + 1``; the first ``warmup`` are setup, the next ``steps`` measured.
    ``prepare`` runs first inside the guard (in setup).
    """
    guard = barrierguard.watch(engine=engine, policy="record", memory=False, warmup_steps=warmup)
    with guard:
        if prepare is not None:
            prepare()
        for i in range(warmup + steps):
            guard.step()
            logger.log(step(i), BATCH)
        during = guard.report
        logger.finish()
    return _sync_record(engine, during, guard.report)


def count_row(
    step: Loop, work: DeviceWork, row: str, engine: str, args: argparse.Namespace
) -> dict[str, Any]:
    """:func:`count_syncs` of a fresh logger of ``row`` (built before the guard starts)."""
    logger = make_logger(row, work.device)
    return count_syncs(
        step, logger, engine, args.count_warmup, args.count_steps, prepare=work.claim
    )


def where(record: dict[str, Any]) -> str:
    """Where a row syncs, for a table cell: the framework mechanisms found, else the
    first line that syncs in the measured steps (its end-of-epoch reduction included)."""
    sites = [s for s in record.get("sites", []) if s["blocking"]]
    named = [s for s in sites if s["mechanisms"]]
    if named:
        named.sort(key=lambda s: (-s["step_count"], -s["count"]))
        return "; ".join(
            f"{s['framework'] or s['line']} ({', '.join(s['mechanisms'])})" for s in named[:2]
        )
    for site in sites:
        if site["step_count"]:
            return str(site["framework"] or site["line"])
    return "-"


# -- Lightning fits -----------------------------------------------------------------


def fit_settings(args: argparse.Namespace) -> argparse.Namespace:
    """``bench_lightning``'s MLP, one epoch of warm-up + timed batches.

    Tiny under ``--quick`` and on a machine without CUDA (where the fits run on
    the CPU: nothing to measure there, and the full model takes minutes).
    """
    settings = lightning_settings("mlp", args.fit_warmup + args.fit_steps)
    if args.quick or not torch.cuda.is_available():
        settings.batch, settings.width, settings.hidden, settings.blocks = 16, 64, 64, 2
    return settings


def fit_module(mode: str, settings: argparse.Namespace) -> Any:
    """bench_lightning's host-bound MLP, logging 8 values per step as ``mode`` says."""
    import lightning.pytorch as pl

    class MetricsMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            hidden = settings.hidden
            layers: list[nn.Module] = [nn.Linear(settings.width, hidden), nn.GELU()]
            for _ in range(settings.blocks - 1):
                layers += [nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU()]
            layers.append(nn.Linear(hidden, 10))
            self.net = nn.Sequential(*layers)
            self.register_buffer("scales", torch.linspace(0.5, 1.5, len(NAMES)))
            self.train_metrics = MetricBuffer(SPECS, default=None) if mode == "buffer" else None
            self.results: dict[str, float] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            values = (loss.detach() * self.scales).unbind(0)  # one kernel, 8 values
            if mode == "self_log":
                for name, value in zip(NAMES, values, strict=True):
                    self.log(name, value, on_step=False, on_epoch=True)
            elif self.train_metrics is not None:
                self.train_metrics.update(dict(zip(NAMES, values, strict=True)), n=x.shape[0])
            return loss

        def on_train_epoch_end(self) -> None:
            if self.train_metrics is not None:
                self.results = self.train_metrics.compute()  # the one transfer of the epoch
                self.train_metrics.reset()
                # Host tensors: Lightning keeps them on the host, no copy to the device.
                self.log_dict({k: torch.tensor(v) for k, v in self.results.items()})

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return MetricsMLP()


def run_fit(
    mode: str,
    settings: argparse.Namespace,
    loader: Any,
    warmup: int,
    guard: Any = None,
) -> dict[str, Any]:
    """One fit; the time per step after ``warmup`` batches, epoch end included.

    With ``guard`` (not started), the fit runs under it: ``guard.step()`` at each
    batch start, a report snapshot after the last batch (before the epoch end),
    and no synchronize of its own (its times then mean nothing).
    """
    import lightning.pytorch as pl

    last = settings.steps - 1
    stamps: list[float] = []
    marks: dict[str, Any] = {}

    class Clock(pl.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            if guard is not None:
                guard.step()

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx == warmup - 1 and guard is None:
                sync()  # not under a guard: the CUDA engine would count this sync
            if batch_idx >= warmup - 1:
                stamps.append(time.perf_counter())
            if guard is not None and batch_idx == last:
                marks["during"] = guard.report

        def on_train_end(self, *a: Any) -> None:
            if guard is None:
                sync()
            marks["end"] = time.perf_counter()

    module = fit_module(mode, settings)
    trainer = lightning_trainer([Clock()])
    gc.collect()
    torch.manual_seed(0)
    if guard is not None:
        with guard:
            trainer.fit(module, loader)
    else:
        trainer.fit(module, loader)
    if "end" not in marks or len(stamps) < 2:
        raise RuntimeError(f"the {mode} fit ran {len(stamps)} timed batches, expected more")
    steps = len(stamps) - 1
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "s": marks["end"] - stamps[0],
        "steps": steps,
        "median_step_s": median(gaps),
        "during": marks.get("during"),
        "results": module.results,
    }


def time_fits(
    args: argparse.Namespace, settings: argparse.Namespace, loader: Any
) -> dict[str, Any]:
    """Paired rounds of the three fits, after untimed warm-up fits."""
    names = list(FIT_ROWS)
    for _ in range(args.fit_warm_fits):
        for name in names:
            run_fit(name, settings, loader, args.fit_warmup)
    medians: dict[str, list[float]] = {name: [] for name in names}

    def run(name: str) -> float:
        rec = run_fit(name, settings, loader, args.fit_warmup)
        medians[name].append(rec["median_step_s"])
        return float(rec["s"])

    rounds = paired_rounds(names, run, args.fits)
    summary = paired_summary(rounds, names, args.fit_steps, base="nothing")
    gpu = torch.cuda.is_available()
    return {
        "model": (
            f"MLP {settings.blocks}x{settings.hidden}, in {settings.width}, batch "
            f"{settings.batch}, AdamW, {'bf16-mixed' if gpu else '32-true'}"
        ),
        "settings": {
            "batch": settings.batch,
            "width": settings.width,
            "hidden": settings.hidden,
            "blocks": settings.blocks,
            "warmup_batches": args.fit_warmup,
            "timed_batches": args.fit_steps,
            "fits": args.fits,
            "warm_fits": args.fit_warm_fits,
        },
        "rows": FIT_ROWS,
        "times_s": {name: [r[name] for r in rounds] for name in names},
        "ms_per_step": summary["step_ms"],
        "ratio_median": summary["ratio_median"],
        "ratio_quartiles": summary["ratio_quartiles"],
        "ratios": summary["ratios"],
        "median_step_ms": {name: median(v) * 1e3 for name, v in medians.items()},
    }


def count_fit_syncs(
    args: argparse.Namespace, settings: argparse.Namespace, loader: Any, engine: str
) -> dict[str, Any]:
    """One fit per row under barrierguard: syncs per batch, at the epoch end, in setup."""
    records: dict[str, Any] = {}
    for name in FIT_ROWS:
        guard = barrierguard.watch(
            engine=engine, policy="record", memory=False, warmup_steps=args.fit_warmup
        )
        rec = run_fit(name, settings, loader, args.fit_warmup, guard=guard)
        during = rec["during"]
        if during is None:
            raise RuntimeError(f"the {name} fit never reached its last batch")
        record = _sync_record(engine, during, guard.report)
        record["at_epoch_end"] = record.pop("at_end")
        records[name] = record
    return records


# -- the report ---------------------------------------------------------------------


def goals(loops: dict[str, Any], fits: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's goals and the decision's inputs, from the measured rows."""
    out: dict[str, Any] = {
        "host_target": HOST_TARGET,
        "balanced_target": BALANCED_TARGET,
        "per_loop": {},
    }
    for name, loop in loops.items():
        syncs = loop.get("syncs", {})
        free = [r for r in TM_ROWS if r in syncs and syncs[r].get("per_step") == 0]
        entry: dict[str, Any] = {"sync_free_torchmetrics": free}
        if free and "update_us" in loop:
            cheapest = min(free, key=lambda r: loop["update_us"][r])
            buffer_us = loop["update_us"]["buffer"]
            entry.update(
                cheapest_sync_free=cheapest,
                host_ratio=loop["update_us"][cheapest] / buffer_us if buffer_us else None,
                step_ratio=loop["ratio_median"][cheapest] / loop["ratio_median"]["buffer"],
            )
        if "ratio_median" in loop:
            entry["buffer_over_nothing"] = loop["ratio_median"]["buffer"]
        if "update_us" in loop and "ms_per_step" in loop:
            # The balanced goal in host time: where the host sets the pace, a logger's
            # host time adds to the step in full, so 1% of the step is all it may spend.
            entry["one_percent_us"] = loop["ms_per_step"]["nothing"] * 1e3 * (BALANCED_TARGET - 1)
            entry["buffer_us"] = loop["update_us"]["buffer"]
            if "refs_floor" in loop["update_us"]:
                entry["floor_us"] = loop["update_us"]["refs_floor"]
                floor = entry["floor_us"]
                entry["floor_ratio"] = entry["buffer_us"] / floor if floor else None
                entry["previous_floor_ratio"] = previous = PREVIOUS_FLOOR_RATIO.get(name)
                if entry["floor_ratio"] is not None and previous:
                    # The keep rule: within 10% of the deferred design's host time.
                    entry["floor_rule_met"] = entry["floor_ratio"] <= FLOOR_RULE * previous
            if "copy_floor" in loop["update_us"]:
                entry["copy_floor_us"] = loop["update_us"]["copy_floor"]
        out["per_loop"][name] = entry
    verdicts = [e["floor_rule_met"] for e in out["per_loop"].values() if "floor_rule_met" in e]
    if verdicts:
        out["floor_rule_met"] = all(verdicts)
    ratios = [e.get("host_ratio") for e in out["per_loop"].values()]
    if ratios and all(r is not None for r in ratios):
        out["host_goal_met"] = all(r >= HOST_TARGET for r in ratios)
    balanced = out["per_loop"].get("balanced", {}).get("buffer_over_nothing")
    if balanced is not None:
        out["balanced_goal_met"] = balanced <= BALANCED_TARGET
    if fits and "ratio_median" in fits:
        out["lightning"] = {
            "self_log_over_nothing": fits["ratio_median"]["self_log"],
            "buffer_over_nothing": fits["ratio_median"]["buffer"],
        }
    return out


def _iqr(loop: dict[str, Any], name: str) -> str:
    if name == "nothing":
        return "1"
    q = loop["ratio_quartiles"][name]
    return f"{loop['ratio_median'][name]:.3f} ({q[0]:.3f}-{q[1]:.3f})"


def _syncs_cells(record: dict[str, Any] | None, end_key: str) -> list[str]:
    if not record or "per_step" not in record:
        return ["?", "?", "?", "-"]
    return [
        f"{record['per_step']:.2f}",
        str(record[end_key]),
        str(record["setup"]),
        where(record),
    ]


def print_original(loop: dict[str, Any]) -> None:
    """The three rows this script had first, in the table it printed then."""
    print("\nthe first three rows, as earlier runs printed them:\n")
    print("| loop | median (s) | ms/step | vs nothing |")
    print("|---|---:|---:|---:|")
    nothing = loop["median_s"]["nothing"]
    for row in ORIGINAL_ROWS:
        s = loop["median_s"][row]
        print(f"| {row} | {s:.4f} | {loop['ms_per_step'][row]:.3f} | {s / nothing:.3f}x |")


def print_loop(name: str, loop: dict[str, Any], config: dict[str, Any]) -> None:
    print(f"\n## {name} loop: {config}\n")
    pace = loop.get("pace", {})
    if pace.get("device_ms_per_step") is not None:
        host, dev = pace["host_ms_per_step"], pace["device_ms_per_step"]
        side = "the host" if host > dev else "the device"
        print(
            f"pace of the nothing row: host {host:.3f} ms/step, device {dev:.3f} ms/step: "
            f"{side} sets the pace by {abs(host - dev) * 1e3:.0f} us\n"
        )
    rows = []
    for row in loop["times_s"]:
        rows.append(
            [
                row,
                f"{loop['ms_per_step'][row]:.3f}",
                _iqr(loop, row),
                f"{loop['update_us'][row]:.1f}",
                f"{loop['finish_ms'][row]:.2f}",
                *_syncs_cells(loop.get("syncs", {}).get(row), "at_end"),
            ]
        )
    print(
        table(
            [
                "row",
                "ms/step",
                "vs nothing (IQR)",
                "host us/step, 8 updates",
                "end ms",
                "syncs/step",
                "syncs at end",
                "setup syncs",
                "where (mechanism)",
            ],
            rows,
        )
    )


def print_fits(fits: dict[str, Any]) -> None:
    print(f"\n## Lightning Trainer.fit: {fits['model']}\n")
    rows = []
    for row in FIT_ROWS:
        rows.append(
            [
                row,
                f"{fits['ms_per_step'][row]:.3f}",
                _iqr(fits, row),
                f"{fits['median_step_ms'][row]:.3f}",
                *_syncs_cells(fits.get("syncs", {}).get(row), "at_epoch_end"),
            ]
        )
    print(
        table(
            [
                "row",
                "ms/step",
                "vs nothing (IQR)",
                "median step ms",
                "syncs/step",
                "syncs at epoch end",
                "setup syncs",
                "where (mechanism)",
            ],
            rows,
        )
    )


def print_goals(g: dict[str, Any]) -> None:
    print()
    for name, entry in g["per_loop"].items():
        if "cheapest_sync_free" in entry:
            print(
                f"{name}: cheapest sync-free torchmetrics = {entry['cheapest_sync_free']}: "
                f"host time of the 8 updates {entry['host_ratio']:.1f}x MetricBuffer's "
                f"(goal >= {HOST_TARGET:g}x); per step {entry['step_ratio']:.3f}x MetricBuffer's"
            )
        else:
            print(f"{name}: no sync-free torchmetrics row found ({entry})")
    if "buffer_over_nothing" in g["per_loop"].get("balanced", {}):
        ratio = g["per_loop"]["balanced"]["buffer_over_nothing"]
        print(
            f"balanced: MetricBuffer / nothing = {ratio:.4f} per step, median of paired rounds "
            f"(goal <= {BALANCED_TARGET})"
        )
        entry = g["per_loop"]["balanced"]
        if "one_percent_us" in entry:
            floor = f", refs_floor {entry['floor_us']:.1f} us" if "floor_us" in entry else ""
            if "copy_floor_us" in entry:
                floor += f", copy_floor {entry['copy_floor_us']:.1f} us"
            print(
                f"balanced: host time a step: MetricBuffer {entry['buffer_us']:.1f} us{floor}; "
                f"1% of the no-logging step is {entry['one_percent_us']:.1f} us (all a logger "
                f"may spend where the host sets the pace)"
            )
    for name, entry in g["per_loop"].items():
        if entry.get("floor_ratio") and entry.get("previous_floor_ratio"):
            change = entry["floor_ratio"] / entry["previous_floor_ratio"]
            print(
                f"{name}: MetricBuffer's host time = {entry['floor_ratio']:.2f}x refs_floor's "
                f"(the deferred design: {entry['previous_floor_ratio']:.2f}x): {change:.3f}x "
                f"the deferred design's (goal <= {FLOOR_RULE:.2f}: "
                f"{'met' if entry.get('floor_rule_met') else 'missed'})"
            )
    if "lightning" in g:
        lt = g["lightning"]
        print(
            f"Lightning fit: self.log / nothing = {lt['self_log_over_nothing']:.4f}, "
            f"MetricBuffer / nothing = {lt['buffer_over_nothing']:.4f}"
        )


def print_report(result: dict[str, Any]) -> None:
    """Every table: the loops, the probes, the fits, then the goals."""
    print("\nrows:")
    for row, text in ROWS.items():
        print(f"  {row}: {text}")
    for name, loop in result["loops"].items():
        if "times_s" in loop:
            print_loop(name, loop, loop["config"])
            if name == "balanced":
                print_original(loop)
    probes = result["probes"]
    if probes:
        print("\n## count-only probes (torchmetrics mechanisms no timed row has)\n")
        print(
            table(
                ["probe", "syncs/step", "syncs at end", "setup syncs", "where (mechanism)"],
                [[p, *_syncs_cells(rec, "at_end")] for p, rec in probes.items()],
            )
        )
        for p, text in PROBES.items():
            print(f"  {p}: {text}")
    fits = result["lightning"]
    if fits and "ms_per_step" in fits:
        print_fits(fits)
        print("  " + "; ".join(f"{k}: {v}" for k, v in FIT_ROWS.items()))
    print_goals(result["goals"])
    if "item_over_buffer" in result:
        print(
            f"balanced: item / buffer = {result['item_over_buffer']:.2f}x (target >= 1.6); "
            f"buffer / nothing = {result['buffer_over_nothing']:.3f} (ratio of medians)"
        )


# -- main -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test")
    parser.add_argument("--loops", default="balanced,launch", help="balanced, launch or both")
    parser.add_argument("--steps", type=int, default=500, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=15, help="paired rounds per loop")
    parser.add_argument("--warmup", type=int, default=20, help="steps per row first")
    parser.add_argument("--host-ms", type=float, default=1.0, help="balanced: host preparation")
    parser.add_argument("--device-ms", type=float, default=1.0, help="balanced: device compute")
    parser.add_argument("--launch-ms", type=float, default=1.0, help="launch: target step time")
    parser.add_argument("--launch-width", type=int, default=256, help="launch: MLP width")
    parser.add_argument("--count-steps", type=int, default=32, help="measured steps per count")
    parser.add_argument("--count-warmup", type=int, default=4, help="setup steps per count")
    parser.add_argument("--count-engine", choices=("cuda", "audit"), help="default: by device")
    parser.add_argument(
        "--fits", type=int, help="paired rounds of fits; 0: none (default 6; 1 without CUDA)"
    )
    parser.add_argument("--fit-steps", type=int, default=100, help="timed batches per fit")
    parser.add_argument("--fit-warmup", type=int, default=20, help="untimed batches first")
    parser.add_argument(
        "--fit-warm-fits", type=int, help="untimed fits per row (default 1; 0 without CUDA)"
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    # Without CUDA the fits are a smoke run (a tiny model on the CPU): one round, no warm fit.
    gpu = torch.cuda.is_available()
    if args.fits is None:
        args.fits = 6 if gpu else 1
    if args.fit_warm_fits is None:
        args.fit_warm_fits = 1 if gpu else 0
    if args.quick:
        args.steps, args.repeats, args.warmup = 8, 2, 2
        args.host_ms, args.device_ms, args.launch_ms, args.launch_width = 0.1, 0.1, 0.2, 32
        args.count_steps, args.count_warmup = 4, 1
        args.fits, args.fit_steps, args.fit_warmup, args.fit_warm_fits = min(args.fits, 1), 4, 2, 0
    args.loops = [name for name in args.loops.split(",") if name]
    for name in args.loops:
        if name not in ("balanced", "launch"):
            parser.error(f"--loops: unknown loop {name!r}; use balanced, launch")
    if args.fit_warmup < 1 or args.fit_steps < 1:
        parser.error("--fit-warmup and --fit-steps must be at least 1")
    return args


class _Tee:
    """A text stream that writes to several: the console and the log under ``$OUT``."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; with ``$OUT`` set, its output and JSON go there too."""
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return _main(argv, None)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with (
        open(Path(out_dir) / "bench_metrics.log", "a") as log,
        contextlib.redirect_stdout(_Tee(sys.stdout, log)),
        contextlib.redirect_stderr(_Tee(sys.stderr, log)),
    ):
        return _main(argv, Path(out_dir))


def _main(argv: list[str] | None, out_dir: Path | None) -> dict[str, Any]:
    started = time.perf_counter()
    args = parse_args(argv)
    args.out_dir = out_dir
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    engine = args.count_engine or ("cuda" if device.type == "cuda" else "audit")
    if engine == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_metrics.py: --count-engine cuda needs a CUDA device")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The "device" work runs on the host: one thread keeps the run steady where other
        # processes share the cores (oversubscribed intra-op threads ran it 10x slower).
        torch.set_num_threads(1)
    try:
        return measure(args, device, engine, started)
    finally:
        torch.set_num_threads(threads)


def measure(
    args: argparse.Namespace, device: torch.device, engine: str, started: float
) -> dict[str, Any]:
    """Every part of the benchmark, in order; see the module docstring."""
    errors: list[str] = []

    def attempt(what: str, fn: Callable[[], Any]) -> Any:
        # A failure in one part is reported and the rest still runs and is written.
        try:
            return fn()
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
            print(f"!! {what} failed:", flush=True)
            traceback.print_exc()
            return None

    result: dict[str, Any] = {
        "benchmark": "metrics_logging",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor(),
        "torch": torch.__version__,
        "steps": args.steps,
        "repeats": args.repeats,
        "host_ms": args.host_ms,
        "device_ms": args.device_ms,
        "metrics_per_step": len(NAMES),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "out_dir")},
        "rows": ROWS,
        "probe_rows": PROBES,
        "count_engine": engine,
    }
    result["versions"] = {}
    for package in ("torchmetrics", "lightning"):
        try:
            result["versions"][package] = __import__(package).__version__
        except ImportError:  # pragma: no cover - both are dependencies
            result["versions"][package] = None
    print(
        f"{len(NAMES)} metrics/step, {args.steps} steps x {args.repeats} paired rounds per loop on "
        f"{result['device_name']} ({device}); syncs counted by barrierguard's {engine} engine"
        + (
            ""
            if engine == "cuda"
            else " (no CUDA here: the audit engine stands in, and tells which lines would "
            "sync on a GPU)"
        ),
        flush=True,
    )

    # 1. Build the loops (the sleep kernel and the launch-bound MLP are calibrated here).
    work = DeviceWork(device, args.device_ms)
    steps: dict[str, Loop] = {}
    device_steps: dict[str, Loop] = {}
    configs: dict[str, dict[str, Any]] = {}
    for name in args.loops:
        if name == "balanced":
            steps[name] = balanced_loop(work, args.host_ms)
            device_steps[name] = work.step
            configs[name] = {"host_ms": args.host_ms, "device_ms": args.device_ms}
        else:
            built = attempt("launch loop setup", functools.partial(launch_loop, work, args))
            if built is not None:
                steps[name], configs[name] = built

    # 2. Time the rows' own host time, the plain loops, then the fits: before any
    # engine has patched torch.
    hosts = attempt("host rows", functools.partial(host_rows, work, args))
    if hosts is not None:
        result["host_rows"] = hosts
        times = ", ".join(f"{k} {v:.2f} us" for k, v in hosts["update_us"].items())
        print(
            f"host time a step, no loop around it (thread CPU time): {times}; MetricBuffer "
            f"= {hosts['floor_ratio']:.2f}x refs_floor, copy_floor + "
            f"{hosts['over_copy_floor_us']:.2f} us",
            flush=True,
        )
    loops: dict[str, dict[str, Any]] = {}
    for name, step in steps.items():
        print(f"timing the {name} loop: {len(ROWS)} rows", flush=True)
        t0 = time.perf_counter()
        timing = attempt(
            f"{name} loop timing",
            functools.partial(time_loop, step, device, list(ROWS), args, device_steps.get(name)),
        )
        if timing is not None:
            loops[name] = {"config": configs[name], **timing}
            print(f"  {time.perf_counter() - t0:.1f} s", flush=True)
    fits: dict[str, Any] | None = None
    settings = fit_settings(args)
    loader: Any = None
    if args.fits:
        quiet_lightning()
        # Built once (some 0.5 GB at the defaults): every fit iterates it again.
        loader = attempt("Lightning data", functools.partial(lightning_loader, settings))
    if loader is not None:
        print(f"timing Lightning fits: {args.fits} rounds of {len(FIT_ROWS)} fits", flush=True)
        t0 = time.perf_counter()
        fits = attempt("Lightning fit timing", functools.partial(time_fits, args, settings, loader))
        print(f"  {time.perf_counter() - t0:.1f} s", flush=True)

    # 3. Count syncs, one short pass per row, under barrierguard.
    print(f"counting syncs ({engine} engine)", flush=True)
    for name, step in steps.items():
        record = loops.setdefault(name, {"config": configs[name]})
        record["syncs"] = {}
        for row in ROWS:
            counted = attempt(
                f"{name} loop, {row}: counting",
                functools.partial(count_row, step, work, row, engine, args),
            )
            if counted is not None:
                record["syncs"][row] = counted
    probes: dict[str, Any] = {}
    if steps:
        probe_step = next(iter(steps.values()))
        for row in PROBES:
            counted = attempt(
                f"probe {row}: counting",
                functools.partial(count_row, probe_step, work, row, engine, args),
            )
            if counted is not None:
                probes[row] = counted
    if loader is not None:
        fit_syncs = attempt(
            "Lightning fits: counting",
            functools.partial(count_fit_syncs, args, settings, loader, engine),
        )
        if fit_syncs is not None:
            fits = fits if fits is not None else {}
            fits["syncs"] = fit_syncs

    # 4. The report.
    if "balanced" in loops and "times_s" in loops["balanced"]:
        bal = loops["balanced"]
        for key in ("times_s", "median_s", "ms_per_step"):
            result[key] = {row: bal[key][row] for row in ORIGINAL_ROWS}
        result["item_over_buffer"] = bal["median_s"]["item"] / bal["median_s"]["buffer"]
        result["buffer_over_nothing"] = bal["median_s"]["buffer"] / bal["median_s"]["nothing"]
    result["loops"] = loops
    result["probes"] = probes
    result["lightning"] = fits
    result["goals"] = goals(loops, fits)
    attempt("printing the tables", functools.partial(print_report, result))
    elapsed = time.perf_counter() - started
    result["elapsed_s"] = elapsed
    result["errors"] = errors
    print(f"\nelapsed: {elapsed:.1f} s")
    write(args.out, result)
    if args.out_dir is not None:
        write(args.out_dir / Path(args.out or "metrics.json").name, result)
    if errors:
        raise SystemExit("bench_metrics.py: some parts failed:\n  " + "\n  ".join(errors))
    return result


if __name__ == "__main__":
    main()
