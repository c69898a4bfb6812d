"""Whether memory keeps growing (a verdict per series), and the known cause when one is found."""

from __future__ import annotations

import gc
import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = ["MIN_SAMPLES", "SeriesVerdict", "analyze", "analyze_series", "explain", "format_bytes"]

MIN_SAMPLES = 9


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest decimal unit that keeps it above 1."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B"


@dataclass(frozen=True)
class SeriesVerdict:
    """What the growth analysis found in one series."""

    slope: float | None
    growing: bool
    began_at: int | None
    peak: int
    peak_step: int
    step_changes: tuple[tuple[int, int], ...]
    samples: int
    growth: int = 0
    last_step: int = 0


def analyze_series(
    steps: Sequence[int], values: Sequence[int | None], *, warmup: int, threshold: int
) -> SeriesVerdict:
    """Robust growth of one series after warm-up.

    The measured samples are cut into up to 8 windows of consecutive samples
    (sharing their end points, so each increase falls in exactly one window),
    and each window's growth rate is measured in bytes per step. The series is
    *growing* when the rates of at least the last 3 windows (3 of 4 for short
    runs) all exceed half the threshold and their median exceeds the threshold:
    growth that goes on until the end. A one-time allocation raises one window
    only: it is a step change, not a leak; growth that stopped before the end
    is not a leak either. ``slope`` is the median rate of that trailing run
    when growing, else the median over all windows.

    Samples before step ``warmup`` are not measured; ``threshold`` is
    ``max_growth_per_step`` in bytes.

    Example:
        >>> v = analyze_series(range(20), [100 * s for s in range(20)], warmup=0, threshold=50)
        >>> v.growing, v.slope, v.began_at
        (True, 100.0, 1)
    """
    # One sample per step (the last): two at one step would make a zero run.
    pts = list({s: (s, v) for s, v in zip(steps, values, strict=True) if v is not None}.values())
    if not pts:
        return SeriesVerdict(None, False, None, 0, 0, (), 0)
    peak_step, peak = max(pts, key=lambda p: (p[1], -p[0]))
    # The sample at the end of the last warm-up step is the measured baseline.
    measured = [p for p in pts if p[0] >= warmup]
    n = len(measured)
    if n < 2:
        return SeriesVerdict(None, False, None, peak, peak_step, (), n)
    xs = [p[0] for p in measured]
    ys = [p[1] for p in measured]
    jumps = [
        (xs[i] + 1, ys[i + 1] - ys[i])
        for i in range(n - 1)
        if ys[i + 1] - ys[i] > max(4 * threshold * (xs[i + 1] - xs[i]), 0)
    ]
    jumps = sorted(sorted(jumps, key=lambda j: -j[1])[:3])
    if n < MIN_SAMPLES:
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        return SeriesVerdict(slope, False, None, peak, peak_step, tuple(jumps), n)
    count = min(8, (n - 1) // 2)
    bounds = [round(k * (n - 1) / count) for k in range(count + 1)]
    rates = [(ys[b] - ys[a]) / (xs[b] - xs[a]) for a, b in itertools.pairwise(bounds)]
    run = next((i for i, r in enumerate(reversed(rates)) if r <= threshold / 2), len(rates))
    trailing = rates[len(rates) - run :]
    if run < 3 or statistics.median(trailing) <= threshold:
        return SeriesVerdict(
            float(statistics.median(rates)), False, None, peak, peak_step, tuple(jumps), n
        )
    first = len(rates) - run
    a, b = bounds[first], bounds[first + 1]
    began = xs[a] + 1
    for i in range(a, b):
        if (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) > threshold / 2:
            began = xs[i] + 1
            break
    return SeriesVerdict(
        float(statistics.median(trailing)),
        True,
        began,
        peak,
        peak_step,
        tuple(jumps),
        n,
        growth=ys[-1] - ys[a],
        last_step=xs[-1],
    )


def analyze(
    steps: Sequence[int],
    series: Mapping[str, Sequence[int | None]],
    *,
    warmup: int,
    threshold: int,
) -> dict[str, SeriesVerdict]:
    return {
        name: analyze_series(steps, values, warmup=warmup, threshold=threshold)
        for name, values in series.items()
    }


# -- known patterns ------------------------------------------------------------
def _add_chain(fn: Any, limit: int) -> int:
    """Length of a chain of additions in an autograd graph (``total += loss``)."""
    depth = 0
    while fn is not None and depth < limit and type(fn).__name__.startswith("AddBackward"):
        depth += 1
        parents = (p for p, _ in fn.next_functions if p is not None)
        fn = next((p for p in parents if type(p).__name__.startswith("AddBackward")), None)
    return depth


def _name_of(obj: object, frame: FrameType | None) -> str | None:
    for _ in range(40):
        if frame is None:
            return None
        for name, value in frame.f_locals.items():
            if value is obj:
                return name
        frame = frame.f_back
    return None


def _tensor_list(obj: list[Any], tensor: type, parameter: type) -> bool:
    probe = obj[:4] + obj[len(obj) // 2 : len(obj) // 2 + 1] + obj[-4:]
    return all(type(t) is not parameter and issubclass(type(t), tensor) for t in probe)


def explain(measured_steps: int, frame: FrameType | None) -> tuple[str, str, str] | None:
    """A known cause of growth among the live objects: ``(pattern, fix, evidence)``, or ``None``.

    Scans ``gc.get_objects()`` (tens of milliseconds: only after a leak
    verdict; host-side metadata only, no sync) for a tensor whose autograd
    graph chains additions (``total_loss += loss``) and for long lists of
    tensors (``losses.append(loss)``), at least half of ``measured_steps`` long;
    names their variables from ``frame`` outward. What is alive now is no
    proof of the cause, so the evidence says "likely".
    """
    import torch

    need = max(8, measured_steps // 2)
    chain: tuple[int, Any] | None = None
    biggest: tuple[int, Any] | None = None
    tensor_type = torch.Tensor
    for obj in gc.get_objects():
        # type() rather than isinstance(): some live objects warn when their
        # __class__ is read (deprecated torch aliases).
        kind = type(obj)
        if issubclass(kind, tensor_type):
            fn = obj.grad_fn
            if fn is not None and type(fn).__name__.startswith("AddBackward"):
                depth = _add_chain(fn, 10 * need + 1000)
                if depth >= need and (chain is None or depth > chain[0]):
                    chain = (depth, obj)
        elif (
            kind is list and len(obj) >= need and _tensor_list(obj, tensor_type, torch.nn.Parameter)
        ):
            size = sum(int(t.nbytes) for t in obj if issubclass(type(t), tensor_type))
            if biggest is None or size > biggest[0]:
                biggest = (size, obj)
    if chain is not None:
        depth, tensor = chain
        name = _name_of(tensor, frame)
        what = f"`{name}`" if name else f"a {tensor.device} tensor"
        evidence = (
            f"likely: {what} has an autograd graph that chains {depth} additions "
            f"(about one per step over {measured_steps} steps), so every step's graph and "
            "the activations it saved stay alive (found among live objects after the "
            "growth was seen)"
        )
        fix = (
            "accumulate a detached value: total_loss += loss.detach() (every step's autograd "
            "graph stays alive through a sum of undetached losses)"
        )
        return "accumulated_graph", fix, evidence
    if biggest is not None:
        size, items = biggest
        name = _name_of(items, frame)
        first = items[-1]
        graph = "; its tensors carry autograd graphs, which stay alive too" if first.grad_fn else ""
        what = f"list `{name}`" if name else "a list"
        evidence = (
            f"likely: {what} holds {len(items)} {first.device} tensors "
            f"({format_bytes(size)} of tensor data) after {measured_steps} steps{graph} "
            "(found among live objects after the growth was seen)"
        )
        fix = (
            "append detached values (losses.append(loss.detach())), reduce them on the device "
            "when you log (torch.stack(losses).mean()), and clear the list after logging"
        )
        return "tensor_list", fix, evidence
    return None
