"""Is a Lightning fit with ``BarrierGuard()`` within 2% of the same fit without it?

Question:
    How much slower is a training step of a ``Trainer.fit`` with the callback (its
    defaults: CUDA engine on a GPU, memory sampling) than without it, on a
    realistic small model (the target: at most 1.02) and on a host-bound worst
    case?

Design:
    Whole fits on a shared host drift by 20-40% within seconds, far more than the
    effect; steps of one fit a few hundred milliseconds apart do not. So each fit
    (``--steps`` batches, after a 30-step warm-up fit) switches the whole
    callback off and on every ``--block-len`` steps (stopping and restarting its
    guard: engine, hooks, memory sampler, step timeline; untimed, between two
    step timestamps), and each on-block's median step is divided by the geometric
    mean of its two off neighbours' (a linear drift cancels; the first two blocks
    are left out). The **null** row runs the same fits without the callback, its
    blocks only labelled: its distance from 1.000 is what the design itself
    reads. ``--fits`` fits per row, alternating rows, each in a fresh process
    (a process that changed ``torch.Tensor`` thousands of times runs every
    tensor method slower, on- and off-blocks alike). The figure is the median of
    all on-blocks' ratios, with its IQR and each fit's median. ``--pool`` joins
    the blocks of several runs' results into one.

    Two models, both with AdamW, ``self.log(prog_bar=True)`` of the loss (one
    sync a step), a pinned DataLoader and bf16-mixed on the GPU:

    * ``--model transformer``: TinyLM, a small causal language model (6 layers of
      width 512, sequence 256, vocabulary 8192, batch 32), the realistic case;
    * ``--model mlp`` (default): a 4-block MLP (width 1024) on 4096-wide inputs,
      batch 256. The GPU works a fraction of each step: Lightning's own loop and
      the DataLoader make it host-bound, the worst case for a callback's host work.

    Beside the step times, each step's CPU time of the training thread
    (``thread_time``) gives the same on / off ratio of blocks: the host work the
    callback adds, without the waits (for the device, the DataLoader, the
    scheduler) that make wall time noisy on a shared host.

    **The cycle design** (``--cycles N``): the blocks above read a switch as well
    as the callback. Each switch patches ``torch.Tensor`` and the hooks, and the
    block after it runs its first steps colder, so a block that follows a switch
    is slower even with nothing on. One long fit (``--epoch-batches`` batches an
    epoch, over as many epochs as it takes, in a fresh process) cycles ``N``
    times through four blocks: on, off, null, off. The null block has nothing
    switched at either end, while the on-block and one of its off neighbours
    each follow a switch. Each cycle's on ratio (its median step over the
    geometric mean of its off neighbours') reads ``e * sqrt(s)`` for a callback
    cost ``e`` and a switch cost ``s``, and its null ratio reads
    ``1 / sqrt(s)``: their product, **on x null**, reads the callback's own cost
    ``e``. Hundreds of cycles in one fit cost no process start-up each; the
    figure is the median over cycles, with its IQR and a 95% confidence interval
    of the median (``_common.median_ci``), for the step time and the training
    thread's CPU time. Each step also notes the garbage collector's
    time and runs by generation inside it (``gc.callbacks``): per label, the
    collections per 100 steps and the mean GC time a step, so a callback that
    made the collector run more often or longer would show there.

    **Settled blocks** (``--settle K``): each block's median leaves out its
    first ``K`` steps, so the figures read the callback in its steady state,
    as a fit that keeps it on pays at every step; the whole blocks' figures
    are printed beside them, from the same steps, and so is what the first
    ``K`` steps after a switch on cost against the rest of their block. A
    one-time cost of each start (installing, the first walks of the stack) is
    then out of the headline and in that last row. ``--collect`` runs a full
    garbage collection (untimed) before every block, whatever its label, so that
    what a switch allocates is not collected inside the block after it: a fit that
    keeps the callback on never pays that collection.

    Where the callback's time goes was measured once by ``bench_lightning_costs.py``,
    a study no longer kept here (docs/benchmarks.md, section 7, gives the commit that has it).
    ``--switch`` splits the callback's cost by what the on-blocks switch on: the
    callback (the default), the callback with ``memory=False``, or sync-debug mode
    alone with its warnings ignored (``mode``, GPU only: the floor under any
    detector built on that mode).

    **By sample** (``--by-sample STEPS``): one fit with the callback on throughout,
    nothing switched. Each step notes how many steps have passed since the memory
    sampler last sampled (0: at this step's boundary); the median step and thread
    CPU time per group (0, 1, 2, 3, 4-7, 8+). The groups are not compared with
    each other: the stride grows as steps get faster, so the far groups hold the
    fast stretches of the fit. Each sample is compared with the step just before
    it instead (the farthest from the last sample, a few milliseconds away), leaving
    out the windows that hold an epoch's first step: what the sampled step and the
    two after it add, their median and mean, and either times the samples spread
    over every step, the sampler's cost to the fit with its aftermath (the median's
    spread is the figure; the mean's carries the rare slow steps, garbage
    collections among them), beside the sampler's own timing of a sample, which
    sets its stride. ``--without nvml`` (or ``allocator``, ``host``) leaves a
    probe out, to split that cost by probe. ``--cuda-engine-on-cpu`` (``--cycles``,
    ``--by-sample``) runs the CUDA engine's host side on a CPU machine: its wrappers,
    hooks, boundary, timeline and sampler, with sync-debug mode a stand-in and the
    timeline's events complete at once; what the GPU runs add to it is the driver's.
    ``--tiny --by-sample 24`` is its CPU smoke run.

    **Parts** (``--parts STEPS``): one fit with the callback on throughout, nothing
    switched, where each of barrierguard's parts carries a ``perf_counter`` meter
    (``_common.GuardMeter``): every call a started guard patches (the wrapper's own
    time: its time less its original's), the optimizer hook, the callback's hooks, and
    inside them the step boundary, its fold, ``stack.forget``, its listeners (step
    timeline, memory sampler) and a sync's count once located (``hub.emit``). Counted
    after ``--block-len`` steps: calls and microseconds per step and their share of the
    median step, barrierguard's parts in all, and that less the meters nested inside
    them. It reads what barrierguard itself runs in a real fit, without the drift of
    step times that the block designs must average out; what it leaves out is what that
    work costs the code around it (caches, the launches after it). ``--tiny --parts 24``
    is its CPU smoke run.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_lightning.py --model transformer \\
        --out benchmarks/results/h200/lightning_blocks_transformer_1.json
    PYTHONPATH=src python benchmarks/bench_lightning.py --model transformer --fits 10 \\
        --out benchmarks/results/h200/lightning_blocks_transformer_2.json
    PYTHONPATH=src python benchmarks/bench_lightning.py --model transformer --fits 10 \\
        --out benchmarks/results/h200/lightning_blocks_transformer_3.json
    PYTHONPATH=src python benchmarks/bench_lightning.py --pool \\
        benchmarks/results/h200/lightning_blocks_transformer_{1,2,3}.json \\
        --out benchmarks/results/h200/lightning_blocks_transformer.json \\
        | tee benchmarks/results/h200/lightning_blocks_transformer.txt
    PYTHONPATH=src python benchmarks/bench_lightning.py \\
        --out benchmarks/results/h200/lightning_blocks_mlp.json

    The committed ``lightning_blocks_mlp.json`` was run shorter, at 5e9cb33::

        PYTHONPATH=src python benchmarks/bench_lightning.py --fits 4 --steps 480 \\
            --out benchmarks/results/h200/lightning_blocks_mlp.json

    ``benchmarks/results/h200/lightning_blocks_mlp_5122280.json`` (and ``.txt``)
    is the full-length command at commit ``5122280``, and
    ``benchmarks/results/h200/lightning_blocks_mlp_84500c4.json`` at ``84500c4``,
    each on another machine. With twice the fits, at 63ea4cb::

        PYTHONPATH=src python benchmarks/bench_lightning.py --fits 8 --steps 480 \\
            --out benchmarks/results/h200/lightning_blocks_mlp_63ea4cb.json \\
            | tee benchmarks/results/h200/lightning_blocks_mlp_63ea4cb.txt

    At 2ea2f9b, with the training thread's CPU time beside the step times::

        PYTHONPATH=src python benchmarks/bench_lightning.py --fits 4 --steps 480 \\
            --out benchmarks/results/h200/lightning_blocks_mlp_2ea2f9b.json \\
            | tee benchmarks/results/h200/lightning_blocks_mlp_2ea2f9b.txt

    At 21e0111 (a step boundary that probes only what it kept), on a noisy host::

        PYTHONPATH=src python benchmarks/bench_lightning.py --fits 4 --steps 480 \\
            --out benchmarks/results/h200/lightning_blocks_mlp_21e0111.json \\
            | tee benchmarks/results/h200/lightning_blocks_mlp_21e0111.txt

    With routes and tallies on the per-sync path, at 1b55493::

        PYTHONPATH=src python benchmarks/bench_lightning.py --fits 4 --steps 480 \\
            --out benchmarks/results/h200/lightning_blocks_mlp_1b55493.json \\
            | tee benchmarks/results/h200/lightning_blocks_mlp_1b55493.txt

    With a step boundary that probes where it last found the loop's frames, at
    ea4926a::

        PYTHONPATH=src python benchmarks/bench_lightning.py --fits 4 --steps 480 \\
            --out benchmarks/results/h200/lightning_blocks_mlp_ea4926a.json \\
            | tee benchmarks/results/h200/lightning_blocks_mlp_ea4926a.txt

    The cycle design at fd12fdf, 800 cycles of the MLP fit (about 6 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 800 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp.txt

    The same MLP command again at 5ecb390 (after the optimizers' host step-counter
    reads left the ``item()`` wrapper, and the last-route replay), on another host::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 800 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_5ecb390.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_5ecb390.txt

    Settled blocks at 10a7106, 200 cycles of blocks of 64 steps of the MLP fit, the
    first 16 of each left out (about 7 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 200 --block-len 64 \\
            --settle 16 --epoch-batches 100 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_settle_10a7106.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_settle_10a7106.txt

    The same at b6bc7d7, and at 042e695 with the garbage collector's lines, each on
    another host::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 200 --block-len 64 \\
            --settle 16 --epoch-batches 100 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_settle_b6bc7d7.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_settle_b6bc7d7.txt
        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 200 --block-len 64 \\
            --settle 16 --epoch-batches 100 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_gc_042e695.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_gc_042e695.txt

    200 cycles of the MLP fit at 45eb087 (the engines' tallies; about 2 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 200 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_45eb087.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_45eb087.txt

    The same at 2f8e154 (step listeners called only when due; a slower, noisier host)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 200 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_2f8e154.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_2f8e154.txt

    600 cycles with ``src/`` at 542a72f, with the 95% confidence intervals (about 5 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 600 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_ci_542a72f.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_ci_542a72f.txt

    At 6cdfab9: 800 cycles of the callback, then what its cost is made of (the
    on-blocks switch sync-debug mode alone, or the callback with ``memory=False``)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 800 --fits 1 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_ci_6cdfab9.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_ci_6cdfab9.txt
        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 900 --fits 1 --switch mode \\
            --out benchmarks/results/h200/lightning_cycle_mlp_mode_6cdfab9.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_mode_6cdfab9.txt
        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 330 --fits 1 \\
            --switch memory-off --out benchmarks/results/h200/lightning_cycle_mlp_nomem_6cdfab9.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_nomem_6cdfab9.txt

    By sample, with ``src/`` at 6cdfab9: the sampler with every probe, then without
    NVML's (about 2.5 minutes each)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --by-sample 15000 --epoch-batches 64 \\
            --out benchmarks/results/h200/lightning_by_sample.json \\
            | tee benchmarks/results/h200/lightning_by_sample.txt
        PYTHONPATH=src python benchmarks/bench_lightning.py --by-sample 15000 --epoch-batches 64 \\
            --without nvml --out benchmarks/results/h200/lightning_by_sample_nonvml.json \\
            | tee benchmarks/results/h200/lightning_by_sample_nonvml.txt

    Settled blocks of 32 steps at d514a66 (the first 8 of each left out; 4 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 200 --fits 1 --block-len 32 \\
            --settle 8 --out benchmarks/results/h200/lightning_cycle_mlp_settle_d514a66.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_settle_d514a66.txt

    On the CPU machine, the CUDA engine's host side (``--cuda-engine-on-cpu``) in a small
    host-bound MLP fit: the callback, the callback without memory sampling, and the
    sampler by sample (1.5 minutes each)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 300 --fits 1 \\
            --cuda-engine-on-cpu --batch 32 --width 256 --hidden 256 --blocks 2 \\
            --out benchmarks/results/lightning_cycle_mlp_cuda_engine_cpu.json
        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 300 --fits 1 \\
            --cuda-engine-on-cpu --switch memory-off --batch 32 --width 256 --hidden 256 \\
            --blocks 2 --out benchmarks/results/lightning_cycle_mlp_cuda_engine_cpu_nomem.json
        PYTHONPATH=src python benchmarks/bench_lightning.py --by-sample 6000 --epoch-batches 64 \\
            --cuda-engine-on-cpu --batch 32 --width 256 --hidden 256 --blocks 2 \\
            --out benchmarks/results/lightning_by_sample_cuda_engine_cpu.json

    The first and the last again once the stride counted the sampler's bookkeeping, as
    ``benchmarks/results/lightning_cycle_mlp_cuda_engine_cpu_stride.json`` and
    ``benchmarks/results/lightning_by_sample_cuda_engine_cpu_stride.json``.

    At fd12fdf, 400 cycles of the TinyLM fit (about 7 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --model transformer --cycles 400 \\
            --fits 1 --out benchmarks/results/h200/lightning_cycle_transformer.json \\
            | tee benchmarks/results/h200/lightning_cycle_transformer.txt

    (The committed runs were started as ``--design blocks``, with ``--block-fits``
    for ``--fits``, when the script also had two older designs.) GPU: each
    transformer run takes 6-9 minutes, the MLP run 5.

    With a sample counted twice against the sampler's budget (``AFTERMATH``), at
    471839c: the sampler by sample, then settled blocks of 32 steps (7 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --by-sample 15000 --epoch-batches 64 \\
            --out benchmarks/results/h200/lightning_by_sample_aftermath.json \\
            | tee benchmarks/results/h200/lightning_by_sample_aftermath.txt
        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 200 --fits 1 --block-len 32 \\
            --settle 8 --out benchmarks/results/h200/lightning_cycle_mlp_settle_aftermath.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_settle_aftermath.txt

    and on the CPU machine, the CUDA engine's host side by sample, as above, into
    ``benchmarks/results/lightning_by_sample_cuda_engine_cpu_aftermath.json``; its cycle
    design as above, into
    ``benchmarks/results/lightning_cycle_mlp_cuda_engine_cpu_aftermath.json``, and with
    a garbage collection before every block::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 300 --fits 1 --collect \\
            --cuda-engine-on-cpu --batch 32 --width 256 --hidden 256 --blocks 2 \\
            --out benchmarks/results/lightning_cycle_mlp_cuda_engine_cpu_collect.json

    and the same in settled blocks of 32 steps, the first 8 of each left out (6.5 minutes)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 300 --fits 1 --collect \\
            --block-len 32 --settle 8 --cuda-engine-on-cpu --batch 32 --width 256 \\
            --hidden 256 --blocks 2 \\
            --out benchmarks/results/lightning_cycle_mlp_cuda_engine_cpu_collect_settle.json

    and that command with ``--switch memory-off``, into
    ``benchmarks/results/lightning_cycle_mlp_cuda_engine_cpu_collect_settle_nomem.json``.

    On the H200 at 1b0db96, settled blocks with a collection before each (5 minutes;
    200 cycles took longer than a device call may run)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --cycles 140 --fits 1 --collect \\
            --block-len 32 --settle 8 \\
            --out benchmarks/results/h200/lightning_cycle_mlp_settle_collect.json \\
            | tee benchmarks/results/h200/lightning_cycle_mlp_settle_collect.txt

    The same command at 1be3c24, on another host, into
    ``benchmarks/results/h200/lightning_cycle_mlp_settle_collect_1be3c24.json`` (and ``.txt``).

    **Parts** (``--parts STEPS``), on the H200 with ``src/`` at 1be3c24 (a minute)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --parts 6000 --block-len 32 \\
            --out benchmarks/results/h200/lightning_parts_mlp_1be3c24.json \\
            | tee benchmarks/results/h200/lightning_parts_mlp_1be3c24.txt

    and at af0f9a7 (a read once a step counted by its tally), on another host, that
    command into ``benchmarks/results/h200/lightning_parts_mlp_af0f9a7.json`` (and
    ``.txt``), and ``--model transformer --parts 1500 --block-len 32`` into
    ``benchmarks/results/h200/lightning_parts_transformer_af0f9a7.json`` (and ``.txt``).
    The same two commands, with ``Guard._roll`` metered in place of ``Guard._fold``: at
    1d417fc (before a violating read settled at once) into
    ``benchmarks/results/h200/lightning_parts_mlp_1d417fc.json`` and
    ``benchmarks/results/h200/lightning_parts_transformer_1d417fc.json`` (and ``.txt``), and at
    eeef063 (it settles at once) into ``benchmarks/results/h200/lightning_parts_mlp_eeef063.json``
    and ``benchmarks/results/h200/lightning_parts_transformer_eeef063.json`` (and ``.txt``), the
    two commits on different hosts (step 6.0 ms against 10.5 ms for the MLP).

    Old and new on one host, the old ``src/`` unpacked from ``git archive 68e2ff0
    src/barrierguard`` into ``/tmp/old`` and run with ``PYTHONPATH=/tmp/old/src``: at ac75bcc
    (a callback's fit hooks no optimizer step; a roll visits only the tallies handed out)
    against 68e2ff0, the MLP command into
    ``benchmarks/results/h200/lightning_parts_mlp_ac75bcc.json`` and
    ``benchmarks/results/h200/lightning_parts_mlp_68e2ff0_host1.json`` (and ``.txt``); on
    another host, at f84a426 (every boundary is ``Guard._advance``) against 68e2ff0, both
    commands into ``benchmarks/results/h200/lightning_parts_mlp_f84a426.json``,
    ``benchmarks/results/h200/lightning_parts_mlp_68e2ff0.json``,
    ``benchmarks/results/h200/lightning_parts_transformer_f84a426.json`` and
    ``benchmarks/results/h200/lightning_parts_transformer_68e2ff0.json`` (and ``.txt``; that
    last table rendered from its JSON by ``_print_parts``, as the run's own output was lost).
    At 227da59 (a boundary puts a carried tally's closed step aside) against a41c287, ``src/``
    of a41c287 unpacked the same way, on one host, the MLP command into
    ``benchmarks/results/h200/lightning_parts_mlp_227da59.json`` and
    ``benchmarks/results/h200/lightning_parts_mlp_a41c287.json`` (and ``.txt``).
    At 59aa2f4 (one test for a quiet boundary's work; the step timeline's period and memory
    sampling under 0.1% of the step) against e2a1478, unpacked the same way, on one host, the
    MLP command into ``benchmarks/results/h200/lightning_parts_mlp_e2a1478.json`` (run first)
    and ``benchmarks/results/h200/lightning_parts_mlp_59aa2f4.json``, then the transformer
    command into ``benchmarks/results/h200/lightning_parts_transformer_59aa2f4.json`` (and
    ``.txt``). On a faster host, the MLP command at e2a1478 (run first) into
    ``benchmarks/results/h200/lightning_parts_mlp_e2a1478_host2.json`` and at 0f1d8be (a
    boundary probes the innermost kept frame alone) into
    ``benchmarks/results/h200/lightning_parts_mlp_0f1d8be.json``; on a third, at 55c0a4b (a
    ``to()`` that moved nothing returns at once; run first) into
    ``benchmarks/results/h200/lightning_parts_mlp_55c0a4b.json`` and at 0f1d8be into
    ``benchmarks/results/h200/lightning_parts_mlp_0f1d8be_host3.json`` (and ``.txt``).
    On a fourth, at 85f72aa (two calls fewer a step: the optimizers' host step reads,
    ``Guard.is_running``) against 358b8c8 unpacked the same way, in one command in the order
    new, old, new: ``benchmarks/results/h200/lightning_parts_mlp_85f72aa.json``,
    ``benchmarks/results/h200/lightning_parts_mlp_358b8c8.json`` and
    ``benchmarks/results/h200/lightning_parts_mlp_85f72aa_b.json`` (and ``.txt``). On a fifth,
    at cae2aa3 (a callback's guard wraps no ``DataLoader`` iteration) against 358b8c8, in one
    command in the order old, new, old, new:
    ``benchmarks/results/h200/lightning_parts_mlp_358b8c8_c.json``,
    ``benchmarks/results/h200/lightning_parts_mlp_cae2aa3.json``,
    ``benchmarks/results/h200/lightning_parts_mlp_358b8c8_d.json`` and
    ``benchmarks/results/h200/lightning_parts_mlp_cae2aa3_b.json`` (and ``.txt``). On a
    sixth, at 42d5c31 (the boundary is the optimizer hook and rolls the tallies inline; the
    roll is no longer metered apart) into
    ``benchmarks/results/h200/lightning_parts_mlp_42d5c31.json``, then in one command 47abf57
    (``src/`` and ``benchmarks/`` of ``git archive 47abf57``, its own meters) into
    ``benchmarks/results/h200/lightning_parts_mlp_47abf57.json`` and 42d5c31 into
    ``benchmarks/results/h200/lightning_parts_mlp_42d5c31_b.json`` (and ``.txt``). On a
    seventh, twice at 2a5264d: ``benchmarks/results/h200/lightning_parts_mlp_2a5264d_a.json``
    and ``benchmarks/results/h200/lightning_parts_mlp_2a5264d_b.json`` (and ``.txt``).

    CPU smoke run (tiny settings, audit engine)::

        PYTHONPATH=src python benchmarks/bench_lightning.py --tiny
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    MODEL_DEFAULTS,
    GuardMeter,
    ModeOnly,
    lightning_loader,
    lightning_model,
    lightning_trainer,
    median,
    median_ci,
    quiet_lightning,
    sync,
    table,
    write,
)

import barrierguard

_FIT_TIMEOUT_S = 600.0
TARGET = 1.02


def _quartiles(xs: list[float]) -> list[float]:
    # Inclusive: quartiles of a few ratios stay within them (exclusive ones extrapolate).
    return statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3


def _cuda_engine_on_cpu() -> None:
    """In this process, guards run the CUDA engine on a CPU machine: its host side (the
    wrappers, hooks, step boundary, timeline and memory sampler), with the tests' stand-ins
    (``tests/_fake_cuda.py``): a sync-debug mode that only records what it is set to, and
    timeline events complete at once. Nothing syncs on a CPU, so the engine records
    nothing: what is timed is the work it does on every step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import _fake_cuda as fake
    from barrierguard import _env
    from barrierguard.detect import cuda as engine
    from barrierguard.session import guard, timeline

    mode = fake.FakeMode()
    _env.cuda_available = lambda: True  # type: ignore[assignment]
    engine._get_mode = mode.get
    engine._set_mode = mode.set
    guard._make_timeline = lambda: timeline.StepTimeline(make_event=fake.InstantEvent)  # type: ignore[assignment]


