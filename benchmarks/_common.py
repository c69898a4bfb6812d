"""Machinery the benchmark scripts share; not a benchmark itself.

Each ``bench_*.py`` script answers one question (its docstring says which, how,
and the command that reproduces its committed result). What two or more of them
use lives here:

* timing: device syncs around a timed block, a host busy-wait, the sleep kernel's
  clock;
* statistics: medians, quartiles, paired rounds (every variant once per round, in
  a rotating order) and their summary;
* output: markdown tables and the JSON results file (with the machine it ran on);
* the steps the scripts time: the launch-bound Adam MLP step (``bench_core``,
  ``bench_memory``), the three step shapes (``bench_alternatives``,
  ``bench_metrics``), sync-debug mode with a naive stack-walking hook
  (``bench_core``, ``bench_alternatives``);
* the Lightning fits: the MLP and TinyLM models, their data and the trainer
  (``bench_lightning``, ``bench_metrics``).

Lightning is imported only by the functions that need it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

# -- timing -------------------------------------------------------------------------


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    """Wall time of ``fn`` between two device synchronizations, in seconds."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def busy_wait(ms: float) -> None:
    """Keep the host busy for ``ms`` milliseconds (stands for batch preparation)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def sleep_cycles_per_ms(probe: int = 1_000_000, samples: int = 5) -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on this GPU.

    The median of ``samples`` sleeps of ``probe`` cycles, after one untimed. The
    default probes are short, like the 1 ms kernels most benchmarks launch: one
    long probe runs at a clock the short ones do not reach.
    """
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = []
    for _ in range(samples):
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        rates.append(probe / start.elapsed_time(end))
    return float(sorted(rates)[len(rates) // 2])


# -- statistics ---------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def quartiles(xs: Sequence[float]) -> list[float]:
    """The first and third quartiles, as the sorted values at n/4 and 3n/4."""
    s = sorted(xs)
    return [s[len(s) // 4], s[(3 * len(s)) // 4]]


def median_ci(xs: Sequence[float], z: float = 1.96) -> list[float]:
    """A distribution-free 95% confidence interval of the median (``z`` sets the level).

    The sorted values at ranks ``floor(n/2 - z*sqrt(n)/2)`` and ``ceil(1 + n/2 +
    z*sqrt(n)/2)``, counted from 1 (the binomial's normal approximation): the
    median of the population the rounds are drawn from lies between them in 95%
    of repeats, whatever the shape of the noise. Needs about 10 values or more.

    Example:
        >>> median_ci(list(range(1, 101)))
        [40, 61]
    """
    s = sorted(xs)
    n = len(s)
    half = z * math.sqrt(n) / 2
    lo = max(1, math.floor(n / 2 - half))
    hi = min(n, math.ceil(1 + n / 2 + half))
    return [s[lo - 1], s[hi - 1]]


def paired_rounds(
    names: Sequence[str], run: Callable[[str], float], pairs: int
) -> list[dict[str, float]]:
    """``pairs`` interleaved rounds, each calling ``run(name)`` once per variant.

    The order rotates by one variant each round, so no variant always runs
    first (or right after the same neighbour). Returns each round's seconds by
    variant.
    """
    rounds = []
    for i in range(pairs):
        k = i % len(names)
        rounds.append({n: run(n) for n in [*names[k:], *names[:k]]})
    return rounds


def paired_summary(
    rounds: list[dict[str, float]], names: Sequence[str], steps: int, base: str = "bare"
) -> dict[str, Any]:
    """Median ms per step per variant, and each variant's ratio to ``base`` within a round."""
    ratios = {n: [r[n] / r[base] for r in rounds] for n in names if n != base}
    return {
        "step_ms": {n: median([r[n] / steps for r in rounds]) * 1e3 for n in names},
        "ratio_median": {n: median(v) for n, v in ratios.items()},
        "ratio_quartiles": {n: quartiles(v) for n, v in ratios.items()},
        "ratio_ci95": {n: median_ci(v) for n, v in ratios.items()},
        "ratios": ratios,
    }


# -- output -------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine() -> dict[str, str]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(terse=True),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def write(path: str | Path | None, results: dict[str, Any]) -> None:
    """Write ``results`` (after the machine's description) as JSON; nothing without a path."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), **results}
    Path(path).write_text(json.dumps(results, indent=2) + "\n")
    print(f"results written to {path}")


# -- the launch-bound Adam step (bench_core, bench_memory) --------------------------


def adam_mlp_step(device: str, layers: int, width: int, read: bool = False) -> Callable[[], None]:
    """An Adam step of ``layers`` Linear+ReLU of ``width``, batch 64, after a batch copy.

    Small kernels, many of them: on a GPU the host's launch rate sets the pace.
    The batch comes from pinned memory with ``non_blocking=True`` (no sync). With
    ``read``, the step ends with ``loss.item()``: one sync a step, as a loop that
    logs its loss makes, from a function the loop calls.
    """
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device=device)
    host = torch.randn(64, width)
    if device == "cuda":
        host = host.pin_memory()

    def step() -> None:
        inp = host.to(device, non_blocking=True) + x
        loss = model(inp).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if read:
            loss.item()

    return step


def adam_mlp_layers(device: str, width: int, target_ms: float) -> int:
    """The layer count whose bare :func:`adam_mlp_step` is closest to ``target_ms``."""
    best, best_gap = 1, float("inf")
    for layers in (1, 2, 3, 4, 6, 8):
        step = adam_mlp_step(device, layers, width)
        for _ in range(5):
            step()
        ms = median([timed(lambda s=step: [s() for _ in range(20)]) / 20 * 1e3 for _ in range(3)])
        if abs(ms - target_ms) < best_gap:
            best, best_gap = layers, abs(ms - target_ms)
    return best


# -- sync-debug mode alone (bench_core, bench_lightning --switch mode) ---------------


class ModeOnly:
    """Sync-debug warn mode with its warnings ignored, and nothing else: the floor
    under any sync-debug-mode detector."""

    on = False

    def __enter__(self) -> None:
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", message="called a synchronizing CUDA operation")
        warnings.filterwarnings("ignore", message="Synchronization debug mode")
        torch.cuda.set_sync_debug_mode("warn")
        self.on = True

    def __exit__(self, *exc: object) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode(0)
            self._w.__exit__(None, None, None)
            self.on = False


# -- sync-debug mode with a naive hook (bench_core, bench_alternatives) -------------


class NaiveSyncDebug:
    """What a user could write instead of barrierguard: sync-debug warn mode, an
    'always' warning filter and a ``showwarning`` that walks the stack
    (``traceback.extract_stack(limit=12)``) at every sync. ``records`` keeps the stacks.
    """

    def __init__(self) -> None:
        self.records: list[traceback.StackSummary] = []

    def __enter__(self) -> NaiveSyncDebug:
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.filterwarnings("ignore", message="Synchronization debug mode")
        # Added last, so it is the first filter a sync warning meets.
        warnings.filterwarnings("always", message="called a synchronizing CUDA operation")
        saved = warnings.showwarning
        records = self.records

        def hook(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
            if "synchronizing CUDA operation" in str(message):
                records.append(traceback.extract_stack(limit=12))
                return
            saved(message, category, filename, lineno, *rest)

        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(0)
        self._filters.__exit__(None, None, None)  # restores showwarning and the filters


# -- what a started guard patches, and its host time by part (bench_core, bench_lightning) --

_ABSENT = object()


def _inherited(owner: Any, name: str) -> Any:
    """What ``owner.name`` reads when ``owner`` does not hold ``name`` itself."""
    for base in getattr(owner, "__mro__", ())[1:]:
        if name in vars(base):
            return vars(base)[name]
    return _ABSENT


Patched = tuple[Any, str, Any, bool]
"""``(owner, name, what the name read before, whether the owner held it itself)``."""


def patched_calls() -> list[Patched]:
    """Every callable a started ``watch(memory=False)`` changes.

    A guard is started once and stopped; what it set on the ``torch`` modules,
    ``torch.Tensor`` (most of whose methods it inherits from ``torch._C.TensorBase``),
    ``torch.cuda.Event`` and the ``DataLoader`` iterator is listed. ``_get_value`` is
    left out: the guard replaces that Python function with one that calls no further.
    """
    import types

    from torch.utils.data.dataloader import _BaseDataLoaderIter

    import barrierguard

    owners: list[Any] = [torch.Tensor, torch.cuda.Event, _BaseDataLoaderIter]
    owners += [m for n, m in list(sys.modules.items()) if n.startswith("torch") and m]
    before = [(o, dict(vars(o))) for o in owners if isinstance(o, (type, types.ModuleType))]
    probe = barrierguard.watch(policy="record", memory=False)
    probe.start()
    try:
        return [
            (o, name, saved[name] if name in saved else _inherited(o, name), name in saved)
            for o, saved in before
            for name, value in vars(o).items()
            if saved.get(name, _ABSENT) is not value
            and callable(value)
            and name != "_get_value"
            and (name in saved or _inherited(o, name) is not _ABSENT)
        ]
    finally:
        probe.stop()


def unpatch(changed: Sequence[Patched]) -> None:
    """Put back what :func:`patched_calls` found (an inherited name is removed again)."""
    for owner, name, orig, own in changed:
        if own:
            setattr(owner, name, orig)
        elif name in vars(owner):
            delattr(owner, name)


# The meter's code is compiled under a standard-library-like file name: the guard's walk
# of the stack passes its frames by, as it passes any library's.
_METER_SOURCE = """
def meter(fn, cell, clock, active, key, role):
    def metered(*args, **kwargs):
        if role == 2 and not active.get(key):
            return fn(*args, **kwargs)
        if role == 1:
            active[key] = active.get(key, 0) + 1
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            cell[0] += clock() - t0
            cell[1] += 1
            if role == 1:
                active[key] -= 1
    return metered
"""
_meter_space: dict[str, Any] = {}
exec(compile(_METER_SOURCE, "<frozen barrierguard_bench.meter>", "exec"), _meter_space)
_WHOLE, _WRAPPER, _ORIGINAL = 0, 1, 2


class GuardMeter:
    """barrierguard's host time by part, measured in place with ``perf_counter`` meters.

    :meth:`install` (before the guard starts) puts a meter on every call a guard
    patches (:func:`patched_calls`), which the guard then wraps, and on each of
    ``methods`` (``(owner, attribute, label)``: metered whole, e.g. the optimizer
    hook); :meth:`wrap_started` (once it started) puts a meter on each of its
    wrappers. A wrapper's own time is its time less its original's (counted only
    inside that wrapper's call), holding one inner meter's cost per call.
    :meth:`uninstall` restores everything; :meth:`reset` zeroes the counts.
    """

    def __init__(self, methods: Sequence[tuple[Any, str, str]] = ()) -> None:
        import functools

        self._wraps = functools.wraps
        self.changed = patched_calls()
        self.methods = list(methods)
        self.spent: dict[str, list[float]] = {}
        self._active: dict[str, int] = {}
        self._originals: dict[tuple[int, str], Any] = {}
        self._saved: list[tuple[Any, str, Any, bool]] = []
        self.empty = self._meter("empty", lambda: None, _WHOLE)

    def _meter(self, label: str, fn: Any, role: int, key: str = "") -> Any:
        cell = self.spent.setdefault(label, [0.0, 0])
        metered = _meter_space["meter"](fn, cell, time.perf_counter, self._active, key, role)
        return self._wraps(fn)(metered)

    @staticmethod
    def _label(owner: Any, name: str) -> str:
        return f"{getattr(owner, '__name__', owner)}.{name}"

    def install(self) -> None:
        for owner, name, orig, own in self.changed:
            label = self._label(owner, name)
            metered = self._meter(f"original {label}", orig, _ORIGINAL, label)
            self._originals[(id(owner), name)] = metered
            self._saved.append((owner, name, orig, own))
            setattr(owner, name, metered)
        for owner, name, label in self.methods:
            self._saved.append((owner, name, vars(owner)[name], True))
            setattr(owner, name, self._meter(label, vars(owner)[name], _WHOLE))

    def wrap_started(self) -> None:
        for owner, name, _, _ in self.changed:
            current = vars(owner).get(name)
            if current is None or current is self._originals[(id(owner), name)]:
                continue  # not patched by this start
            label = self._label(owner, name)
            setattr(owner, name, self._meter(f"wrapper {label}", current, _WRAPPER, label))

    def uninstall(self) -> None:
        unpatch(self._saved[::-1])
        self._saved.clear()

    def reset(self) -> None:
        for cell in self.spent.values():
            cell[0], cell[1] = 0.0, 0

    def rows(self, steps: int) -> dict[str, dict[str, float]]:
        """Per step: each wrapper's own time and calls, then each metered method's."""
        per = {k: (c[0] / steps * 1e6, c[1] / steps) for k, c in self.spent.items() if c[1]}
        rows = {
            f"wrapper of {k[len('wrapper ') :]}": {
                "us_per_step": us - per.get(f"original {k[len('wrapper ') :]}", (0.0, 0))[0],
                "calls_per_step": calls,
            }
            for k, (us, calls) in sorted(per.items(), key=lambda kv: -kv[1][0])
            if k.startswith("wrapper ")
        }
        for _, _, label in self.methods:
            us, calls = per.get(label, (0.0, 0.0))
            rows[label] = {"us_per_step": us, "calls_per_step": calls}
        return rows

    def nested_calls(self, steps: int) -> float:
        """Meters a step that run inside another meter's interval (each wrapper's original,
        and each method metered inside another: labels that start with spaces)."""
        return sum(c[1] for k, c in self.spent.items() if k.startswith(("original ", " "))) / steps

    @property
    def meter_us(self) -> float:
        """One meter's own cost per call (the empty call's mean), in microseconds."""
        cell = self.spent["empty"]
        return cell[0] / cell[1] * 1e6 if cell[1] else float("nan")


# -- step shapes (bench_alternatives, bench_metrics) --------------------------------

Step = Callable[[], torch.Tensor]

SHAPE_TITLES = {
    "launch": "launch-bound step",
    "balanced": "balanced step (host preparation = device compute)",
    "device": "device-bound step",
}


def _mlp(device: str, width: int, layers: int, out: int = 1) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, out)).to(device)


def _sgd_step(model: nn.Module, x: torch.Tensor) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def step_ms(step: Step, n: int = 20) -> float:
    """Milliseconds per call of ``step``, over ``n`` calls after 3 untimed ones."""
    for _ in range(3):
        step()
    return timed(lambda: [step() for _ in range(n)]) / n * 1e3


def _launch_shape(device: str, width: int, target_ms: float) -> tuple[Step, dict[str, Any]]:
    """The layer count whose step is closest to ``target_ms``: small kernels, many of them."""
    torch.manual_seed(0)
    x = torch.randn(64, width, device=device)
    best: tuple[float, int, Step] | None = None
    for layers in (1, 2, 4, 6, 8, 12, 16):
        step = _sgd_step(_mlp(device, width, layers), x)
        ms = step_ms(step)
        if best is None or abs(ms - target_ms) < best[0]:
            best = (abs(ms - target_ms), layers, step)
    assert best is not None
    return best[2], {"layers": best[1], "width": width, "batch": 64}


def _calibrate_in_loop(
    cycles: int, host_ms: float, inner: Step, rounds: int = 3
) -> tuple[int, float]:
    """Rescale ``cycles`` until the sleep kernel lasts ``host_ms`` inside the loop itself.

    The GPU's clock in the loop (a busy-wait on the host, a sleep, a tiny step)
    is not the clock of an isolated probe, so the kernel is timed with CUDA
    events where it runs, and the cycle count scaled by the median, a few times.
    """
    took = float("nan")
    for _ in range(rounds):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(10)
        ]
        for start, end in events:
            busy_wait(host_ms)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            inner()
        torch.cuda.synchronize()
        took = median([start.elapsed_time(end) for start, end in events])
        cycles = max(1, int(cycles * host_ms / took))
    return cycles, took  # took: the kernel's ms before the last rescaling


def _balanced_shape(device: str, host_ms: float) -> tuple[Step, dict[str, Any]]:
    """Host preparation and device compute of the same length, then a tiny model step."""
    torch.manual_seed(0)
    inner = _sgd_step(_mlp(device, 64, 1), torch.randn(8, 64, device=device))
    measured: dict[str, Any] = {}
    if device == "cuda":
        n, took = _calibrate_in_loop(int(host_ms * sleep_cycles_per_ms()), host_ms, inner)
        measured["sleep_ms_in_loop"] = round(took, 3)

        def device_work() -> None:
            torch.cuda._sleep(n)

    else:

        def device_work() -> None:
            busy_wait(host_ms)  # no device: the same time, spent on the host

    def step() -> torch.Tensor:
        busy_wait(host_ms)  # data preparation on the host
        device_work()
        return inner()

    return step, {"host_ms": host_ms, "device_ms": host_ms, **measured}


def _device_shape(device: str, width: int, batch: int, layers: int) -> tuple[Step, dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(batch, width, device=device)
    return _sgd_step(_mlp(device, width, layers), x), {
        "width": width,
        "batch": batch,
        "layers": layers,
    }


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The options that choose and size the step shapes (and ``--device``, ``--quick``)."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny settings: a smoke test")
    ap.add_argument("--shapes", default="launch,balanced,device")
    ap.add_argument("--launch-ms", type=float, default=1.0)
    ap.add_argument("--launch-width", type=int, default=256)
    ap.add_argument("--balanced-ms", type=float, default=1.0, help="host ms = device ms")
    ap.add_argument("--device-width", type=int, default=4096)
    ap.add_argument("--device-batch", type=int, default=2048)
    ap.add_argument("--device-layers", type=int, default=2)


def shape_names(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The shapes ``--shapes`` names (a usage error for an unknown one); ``--quick`` makes
    their settings tiny."""
    if args.quick:
        args.launch_ms, args.launch_width, args.balanced_ms = 0.2, 32, 0.2
        args.device_width, args.device_batch, args.device_layers = 64, 64, 1
    names = args.shapes.split(",")
    for name in names:
        if name not in SHAPE_TITLES:
            ap.error(f"--shapes: unknown shape {name!r}; use {', '.join(SHAPE_TITLES)}")
    return names


def build_shape(args: argparse.Namespace, name: str) -> tuple[Step, dict[str, Any]]:
    """The step of shape ``name`` and its settings, including its bare ms per step.

    Built just before it is timed: the balanced shape's sleep kernel is
    calibrated at the GPU clock of that moment.
    """
    if name == "launch":
        step, config = _launch_shape(args.device, args.launch_width, args.launch_ms)
    elif name == "balanced":
        step, config = _balanced_shape(args.device, args.balanced_ms)
    else:
        step, config = _device_shape(
            args.device, args.device_width, args.device_batch, args.device_layers
        )
    config["bare_step_ms"] = step_ms(step)
    return step, config


# -- Lightning fits (bench_lightning, bench_metrics) -------------------------------

# Each model's shape: batch, width (input or model), hidden (or feed-forward), blocks (or layers).
MODEL_DEFAULTS: dict[str, dict[str, int]] = {
    "mlp": {"batch": 256, "width": 4096, "hidden": 1024, "blocks": 4},
    "transformer": {"batch": 32, "width": 512, "hidden": 2048, "blocks": 6},
}
SEQ, VOCAB = 256, 8192  # the transformer's tokens per sample and vocabulary


def lightning_settings(model: str, steps: int) -> argparse.Namespace:
    """The settings :func:`lightning_model` and :func:`lightning_loader` read, at their defaults."""
    return argparse.Namespace(
        model=model, steps=steps, seq=SEQ, vocab=VOCAB, **MODEL_DEFAULTS[model]
    )


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


def _tiny_lm(args: argparse.Namespace) -> Any:
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


def _lightning_mlp(width: int, hidden: int, blocks: int) -> Any:
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


def lightning_model(args: argparse.Namespace) -> Any:
    """The LightningModule of ``args.model``: ``mlp`` (host-bound) or ``transformer`` (TinyLM).

    Both use AdamW and log the loss with ``prog_bar=True`` (one sync a step).
    """
    if args.model == "transformer":
        return _tiny_lm(args)
    return _lightning_mlp(args.width, args.hidden, args.blocks)


def lightning_loader(args: argparse.Namespace) -> Any:
    """``args.steps`` batches of random data for ``args.model``, pinned on a GPU machine."""
    from torch.utils.data import DataLoader, TensorDataset

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


def quiet_lightning() -> None:
    """Silence Lightning's start-up messages and warnings."""
    warnings.filterwarnings("ignore", module="lightning")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def lightning_trainer(callbacks: list[Any], max_steps: int = -1) -> Any:
    """The Lightning fits' trainer: one device, bf16 on a GPU, nothing extra.

    One epoch, or ``max_steps`` batches over as many epochs as that takes.
    """
    import lightning.pytorch as pl

    gpu = torch.cuda.is_available()
    return pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_epochs=1 if max_steps < 0 else -1,
        max_steps=max_steps,
        precision="bf16-mixed" if gpu else "32-true",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
        callbacks=callbacks,
    )
