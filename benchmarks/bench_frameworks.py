"""Framework syncs and their fixes: does each hinted setting remove the sync, and save what the report said?

Question:
    For each framework sync barrierguard names (Lightning, the Hugging Face
    Trainer with accelerate, torchmetrics, torch's GradScaler, clip_grad_norm_
    and torch.save), does the setting the report names remove the sync on a
    GPU, and does the time per step drop by about what the report said
    removing it would save?

Design:
    Each case has a default and a hinted variant of one training run.
    * Counting: each variant runs once under barrierguard's CUDA engine (policy
      record); the report gives syncs per measured step by mechanism, the stall
      of every site, and its timeline's saving (the stall that the overlap of
      host and device work could hide, per timed step). The predicted saving is
      that timeline saving, times the share of the stall that belongs to the
      sites the hinted run no longer has. The raw stall of those sites is kept
      beside it: a stall is what the host waited, not what the step loses.
    * The four loops are balanced, as a real input pipeline makes them: each
      step adds ``--host-ms`` of host work (a busy-wait standing for data
      loading) and ``--device-ms`` of device work (``torch.cuda._sleep``) to
      the MLP's own, so removing a sync can save up to about the smaller one.
    * Timing: each variant runs without barrierguard, in alternating rounds
      (default, hinted, hinted, default, ...); the time per step is the median
      over the rounds of each run's median. The two fits (Lightning, HF) run in
      fresh processes (``examples/lightning_fit.py``, ``examples/hf_fit.py``,
      with ``--time``: a synchronize only at the ends of each timed window),
      ``--rounds`` rounds; the four loops run in this process between two
      synchronizes per window, ``--loop-rounds`` rounds (they are short, and
      this host's speed drifts between runs).
    * What a loop's saving is made of: after the timing, one more window of
      each variant runs with every host read of a tensor (``item``, ``bool``,
      ``tolist``, ``float``, ``int``, ``cpu``, ...; the outermost call) timed
      by a plain ``perf_counter`` wrapper, still without barrierguard: the
      wait plus the read's own host work. The saving minus the drop in that
      time is what the fix removed besides the wait (the ops that computed
      the value read, and the run-to-run drift of the host).
    ``--smoke`` runs every case with tiny sizes (CPU: the audit engine counts,
    and the GPU-only GradScaler case is skipped); its numbers mean nothing.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_frameworks.py --out benchmarks/results/h200/frameworks.json | tee benchmarks/results/h200/frameworks.txt

    The Lightning fit alone, with six rounds of fresh-process fits (its step time
    moves by a third from one process to the next)::

        PYTHONPATH=src python benchmarks/bench_frameworks.py --cases lightning --rounds 6 \\
            --out benchmarks/results/h200/frameworks_lightning_6_rounds.json

    ``benchmarks/results/h200/frameworks_b11a520.json`` (and ``.txt``) is the
    first command run at commit ``b11a520``, with two timing rounds for the loops
    and no host reads timed, and
    ``benchmarks/results/h200/frameworks_8c6694d.json`` at ``8c6694d``,
    before the timeline paired each timed step with its own stalls; both on
    other leases of an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _common import busy_wait, median, sleep_cycles_per_ms, table, write
from torch import nn

import barrierguard

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# What each case changes, as the report names it.
KNOBS = {
    "lightning": "self.log(prog_bar=False, on_step=False, on_epoch=True); DataLoader(pin_memory=True)",
    "hf": "TrainingArguments(use_cache=True, logging_nan_inf_filter=False, "
    "accelerator_config={'non_blocking': True})",
    "torchmetrics": "MeanMetric(nan_strategy='disable') x8",
    "grad_scaler": "AdamW(fused=True) under fp16 GradScaler",
    "clip_grad": "clip_grad_norm_(error_if_nonfinite=False)",
    "torch_save": "every 10 steps: copy to pinned buffers (non_blocking) + one synchronize, "
    "then torch.save",
}


# -- the fits: examples run in fresh processes ------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _fit_args(case: str, smoke: bool) -> list[str]:
    if case == "lightning":
        small = ["--epochs", "2", "--batches", "4", "--batch", "8", "--width", "16", "--depth", "1"]
        return small if smoke else []
    small = ["--steps", "12", "--batch", "2", "--length", "32", "--layers", "1", "--width", "64"]
    return small if smoke else []


def _fit_script(case: str) -> str:
    return str(EXAMPLES / ("lightning_fit.py" if case == "lightning" else "hf_fit.py"))


def count_fit(case: str, hinted: bool, smoke: bool, tmp: Path) -> barrierguard.Report:
    """The fit's report under ``barrierguard run`` (policy record)."""
    out = tmp / f"{case}_{'hinted' if hinted else 'default'}.json"
    cmd = [sys.executable, "-m", "barrierguard", "run", "--policy", "record", "--out", str(out)]
    cmd += [_fit_script(case), *_fit_args(case, smoke)] + (["--hinted"] if hinted else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return barrierguard.Report.load(out)


def time_fit(case: str, hinted: bool, smoke: bool) -> float:
    """Median ms per step of one fit without barrierguard (its own --time)."""
    cmd = [sys.executable, _fit_script(case), "--time", *_fit_args(case, smoke)]
    cmd += ["--hinted"] if hinted else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    found = re.search(r"ms/step ([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return float(found.group(1))


# -- the loops: in this process ---------------------------------------------------------
class Loop:
    """One training step of an MLP plus the case's own work; ``run(n)`` times n steps."""

    def __init__(
        self,
        case: str,
        hinted: bool,
        device: str,
        smoke: bool,
        host_ms: float = 0.0,
        device_ms: float = 0.0,
    ) -> None:
        self.case, self.hinted, self.device = case, hinted, device
        self.host_ms = host_ms
        on_gpu = device == "cuda" and device_ms > 0
        self.sleep_cycles = int(device_ms * _cycles_per_ms()) if on_gpu else 0
        width, depth, batch = (32, 1, 8) if smoke else (2048, 4, 512)
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.model = nn.Sequential(*layers, nn.Linear(width, 1)).to(device)
        fused = case == "grad_scaler" and hinted
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused or None)
        self.x = torch.randn(batch, width, device=device)
        self.y = torch.randn(batch, 1, device=device)
        self.scaler = torch.amp.GradScaler("cuda") if case == "grad_scaler" else None
        self.metrics: list[Any] = []
        if case == "torchmetrics":
            from torchmetrics.aggregation import MeanMetric

            strategy = "disable" if hinted else "warn"
            self.metrics = [MeanMetric(nan_strategy=strategy).to(device) for _ in range(8)]
        self.pinned: dict[str, torch.Tensor] = {}
        self.save_path = Path(tempfile.gettempdir()) / f"bench_frameworks_{os.getpid()}.pt"
        self.steps = 0
        self.save_every = 2 if smoke else 10

    def step(self) -> None:
        opt, model = self.opt, self.model
        if self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)  # the step's other device work
        opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(self.x), self.y)
            self.scaler.scale(loss).backward()
            self.scaler.step(opt)
            self.scaler.update()
        else:
            loss = nn.functional.mse_loss(model(self.x), self.y)
            loss.backward()
            if self.case == "clip_grad":
                torch.nn.utils.clip_grad_norm_(
                    model.parameters(), 1.0, error_if_nonfinite=not self.hinted
                )
            opt.step()
        for i, metric in enumerate(self.metrics):
            metric.update(loss.detach() * (i + 1))
        self.steps += 1
        if self.case == "torch_save" and self.steps % self.save_every == 0:
            self._save()
        if self.host_ms:
            busy_wait(self.host_ms)  # the step's other host work

    def _save(self) -> None:
        state = self.model.state_dict()
        if self.hinted:
            for name, t in state.items():
                buf = self.pinned.get(name)
                if buf is None:
                    pin = self.device == "cuda"
                    buf = self.pinned[name] = torch.empty(
                        t.shape, dtype=t.dtype, device="cpu", pin_memory=pin
                    )
                buf.copy_(t, non_blocking=True)
            if self.device == "cuda":
                torch.cuda.synchronize()
            state = dict(self.pinned)
        torch.save(state, self.save_path)

    def run(self, n: int) -> float:
        """Seconds per step over ``n`` steps, between two synchronizes."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    def close(self) -> None:
        self.save_path.unlink(missing_ok=True)


@functools.cache
def _cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per ms on this GPU, measured once."""
    return sleep_cycles_per_ms(probe=2_000_000, samples=1)


