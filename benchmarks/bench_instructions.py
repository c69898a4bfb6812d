"""How many instructions does barrierguard run per recorded sync, per quiet step, per Lightning step?

Question:
    Host timings of one step drift by 20-40% on a shared machine, so a cost of
    1% or a microsecond per sync takes hundreds of paired rounds to resolve,
    and one host reads differently from the next. What does the instrument
    itself execute, counted without noise: per recorded ``.item()`` (in user
    code, and inside a framework 20 frames deep), per step that records nothing,
    and per step of a Lightning fit with the callback?

Design:
    The workload runs under valgrind's callgrind, which counts every machine
    instruction the process executes (``Ir``); the count of a part is the
    same from run to run within a fraction of a percent. The workload marks
    the end of each part by calling ``time.clock_getres``, before which
    callgrind writes the counts so far (``--dump-before``): the parent reads
    each dump's total and the part's label, which the workload prints.

    The CUDA engine runs on the CPU through its seams (``detect/cuda.py``):
    the sync-debug mode reads as warn, setting it does nothing (both C calls,
    as torch's are), and in the
    reads part every tensor counts as on the device, so an ``.item()`` takes
    the GPU's path (its wrapper records it). The device's own wait is absent,
    as are the CUDA calls of the memory sampler and the step timeline.

    * ``reads``: ``--reads`` reads, bare and under ``watch(engine="cuda",
      memory=False)`` after a step boundary confirmed the site and the
      violation list filled (the steady state of a long run): in user code
      (one loop) and in bench_core's framework path (a Lightning file, 20
      frames deep). Added per read = (watched - bare) / reads.
      Then ``--reads`` calls of ``.to("cpu")`` on a host tensor (it moves
      nothing and syncs nothing), bare and watched: what the copy wrapper
      adds to every ``.to()``, ``.cuda()`` and ``copy_()``.
    * ``steps``: ``--steps`` steps with nothing to record, bare, under
      ``watch(engine="cuda", memory=False)``, the same with one
      ``torch.cuda.synchronize()`` recorded just before the counted steps (a
      stand-in that waits for nothing; its walk keeps frames that each boundary
      then looks for, as in bench_core's timed blocks) and under
      ``watch(engine="cuda", memory_every=10**6)``: a non-blocking ``.to()`` of a host tensor,
      ``torch.tensor(1.0, device="cpu")`` (Adam's, each step) and the step of an
      SGD optimizer with no gradient (its step is its hooks: the step boundary).
      The step timeline runs on stand-in events; the memory sampler samples at
      the start and not in the counted steps (what each step between two samples
      pays). Added per step = (watched - bare) / steps. Then the same steps, each
      ending with ``.item()`` of a tensor counted as on the device, in a function
      the step calls (a logged loss): bare, and under ``watch(engine="cuda",
      memory=False)`` after 1,100 such steps (the site settled once its first
      1,000 violations are listed), against its own bare steps; and the same with
      the read in a helper that a step function calls (two frames new each step).
    * ``lightning``: a CPU Lightning fit of a small TinyLM with
      ``BarrierGuard(memory=False)``, then ``BarrierGuard()``, switched off and
      on every ``--block-len`` steps (the switch itself is counted apart); the
      median on-block and off-block per step, and what the callback adds.
      Without memory sampling the count is the same from run to run; with it,
      it varies with how many samples fall in a block (the sampler picks its
      stride from the step's wall time). Device placement is left alone here:
      optimizers' host step counters stay on the host.

    Instructions are not time: a cache miss costs hundreds of cycles, and a
    GPU host runs CUDA calls this machine does not. The figures bound what
    barrierguard's own Python adds; the timed benchmarks give the rest.

Reproduce:
    On a Linux machine with valgrind (CPU; about 13 minutes)::

        PYTHONPATH=src python benchmarks/bench_instructions.py \\
            --out benchmarks/results/instructions_cpu.json \\
            | tee benchmarks/results/instructions_cpu.txt

    The committed run is at c64b767 (the step boundary is the optimizer hook itself and rolls
    the tallies inline; a callback's guard wraps no ``DataLoader``). The ones before it, at
    55c0a4b, 2645640, eeef063, 8f7d436, 4b2adb7, 0bd0649, 8343848 and 2f8e154, are in git
    history.
    The ``steps`` part of another ``src/``
    (``79963a1``, before the copy and the listeners changed) is counted with this
    script and that ``src/`` first on ``PYTHONPATH``.

    Smoke run without valgrind (the workload only, no counts)::

        PYTHONPATH=src python benchmarks/bench_instructions.py --no-valgrind --tiny
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, table, write

_MARK_CLOCK = time.CLOCK_MONOTONIC
SYNC_FIRST = "memory=False, a sync recorded first"
READ = "memory=False, a read each step in a function"
READ_NESTED = "memory=False, a read each step in a helper of the step function"
_LABELS = "LABELS "


def _mark() -> None:
    """The end of a part: callgrind writes its counts before this call."""
    time.clock_getres(_MARK_CLOCK)


def _engine_on_cpu(all_on_device: bool) -> None:
    """Run the CUDA engine here: the mode reads as warn and is never set."""
    import logging

    from barrierguard import _env
    from barrierguard.detect import cuda as engine
    from barrierguard.session import guard as guard_module

    _env.cuda_available = lambda: True  # type: ignore[assignment]
    engine._get_mode = lambda: 0
    engine._set_mode = lambda mode: None
    # C calls, as torch's own are on a GPU: no Python frame counted for them.
    engine._raw_get = functools.partial(int, 1)
    engine._raw_set = abs
    if all_on_device:
        engine._on_device = lambda tensor: True
    guard_module._make_engine = lambda name: engine.CudaEngine()  # type: ignore[assignment]

    def no_timeline() -> Any:
        raise RuntimeError("no CUDA events on this machine")

    guard_module._make_timeline = no_timeline  # type: ignore[assignment]
    # The step timeline's fault is noted once per start: not printed.
    logging.getLogger("barrierguard").setLevel(logging.CRITICAL)


def _reads(args: argparse.Namespace) -> list[str]:
    """Bare and watched reads, user and framework path; returns the labels."""
    import torch
    from bench_core import _framework

    import barrierguard

    _engine_on_cpu(all_on_device=True)
    x = torch.ones(1)
    through = _framework()

    def user(n: int) -> None:
        for _ in range(n):
            x.item()

    def framework(n: int) -> None:
        for _ in range(n):
            through(20, x)

    labels: list[str] = []
    for path, loop in (("user", user), ("framework", framework)):
        loop(50)
        _mark()
        loop(args.reads)
        _mark()
        labels += ["-", f"{path} bare"]
        guard = barrierguard.watch(engine="cuda", policy="record", memory=False)
        guard.start()
        guard.step()
        loop(1)  # the site, confirmed by the step boundary that follows
        guard.step()
        loop(1100)  # past the violation list's 1,000 entries: the steady state
        _mark()
        loop(args.reads)
        _mark()
        labels += ["-", f"{path} watched"]
        guard.stop()
        found = sum(s.count for s in guard.report.sites if s.kind == "item")
        assert found == args.reads + 1101, (path, found)
    # A .to() that moves nothing: the copy wrapper's own cost, paid by every
    # .to(), .cuda() and copy_() (a Lightning step makes several).
    y = torch.ones(4)

    def copy(n: int) -> None:
        for _ in range(n):
            y.to("cpu")

    for watched in (False, True):
        guard = barrierguard.watch(engine="cuda", policy="record", memory=False)
        if watched:
            guard.start()
            guard.step()
        copy(50)
        _mark()
        copy(args.reads)
        _mark()
        labels += ["-", f"copy {'watched' if watched else 'bare'}"]
        if watched:
            guard.stop()
            assert not guard.report.sites, guard.report.sites  # nothing synced
    return labels


def _steps(args: argparse.Namespace) -> list[str]:
    """Steps with nothing to record, bare and watched; returns the labels."""
    import torch

    import barrierguard
    from barrierguard.session import guard as guard_module
    from barrierguard.session.timeline import StepTimeline

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _fake_cuda import InstantEvent

    _engine_on_cpu(all_on_device=False)
    guard_module._make_timeline = lambda: StepTimeline(make_event=InstantEvent)  # type: ignore[assignment]
    host = torch.ones(4)
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.1)  # no gradient: its step is its hooks

    def steps(n: int) -> None:
        for _ in range(n):
            host.to("cpu", non_blocking=True)
            torch.tensor(1.0, device="cpu")
            opt.step()

    # torch.cuda.synchronize() as a C call that waits for nothing, wrapped by the engine.
    torch.cuda.synchronize = functools.partial(int, 0)  # type: ignore[assignment]
    labels: list[str] = []

    def counted(label: str, loop: Any, warm: int, before: Any = None) -> None:
        """``warm`` steps of ``loop``, ``before()``, then ``args.steps`` counted as ``label``."""
        loop(warm)
        if before is not None:
            before()
        _mark()
        loop(args.steps)
        _mark()
        labels.extend(["-", label])

    # Memory sampled once at the start, then never in the counted steps: what
    # every step between two samples pays. With a sync recorded just before the
    # counted steps (as bench_core's timed block has), its walk keeps frames
    # that every boundary after it must find still on the stack.
    for name, options in (
        ("bare", None),
        ("memory=False", {"memory": False}),
        (SYNC_FIRST, {"memory": False}),
        ("memory sampling on", {"memory_every": 10**6}),
    ):
        guard = None
        if options is not None:
            guard = barrierguard.watch(engine="cuda", policy="record", **options)
            guard.start()
        counted(f"steps {name}", steps, 300, torch.cuda.synchronize if name == SYNC_FIRST else None)
        if guard is not None:
            guard.stop()
            synced = [s.kind for s in guard.report.sites]
            assert synced == (["synchronize"] if name == SYNC_FIRST else []), synced
            assert guard.report.steps == args.steps + 300, guard.report.steps
    # The same steps, each ending with a read (a logged loss) in a function the step calls,
    # its tensor counted as on the device: bare, and watched once its site is settled (the
    # violations of the first 1,000 reads listed), as in a long run.
    from barrierguard.detect import cuda as engine

    loss = torch.ones(1)

    def read() -> None:
        loss.item()

    def read_steps(n: int) -> None:
        for _ in range(n):
            steps(1)
            read()

    def train_step() -> None:
        steps(1)
        read()  # a helper of the step function: two frames that are new each step

    def nested_steps(n: int) -> None:
        for _ in range(n):
            train_step()

    on_device = engine._on_device
    for name, loop in ((READ, read_steps), (READ_NESTED, nested_steps)):
        for watched in (False, True):
            guard = None
            if watched:
                engine._on_device = lambda tensor: tensor is loss
                guard = barrierguard.watch(engine="cuda", policy="record", memory=False)
                guard.start()
            counted(f"steps {name}{'' if watched else ' bare'}", loop, 1100)
            if guard is not None:
                guard.stop()
                engine._on_device = on_device
                (site,) = guard.report.sites
                assert site.count == args.steps + 1100, site.count
    return labels


def _lightning(args: argparse.Namespace) -> list[str]:
    """A CPU fit with the callback switched every ``args.block_len`` steps; the labels."""
    import lightning.pytorch as pl
    import torch
    from _common import (
        lightning_loader,
        lightning_model,
        lightning_settings,
        lightning_trainer,
        quiet_lightning,
    )

    import barrierguard

    torch.set_num_threads(1)
    quiet_lightning()
    _engine_on_cpu(all_on_device=False)
    fit = lightning_settings("transformer", 64)
    fit.width, fit.hidden, fit.seq, fit.vocab, fit.batch = 64, 64, 2, 32, 1
    cb = barrierguard.BarrierGuard(
        policy="record", print_report=False, save_report=False, memory=args.memory
    )
    labels = ["-"]
    steps = [0]
    block = args.block_len

    class Switch(pl.Callback):
        def on_train_batch_end(self, *a: Any) -> None:
            steps[0] += 1
            if steps[0] % block:
                return
            on = (steps[0] // block) % 2 == 1  # the callback starts on
            _mark()
            labels.append("on" if on else "off")
            if on:
                cb.guard._stop(act=False)
            else:
                cb._begin("train", functools.partial(getattr, a[0], "optimizers"))
            _mark()
            labels.append("switch")

    trainer = lightning_trainer([cb, Switch()], max_steps=block * args.blocks)
    torch.manual_seed(0)
    _mark()
    trainer.fit(lightning_model(fit), lightning_loader(fit))
    return labels


def _child(args: argparse.Namespace) -> None:
    part = {"lightning": _lightning, "steps": _steps, "reads": _reads}[args.child]
    labels = part(args)
    print(_LABELS + " ".join(label.replace(" ", "_") for label in labels), flush=True)


def _counts(directory: Path, base: str) -> list[int]:
    """Each dump's instruction total, in order."""
    files = sorted(directory.glob(f"{base}.*"), key=lambda p: int(p.suffix[1:]))
    totals = []
    for path in files:
        with path.open(errors="replace") as f:
            for line in f:
                if line.startswith("summary:"):
                    totals.append(int(line.split()[1]))
                    break
    return totals


