"""Overhead of the Lightning callback: a fit with ``BarrierGuard()`` against one without.

Two designs, both timing the training loop only (``on_train_start`` to
``on_train_end``, from a device synchronization on), on the same model and data:

* **lockstep**: two worker processes, one fitting with the callback and one
  without, take turns batch by batch on the same GPU: at each batch end one
  hands the turn to the other (once its GPU work is done, so each turn starts
  on an idle GPU) and sleeps until it comes back. Each process times only its
  own turns, so the two fits run side by side and the host's drifts (other
  tenants, clock changes), which move a whole fit by 5-40 % on a shared host,
  hit both. It is a crossover: the callback passes to the other worker every
  round and the first move every two rounds, so each pair of rounds swaps
  which process (with ``--pin``, which half of the CPUs) and which turn order
  carry the callback. A null row runs two fits *without* the
  callback the same way: how far its ratio lies from 1.000 is what the
  pairing itself contributes. Steps run slower than in a fit alone (a process
  woken at every batch runs on a cold core), so read the ratio, not the step
  time.
* **interleaved**: whole fits one after the other, alternating which goes
  first, in this process. What a user timing two runs would see, but the drift
  between two fits seconds apart widens its IQR far beyond the effect.

Each round gives the with/without ratio of the training-loop time and of the
fits' median steps. Each design reports the median, with its IQR, of the
geometric means of rounds 0-1, 2-3, ...: within such a pair the process, CPUs
and order that carry the callback are swapped, so a bias of one process or of
going first cancels. Every fit starts after a ``gc.collect()``.

Two models, both with AdamW, ``self.log(prog_bar=True)`` of the loss, a pinned
DataLoader and bf16 autocast on the GPU:

* ``--model mlp`` (default): a 4-block MLP (width 1024) on 4096-wide inputs.
  The GPU works a fraction of each step: Lightning's own loop and the
  DataLoader make the step host-bound, the worst case for a callback's host
  work;
* ``--model transformer``: a small causal language model (6 layers of width
  512, sequence 256, vocabulary 8192) with far more GPU work per step (on the
  H200, 16 ms steps against the MLP's 6 ms).

The callback runs with its defaults (CUDA engine on a GPU, memory sampling on).
The target: with / without at most 1.02. To see which part of the callback
costs what, see ``bench_lightning_parts.py``.

GPU:
    PYTHONPATH=src python benchmarks/bench_lightning.py --out benchmarks/results/h200/lightning.json
    PYTHONPATH=src python benchmarks/bench_lightning.py --model transformer --rounds 12 \
        --steps 200 --out benchmarks/results/h200/lightning_transformer.json
CPU smoke test (tiny settings, audit engine):
    PYTHONPATH=src python benchmarks/bench_lightning.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, sync, table, write

import barrierguard

_TURN_TIMEOUT_S = 300.0

# Each model's shape: batch, width (input or model), hidden (or feed-forward), blocks (or layers).
MODEL_DEFAULTS: dict[str, dict[str, int]] = {
    "mlp": {"batch": 256, "width": 4096, "hidden": 1024, "blocks": 4},
    "transformer": {"batch": 32, "width": 512, "hidden": 2048, "blocks": 6},
}


def _module(args: argparse.Namespace) -> Any:
    if args.model == "transformer":
        return _transformer(args)
    return _mlp(args.width, args.hidden, args.blocks)


class _Block(nn.Module):
    """A pre-norm transformer block with causal scaled-dot-product attention."""

    def __init__(self, width: int, ff: int) -> None:
        super().__init__()
        self.heads = width // 64
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, ff), nn.GELU(), nn.Linear(ff, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


def _transformer(args: argparse.Namespace) -> Any:
    """A small causal language model: ``blocks`` pre-norm layers of width ``width``."""
    import lightning.pytorch as pl

    vocab, seq = args.vocab, args.seq

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, args.width)
            self.pos = nn.Parameter(torch.zeros(seq, args.width))
            self.body = nn.Sequential(
                *(_Block(args.width, args.hidden) for _ in range(args.blocks))
            )
            self.norm = nn.LayerNorm(args.width)
            self.head = nn.Linear(args.width, vocab)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            x = self.embed(tokens[:, :-1]) + self.pos[: seq - 1]
            logits = self.head(self.norm(self.body(x)))
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    return TinyLM()


def _mlp(width: int, hidden: int, blocks: int) -> Any:
    import lightning.pytorch as pl

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = [nn.Linear(width, hidden), nn.GELU()]
            for _ in range(blocks - 1):
                layers += [nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU()]
            layers.append(nn.Linear(hidden, 10))
            self.net = nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return MLP()


def _drain() -> None:
    """Wait, untimed, until this process's queued GPU work is done.

    Polls an event (not a sync: no barrier the guard would count), so that the
    partner's turn starts on an idle GPU instead of waiting for a context switch.
    """
    if torch.cuda.is_available():
        event = torch.cuda.Event()
        event.record()
        while not event.query():
            time.sleep(0)


class _Turns:
    """Take turns with a partner process: only one of the two runs at a time."""

    def __init__(self, mine: Any, theirs: Any, barrier: Any) -> None:
        self.mine, self.theirs, self.barrier = mine, theirs, barrier
        self.first = True

    def _wait(self) -> None:
        if not self.mine.acquire(timeout=_TURN_TIMEOUT_S):
            raise TimeoutError("the partner process did not hand the turn back")

    def start(self) -> None:
        """Meet the partner; the first mover goes on, the other waits its turn."""
        self.barrier.wait(_TURN_TIMEOUT_S)
        while self.mine.acquire(block=False):  # the last round's final hand-over
            pass
        self.barrier.wait(_TURN_TIMEOUT_S)
        if not self.first:
            self._wait()

    def hand_over(self) -> None:
        _drain()
        self.theirs.release()
        self._wait()

    def finish(self) -> None:
        self.theirs.release()


class _Clock:
    """A callback that times the training loop from a device sync on.

    With ``turns``, it hands the turn to the partner at every batch end and
    counts only its own turns.
    """

    def __new__(cls, turns: _Turns | None = None) -> Any:
        import lightning.pytorch as pl

        class Clock(pl.Callback):
            def __init__(self) -> None:
                self.turns = turns
                self.seconds = 0.0
                self.steps: list[float] = []
                self._t = 0.0

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                sync()
                if self.turns is not None:
                    self.turns.start()
                self._t = time.perf_counter()

            def on_train_batch_end(self, *args: Any) -> None:
                now = time.perf_counter()
                self.steps.append(now - self._t)
                if self.turns is not None:
                    self.turns.hand_over()
                    now = time.perf_counter()
                self._t = now

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                sync()
                self.seconds = sum(self.steps) + time.perf_counter() - self._t
                if self.turns is not None:
                    self.turns.finish()

            def median_step(self) -> float:
                """Median host time between batch ends (robust to a stray slow step)."""
                return median(self.steps)

        return Clock()


def _loader(args: argparse.Namespace) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch
    if args.model == "transformer":
        data = TensorDataset(torch.randint(0, args.vocab, (n, args.seq), generator=g))
    else:
        data = TensorDataset(
            torch.randn(n, args.width, generator=g), torch.randint(0, 10, (n,), generator=g)
        )
    return DataLoader(
        data, batch_size=args.batch, pin_memory=torch.cuda.is_available(), drop_last=True
    )


def _quiet() -> None:
    warnings.filterwarnings("ignore", module="lightning")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def _trainer(callbacks: list[Any]) -> Any:
    """The benchmark's trainer: one device, one epoch, bf16 on a GPU, nothing extra."""
    import lightning.pytorch as pl

    gpu = torch.cuda.is_available()
    return pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_epochs=1,
        precision="bf16-mixed" if gpu else "32-true",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
        callbacks=callbacks,
    )