def count_loop(case: str, hinted: bool, device: str, args: argparse.Namespace) -> Any:
    loop = Loop(case, hinted, device, args.smoke, args.host_ms, args.device_ms)
    steps = args.loop_steps
    loop.run(5)  # warm-up outside the guard (lazy init, cuBLAS handles)
    with barrierguard.watch(policy="record", memory=False) as guard:
        for _ in range(steps + 1):
            loop.step()
            guard.step()
    loop.close()
    return guard.report


def time_loop(case: str, hinted: bool, device: str, args: argparse.Namespace) -> float:
    loop = Loop(case, hinted, device, args.smoke, args.host_ms, args.device_ms)
    loop.run(10)
    windows = [loop.run(args.loop_steps) * 1e3 for _ in range(3)]
    loop.close()
    return median(windows)


# Host reads of a tensor: each waits for the device when the tensor lives there.
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def timed_reads(into: list[float]) -> Iterator[None]:
    """Append the seconds of every outermost host read of a tensor to ``into``.

    A plain ``perf_counter`` around each call (``print(t)`` calls ``item``
    inside ``__format__``: only the outer call counts). The methods are
    restored on exit, also after an exception.
    """
    clock = time.perf_counter
    inside = [False]

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:
                return orig(*args, **kwargs)
            inside[0] = True
            t0 = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                into.append(clock() - t0)
                inside[0] = False

        return timed

    own = vars(torch.Tensor)
    saved = {name: (getattr(torch.Tensor, name), name in own) for name in READS}
    try:
        for name, (orig, _) in saved.items():
            setattr(torch.Tensor, name, wrap(orig))
        yield
    finally:
        for name, (orig, was_own) in saved.items():
            if was_own:
                setattr(torch.Tensor, name, orig)
            else:  # inherited from the C base class: leave it inherited
                delattr(torch.Tensor, name)