def _warm_up(args: argparse.Namespace) -> None:
    """A 30-step fit without the callback first: CUDA, cuBLAS, Lightning's imports."""
    warm = argparse.Namespace(**{**vars(args), "steps": 30})
    gc.collect()
    lightning_trainer([]).fit(lightning_model(warm), lightning_loader(warm))
    gc.collect()


def _blocks_fit(args: argparse.Namespace, switched: bool) -> dict[str, Any]:
    """One fit whose callback is switched off and on every ``args.block_len`` steps.

    Blocks alternate on, off, on, ... from the first step (the callback starts
    at ``setup``). Unless ``switched``, there is no callback and the blocks are
    only labelled, the null row. Returns the labelled step times and the fit's
    time outside the training loop.
    """
    import lightning.pytorch as pl

    loader = lightning_loader(args)
    _warm_up(args)
    guard_cb: Any = (
        barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
        if switched
        else None
    )
    steps: list[tuple[bool, float]] = []
    cpu: list[tuple[bool, float]] = []  # the training thread's CPU time of each step
    state = {"on": True, "t": 0.0, "c": 0.0, "loop": 0.0}

    class Switch(pl.Callback):
        def on_train_start(self, *a: Any) -> None:
            sync()
            state["loop"] = state["t"] = time.perf_counter()
            state["c"] = time.thread_time()

        def on_train_batch_end(self, *a: Any) -> None:
            now, now_cpu = time.perf_counter(), time.thread_time()
            steps.append((bool(state["on"]), now - state["t"]))
            cpu.append((bool(state["on"]), now_cpu - state["c"]))
            if len(steps) % args.block_len == 0:
                if guard_cb is not None:
                    guard = guard_cb.guard
                    if state["on"]:
                        guard._stop(act=False)
                    else:
                        guard_cb._begin("train", functools.partial(getattr, a[0], "optimizers"))
                state["on"] = not state["on"]
            state["t"], state["c"] = time.perf_counter(), time.thread_time()

        def on_train_end(self, *a: Any) -> None:
            sync()
            state["loop"] = time.perf_counter() - state["loop"]

    callbacks: list[Any] = [Switch()]
    if guard_cb is not None:
        callbacks.insert(0, guard_cb)
    trainer = lightning_trainer(callbacks)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    trainer.fit(lightning_model(args), loader)
    total = time.perf_counter() - t0
    syncs = guard_cb.report.total_syncs if guard_cb is not None else 0
    return {"steps": steps, "cpu": cpu, "outside_s": total - state["loop"], "syncs": syncs}