def parse(stdout: str, totals: list[int]) -> dict[str, list[int]]:
    """Instructions by label: dump ``i`` holds what ran before the ``i``-th mark.

    Example:
        >>> parse("x\\nLABELS - user_bare\\n", [900, 100])
        {'-': [900], 'user bare': [100]}
    """
    line = next(ln for ln in stdout.splitlines() if ln.startswith(_LABELS))
    labels = [label.replace("_", " ") for label in line[len(_LABELS) :].split()]
    if len(labels) != len(totals):
        raise RuntimeError(f"{len(labels)} labels for {len(totals)} dumps")
    out: dict[str, list[int]] = {}
    for label, total in zip(labels, totals, strict=True):
        out.setdefault(label, []).append(total)
    return out


def _run_part(part: str, args: argparse.Namespace, *extra: str) -> dict[str, list[int]] | None:
    """The part's workload, with ``extra`` arguments, under callgrind (or bare with
    ``--no-valgrind``)."""
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        part,
        "--reads",
        str(args.reads),
        "--block-len",
        str(args.block_len),
        "--blocks",
        str(args.blocks),
        "--steps",
        str(args.steps),
        *extra,
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if args.no_valgrind:
        subprocess.run(argv, check=True, env=env)
        return None
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("bench_instructions: valgrind is not installed (or use --no-valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        cmd = [
            valgrind,
            "--tool=callgrind",
            "--dump-before=time_clock_getres",
            f"--callgrind-out-file={out}",
            *argv,
        ]
        proc = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
        return parse(proc.stdout, _counts(Path(tmp), "cg.out"))


