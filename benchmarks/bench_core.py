"""What does ``watch()`` cost: per training step when nothing syncs, and per sync it records?

Question:
    How much slower does a training step run under ``watch()``, on the step where
    its cost shows most (launch-bound, no sync in it), and how much does it add to
    each sync it records?

Design:
    * Per step: an Adam step of an MLP (width 512, batch 64, its layer count
      calibrated to a 1 ms bare step) whose host launches kernels as fast as it
      can. Variants ``bare``, ``watch()``, ``watch(memory=False)`` and, on a GPU,
      sync-debug mode alone (its warnings ignored) time blocks of ``--steps``
      steps in ``--pairs`` paired rounds (every variant once per round, the order
      rotating); the figure is the median of the per-round ratios to bare, with
      its IQR and a 95% confidence interval of that median (distribution-free,
      ``_common.median_ci``): a cost is within a target when the interval's upper
      end is, and not when its lower end is above it. Each guard is started
      before its block and stopped after it; its one-time ``start()+stop()`` is
      timed apart. With ``--settle K`` each block first runs ``K`` steps, timed
      apart from its ``--steps`` (every variant alike, bare too): the steps just
      after a start run colder (the patched types, the first walks, the caches
      that start touched), a cost per start and not per step, which a block of a
      few hundred steps would otherwise spread over its steps. What those ``K``
      steps took beyond bare's is printed per start.
    * With ``--null``, one more variant, ``null`` (:class:`NullInterposition`):
      every call a started ``watch(memory=False)`` patches, passed on by a plain
      wrapper and nothing else, an empty optimizer step hook and, on a GPU,
      sync-debug mode with its warnings ignored. It is the floor under any
      detector made of Python wrappers and an optimizer hook; each round's
      guarded blocks over its null block give the guard's own work (printed
      with a 95% confidence interval). On a CPU the audit engine is a mode,
      which this variant does not reproduce.
    * Per step, by part (GPU only, ``--parts-steps``): where ``watch(memory=False)``'s
      host time goes on that step, measured in place: each entry point the step
      reaches (the optimizer hook and, when some is due, the boundary's work in
      it, the ``.to()`` copy wrapper, the timed wrappers the step calls, e.g.
      ``torch.tensor``) is wrapped
      in a ``perf_counter`` meter, and so is the original call inside each
      wrapper; a wrapper's cost is its time less its original's, and holds one
      inner meter's cost per call (an empty metered call after each step gives
      it, cold: its upper bound).
      Beside it, the step's host CPU time (``thread_time``), bare and watched
      without meters, in ``--parts-rounds`` rounds of rotating blocks (the
      median of the rounds' paired differences, with its IQR): what the parts
      do not explain is the indirect cost (caches, the Python calls' own frames).
    * After restarts (``--restarts N``): a class's attribute cache takes a new
      version at each lookup that follows a change to the class, and CPython 3.13
      stops caching a class that has used 1,000 (3.12.3 does not); every
      method of its instances is then looked up slower, for the rest of the
      process. Two fresh processes time ``x.to(x.dtype)`` (no kernel: the method's
      lookup and call), fresh and after ``N`` starts and stops of
      ``watch(memory=False)``: one with the engine's patches of ``torch.Tensor``
      made together (``Patches.deferred``), one with them made one by one, a
      lookup between each two (as before ``deferred``); with ``torch.Tensor``'s
      cache version where ``_testcapi`` tells it (0: none, no longer cached).
    * Per sync (GPU only): loops of ``--calls`` ``.item()`` on an idle GPU, one
      in user code and one inside a framework's code ``--depth`` (20) frames
      deep (a function chain compiled as Lightning's logger-connector file),
      bare and under a started ``watch()``, in ``--sync-pairs`` paired rounds
      (the order rotating), with sync-debug mode and a naive
      ``traceback.extract_stack(limit=12)`` hook for scale; the median over
      rounds of what ``watch()`` adds per call, with its 95% confidence interval
      (target: 2 us for each). Before
      its block, the guard sees one step with one read of the same line: the
      block's reads are those of a training loop past its first step (a site
      the loop confirmed), not of a first step never closed.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_core.py --out benchmarks/results/h200/core.json

    (``bash benchmarks/run_all.sh benchmarks/results/h200`` runs it with the rest
    of the suite and keeps the printed tables in ``core.txt``.) The committed
    ``h200/core.json`` and ``core.txt`` are a run at 1b55493, and
    ``benchmarks/results/h200/core_caaf1d7.json`` and ``core_caaf1d7.txt`` one at
    caaf1d7 on a faster host (both with the per-sync rows for user code and for a
    framework 20 frames deep, the site confirmed by a step first);
    ``benchmarks/results/h200/core_b8efdc4.json`` and ``core_b8efdc4.txt`` the same
    code again on a third, slower host;
    ``benchmarks/results/h200/core_c669137.json`` and ``core_c669137.txt`` at c669137
    (the scalar read's walk through ``CudaEngine._emit``, one loop in ``hub.emit``);
    ``benchmarks/results/h200/core_steps1000_d1c8e44.json`` and ``core_steps1000_d1c8e44.txt``
    are ``--steps 1000 --pairs 20 --sync-pairs 3 --calls 500`` at d1c8e44 (blocks ten
    times longer);
    ``benchmarks/results/h200/core_0c93948.json`` and ``core_0c93948.txt`` at 0c93948
    add the by-part table (a step boundary that probes where the loop's held
    frames were, a framework sync's routes kept from one replay to the next);
    ``benchmarks/results/h200/core_340c4a3_pin2.json`` and ``core_340c4a3_pin2.txt``
    are ``--pin 2`` at 340c4a3 on a slower host, and
    ``benchmarks/results/h200/core_74ab12c_pin2.json`` and ``core_74ab12c_pin2.txt``
    the same at 74ab12c (the by-part rows holding their inner meters' cost);
    ``benchmarks/results/h200/core_e889810_pin2.json`` and ``core_e889810_pin2.txt``
    the same at e889810 on a fast host;
    ``benchmarks/results/h200/core_21e0111_pin2.json`` and ``core_21e0111_pin2.txt``
    are ``--pin 2 --parts-steps 100 --parts-rounds 30`` at 21e0111 (a noisy host);
    ``benchmarks/results/h200/core_steps_ab/`` holds six alternating runs on one host of
    ``--pin 2 --layers 3 --pairs 100 --steps 50 --parts-steps 0 --sync-pairs 0``,
    ``src/`` at acdd42f and at 3e60cfe with this script (its ``README.txt``);
    ``benchmarks/results/h200/core_sync_ab/`` six alternating runs on one host of
    ``--pin 2 --layers 1 --pairs 3 --steps 5 --parts-steps 0 --sync-pairs 30``, ``src/``
    at 828ceb7 and at 2bbbd80 (its ``README.txt``), and
    ``benchmarks/results/h200/core_sync_ab_a096529/`` the same at 6514e05 and at a096529,
    and ``benchmarks/results/h200/core_sync_ab_tally/`` the same at cb0b631 and with the
    wrapper's tally (runs 1-2 at 96e0e21, 3-4 at f12e780);
    ``benchmarks/results/h200/core_step_f12e780.json`` and ``core_step_f12e780.txt`` are
    ``--pin 2 --layers 3 --pairs 100 --steps 50 --parts-steps 0 --sync-pairs 0`` at f12e780,
    and ``benchmarks/results/h200/core_parts_f12e780.json`` and ``core_parts_f12e780.txt``
    ``--pin 2 --layers 3 --pairs 3 --steps 5 --parts-steps 500 --parts-rounds 6
    --sync-pairs 0`` at f12e780;
    ``benchmarks/results/h200/core_step_2f8e154.json`` and ``core_step_2f8e154.txt`` are
    ``--pin 2 --layers 3 --pairs 100 --steps 50 --parts-steps 0 --sync-pairs 0`` at
    2f8e154 (a copy that sets nothing on the thread, step listeners called when due; a
    noisy host);
    ``benchmarks/results/h200/core_d12bf32.json`` and ``core_d12bf32.txt`` are the
    same command at d12bf32, before routes and tallies;
    ``benchmarks/results/h200/core_f0dd44e.json`` and ``core_f0dd44e.txt``, and
    ``benchmarks/results/h200/core_2c45661.json`` and ``core_2c45661.txt``,
    are the same command at f0dd44e and 2c45661.
    ``benchmarks/results/h200/core_ci_542a72f.json`` and ``core_ci_542a72f.txt`` are
    ``--pin 2 --layers 3 --steps 200 --pairs 200 --parts-steps 0 --sync-pairs 40`` with
    ``src/`` at 542a72f: enough rounds for the confidence intervals to decide the 1%
    and 2 us targets (about 4.5 minutes).
    ``benchmarks/results/h200/core_ci_6cdfab9.json`` and ``core_ci_6cdfab9.txt`` are
    ``--pin 2 --layers 3 --steps 200 --pairs 200 --parts-steps 100 --parts-rounds 30
    --sync-pairs 40`` with ``src/`` at 6cdfab9, on a faster host (about 5 minutes).
    ``benchmarks/results/h200/core_ci_471839c.json`` and ``core_ci_471839c.txt`` are
    ``--pin 2 --layers 3 --steps 200 --pairs 200 --parts-steps 0 --sync-pairs 40`` with
    ``src/`` at 471839c (a memory sample counted twice against its budget; 3.5 minutes).
    ``benchmarks/results/h200/core_settle_82da173.json`` and ``core_settle_82da173.txt`` are
    ``--pin 2 --layers 3 --steps 200 --pairs 200 --parts-steps 0 --sync-pairs 0 --settle 16``
    at 82da173 (4 minutes). ``benchmarks/results/h200/core_restarts_300.json`` and
    ``core_restarts_300.txt`` are ``--restarts 300 --pairs 0`` at da428fd, and
    ``benchmarks/results/h200/core_restarts_600.json`` and ``core_restarts_600.txt``
    ``--restarts 600 --pairs 0``.
    ``benchmarks/results/h200/core_null_7845e38.json`` and ``core_null_7845e38.txt`` are
    ``--pin 2 --layers 3 --steps 200 --pairs 200 --parts-steps 0 --sync-pairs 0 --settle 16
    --null`` with ``src/`` at 7845e38 (5 minutes), and
    ``benchmarks/results/h200/core_null_8274972.json`` and ``core_null_8274972.txt`` the
    same with ``--pairs 180`` at 8274972 (a boundary whose kept frames are where they were
    calls nothing) on another host;
    ``benchmarks/results/h200/core_null_1be3c24.json`` and ``core_null_1be3c24.txt`` are
    ``--pin 2 --layers 3 --steps 200 --pairs 220 --parts-steps 0 --sync-pairs 40 --settle 16
    --null`` at 1be3c24 (a manual ``step()`` that finds its kept frames in place calls
    nothing further; 5 minutes);
    ``benchmarks/results/h200/core_parts_8274972.json`` and ``core_parts_8274972.txt`` are
    ``--pin 2 --layers 3 --pairs 3 --steps 5 --parts-steps 100 --parts-rounds 30
    --sync-pairs 0`` at 8274972.
    ``benchmarks/results/h200/core_null_2a5264d.json`` and ``core_null_2a5264d.txt`` are
    ``--pin 2 --layers 3 --steps 200 --pairs 200 --parts-steps 0 --sync-pairs 0 --settle 16
    --null`` at 2a5264d, the first with the null's ``_get_value`` replaced as the guard's is
    (5 minutes); ``benchmarks/results/h200/core_parts_2a5264d.json`` and
    ``core_parts_2a5264d.txt`` are ``--pin 2 --layers 3 --pairs 3 --steps 5 --parts-steps 3000
    --parts-rounds 30 --sync-pairs 0`` at 2a5264d, on another host.
    ``benchmarks/results/h200/core_sync_eeef063.json`` is ``--pin 2 --layers 3 --steps 50
    --pairs 10 --parts-steps 0 --sync-pairs 40`` at eeef063: the per-sync part (its 10 rounds
    of the per-step part are too few to read).
    ``benchmarks/results/h200/core_59aa2f4.json`` and ``core_59aa2f4.txt`` are ``--pin 2
    --layers 3 --steps 200 --pairs 200 --parts-steps 0 --sync-pairs 0`` at 59aa2f4 (the step
    timeline's period and memory sampling under 0.1% of the step; a noisy host), and
    ``benchmarks/results/h200/core_parts_read_59aa2f4.json`` and ``core_parts_read_59aa2f4.txt``
    ``--pin 2 --layers 3 --pairs 3 --steps 5 --parts-steps 100 --parts-rounds 30 --parts-read
    --sync-pairs 0`` at 59aa2f4 (its 3 rounds of the per-step part are too few to read).

    CPU smoke run (the per-step rounds only, audit engine)::

        PYTHONPATH=src python benchmarks/bench_core.py --device cpu --layers 1 --pairs 4

    The per-sync part on a CPU, with the tests' CUDA stand-in (the engine's
    whole path but the GPU's wait), timed in the thread's CPU time on the shared
    2-core machine::

        PYTHONPATH=src python benchmarks/bench_core.py --device cpu --layers 1 --pairs 4 \\
            --sync-stand-in --clock thread --out benchmarks/results/core_sync_cpu.json
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    GuardMeter,
    ModeOnly,
    NaiveSyncDebug,
    adam_mlp_layers,
    adam_mlp_step,
    median,
    median_ci,
    paired_rounds,
    paired_summary,
    patched_calls,
    quartiles,
    sync,
    table,
    timed,
    unpatch,
    write,
)

import barrierguard
from barrierguard.detect.cuda import CudaEngine


class NullInterposition:
    """The calls ``watch(memory=False)`` interposes on, passed on and nothing else.

    On entry a guard is started once to learn what it patches (every attribute of
    the ``torch`` modules, ``torch.Tensor``, ``torch.cuda.Event`` and the
    ``DataLoader`` iterator that a started guard changes), then stopped; each such
    callable is then wrapped in a plain ``(*args, **kwargs)`` pass-through, an
    empty global optimizer step hook is registered and, on a GPU, sync-debug warn
    mode is set with its warnings ignored (:class:`ModeOnly`). ``torch.optim``'s
    ``_get_value`` is replaced by the CUDA engine's own replacement
    (``CudaEngine._host_reads_unwrapped``: a host step counter read with the
    unwrapped ``item``, one test of compiling), so that Adam's reads of
    its step counters pass no wrapper here either (before ``core_null_2a5264d``
    it was left alone, and each of them passed the null's ``item`` wrapper: 12 a
    step that the guard does not pay). The floor under a detector built as this
    one is, from Python wrappers and an optimizer hook: what the guard's own work
    costs is its ratio to this one.
    """

    def __init__(self, device: str) -> None:
        changed = patched_calls()
        self.names = sorted({f"{getattr(o, '__name__', o)}.{n}" for o, n, _, _ in changed})
        self._changed = changed
        self._mode = ModeOnly() if device == "cuda" else None
        self._handle: Any = None
        self._host_reads: Any = None  # the CUDA engine whose _get_value is set

    def __enter__(self) -> None:
        import functools

        def passthrough(orig: Any) -> Any:
            @functools.wraps(orig)
            def passed(*args: Any, **kwargs: Any) -> Any:
                return orig(*args, **kwargs)

            return passed

        item = torch.Tensor.item
        for owner, name, orig, _ in self._changed:
            setattr(owner, name, passthrough(orig))
        self._host_reads = CudaEngine()
        self._host_reads._host_reads_unwrapped(item)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: None)
        if self._mode is not None:
            self._mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__()
        self._handle.remove()
        self._host_reads._patches.undo()
        unpatch(self._changed)


def overhead(
    device: str,
    steps: int,
    pairs: int,
    layers: int,
    width: int,
    settle: int = 0,
    null: bool = False,
) -> dict[str, Any]:
    step = adam_mlp_step(device, layers, width)
    # The host CPU time of each block's steps (not its closing synchronize),
    # in the order paired_rounds runs them: round i is entry i of each list.
    cpu: dict[str, list[float]] = {}
    current = ["bare"]

    def block() -> None:
        c0 = time.thread_time()
        for _ in range(steps):
            step()
        cpu.setdefault(current[0], []).append(time.thread_time() - c0)

    # Each guard is started before its timed block and stopped after it: the
    # per-step cost, not the one-time start/stop (measured apart below).
    guards = {
        "watch": barrierguard.watch(policy="record"),
        "watch_no_memory": barrierguard.watch(policy="record", memory=False),
    }
    names = ["bare", *guards]
    if device == "cuda":
        names.append("mode_only")
    interposed = NullInterposition(device) if null else None
    if interposed is not None:
        names.append("null")
    block()
    cpu.clear()
    starts = []
    probe = barrierguard.watch(policy="record")
    for _ in range(20):
        t0 = time.perf_counter()
        probe.start()
        probe.stop()
        starts.append(time.perf_counter() - t0)

    # The first ``settle`` steps of each block, timed apart (every variant alike).
    first: dict[str, list[float]] = {}

    def settled() -> float:
        if settle:
            seconds = timed(lambda: [step() for _ in range(settle)])
            first.setdefault(current[0], []).append(seconds)
        return timed(block)

    def run(name: str) -> float:
        current[0] = name
        if name in guards:
            guards[name].start()
            seconds = settled()
            guards[name].stop()
            return seconds
        if name == "mode_only":
            with ModeOnly():
                return settled()
        if name == "null":
            assert interposed is not None
            with interposed:
                return settled()
        return settled()

    rounds = paired_rounds(names, run, pairs)
    for g in guards.values():
        report = g.report
        # The only syncs are timed()'s own synchronize calls around each block.
        assert all(s.file.endswith("_common.py") for s in report.sites), report
        assert report.steps == (settle + steps) * pairs, report.steps
    # What the first settle steps after a start cost beyond bare's, per start.
    first_added = {
        name: median([(t - b) * 1e6 for t, b in zip(first[name], first["bare"], strict=True)])
        for name in first
        if name != "bare"
    }
    # The same rounds as whole blocks (the first settle steps in): what the ratio was before.
    whole = {
        name: [
            (r[name] + first[name][i]) / (r["bare"] + first["bare"][i])
            for i, r in enumerate(rounds)
        ]
        for name in first
        if name != "bare"
    }
    added = {
        name: [(c - b) / steps * 1e6 for c, b in zip(cpu[name], cpu["bare"], strict=True)]
        for name in names
        if name != "bare"
    }
    # The guard's own work: each round's watch(memory=False) block over its null block.
    to_null = (
        {name: [r[name] / r["null"] for r in rounds] for name in guards}
        if interposed is not None
        else {}
    )
    return {
        "null_interposes": interposed.names if interposed is not None else [],
        "ratio_to_null_median": {name: median(v) for name, v in to_null.items()},
        "ratio_to_null_ci95": {name: median_ci(v) for name, v in to_null.items()},
        "start_stop_us": median(starts) * 1e6,
        "thread_us_per_step": {name: median(c) / steps * 1e6 for name, c in cpu.items()},
        "added_thread_us_median": {name: median(a) for name, a in added.items()},
        "added_thread_us_quartiles": {name: quartiles(a) for name, a in added.items()},
        "steps_per_block": steps,
        "settle": settle,
        "first_steps_added_us": first_added,
        "whole_ratio_median": {name: median(v) for name, v in whole.items()},
        "whole_ratio_ci95": {name: median_ci(v) for name, v in whole.items()},
        "pairs": pairs,
        "layers": layers,
        "width": width,
        **paired_summary(rounds, names, steps),
    }


def parts(
    device: str, steps: int, layers: int, width: int, rounds: int = 6, read: bool = False
) -> dict[str, Any]:
    """Host microseconds per step of each part of ``watch(memory=False)``, measured in place.

    ``rounds`` rounds of blocks of ``steps`` steps: bare, watched, and watched
    with a meter on each part (and on each wrapper's original call, and on an
    empty call after each step: a meter's own cost, cold). The step's host CPU
    time is compared between the bare and the plain watched block of each
    round, which carry no meter: the median of the rounds' differences, with
    its quartiles. With ``read`` each step ends with ``loss.item()`` (the boundary's roll of
    that read's tally is the hook's own, metered with it).
    """
    from barrierguard.session import guard as guard_module

    meter = GuardMeter(
        [
            # Guard._advance is the hook; a quiet step's boundary and a carried tally's roll are
            # its own (metered apart, as Guard._roll, up to 47abf57).
            (guard_module.Guard, "_advance", "optimizer hook (with the boundary)"),
            # The boundary's work when some is due (a listener, kept frames).
            (guard_module.Guard, "_boundary", "  of which the boundary's work when due"),
        ]
    )
    step = adam_mlp_step(device, layers, width, read)
    for _ in range(20):
        step()
    guards = {
        "watch": barrierguard.watch(policy="record", memory=False),
        "metered": barrierguard.watch(policy="record", memory=False),
    }
    cpu: dict[str, list[float]] = {"bare": [], "watch": []}
    try:
        names = ("bare", "watch", "metered")
        for block in range(rounds):
            for name in names[block % 3 :] + names[: block % 3]:  # the order rotates
                if name == "metered":
                    meter.install()
                if name in guards:
                    guards[name].start()
                if name == "metered":
                    meter.wrap_started()
                    if block == 0:
                        meter.reset()
                sync()
                t0 = time.thread_time()
                for _ in range(steps):
                    step()
                    if name == "metered":
                        meter.empty()
                sync()
                if name in cpu:
                    cpu[name].append((time.thread_time() - t0) / steps)
                if name in guards:
                    guards[name].stop()
                if name == "metered":
                    meter.uninstall()
    finally:
        meter.uninstall()
    counted = guards["metered"].report.steps
    rows = meter.rows(counted)
    bare, watched = median(cpu["bare"]), median(cpu["watch"])
    added = [(w - b) * 1e6 for w, b in zip(cpu["watch"], cpu["bare"], strict=True)]
    named = sum(r["us_per_step"] for k, r in rows.items() if not k.startswith("  "))
    return {
        "steps": counted,
        "layers": layers,
        "rounds": rounds,
        "read": read,
        "meter_us": meter.meter_us,
        "parts": rows,
        "named_us_per_step": named,
        "thread_us_per_step": {"bare": bare * 1e6, "watch": watched * 1e6},
        "added_thread_us_per_step": median(added),
        "added_thread_us_quartiles": list(quartiles(added)),
    }


def print_parts(pp: dict[str, Any]) -> None:
    read = " (each step ending with loss.item())" if pp.get("read") else ""
    print(
        f"\n## where watch(memory=False)'s host time goes on that step{read} "
        f"({pp['steps']} watched steps)"
    )
    rows = [
        [name, f"{r['calls_per_step']:.2f}", f"{r['us_per_step']:.2f}"]
        for name, r in pp["parts"].items()
    ]
    rows.append(["named parts, in all", "", f"{pp['named_us_per_step']:.1f}"])
    rows.append(["(one meter's own cost per call, in each row)", "", f"{pp['meter_us']:.2f}"])
    t = pp["thread_us_per_step"]
    q = pp.get("added_thread_us_quartiles")
    spread = f" (IQR {q[0]:.1f} to {q[1]:.1f})" if q else ""
    rows.append(
        [
            f"host CPU time added per step, median of {pp.get('rounds', 6)} paired blocks"
            f" (bare {t['bare']:.0f} us)",
            "",
            f"{pp['added_thread_us_per_step']:.1f}{spread}",
        ]
    )
    print(table(["part", "calls per step", "us per step"], rows))


# A framework's code, 20 frames deep: `through` calls itself down to `metrics`,
# which reads the tensor (compiled as Lightning's logger connector file, so the
# walk classifies it as a framework and names its mechanism).
_FRAMEWORK_SRC = """
def metrics(x):
    return x.item()

def through(depth, x):
    return metrics(x) if depth <= 1 else through(depth - 1, x)
"""
_FRAMEWORK_FILE = os.path.join(
    os.sep,
    "bench",
    "site-packages",
    "lightning",
    "pytorch",
    "trainer",
    "connectors",
    "logger_connector",
    "result.py",
)


def _framework() -> Any:
    # Its source where linecache finds it, so the walk reads the call (item).
    lines = _FRAMEWORK_SRC.splitlines(keepends=True)
    linecache.cache[_FRAMEWORK_FILE] = (len(_FRAMEWORK_SRC), None, lines, _FRAMEWORK_FILE)
    namespace: dict[str, Any] = {}
    exec(compile(_FRAMEWORK_SRC, _FRAMEWORK_FILE, "exec"), namespace)
    return namespace["through"]


def _cuda_stand_in() -> Any:
    """Run the CUDA engine on a CPU, as the tests do (``tests/_fake_cuda.py``).

    CUDA 'available', the sync-debug mode faked, and a stand-in tensor whose
    reads raise the mode's warning from a file classified as torch: the engine's
    whole per-sync path runs, the GPU's wait does not. Returns the tensor.
    """
    import logging

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import _fake_cuda as fake
    from barrierguard import _env
    from barrierguard.detect import cuda as cuda_engine
    from barrierguard.detect import frames

    mode = fake.FakeMode()
    _env.cuda_available = lambda: True  # type: ignore[assignment]
    cuda_engine._get_mode = mode.get
    cuda_engine._set_mode = mode.set
    path = os.path.abspath(fake.__file__)
    frames._classifier.classify(path)
    frames._classifier._cache[path] = (frames.TORCH, "torch")
    # No CUDA events here: the step timeline's fault is noted once per guard.
    logging.getLogger("barrierguard").setLevel(logging.ERROR)
    # Bare: the stand-in's warning dropped, as a GPU without the mode raises none.
    warnings.filterwarnings("ignore", message=fake.MESSAGE[:30])
    return fake.FakeTensor()


def per_sync(
    calls: int, pairs: int, x: Any = None, depth: int = 20, naive: bool = True
) -> dict[str, Any]:
    """Microseconds one recorded ``.item()`` adds: in user code, and in a framework.

    Paired rounds (the order rotating): each variant times ``calls`` reads on
    an idle GPU; ``watched`` variants run under a started ``watch()``. The
    figure per path is the median over rounds of (watched - bare) / calls.
    ``x`` and ``naive=False`` let a CPU run time it with a stand-in tensor.
    """
    x = torch.ones(1, device="cuda") if x is None else x
    through = _framework()

    def user_loop(n: int = calls) -> None:
        for _ in range(n):
            x.item()

    def framework_loop(n: int = calls) -> None:
        for _ in range(n):
            through(depth, x)

    loops = {"user": user_loop, "framework": framework_loop}
    guards: dict[str, Any] = {}

    def run(name: str) -> float:
        path, variant = name.split(":")
        if variant == "bare":
            return timed(loops[path])
        if variant == "naive":
            with NaiveSyncDebug() as naive:
                seconds = timed(loops[path])
            assert len(naive.records) == calls, len(naive.records)
            return seconds
        guard = guards.setdefault(path, barrierguard.watch(engine="cuda", policy="record"))
        guard.start()
        guard.step()
        loops[path](1)  # the site, confirmed by the step boundary that follows
        guard.step()
        try:
            return timed(loops[path])
        finally:
            guard.stop()

    names = ["user:bare", "user:watched", "framework:bare", "framework:watched"]
    if naive:
        names.append("user:naive")
    for name in names:
        run(name)  # warm: the first sync of a site classifies its files
    rounds = paired_rounds(names, run, pairs)
    for path, guard in guards.items():
        sites = [s for s in guard.report.sites if s.kind == "item"]
        assert sum(s.count for s in sites) == (calls + 1) * (pairs + 1), guard.report
        if path == "framework":
            assert all(s.origin == "framework:lightning" for s in sites), sites
    out: dict[str, Any] = {"calls": calls, "pairs": pairs, "framework_depth": depth}
    for path in loops:
        added = [(r[f"{path}:watched"] - r[f"{path}:bare"]) / calls * 1e6 for r in rounds]
        out[path] = {
            "us_bare": median([r[f"{path}:bare"] for r in rounds]) / calls * 1e6,
            "us_watched": median([r[f"{path}:watched"] for r in rounds]) / calls * 1e6,
            "us_added": median(added),
            "us_added_quartiles": quartiles(added),
            "us_added_ci95": median_ci(added),
        }
    if naive:
        naive_us = [(r["user:naive"] - r["user:bare"]) / calls * 1e6 for r in rounds]
        out["user"]["us_added_naive"] = median(naive_us)
    # The figures of earlier runs, under their names.
    out["us_bare"] = out["user"]["us_bare"]
    out["us_watched"] = out["user"]["us_watched"]
    out["us_added_watched"] = out["user"]["us_added"]
    out["us_added_framework"] = out["framework"]["us_added"]
    out["target_us"] = 2.0
    return out


def _restarts_child(n: int, deferred: bool, stand_in: bool) -> dict[str, Any]:
    """In this process: a tensor method's time before and after ``n`` starts and stops of
    ``watch(memory=False)``, the engine's patches made together (``deferred``) or one by one."""
    import contextlib
    import timeit

    from barrierguard.detect.patch import Patches

    if stand_in:
        _cuda_stand_in()
    if not deferred:
        Patches.deferred = lambda self: contextlib.nullcontext()  # type: ignore[assignment,method-assign]
    try:
        from _testcapi import type_get_version  # type: ignore[import-not-found]
    except ImportError:
        type_get_version = None
    x = torch.ones(4)

    def ns_per_call() -> float:
        # x.to(x.dtype) returns x: the method's lookup and call, no kernel.
        return (
            min(timeit.repeat(lambda: x.to(torch.float32), number=20_000, repeat=9)) / 20_000 * 1e9
        )

    before = ns_per_call()
    guard = barrierguard.watch(engine="cuda", policy="record", memory=False)
    for _ in range(n):
        guard.start()
        guard.stop()
    x.add(1)  # a lookup after the last change
    return {
        "before_ns": before,
        "after_ns": ns_per_call(),
        "tensor_version": type_get_version(torch.Tensor) if type_get_version else None,
    }


def restarts(n: int, stand_in: bool) -> dict[str, Any]:
    """:func:`_restarts_child` in two fresh processes: patches made together, one by one."""
    import subprocess

    out: dict[str, Any] = {"restarts": n, "python": sys.version.split()[0]}
    for label, deferred in (("together", True), ("one by one", False)):
        argv = [sys.executable, __file__, "--restarts-child", str(n)]
        argv += [] if deferred else ["--one-by-one"]
        argv += ["--sync-stand-in"] if stand_in else []
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        out[label] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def print_restarts(rs: dict[str, Any]) -> None:
    print(
        f"\n## a tensor method after {rs['restarts']} starts and stops of watch() "
        f"(Python {rs['python']})"
    )
    rows = []
    for label in ("together", "one by one"):
        r = rs[label]
        version = r["tensor_version"]
        rows.append(
            [
                label,
                f"{r['before_ns']:.0f}",
                f"{r['after_ns']:.0f}",
                f"{r['after_ns'] / r['before_ns']:.3f}",
                "none (0)" if version == 0 else str(version),
            ]
        )
    print(
        table(
            [
                "engine's patches made",
                "x.to(dtype) ns, fresh",
                "after",
                "ratio",
                "torch.Tensor's cache version",
            ],
            rows,
        )
    )


def _thread_timed(fn: Any) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def print_per_sync(ps: dict[str, Any]) -> None:
    print(f"\n## cost of one recorded .item() (us per call, median of {ps['pairs']} paired rounds)")
    rows = []
    for path, label in (
        ("user", "in user code"),
        ("framework", f"inside a framework, {ps['framework_depth']} frames deep"),
    ):
        r = ps[path]
        q = r["us_added_quartiles"]
        ci = r.get("us_added_ci95")
        rows.append(
            [
                label,
                f"{r['us_bare']:.1f}",
                f"{r['us_watched']:.1f}",
                f"{r['us_added']:.2f} ({q[0]:.2f}-{q[1]:.2f})",
                f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-",
            ]
        )
    print(
        table(["sync", "bare", "watch()", "added by watch() (IQR)", "95% CI of the median"], rows)
    )
    if "us_added_naive" in ps["user"]:
        print(f"a naive extract_stack hook adds {ps['user']['us_added_naive']:.1f} us")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pairs", type=int, default=80)
    ap.add_argument("--layers", type=int, default=0, help="0: calibrate to --target-ms")
    ap.add_argument("--target-ms", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument(
        "--settle",
        type=int,
        default=0,
        help="steps each block runs before its timed steps, timed apart (every variant)",
    )
    ap.add_argument(
        "--null",
        action="store_true",
        help="add a variant that interposes on the same calls and does nothing (NullInterposition)",
    )
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument(
        "--sync-pairs", type=int, default=15, help="paired rounds of the per-sync part (0: none)"
    )
    ap.add_argument("--depth", type=int, default=20, help="frames of the framework path")
    ap.add_argument(
        "--parts-steps",
        type=int,
        default=500,
        help="steps per block of the by-part rounds (0: none)",
    )
    ap.add_argument("--parts-rounds", type=int, default=6, help="rounds of the by-part blocks")
    ap.add_argument(
        "--parts-read",
        action="store_true",
        help="the by-part step ends with loss.item() (a loop that logs its loss)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--sync-stand-in",
        action="store_true",
        help="on a CPU: time the per-sync part with the tests' CUDA stand-in (no GPU wait)",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: this thread's CPU time (per-sync part; a loaded shared CPU machine)",
    )
    ap.add_argument(
        "--pin",
        type=int,
        help="run on this one CPU core: the host's scheduler moves the process less",
    )
    ap.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="a tensor method's time after this many starts and stops, in fresh processes",
    )
    ap.add_argument("--restarts-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--one-by-one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.restarts_child is not None:
        child = _restarts_child(args.restarts_child, not args.one_by_one, args.sync_stand_in)
        print(json.dumps(child))
        return child
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    if args.restarts:
        rs = restarts(args.restarts, args.sync_stand_in)
        results["restarts"] = rs
        print_restarts(rs)
        if not args.pairs:
            write(args.out, results)
            return results
    layers = args.layers or adam_mlp_layers(args.device, args.width, args.target_ms)
    ov = overhead(args.device, args.steps, args.pairs, layers, args.width, args.settle, args.null)
    results["overhead"] = ov
    print(f"\n## watch() on a launch-bound step (no sync in it), {layers} layers of {args.width}")
    rows = []
    for name, ms in ov["step_ms"].items():
        ratio = ov["ratio_median"].get(name)
        q = ov["ratio_quartiles"].get(name)
        ci = ov["ratio_ci95"].get(name)
        added = ov["added_thread_us_median"].get(name)
        aq = ov["added_thread_us_quartiles"].get(name)
        rows.append(
            [
                name,
                f"{ms:.3f}",
                f"{ratio:.4f}" if ratio else "1",
                f"{q[0]:.3f}-{q[1]:.3f}" if q else "-",
                f"{ci[0]:.4f}-{ci[1]:.4f}" if ci else "-",
                f"{added:.1f} ({aq[0]:.1f} to {aq[1]:.1f})" if aq else "-",
            ]
        )
    print(
        table(
            [
                "variant",
                "step ms (median)",
                "ratio to bare (median of paired)",
                "ratio IQR",
                "95% CI of the median ratio",
                "host CPU us added per step (IQR)",
            ],
            rows,
        )
    )
    print(
        f"{ov['pairs']} interleaved rounds x {ov['steps_per_block']} steps; one start()+stop(): {ov['start_stop_us']:.0f} us"
    )
    if ov["null_interposes"]:
        print(
            "null: the same calls passed on, an empty optimizer hook"
            + (", sync-debug mode" if args.device == "cuda" else "")
            + f" ({len(ov['null_interposes'])} calls: {', '.join(ov['null_interposes'])})"
        )
        print(
            "the guard's own work, its block over the same round's null block (95% CI): "
            + ", ".join(
                f"{n} {r:.4f} ({ci[0]:.4f}-{ci[1]:.4f})"
                for (n, r), ci in zip(
                    ov["ratio_to_null_median"].items(),
                    ov["ratio_to_null_ci95"].values(),
                    strict=True,
                )
            )
        )
    if ov["settle"]:
        firsts = ", ".join(f"{n} {us:.0f} us" for n, us in ov["first_steps_added_us"].items())
        wholes = ", ".join(
            f"{n} {r:.4f} ({ci[0]:.4f}-{ci[1]:.4f})"
            for (n, r), ci in zip(
                ov["whole_ratio_median"].items(), ov["whole_ratio_ci95"].values(), strict=True
            )
        )
        print(
            f"each block's first {ov['settle']} steps ran apart, before its timed ones; "
            f"they took more than bare's, per start: {firsts}\n"
            f"ratio to bare of the whole blocks, those steps in (95% CI): {wholes}"
        )
    if args.device == "cuda" and args.parts_steps:
        pp = parts(
            args.device, args.parts_steps, layers, args.width, args.parts_rounds, args.parts_read
        )
        results["parts"] = pp
        print_parts(pp)
    if (args.device == "cuda" or args.sync_stand_in) and args.sync_pairs:
        x = _cuda_stand_in() if args.sync_stand_in else None
        if args.clock == "thread":
            global timed
            timed = _thread_timed
        ps = per_sync(args.calls, args.sync_pairs, x=x, depth=args.depth, naive=x is None)
        results["per_sync"] = ps
        results["per_sync_stand_in"] = args.sync_stand_in
        results["clock"] = args.clock
        print_per_sync(ps)
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