def _block_medians(
    steps: list[tuple[Any, float]], block: int, start: int = 0, stop: int | None = None
) -> list[float]:
    """The median step of each whole block of ``block`` steps, in order, over its steps
    ``start`` to ``stop`` (default: to the block's end)."""
    stop = block if stop is None else stop
    return [
        median([d for _, d in steps[k + start : k + stop]])
        for k in range(0, len(steps) - block + 1, block)
    ]


def _block_ratios(steps: list[tuple[bool, float]], block: int) -> list[float]:
    """Each on-block's median step over the geometric mean of its off neighbours'.

    The first two blocks (warm-up, first switch) are left out; a linear drift
    across three adjacent blocks cancels.
    """
    meds = [
        (steps[k][0], m)
        for k, m in zip(range(0, len(steps), block), _block_medians(steps, block), strict=False)
    ]
    return [
        meds[j][1] / math.sqrt(meds[j - 1][1] * meds[j + 1][1])
        for j in range(2, len(meds) - 1)
        if meds[j][0] and not meds[j - 1][0] and not meds[j + 1][0]
    ]


def _worker(fit: Any, args: tuple[Any, ...], results: Any) -> None:
    quiet_lightning()
    try:
        results.put(fit(*args))
    except BaseException as exc:
        results.put(repr(exc))
        raise