def _per_step(args: argparse.Namespace, fit: dict[str, list[int]]) -> dict[str, Any]:
    """Instructions per step of the on- and off-blocks, and of a switch."""
    # The first on-block holds the fit's setup: left out.
    on = [t / args.block_len for t in fit["on"][1:]]
    off = [t / args.block_len for t in fit["off"]]
    step: dict[str, Any] = {"off": median(off), "on": median(on), "blocks": [len(on), len(off)]}
    step["added"] = step["on"] - step["off"]
    step["ratio"] = step["on"] / step["off"]
    switch = fit["switch"]
    step["switch_on"] = median(switch[1::2])
    step["switch_off"] = median(switch[0::2])
    return step


def _summarise(
    args: argparse.Namespace, reads: Any, steps: Any, fits: dict[str, Any]
) -> dict[str, Any]:
    n = args.reads
    per_read = {
        path: {
            "bare": reads[f"{path} bare"][0] / n,
            "watched": reads[f"{path} watched"][0] / n,
            "added": (reads[f"{path} watched"][0] - reads[f"{path} bare"][0]) / n,
        }
        for path in ("user", "framework")
    }
    copies = reads.get("copy bare") and reads.get("copy watched")
    return {
        "per_read": per_read,
        "per_copy": {
            "bare": reads["copy bare"][0] / n,
            "watched": reads["copy watched"][0] / n,
            "added": (reads["copy watched"][0] - reads["copy bare"][0]) / n,
        }
        if copies
        else None,
        "per_step": {
            name: {
                "bare": steps[bare][0] / args.steps,
                "watched": steps[f"steps {name}"][0] / args.steps,
                "added": (steps[f"steps {name}"][0] - steps[bare][0]) / args.steps,
            }
            for name, bare in (
                ("memory=False", "steps bare"),
                (SYNC_FIRST, "steps bare"),
                ("memory sampling on", "steps bare"),
                (READ, f"steps {READ} bare"),
                (READ_NESTED, f"steps {READ_NESTED} bare"),
            )
            if f"steps {name}" in steps
        },
        "lightning_per_step": {name: _per_step(args, fit) for name, fit in fits.items()},
    }