def read_loop(case: str, hinted: bool, device: str, args: argparse.Namespace) -> float:
    """Milliseconds per step in host reads of tensors, one window, without barrierguard."""
    loop = Loop(case, hinted, device, args.smoke, args.host_ms, args.device_ms)
    loop.run(10)
    spent: list[float] = []
    with timed_reads(spent):
        loop.run(args.loop_steps)
    loop.close()
    return sum(spent) / args.loop_steps * 1e3


# -- reading the reports ----------------------------------------------------------------
def _mechanisms(report: barrierguard.Report) -> dict[str, float]:
    """Syncs per measured step, by mechanism (or by kind for a site without one)."""
    per: dict[str, float] = {}
    steps = max(1, report.measured_steps)
    for site in report.sites:
        if not site.blocking or not site.step_count:
            continue
        names = [m.split(" (", 1)[0] for m, _ in site.mechanisms] or [f"{site.kind} (user)"]
        name = names[0]
        per[name] = per.get(name, 0.0) + site.step_count / steps
    return per


def _stall_ms(report: barrierguard.Report, gone: set[str]) -> float:
    """Stall per measured step, in ms, of the sites whose mechanism is in ``gone``."""
    steps = max(1, report.measured_steps)
    total = 0.0
    for site in report.sites:
        if _names(site) & gone and site.stall_s is not None:
            total += site.stall_s
    return total / steps * 1e3


def _names(site: barrierguard.Site) -> set[str]:
    return {m.split(" (", 1)[0] for m, _ in site.mechanisms} or {f"{site.kind} (user)"}


def _report_saving_ms(report: barrierguard.Report, gone: set[str]) -> float | None:
    """What the report said removing the ``gone`` sites would save, in ms per step.

    The timeline's saving per timed step, times the gone sites' share of the
    stall; ``None`` without a timeline (the audit engine, a CPU run).
    """
    timeline = report.timeline
    if timeline is None or not timeline.steps:
        return None
    stalls = [(s.stall_s or 0.0, bool(_names(s) & gone)) for s in report.sites if s.step_count]
    total = sum(stall for stall, _ in stalls)
    share = sum(stall for stall, hit in stalls if hit) / total if total > 0 else 0.0
    return timeline.saving_s / len(timeline.steps) * share * 1e3