def _in_fresh_process(fit: Any, args: tuple[Any, ...], timeout: float) -> Any:
    """``fit(*args)`` in a spawned process (a fresh ``torch.Tensor``); its result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    worker = ctx.Process(target=_worker, args=(fit, args, results))
    worker.start()
    try:
        res = results.get(timeout=timeout)
    finally:
        worker.join(timeout=60)
        if worker.is_alive():
            worker.terminate()
    if isinstance(res, str):
        raise RuntimeError(f"a {fit.__name__} worker failed: {res}")
    return res


def _blocks(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Fits of both rows, alternating which goes first, each in a fresh process."""
    fits: dict[str, list[dict[str, Any]]] = {"blocks": [], "blocks_null": []}
    for i in range(args.fits):
        for switched in (True, False) if i % 2 == 0 else (False, True):
            res = _in_fresh_process(_blocks_fit, (args, switched), _FIT_TIMEOUT_S)
            fits["blocks" if switched else "blocks_null"].append(res)
    return fits


# The cycle design's blocks, in order: the null block has no switch at either end.
CYCLE = ("on", "off", "null", "off")


def _cycle_fit(args: argparse.Namespace) -> dict[str, Any]:
    """One fit of ``args.cycles`` cycles of :data:`CYCLE` blocks, over epochs of
    ``args.epoch_batches`` batches. Returns each step's label, time and thread CPU time."""
    import lightning.pytorch as pl

    epoch = argparse.Namespace(**{**vars(args), "steps": args.epoch_batches})
    if getattr(args, "cuda_engine_on_cpu", False):
        _cuda_engine_on_cpu()
    _warm_up(args)
    switch = getattr(args, "switch", "callback")
    guard_cb = barrierguard.BarrierGuard(
        policy="record", print_report=False, save_report=False, memory=switch != "memory-off"
    )
    # --switch mode: the on-blocks run sync-debug mode alone, and no callback.
    mode = ModeOnly() if switch == "mode" else None
    collect = getattr(args, "collect", False)
    # Each step: its label, time, thread CPU time, and the garbage collector's
    # time and collections by generation within it (gc.callbacks).
    steps: list[tuple[str, float, float, float, tuple[int, int, int]]] = []
    state = {"t": 0.0, "c": 0.0}
    collected = {"t0": 0.0, "s": 0.0, "n": [0, 0, 0]}

    def on_collect(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collected["t0"] = time.perf_counter()
        else:
            collected["s"] += time.perf_counter() - collected["t0"]
            collected["n"][info["generation"]] += 1

    class Cycle(pl.Callback):
        def on_train_start(self, *a: Any) -> None:
            if mode is not None:
                mode.__enter__()  # the first block is an on-block
            sync()
            state["t"], state["c"] = time.perf_counter(), time.thread_time()
            collected["s"], collected["n"] = 0.0, [0, 0, 0]

        def on_train_batch_end(self, *a: Any) -> None:
            now, now_cpu = time.perf_counter(), time.thread_time()
            label = CYCLE[len(steps) // args.block_len % len(CYCLE)]
            gen = collected["n"]
            steps.append(
                (label, now - state["t"], now_cpu - state["c"], collected["s"], tuple(gen))
            )
            collected["s"], collected["n"] = 0.0, [0, 0, 0]
            if len(steps) % args.block_len == 0:
                after = CYCLE[len(steps) // args.block_len % len(CYCLE)]
                if label == "on":
                    if mode is None:
                        guard_cb.guard._stop(act=False)
                    else:
                        mode.__exit__()
                elif after == "on":
                    if mode is None:
                        guard_cb._begin("train", functools.partial(getattr, a[0], "optimizers"))
                    else:
                        mode.__enter__()
                if collect:
                    # Every block, whatever its label, starts with the collector's counts at
                    # zero: what a switch allocated is not collected inside the next block.
                    gc.collect()
                    collected["s"], collected["n"] = 0.0, [0, 0, 0]
            state["t"], state["c"] = time.perf_counter(), time.thread_time()

    callbacks = [guard_cb, Cycle()] if mode is None else [Cycle()]
    trainer = lightning_trainer(callbacks, max_steps=args.cycles * 4 * args.block_len)
    torch.manual_seed(0)
    gc.callbacks.append(on_collect)
    try:
        trainer.fit(lightning_model(args), lightning_loader(epoch))
    finally:
        gc.callbacks.remove(on_collect)
        if mode is not None:
            mode.__exit__()
    report = guard_cb.report
    return {"steps": steps, "syncs": report.total_syncs, "engine": report.engine}


def _cycle_ratios(
    steps: list[tuple[str, float]], block: int, settle: int = 0
) -> dict[str, list[float]]:
    """Per cycle (the first left out): the on-block's and the null block's median step,
    each over the geometric mean of its two off neighbours', and their product.

    The null block has no switch at either end, the on-block and one of its
    neighbours each follow one: if a switch slows the block after it by a
    factor ``s`` and the callback by ``e``, the on ratio reads ``e * sqrt(s)``
    and the null one ``1 / sqrt(s)``, so their product reads ``e``. Each block's
    median leaves out its first ``settle`` steps. With ``settle``, ``first`` is the
    on-block's median over those first steps against its own median after them:
    what a switch on costs the steps right after it.
    """
    meds = _block_medians(steps, block, settle)
    out: dict[str, list[float]] = {"on": [], "null": [], "on x null": []}
    if settle:
        heads = _block_medians(steps, block, 0, settle)
        out["first"] = []
    for c in range(len(CYCLE), len(meds) - len(CYCLE) + 1, len(CYCLE)):
        on = meds[c] / math.sqrt(meds[c - 1] * meds[c + 1])
        null = meds[c + 2] / math.sqrt(meds[c + 1] * meds[c + 3])
        out["on"].append(on)
        out["null"].append(null)
        out["on x null"].append(on * null)
        if settle:
            out["first"].append(heads[c] / meds[c])
    return out


def _cycle(args: argparse.Namespace) -> dict[str, Any]:
    """``args.fits`` cycle fits, each in a fresh process; the rows of their pooled cycles."""
    timeout = _FIT_TIMEOUT_S + args.cycles * 4 * args.block_len
    fits = [_in_fresh_process(_cycle_fit, (args,), timeout) for _ in range(args.fits)]
    record: dict[str, Any] = {
        "syncs_found": max(f["syncs"] for f in fits),
        "engine": fits[0].get("engine"),
    }
    # With --settle, the whole blocks' figures too, from the same steps.
    views = {"": args.settle, " (whole blocks)": 0} if args.settle else {"": 0}
    for clock, col in (("wall", 1), ("cpu", 2)):
        for view, settle in views.items():
            ratios: dict[str, list[float]] = {}
            for f in fits:
                for key, rs in _cycle_ratios(
                    [(s[0], s[col]) for s in f["steps"]], args.block_len, settle
                ).items():
                    ratios.setdefault(key, []).extend(rs)
            for key, rs in ratios.items():
                q = _quartiles(rs)
                record[f"{clock} {key}{view}"] = {
                    "median": median(rs),
                    "iqr": [q[0], q[2]],
                    "ci95": median_ci(rs),
                    "n": len(rs),
                }
        for label in ("off", "on"):
            record[f"{clock} step {label} (us)"] = 1e6 * median(
                [s[col] for f in fits for s in f["steps"] if s[0] == label]
            )
    # Whether the callback makes the collector run more often or longer: per
    # label, collections per 100 steps by generation and the mean GC time a step.
    for label in ("off", "on"):
        rows = [s for f in fits for s in f["steps"] if s[0] == label and len(s) > 4]
        if rows:
            record[f"gc {label}"] = {
                "per_100_steps": [100 * sum(s[4][g] for s in rows) / len(rows) for g in range(3)],
                "mean_us": 1e6 * statistics.fmean(s[3] for s in rows),
            }
    return record


_SINCE = ("0 (sampled)", "1", "2", "3", "4-7", "8+")


def _since_label(k: int) -> str:
    """A step's group by the steps since the memory sampler's last sample."""
    return _SINCE[k] if k < 4 else _SINCE[4] if k < 8 else _SINCE[5]


def _by_sample_fit(args: argparse.Namespace) -> dict[str, Any]:
    """One fit of ``args.by_sample`` steps with the callback on throughout (no switch):
    each step's time, thread CPU time, and how many steps since the memory sampler last
    sampled (0: at this step's boundary)."""
    import lightning.pytorch as pl

    epoch = argparse.Namespace(**{**vars(args), "steps": args.epoch_batches})
    if getattr(args, "cuda_engine_on_cpu", False):
        _cuda_engine_on_cpu()
    _warm_up(args)
    without = set(getattr(args, "without", None) or ())
    if without:
        from barrierguard.session import memory as memory_module

        real = memory_module.default_probes

        def fewer(notes: list[str], **kw: Any) -> Any:
            probes = real(notes, **kw)
            for name in without:
                probes.probes.pop(name, None)
            return probes

        memory_module.default_probes = fewer  # type: ignore[assignment]  # this process only
    guard_cb = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
    steps: list[tuple[int, float, float]] = []
    state = {"t": 0.0, "c": 0.0}

    class Since(pl.Callback):
        def on_train_start(self, *a: Any) -> None:
            sync()
            state["t"], state["c"] = time.perf_counter(), time.thread_time()

        def on_train_batch_end(self, *a: Any) -> None:
            now, now_cpu = time.perf_counter(), time.thread_time()
            guard = guard_cb.guard
            memory = guard._memory
            sampled = memory.sampler.steps if memory is not None else []
            since = guard._steps - sampled[-1] if sampled else -1
            steps.append((since, now - state["t"], now_cpu - state["c"]))
            # The sampler's own timing of a sample (a running mean): what sets its stride.
            own = getattr(memory.sampler, "_cost", None) if memory is not None else None
            state["own"] = -1.0 if own is None else own
            state["t"], state["c"] = time.perf_counter(), time.thread_time()

    trainer = lightning_trainer([guard_cb, Since()], max_steps=args.by_sample)
    torch.manual_seed(0)
    trainer.fit(lightning_model(args), lightning_loader(epoch))
    memory = guard_cb.report.memory
    return {
        "steps": steps,
        "sampling": memory.sampling if memory is not None else "",
        "sample_own_us": None if state.get("own", -1.0) < 0 else state["own"] * 1e6,
    }


def _by_sample(args: argparse.Namespace) -> dict[str, Any]:
    """Per group of steps since the last memory sample: count, median step and CPU time;
    and each sample against the step before it (``around``): what the sampled step and
    the two after it add, per sample and spread over every step."""
    timeout = _FIT_TIMEOUT_S + args.by_sample
    fit = _in_fresh_process(_by_sample_fit, (args,), timeout)
    rows = fit["steps"][args.block_len :]  # the first steps settle
    groups: dict[str, list[tuple[float, float]]] = {}
    for since, wall, cpu in rows:
        if since >= 0:
            groups.setdefault(_since_label(since), []).append((wall, cpu))
    record: dict[str, Any] = {
        "sampling": fit["sampling"],
        "sample_own_us": fit.get("sample_own_us"),
        "without": sorted(getattr(args, "without", None) or ()),
        "steps": len(rows),
        "groups": {},
    }
    for g in (g for g in _SINCE if g in groups):
        walls, cpus = [w for w, _ in groups[g]], [c for _, c in groups[g]]
        record["groups"][g] = {
            "n": len(walls),
            "wall_us": 1e6 * median(walls),
            "cpu_us": 1e6 * median(cpus),
        }
    # The far groups hold the steps of the longest strides, and the stride grows as
    # the steps get faster: against them a sample would read the host's drift. The
    # step just before a sample (the farthest from the last one) is its own baseline.
    around: dict[str, dict[str, list[float]]] = {
        clock: {str(k): [] for k in range(3)} for clock in ("wall", "cpu")
    }
    epoch = getattr(args, "epoch_batches", None) or 0
    for i in range(1, len(rows) - 2):
        since = [r[0] for r in rows[i - 1 : i + 3]]
        if since[0] <= 0 or since[1:] != [0, 1, 2]:
            continue
        # An epoch's first step (a new DataLoader iterator, the epoch hooks) is tens of
        # milliseconds slower: a window holding one would read the epoch, not the sample.
        first = i - 1 + args.block_len  # the fit's step number of rows[i - 1]
        if epoch and any((first + j) % epoch == 0 for j in range(4)):
            continue
        for c, clock in ((1, "wall"), (2, "cpu")):
            for k in range(3):
                around[clock][str(k)].append(rows[i + k][c] - rows[i - 1][c])
    samples, sampled = len(around["wall"]["0"]), len(groups.get("0 (sampled)", ()))
    record["around"] = {"samples": samples}
    if samples:
        for clock in ("wall", "cpu"):
            c = 1 if clock == "wall" else 2
            step = median([r[c] for r in rows])
            medians = {k: median(v) for k, v in around[clock].items()}
            means = {k: statistics.fmean(v) for k, v in around[clock].items()}
            record["around"][clock] = {
                "step_us": 1e6 * step,
                "median_us": {k: 1e6 * m for k, m in medians.items()},
                "mean_us": {k: 1e6 * m for k, m in means.items()},
                # Every sample in the fit, not only those with a clean neighbourhood.
                "per_step": sum(medians.values()) * sampled / len(rows) / step,
                "per_step_mean": sum(means.values()) * sampled / len(rows) / step,
            }
    return record


def _parts_fit(args: argparse.Namespace) -> dict[str, Any]:
    """One fit of ``args.parts`` steps with the callback on throughout, a meter on each of
    barrierguard's parts (:class:`_common.GuardMeter`): its wrappers, the optimizer hook, the
    callback's hooks, the step boundary and its listeners. Counted after ``args.block_len``
    steps; each step's time and thread CPU time beside them."""
    import lightning.pytorch as pl

    from barrierguard.detect import hub, stack
    from barrierguard.session.guard import Guard
    from barrierguard.session.memory import MemoryMonitor
    from barrierguard.session.timeline import StepTimeline

    epoch = argparse.Namespace(**{**vars(args), "steps": args.epoch_batches})
    if getattr(args, "cuda_engine_on_cpu", False):
        _cuda_engine_on_cpu()
    _warm_up(args)
    cls = barrierguard.BarrierGuard
    meter = GuardMeter(
        [
            # Under a callback (steps by caller) every hook call would come here: none is made.
            (Guard, "_optimizer_boundaries", "optimizer hook"),
            (cls, "on_train_batch_end", "callback: on_train_batch_end, its step()"),
            # _advance: every boundary's entry, its quiet path and the carried tallies' roll
            # inline (metered apart, as Guard._roll, up to 47abf57).
            (Guard, "_advance", "  of which the step boundary"),
            (stack, "forget", "    of which stack.forget (the kept frames)"),
            (Guard, "_close_step", "    of which closing the step's held syncs"),
            (Guard, "_listen", "    of which its listeners"),
            (StepTimeline, "on_step", "      of which the step timeline"),
            (MemoryMonitor, "on_step", "      of which the memory sampler"),
            # Inside the read wrappers (called by name, at no depth a probe counts: a meter
            # there moves no probe): a read's count once located.
            (hub, "emit", "  (in the wrappers) a sync's count: hub.emit, Guard.record"),
            (cls, "on_train_epoch_start", "callback: on_train_epoch_start"),
            (cls, "on_train_epoch_end", "callback: on_train_epoch_end"),
        ]
    )
    steps: list[tuple[float, float]] = []
    state = {"t": 0.0, "c": 0.0, "from": 0}
    meter.install()
    try:
        guard_cb = cls(policy="record", print_report=False, save_report=False)

        class Count(pl.Callback):
            def setup(self, *a: Any, **kw: Any) -> None:
                meter.wrap_started()  # the callback's setup, just before, started its guard

            def on_train_start(self, *a: Any) -> None:
                sync()
                state["t"], state["c"] = time.perf_counter(), time.thread_time()

            def on_train_batch_end(self, *a: Any) -> None:
                now, now_cpu = time.perf_counter(), time.thread_time()
                steps.append((now - state["t"], now_cpu - state["c"]))
                if len(steps) == args.block_len:
                    meter.reset()
                    state["from"] = guard_cb.guard.steps
                meter.empty()  # a meter's own cost, cold, once a step
                state["t"], state["c"] = time.perf_counter(), time.thread_time()

        trainer = lightning_trainer([guard_cb, Count()], max_steps=args.parts)
        torch.manual_seed(0)
        trainer.fit(lightning_model(args), lightning_loader(epoch))
    finally:
        meter.uninstall()
    counted = guard_cb.report.steps - state["from"]
    rows = meter.rows(counted)
    kept = steps[args.block_len :]
    return {
        "steps": counted,
        "step_us": 1e6 * median([w for w, _ in kept]),
        "thread_cpu_us": 1e6 * median([c for _, c in kept]),
        "meter_us": meter.meter_us,
        "nested_meters": meter.nested_calls(counted),
        "parts": rows,
        "own_us": sum(r["us_per_step"] for k, r in rows.items() if not k.startswith("  ")),
        "syncs": guard_cb.report.total_syncs,
    }


def _print_parts(record: dict[str, Any]) -> None:
    step = record["step_us"]
    rows = [
        [
            name,
            f"{r['calls_per_step']:.2f}",
            f"{r['us_per_step']:.2f}",
            f"{r['us_per_step'] / step:.3%}",
        ]
        for name, r in record["parts"].items()
        if r["calls_per_step"] or not name.startswith("wrapper")
    ]
    rows.append(
        [
            "barrierguard's parts, in all",
            "",
            f"{record['own_us']:.1f}",
            f"{record['own_us'] / step:.3%}",
        ]
    )
    rows.append(["(one meter's own cost per call, cold)", "", f"{record['meter_us']:.2f}", ""])
    # The meters inside the parts' intervals are in their times: at most one meter's cost each.
    less = record["own_us"] - record["nested_meters"] * record["meter_us"]
    rows.append(
        [
            f"in all, less the {record['nested_meters']:.1f} meters nested in them (at most)",
            "",
            f"{less:.1f}",
            f"{less / step:.3%}",
        ]
    )
    print(
        f"{record['steps']} metered steps with the callback on; median step {step:.0f} us, "
        f"thread CPU {record['thread_cpu_us']:.0f} us (meters in); {record['syncs']} syncs found"
    )
    print(table(["part", "calls per step", "us per step", "of the step"], rows))


def _print_by_sample(record: dict[str, Any]) -> None:
    rows = [
        [g, r["n"], f"{r['wall_us']:.0f}", f"{r['cpu_us']:.0f}"]
        for g, r in record["groups"].items()
    ]
    without = f", without the {'/'.join(record['without'])} probes" if record["without"] else ""
    print(f"{record['steps']} steps with the callback on{without}; memory {record['sampling']}")
    if record.get("sample_own_us") is not None:
        print(
            f"a sample as the sampler times it (its running mean at the end): "
            f"{record['sample_own_us']:.0f} us"
        )
    print(
        table(["steps since a sample", "steps", "median step (us)", "median thread CPU (us)"], rows)
    )
    around = record["around"]
    if not around["samples"]:
        return
    print(f"each sample against the step before it ({around['samples']} samples):")
    print(
        table(
            [
                "clock",
                "step (us)",
                *(f"step +{k}: median / mean (us)" for k in range(3)),
                "spread: median / mean",
            ],
            [
                [
                    clock,
                    f"{a['step_us']:.0f}",
                    *(
                        f"{a['median_us'][str(k)]:+.0f} / {a['mean_us'][str(k)]:+.0f}"
                        for k in range(3)
                    ),
                    f"{a['per_step']:+.2%} / {a['per_step_mean']:+.2%}",
                ]
                for clock, a in ((c, around[c]) for c in ("wall", "cpu"))
            ],
        )
    )
    print(
        "spread: the three steps' excess (their medians, or means), times the samples, over "
        "every step's median time: the sampler's cost to the fit, with what it leaves after it"
    )


def _print_cycle(args: argparse.Namespace, record: dict[str, Any]) -> None:
    names = [
        ("on", "on / off"),
        ("null", "null / off (nothing switched)"),
        ("on x null", "**on x null: the callback's own cost**"),
    ]
    if args.settle:
        names = [(key, f"{name}, after {args.settle} steps") for key, name in names]
        names.append(("first", f"on-block: its first {args.settle} steps / the rest"))
        names += [
            (f"{key} (whole blocks)", f"{name}, whole blocks")
            for key, name in (("on", "on / off"), ("on x null", "on x null"))
        ]
    rows: list[list[object]] = []
    for key, name in names:
        cells: list[object] = [name]
        for clock in ("wall", "cpu"):
            r = record[f"{clock} {key}"]
            ci = r.get("ci95")
            cells.append(
                f"{r['median']:.4f} ({r['iqr'][0]:.4f}-{r['iqr'][1]:.4f})"
                + (f" [{ci[0]:.4f}-{ci[1]:.4f}]" if ci else "")
            )
        rows.append(cells)
    n = record["wall on"]["n"]
    print(
        f"{args.fits} fit(s) x {args.cycles} cycles of {' / '.join(CYCLE)} blocks of "
        f"{args.block_len} steps ({n} cycles counted); epochs of {args.epoch_batches} "
        f"batches; step off "
        f"{record['wall step off (us)']:.0f} us, thread CPU off {record['cpu step off (us)']:.0f} us; "
        f"syncs found {record['syncs_found']}; on-blocks: {getattr(args, 'switch', 'callback')}"
        f" (engine {record.get('engine')})"
    )
    header = ["ratio", "step time (IQR) [95% CI]", "training thread's CPU time (IQR) [95% CI]"]
    print(table(header, rows))
    for label in ("on", "off"):
        gc_rec = record.get(f"gc {label}")
        if gc_rec is not None:
            per = " / ".join(f"{n:.2f}" for n in gc_rec["per_100_steps"])
            print(
                f"garbage collection, {label}-blocks: {per} collections per 100 steps "
                f"(generations 0 / 1 / 2), {gc_rec['mean_us']:.1f} us a step"
            )


def _blocks_record(
    per_fit: list[list[float]],
    step_off_s: float,
    step_on_s: float,
    outside_loop_s: list[float],
    syncs_found: int,
) -> dict[str, Any]:
    """The JSON record of a row, from its per-fit block ratios."""
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


def _summary(
    name: str, args: argparse.Namespace, fits: list[dict[str, Any]]
) -> tuple[list[object], dict[str, Any]]:
    """A table row and the JSON record of one row's fits."""
    record = _blocks_record(
        [_block_ratios(f["steps"], args.block_len) for f in fits],
        median([d for f in fits for on, d in f["steps"] if not on]),
        median([d for f in fits for on, d in f["steps"] if on]),
        [f["outside_s"] for f in fits],
        max(f["syncs"] for f in fits),
    )
    # The same ratios of the training thread's CPU time: the host work the
    # callback adds, without the waits that make wall time noisy.
    cpu_ratios = [r for f in fits if "cpu" in f for r in _block_ratios(f["cpu"], args.block_len)]
    if cpu_ratios:
        q = _quartiles(cpu_ratios)
        record["cpu_median_ratio"], record["cpu_iqr"] = median(cpu_ratios), [q[0], q[2]]
    iqr = record["iqr"]
    cpu_iqr = record.get("cpu_iqr")
    row: list[object] = [
        name,
        f"{len(fits)} x {args.steps} ({sum(map(len, record['block_ratios']))} blocks of "
        f"{args.block_len})",
        f"{record['step_off_s'] * 1e6:.0f}",
        f"{record['step_on_s'] * 1e6:.0f}",
        f"**{record['median_ratio']:.4f}** ({iqr[0]:.4f}-{iqr[1]:.4f})",
        f"{record['cpu_median_ratio']:.4f} ({cpu_iqr[0]:.4f}-{cpu_iqr[1]:.4f})" if cpu_iqr else "-",
        " ".join(f"{m:.4f}" for m in record["per_fit_median"]),
        f"{median(record['outside_loop_s']) * 1e3:.0f}",
        f"{record['syncs_found']}",
    ]
    return row, record


def _pool(paths: list[str], out: str | None) -> None:
    """Pool the rows of several runs' results (same model and settings)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    models = {r["model"] for r in runs}
    if len(models) != 1 or any("blocks" not in r["designs"] for r in runs):
        raise SystemExit(f"--pool needs results of one model, got {sorted(models)}")
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
            "target": TARGET,
        },
    )


def _model_name(args: argparse.Namespace) -> str:
    if args.model == "transformer":
        return (
            f"TinyLM {args.blocks} layers x {args.width} (ff {args.hidden}), seq {args.seq}, "
            f"vocab {args.vocab}, batch {args.batch}"
        )
    return f"MLP {args.blocks}x{args.hidden}, in {args.width}, batch {args.batch}"


def _write_design(args: argparse.Namespace, benchmark: str, design: str, record: Any) -> None:
    write(
        args.out,
        {
            "benchmark": benchmark,
            "settings": vars(args),
            "model": _model_name(args),
            "designs": {design: record},
        },
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
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
    ap.add_argument("--steps", type=int, default=640, help="training batches per fit")
    ap.add_argument("--block-len", type=int, default=16, help="steps per block")
    ap.add_argument("--fits", type=int, default=6, help="fits per row (per run with --cycles)")
    ap.add_argument(
        "--cycles",
        type=int,
        help="the cycle design: one long fit of this many on / off / null / off cycles",
    )
    ap.add_argument(
        "--epoch-batches", type=int, default=64, help="--cycles: batches per epoch of the fit"
    )
    ap.add_argument(
        "--settle",
        type=int,
        default=0,
        help="--cycles: leave out each block's first steps (the figures after a switch settles)",
    )
    ap.add_argument(
        "--collect",
        action="store_true",
        help="--cycles: a full garbage collection (untimed) before every block, so that what "
        "a switch allocated is not collected inside the block after it",
    )
    ap.add_argument(
        "--switch",
        choices=("callback", "memory-off", "mode"),
        default="callback",
        help="--cycles: what the on-blocks switch on: the callback, the callback with "
        "memory=False, or sync-debug mode alone (GPU)",
    )
    ap.add_argument(
        "--by-sample",
        type=int,
        metavar="STEPS",
        help="one fit of STEPS steps with the callback on throughout: the step times by "
        "how many steps since the memory sampler last sampled",
    )
    ap.add_argument(
        "--parts",
        type=int,
        metavar="STEPS",
        help="one fit of STEPS steps with the callback on throughout: barrierguard's host "
        "time per step by part, measured in place by meters",
    )
    ap.add_argument(
        "--without",
        nargs="+",
        choices=("host", "allocator", "nvml"),
        help="--by-sample: the memory sampler leaves these probes out",
    )
    ap.add_argument(
        "--cuda-engine-on-cpu",
        action="store_true",
        help="--cycles, --by-sample on a CPU machine: the callback runs the CUDA engine's host side "
        "(no sync-debug mode, instant timeline events), to time its Python without a driver",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test settings")
    ap.add_argument("--pool", nargs="+", metavar="JSON", help="pool the rows of these results")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not 0 <= args.settle < args.block_len:
        ap.error(f"--settle {args.settle}: expected 0 <= settle < --block-len ({args.block_len})")
    if args.pool:
        _pool(args.pool, args.out)
        return
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.tiny:
        args.steps, args.block_len, args.fits, args.batch = 12, 2, 1, 16
        args.width, args.hidden, args.blocks = 64, 64, 2
        args.seq, args.vocab = 16, 128
        args.epoch_batches = 4
        if args.cycles is not None:
            args.cycles = 3
            args.settle = min(args.settle, 1)
        if args.by_sample is not None:
            args.by_sample = 24
    quiet_lightning()
    if args.parts is not None:
        if args.tiny:
            args.parts = 24
        record = _in_fresh_process(_parts_fit, (args,), _FIT_TIMEOUT_S + args.parts)
        _print_parts(record)
        _write_design(args, "lightning_callback_parts", "parts", record)
        return
    if args.by_sample is not None:
        record = _by_sample(args)
        _print_by_sample(record)
        _write_design(args, "lightning_memory_sampling", "by_sample", record)
        return
    if args.cycles is not None:
        record = _cycle(args)
        _print_cycle(args, record)
        write(
            args.out,
            {
                "benchmark": "lightning_callback_overhead",
                "settings": vars(args),
                "model": _model_name(args),
                "designs": {"cycle": record},
                "target": TARGET,
            },
        )
        return
    rows: list[list[object]] = []
    records: dict[str, Any] = {}
    for key, fits in _blocks(args).items():
        name = "on / off" if key == "blocks" else "null: nothing switched"
        row, record = _summary(name, args, fits)
        rows.append(row)
        records[key] = record
        print(f"{name}: {row[4]}", flush=True)
    print(
        table(
            [
                "row",
                "fits x steps",
                "step off (us)",
                "step on (us)",
                "on / off, pooled blocks (IQR)",
                "training thread's CPU time, on / off (IQR)",
                "per fit",
                "fit outside loop (ms)",
                "syncs found",
            ],
            rows,
        )
    )
    model = _model_name(args)
    print(f"model: {model}; target: with / without at most {TARGET}")
    write(
        args.out,
        {
            "benchmark": "lightning_callback_overhead",
            "settings": vars(args),
            "model": model,
            "designs": records,
            "target": TARGET,
        },
    )


if __name__ == "__main__":
    main()