def _fit(
    args: argparse.Namespace, loader: DataLoader[Any], guarded: bool, turns: _Turns | None = None
) -> tuple[float, int, float]:
    """One fit: (training-loop seconds, syncs found, median step seconds)."""
    gc.collect()  # each fit starts from the same heap, not from the last one's garbage
    clock = _Clock(turns)
    callbacks: list[Any] = [clock]
    guard = None
    if guarded:
        guard = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
        callbacks.insert(0, guard)
    trainer = _trainer(callbacks)
    torch.manual_seed(0)
    trainer.fit(_module(args), loader)
    syncs = guard.report.total_syncs if guard is not None else 0
    return clock.seconds, syncs, clock.median_step()


def _quartiles(xs: list[float]) -> list[float]:
    return statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3


def _pair_means(ratios: list[float]) -> list[float]:
    """Geometric means of rounds 0-1, 2-3, ...: each pair swaps order and process."""
    return [math.sqrt(ratios[k] * ratios[k + 1]) for k in range(0, len(ratios) - 1, 2)]


def _summary(
    name: str, args: argparse.Namespace, rounds: list[dict[bool, tuple[float, int, float]]]
) -> tuple[list[object], dict[str, Any]]:
    """A table row and the JSON record of one design's rounds."""
    bare = [r[False][0] for r in rounds]
    guarded = [r[True][0] for r in rounds]
    ratios = [r[True][0] / r[False][0] for r in rounds]
    step_ratios = [r[True][2] / r[False][2] for r in rounds]
    pairs, step_pairs = _pair_means(ratios), _pair_means(step_ratios)
    q, qs = _quartiles(pairs), _quartiles(step_pairs)
    syncs = max(r[True][1] for r in rounds)
    step_us = median(bare) / args.steps * 1e6
    row: list[object] = [
        name,
        f"{len(rounds)} x {args.steps}",
        f"{median(bare) * 1e3:.1f} ms ({step_us:.0f} us/step)",
        f"{median(guarded) * 1e3:.1f} ms",
        f"**{median(pairs):.4f}** ({q[0]:.4f}-{q[2]:.4f})",
        f"{median(step_pairs):.4f} ({qs[0]:.4f}-{qs[2]:.4f})",
        f"{syncs}",
    ]
    record = {
        "bare_s": bare,
        "guarded_s": guarded,
        "ratios": ratios,
        "pair_ratios": pairs,
        "median_ratio": median(pairs),
        "iqr": [q[0], q[2]],
        "step_ratios": step_ratios,
        "step_pair_ratios": step_pairs,
        "median_step_ratio": median(step_pairs),
        "step_iqr": [qs[0], qs[2]],
        "syncs_found": syncs,
    }
    return row, record