def run_case(case: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    fit = case in ("lightning", "hf")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reports = {}
    for hinted in (False, True):
        if fit:
            reports[hinted] = count_fit(case, hinted, args.smoke, tmp)
        else:
            reports[hinted] = count_loop(case, hinted, device, args)
    timer: Callable[[bool], float]
    if fit:

        def timer(hinted: bool) -> float:
            return time_fit(case, hinted, args.smoke)
    else:

        def timer(hinted: bool) -> float:
            return time_loop(case, hinted, device, args)

    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.rounds if fit else args.loop_rounds):
        for hinted in (False, True) if i % 2 == 0 else (True, False):
            times[hinted].append(timer(hinted))
    reads: dict[bool, float | None] = {False: None, True: None}
    if not fit:
        for hinted in (False, True):
            reads[hinted] = read_loop(case, hinted, device, args)
    before, after = _mechanisms(reports[False]), _mechanisms(reports[True])
    gone = {m for m in before if m not in after}
    ms_before, ms_after = median(times[False]), median(times[True])
    reads_before, reads_after = reads[False], reads[True]
    read_drop = None if reads_before is None or reads_after is None else reads_before - reads_after
    return {
        "knob": KNOBS[case],
        "engine": reports[False].engine,
        "syncs_per_step_before": before,
        "syncs_per_step_after": after,
        "removed": sorted(gone),
        "stall_ms": _stall_ms(reports[False], gone),
        "predicted_saving_ms": _report_saving_ms(reports[False], gone),
        "timeline": (
            reports[False].timeline.summary if reports[False].timeline is not None else None
        ),
        "ms_per_step_before": ms_before,
        "ms_per_step_after": ms_after,
        "measured_saving_ms": ms_before - ms_after,
        "reads_ms_before": reads_before,
        "reads_ms_after": reads_after,
        "saving_besides_reads_ms": None if read_drop is None else ms_before - ms_after - read_drop,
        "times_ms": {"before": times[False], "after": times[True]},
        "fixes": sorted({s.fix for s in reports[False].sites if s.step_count and s.mechanisms}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cases", nargs="*", default=list(KNOBS), choices=list(KNOBS))
    ap.add_argument("--rounds", type=int, default=2, help="fits: timing runs per variant")
    ap.add_argument("--loop-rounds", type=int, default=6, help="loops: timing runs per variant")
    ap.add_argument("--loop-steps", type=int, default=60, help="steps per timed loop window")
    ap.add_argument("--host-ms", type=float, default=1.0, help="loops: host work per step")
    ap.add_argument("--device-ms", type=float, default=1.0, help="loops: device work per step")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU checks)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    cases = [c for c in args.cases if torch.cuda.is_available() or c != "grad_scaler"]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            t0 = time.perf_counter()
            results[case] = run_case(case, args, Path(tmp))
            print(f"{case}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for case, r in results.items():
        fmt = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["syncs_per_step_before"].items()))
        after = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["syncs_per_step_after"].items()))
        rows.append(
            [
                case,
                ", ".join(r["removed"]) or "-",
                fmt or "0",
                after or "0",
                f"{r['ms_per_step_before']:.3f}",
                f"{r['ms_per_step_after']:.3f}",
                f"{r['measured_saving_ms']:.3f}",
                "-" if r["predicted_saving_ms"] is None else f"{r['predicted_saving_ms']:.3f}",
                f"{r['stall_ms']:.3f}",
            ]
        )
    header = [
        "case",
        "syncs removed",
        "syncs/step before",
        "syncs/step after",
        "ms/step before",
        "ms/step after",
        "saved ms",
        "report's saving ms",
        "stall ms",
    ]
    print(table(header, rows))
    parts = [
        [
            case,
            f"{r['measured_saving_ms']:.3f}",
            f"{r['reads_ms_before']:.3f}",
            f"{r['reads_ms_after']:.3f}",
            f"{r['saving_besides_reads_ms']:.3f}",
        ]
        for case, r in results.items()
        if r["reads_ms_before"] is not None
    ]
    if parts:
        print("\nloops: the saving against the time in host reads (no barrierguard)\n")
        head = ["case", "saved ms", "reads ms before", "reads ms after", "saved besides reads ms"]
        print(table(head, parts))
    for case, r in results.items():
        print(f"\n{case}: {r['knob']}")
        if r["timeline"]:
            print(f"  report's timeline (default): {r['timeline']}")
        for fix in r["fixes"]:
            print(f"  report's fix: {fix}")
    elapsed = time.perf_counter() - start
    print(f"\nelapsed {elapsed:.0f} s")
    settings = {"host_ms": args.host_ms, "device_ms": args.device_ms}
    write(
        args.out, {"smoke": args.smoke, "elapsed_s": elapsed, "loops": settings, "cases": results}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