def _print(record: dict[str, Any]) -> None:
    pr = record["per_read"]
    print(
        table(
            ["recorded .item()", "bare (Ir/read)", "watched (Ir/read)", "added (Ir/read)"],
            [
                [name, f"{v['bare']:,.0f}", f"{v['watched']:,.0f}", f"{v['added']:,.0f}"]
                for name, v in (
                    ("in user code", pr["user"]),
                    ("in a framework, 20 frames deep", pr["framework"]),
                )
            ],
        )
    )
    copy = record.get("per_copy")
    if copy:
        print(
            f"a .to() that moves nothing (the copy wrapper): bare {copy['bare']:,.0f} Ir, "
            f"watched {copy['watched']:,.0f} Ir, added {copy['added']:,.0f} Ir a call"
        )
    print(
        table(
            ["a step with nothing to record", "bare (Ir/step)", "watched (Ir/step)", "added"],
            [
                [name, f"{v['bare']:,.0f}", f"{v['watched']:,.0f}", f"{v['added']:,.0f}"]
                for name, v in record["per_step"].items()
            ],
        )
    )
    steps = record["lightning_per_step"]
    print(
        table(
            ["Lightning step (CPU TinyLM)", "off (Ir/step)", "on (Ir/step)", "added", "on / off"],
            [
                [
                    f"{name}: {ps['blocks'][0]} on-, {ps['blocks'][1]} off-blocks",
                    f"{ps['off']:,.0f}",
                    f"{ps['on']:,.0f}",
                    f"{ps['added']:,.0f}",
                    f"{ps['ratio']:.4f}",
                ]
                for name, ps in steps.items()
            ],
        )
    )
    for name, ps in steps.items():
        print(
            f"{name}: switching the callback on: {ps['switch_on']:,.0f} Ir; "
            f"off: {ps['switch_off']:,.0f} Ir"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=5000, help="reads per part")
    ap.add_argument("--block-len", type=int, default=8, help="Lightning steps per block")
    ap.add_argument("--blocks", type=int, default=9, help="Lightning blocks (on, off, ...)")
    ap.add_argument("--steps", type=int, default=2048, help="steps with nothing to record")
    ap.add_argument("--no-valgrind", action="store_true", help="run the workload only")
    ap.add_argument("--tiny", action="store_true", help="smoke-test settings")
    ap.add_argument("--child", choices=("reads", "steps", "lightning"), help=argparse.SUPPRESS)
    ap.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.tiny:
        args.reads, args.block_len, args.blocks, args.steps = 50, 2, 3, 300
    if args.child:
        _child(args)
        return
    reads = _run_part("reads", args)
    steps = _run_part("steps", args)
    fits = {
        "memory=False": _run_part("lightning", args),
        "memory sampling on": _run_part("lightning", args, "--memory"),
    }
    if reads is None:
        return
    record = _summarise(args, reads, steps, fits)
    _print(record)
    write(
        args.out,
        {
            "benchmark": "instructions",
            "settings": {k: v for k, v in vars(args).items() if k not in ("child", "memory")},
            "valgrind": subprocess.run(
                ["valgrind", "--version"], capture_output=True, text=True
            ).stdout.strip(),
            **record,
        },
    )


if __name__ == "__main__":
    main()