def _interleaved(args: argparse.Namespace) -> list[dict[bool, tuple[float, int, float]]]:
    loader = _loader(args)
    _fit(args, loader, False)  # warm-up: CUDA context, cuBLAS, allocator, imports
    _fit(args, loader, True)
    rounds = []
    for i in range(args.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        rounds.append({flag: _fit(args, loader, flag) for flag in order})
    return rounds


def _cores(index: int) -> set[int] | None:
    """Half of this machine's usable CPUs for lockstep worker ``index`` (None: too few)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 4:
        return None
    half = len(cpus) // 2
    return set(cpus[:half] if index == 0 else cpus[half:])


def _lockstep_worker(
    args: argparse.Namespace,
    index: int,
    partner_guarded: bool,
    mine: Any,
    theirs: Any,
    barrier: Any,
    results: Any,
) -> None:
    cores = _cores(index) if args.pin else None
    if cores is not None:
        os.sched_setaffinity(0, cores)
    _quiet()
    loader = _loader(args)
    try:
        _fit(args, loader, partner_guarded)  # warm-up, side by side with the partner's
        turns = _Turns(mine, theirs, barrier)
        for i in range(args.rounds):
            # A crossover: the "with" role passes to the other worker every round,
            # the first move every two rounds, so each pair of rounds (0-1, 2-3,
            # ...) swaps which process, which CPUs and which turn order carry it.
            mine_with = i % 2 == index
            turns.first = (i // 2) % 2 == index
            res = _fit(args, loader, partner_guarded and mine_with, turns)
            results.put((mine_with, i, res))
    except BaseException as exc:
        barrier.abort()
        results.put((False, -1, repr(exc)))
        raise


def _lockstep(
    args: argparse.Namespace, partner_guarded: bool = True
) -> list[dict[bool, tuple[float, int, float]]]:
    """Rounds of a bare fit side by side with a guarded one (or a bare one, the null row)."""
    ctx = mp.get_context("spawn")
    sems = (ctx.Semaphore(0), ctx.Semaphore(0))
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=_lockstep_worker,
            args=(args, i, partner_guarded, sems[i], sems[1 - i], barrier, results),
        )
        for i in range(2)
    ]
    for w in workers:
        w.start()
    rounds: list[dict[bool, tuple[float, int, float]]] = [{} for _ in range(args.rounds)]
    try:
        for _ in range(2 * args.rounds):
            slot, i, res = results.get(timeout=_TURN_TIMEOUT_S * 2)
            if i < 0:
                raise RuntimeError(f"a lockstep worker failed: {res}")
            # In the null row the worker holding the "with" role fits bare as well.
            rounds[i][slot] = res
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.terminate()
    return rounds


def _blocks_fit(args: argparse.Namespace, switched: bool) -> dict[str, Any]:
    """One fit whose callback is switched off and on every ``args.block_len`` steps.

    Blocks alternate on, off, on, ... from the first step (the callback starts
    at ``setup``). Unless ``switched``, there is no callback and the blocks are
    only labelled, the null row. Returns the labelled step times and the fit's
    time outside the training loop.
    """
    import lightning.pytorch as pl

    loader = _loader(args)
    warm = argparse.Namespace(**{**vars(args), "steps": 30})
    _fit(warm, _loader(warm), False)  # CUDA context, cuBLAS, allocator, imports
    gc.collect()
    guard_cb: Any = (
        barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
        if switched
        else None
    )
    steps: list[tuple[bool, float]] = []
    state = {"on": True, "t": 0.0, "loop": 0.0}

    class Switch(pl.Callback):
        def on_train_start(self, *a: Any) -> None:
            sync()
            state["loop"] = state["t"] = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            now = time.perf_counter()
            steps.append((bool(state["on"]), now - state["t"]))
            if len(steps) % args.block_len == 0:
                if guard_cb is not None:
                    guard = guard_cb.guard
                    if state["on"]:
                        guard._stop(act=False)
                    else:
                        guard_cb._start("train")
                state["on"] = not state["on"]
            state["t"] = time.perf_counter()

        def on_train_end(self, *a: Any) -> None:
            sync()
            state["loop"] = time.perf_counter() - state["loop"]

    callbacks: list[Any] = [Switch()]
    if guard_cb is not None:
        callbacks.insert(0, guard_cb)
    trainer = _trainer(callbacks)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    trainer.fit(_module(args), loader)
    total = time.perf_counter() - t0
    syncs = guard_cb.report.total_syncs if guard_cb is not None else 0
    return {"steps": steps, "outside_s": total - state["loop"], "syncs": syncs}


def _block_ratios(steps: list[tuple[bool, float]], block: int) -> list[float]:
    """Each on-block's median step over the geometric mean of its off neighbours'.

    The first two blocks (warm-up, first switch) are left out; a linear drift
    across three adjacent blocks cancels.
    """
    meds = [
        (steps[k][0], median([d for _, d in steps[k : k + block]]))
        for k in range(0, len(steps) - block + 1, block)
    ]
    return [
        meds[j][1] / math.sqrt(meds[j - 1][1] * meds[j + 1][1])
        for j in range(2, len(meds) - 1)
        if meds[j][0] and not meds[j - 1][0] and not meds[j + 1][0]
    ]


def _blocks_worker(args: argparse.Namespace, switched: bool, results: Any) -> None:
    _quiet()
    try:
        results.put(_blocks_fit(args, switched))
    except BaseException as exc:
        results.put(repr(exc))
        raise


def _blocks(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Fits of both rows, alternating, each in a fresh process."""
    ctx = mp.get_context("spawn")
    fits: dict[str, list[dict[str, Any]]] = {"blocks": [], "blocks_null": []}
    for i in range(args.rounds):
        for switched in (True, False) if i % 2 == 0 else (False, True):
            results = ctx.Queue()
            worker = ctx.Process(target=_blocks_worker, args=(args, switched, results))
            worker.start()
            try:
                res = results.get(timeout=_TURN_TIMEOUT_S * 2)
            finally:
                worker.join(timeout=60)
                if worker.is_alive():
                    worker.terminate()
            if isinstance(res, str):
                raise RuntimeError(f"a blocks worker failed: {res}")
            fits["blocks" if switched else "blocks_null"].append(res)
    return fits


def _blocks_record(
    per_fit: list[list[float]],
    step_off_s: float,
    step_on_s: float,
    outside_loop_s: list[float],
    syncs_found: int,
) -> dict[str, Any]:
    """The JSON record of a blocks row, from its per-fit block ratios."""
    pooled = [r for rs in per_fit for r in rs]
    q = _quartiles(pooled)
    return {
        "block_ratios": per_fit,
        "median_ratio": median(pooled),
        "iqr": [q[0], q[2]],
        "per_fit_median": [median(rs) for rs in per_fit],
        "step_off_s": step_off_s,
        "step_on_s": step_on_s,
        "outside_loop_s": outside_loop_s,
        "syncs_found": syncs_found,
    }


def _blocks_summary(
    name: str, args: argparse.Namespace, fits: list[dict[str, Any]]
) -> tuple[list[object], dict[str, Any]]:
    record = _blocks_record(
        [_block_ratios(f["steps"], args.block_len) for f in fits],
        median([d for f in fits for on, d in f["steps"] if not on]),
        median([d for f in fits for on, d in f["steps"] if on]),
        [f["outside_s"] for f in fits],
        max(f["syncs"] for f in fits),
    )
    iqr = record["iqr"]
    row: list[object] = [
        name,
        f"{len(fits)} x {args.steps} ({sum(map(len, record['block_ratios']))} blocks of "
        f"{args.block_len})",
        f"{record['step_off_s'] * 1e6:.0f}",
        f"{record['step_on_s'] * 1e6:.0f}",
        f"**{record['median_ratio']:.4f}** ({iqr[0]:.4f}-{iqr[1]:.4f})",
        " ".join(f"{m:.4f}" for m in record["per_fit_median"]),
        f"{median(record['outside_loop_s']) * 1e3:.0f}",
        f"{record['syncs_found']}",
    ]
    return row, record


def _pool(paths: list[str], out: str | None) -> None:
    """Pool the blocks rows of several runs' results (same model and settings)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    models = {r["model"] for r in runs}
    if len(models) != 1 or any("blocks" not in r["designs"] for r in runs):
        raise SystemExit(f"--pool needs blocks results of one model, got {sorted(models)}")
    rows: list[list[object]] = []
    records: dict[str, Any] = {}
    for key in ("blocks", "blocks_null"):
        recs = [r["designs"][key] for r in runs]
        record = _blocks_record(
            [rs for rec in recs for rs in rec["block_ratios"]],
            median([rec["step_off_s"] for rec in recs]),
            median([rec["step_on_s"] for rec in recs]),
            [t for rec in recs for t in rec["outside_loop_s"]],
            max(rec["syncs_found"] for rec in recs),
        )
        records[key] = record
        fits = record["per_fit_median"]
        iqr = record["iqr"]
        rows.append(
            [
                key,
                f"{len(fits)} fits ({sum(map(len, record['block_ratios']))} blocks)",
                f"**{record['median_ratio']:.4f}** ({iqr[0]:.4f}-{iqr[1]:.4f})",
                f"{min(fits):.4f}-{max(fits):.4f}",
                f"{median(record['outside_loop_s']) * 1e3:.0f}",
            ]
        )
    print(f"pooled from {', '.join(paths)}; model: {runs[0]['model']}")
    print(
        table(["row", "fits", "on / off (IQR)", "per-fit medians", "fit outside loop (ms)"], rows)
    )
    write(
        out,
        {
            "benchmark": "lightning_callback_overhead",
            "pooled_from": [Path(p).name for p in paths],
            "settings": runs[0]["settings"],
            "model": runs[0]["model"],
            "designs": records,
            "target": 1.02,
        },
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=16, help="an even number (rounds pair up)")
    ap.add_argument("--steps", type=int, default=300, help="training batches per fit")
    ap.add_argument(
        "--model",
        choices=("mlp", "transformer"),
        default="mlp",
        help="mlp: host-bound (Lightning's own loop dominates the step); "
        "transformer: a small language model with more GPU work per step",
    )
    ap.add_argument("--batch", type=int, help="default: 256 (mlp), 32 (transformer)")
    ap.add_argument("--width", type=int, help="input width (mlp) or model width (transformer)")
    ap.add_argument("--hidden", type=int, help="hidden width (mlp) or feed-forward width")
    ap.add_argument("--blocks", type=int, help="hidden blocks (mlp) or layers (transformer)")
    ap.add_argument("--seq", type=int, default=256, help="transformer: tokens per sample")
    ap.add_argument("--vocab", type=int, default=8192, help="transformer: vocabulary size")
    ap.add_argument(
        "--design",
        choices=("blocks", "lockstep", "interleaved", "all"),
        default="all",
        help="blocks (with its null row), lockstep (with its null row), interleaved fits, or all",
    )
    ap.add_argument("--block-len", type=int, default=16, help="blocks: steps per block")
    ap.add_argument("--block-steps", type=int, default=640, help="blocks: training batches per fit")
    ap.add_argument("--block-fits", type=int, default=6, help="blocks: fits per row")
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="lockstep: give each worker process half of the CPUs (4 or more needed); "
        "on the H200 host this made lockstep steps slower (19 ms instead of 11 ms for the MLP)",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test settings")
    ap.add_argument(
        "--pool", nargs="+", metavar="JSON", help="pool the blocks rows of these results"
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.pool:
        _pool(args.pool, args.out)
        return
    if args.rounds < 2 or args.rounds % 2:
        ap.error(f"--rounds must be an even number of at least 2, got {args.rounds}")
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tiny:
        args.rounds, args.steps, args.batch = 2, 12, 16
        args.block_len, args.block_steps, args.block_fits = 2, 12, 2
        args.width, args.hidden, args.blocks = 64, 64, 2
        args.seq, args.vocab = 16, 128
    _quiet()
    rows: list[list[object]] = []
    records: dict[str, Any] = {}
    designs: list[tuple[str, str, Any]] = []
    if args.design in ("lockstep", "all"):
        designs += [
            ("lockstep", "lockstep: with / without", lambda: _lockstep(args)),
            ("lockstep_null", "lockstep null: without / without", lambda: _lockstep(args, False)),
        ]
    if args.design in ("interleaved", "all"):
        designs.append(("interleaved", "interleaved fits", lambda: _interleaved(args)))
    if args.design in ("blocks", "all"):
        blocks_args = argparse.Namespace(
            **{**vars(args), "steps": args.block_steps, "rounds": args.block_fits}
        )
        brows = []
        for key, fits in _blocks(blocks_args).items():
            name = "blocks: on / off" if key == "blocks" else "blocks null: nothing switched"
            row, record = _blocks_summary(name, blocks_args, fits)
            brows.append(row)
            records[key] = record
            print(f"{name}: {row[4]}", flush=True)
        print(
            table(
                [
                    "design",
                    "fits x steps",
                    "step off (us)",
                    "step on (us)",
                    "on / off, pooled blocks (IQR)",
                    "per fit",
                    "fit outside loop (ms)",
                    "syncs found",
                ],
                brows,
            )
        )
    for key, name, run in designs:
        row, record = _summary(name, args, run())
        rows.append(row)
        records[key] = record
        print(f"{name}: {row[4]}", flush=True)
    if rows:
        print(
            table(
                [
                    "design",
                    "rounds x steps",
                    "fit without",
                    "fit with BarrierGuard",
                    "with / without (IQR)",
                    "median step, with / without (IQR)",
                    "syncs found",
                ],
                rows,
            )
        )
    if args.model == "transformer":
        model = (
            f"TinyLM {args.blocks} layers x {args.width} (ff {args.hidden}), seq {args.seq}, "
            f"vocab {args.vocab}, batch {args.batch}"
        )
    else:
        model = f"MLP {args.blocks}x{args.hidden}, in {args.width}, batch {args.batch}"
    print(f"model: {model}; target: with / without at most 1.02")
    write(
        args.out,
        {
            "benchmark": "lightning_callback_overhead",
            "settings": vars(args),
            "model": model,
            "designs": records,
            "target": 1.02,
        },
    )


if __name__ == "__main__":
    main()
