"""Memory per step, host and device, and a verdict on whether it keeps growing.

The sampler runs at step boundaries (a guard's step listener). Each sample reads
a few probes; none of them synchronizes with the device:

* ``host_rss``: this process's resident set, read from ``/proc/self/statm``
  with one ``pread`` on a descriptor kept open (about 2 us; psutil's
  ``memory_info()`` costs about 14 us and is the fallback off Linux).
* ``workers_rss``: the resident sets of child processes (DataLoader workers),
  on request; the list of children is refreshed every 16th sample because
  walking the process table costs about a millisecond.
* ``device_allocated``/``device_reserved``: torch's CUDA caching allocator,
  both from one ``torch._C._cuda_memoryStats(device)`` call, the nested dict
  that ``torch.cuda.memory_allocated()`` flattens and sorts (that flattening is
  most of its 120 us). It is a host-side read of the allocator's counters.
* ``device_used``: the driver's view through NVML, this process's own usage
  where the driver reports it, else the whole device's used memory.

Sampling is adaptive: a sample's cost is measured, and the stride (sample every
N steps) is chosen so that sampling costs at most ``BUDGET`` (0.25 %) of the
measured step time; slow steps are sampled every step. ``watch(memory_every=N)``
fixes the stride instead. At most ``MAX_SAMPLES`` samples are kept: when full,
every other one is dropped and the stride doubles.
"""

from __future__ import annotations

import bisect
import math
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from types import FrameType

from barrierguard._errors import MemoryGrowthError, MemoryGrowthWarning
from barrierguard.report.records import MemoryReport
from barrierguard.session.memory_growth import MIN_SAMPLES, analyze, explain, format_bytes
from barrierguard.session.memory_probes import Probe, ProbeSet, default_probes

__all__ = ["BUDGET", "MAX_SAMPLES", "MemoryMonitor", "Sampler", "default_probes"]

BUDGET = 0.0025
MAX_SAMPLES = 2048
MAX_STRIDE = 256


class Sampler:
    """Reads the probes at step boundaries, every step or adaptively.

    Args:
        probes: Name to probe; each returns ``{series: bytes}``. A probe that
            raises is dropped (with a note) and its series end there.
        every: A fixed stride (sample every N steps), or ``None`` for adaptive.
        budget: Adaptive mode's share of the step time that sampling may cost.
        clock: Seconds, monotonic (tests pass a fake one).
        max_samples: When this many are kept, every other one is dropped.
        notes: Where notes go (shared with the probes).
    """

    def __init__(
        self,
        probes: Mapping[str, Probe],
        *,
        every: int | None = None,
        budget: float = BUDGET,
        clock: Callable[[], float] = time.perf_counter,
        max_samples: int = MAX_SAMPLES,
        notes: list[str] | None = None,
    ) -> None:
        self._probes = dict(probes)
        self._every = every
        self._budget = budget
        self._clock = clock
        self._max = max(4, max_samples)
        self.notes = notes if notes is not None else []
        self.steps: list[int] = []
        self.values: dict[str, list[int | None]] = {}
        self._next = 0
        self._min_stride = 1
        self._cost: float | None = None
        self._step_s: float | None = None
        self._last_t: float | None = None
        self._last_step = 0
        self.stride = every or 1

    def sample(self, step: int) -> None:
        """Read every probe now and record the values at ``step``."""
        if self.steps and self.steps[-1] == step:
            return
        row: dict[str, int] = {}
        for name, probe in list(self._probes.items()):
            try:
                row.update(probe())
            except Exception as exc:
                del self._probes[name]
                self.notes.append(
                    f"{name} memory probe failed at step {step} and was dropped: "
                    f"{type(exc).__name__}: {exc}"
                )
        n = len(self.steps)
        for key in row:
            if key not in self.values:
                self.values[key] = [None] * n
        for key, column in self.values.items():
            column.append(row.get(key))
        self.steps.append(step)
        if len(self.steps) >= self._max:
            self._decimate()

    def _decimate(self) -> None:
        keep = range(0, len(self.steps), 2)
        self.steps = [self.steps[i] for i in keep]
        for key, column in self.values.items():
            self.values[key] = [column[i] for i in keep]
        self._min_stride *= 2
        self.stride = max(self.stride, self._min_stride)

    def on_step(self, step: int) -> bool:
        """Called at every step boundary; returns whether a sample was taken."""
        # Steps between samples cost one comparison: the step time is measured
        # over the whole stride, at the next sample.
        if step < self._next:
            return False
        now = self._clock()
        if self._last_t is not None and step > self._last_step:
            dt = (now - self._last_t) / (step - self._last_step)
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        setup = self._setup_s()
        t0 = self._clock()
        self.sample(step)
        cost = max(0.0, self._clock() - t0 - (self._setup_s() - setup))
        self._cost = cost if self._cost is None else 0.7 * self._cost + 0.3 * cost
        if self._every is not None:
            stride = self._every
        elif self._step_s is None or self._step_s <= 0:
            stride = 1
        else:
            stride = math.ceil(self._cost / (self._budget * self._step_s))
            stride = min(MAX_STRIDE, max(1, stride))
        self.stride = max(stride, self._min_stride)
        self._next = step + self.stride
        # Steps are timed from here, so the sample's own cost is not step time.
        self._last_t, self._last_step = self._clock(), step
        return True

    def open(self, probes: Mapping[str, Probe]) -> None:
        """Read ``probes`` from now on (a restarted guard keeps its samples)."""
        self._probes = dict(probes)
        self._last_t = None

    def _setup_s(self) -> float:
        return sum(float(getattr(p, "setup_s", 0.0)) for p in self._probes.values())

    def close(self) -> None:
        """Release what the probes hold (file descriptors, NVML)."""
        for name, probe in list(self._probes.items()):
            close = getattr(probe, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:
                    self.notes.append(f"{name} memory probe failed to close: {exc}")


# -- analysis ----------------------------------------------------------------
class MemoryMonitor:
    """The sampler, the verdict and the policy's action, for one guard.

    Args:
        probes: Makes the probes at each start, given the notes list (see
            :func:`default_probes`).
        policy: ``"record"``, ``"warn"`` or ``"error"``.
        threshold: ``max_growth_per_step`` in bytes.
        warmup: ``warmup_steps`` of the guard.
        every: A fixed stride, or ``None`` for adaptive sampling.
        clock: Seconds, monotonic (tests pass a fake one).
        thread_ident: The guard's thread; a leak found in another thread is
            raised at :meth:`finish` instead.
        explain_fn: Finds a known cause (tests replace it).
    """

    def __init__(
        self,
        probes: Callable[[list[str]], ProbeSet],
        *,
        policy: str,
        threshold: int,
        warmup: int,
        every: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        explain_fn: Callable[[int, FrameType | None], tuple[str, str, str] | None] = explain,
    ) -> None:
        self._make_probes = probes
        self._probeset = ProbeSet({}, {}, [], tuple)
        self.sampler = Sampler({}, every=every, clock=clock)
        self.active = False
        self._policy = policy
        self._threshold = threshold
        self._warmup = warmup
        self._every = every
        self._explain = explain_fn
        self._checkpoint = 16
        self._acted = False
        self._cause: tuple[str, str, str] | None = None
        self._explained = False
        self._pending: MemoryGrowthError | None = None
        self.thread_ident: int | None = None
        self._strides: set[int] = set()

    def start(self, step: int) -> None:
        """Open the probes and take the baseline sample (the guard starts at ``step``)."""
        probeset = self._make_probes(self.sampler.notes)
        self._probeset = probeset
        self.sampler.open(probeset.probes)
        self.active = True
        self.sampler.sample(step)

    def on_step(self, step: int) -> None:
        """The guard's step listener: sample, and act once a leak is seen."""
        if not self.active or not self.sampler.on_step(step):
            return
        self._strides.add(self.sampler.stride)
        if self._acted or self._policy == "record":
            return
        # Samples are in step order: count the measured ones without a scan.
        steps = self.sampler.steps
        measured = len(steps) - bisect.bisect_left(steps, self._warmup)
        if measured < self._checkpoint:
            return
        self._checkpoint = math.ceil(self._checkpoint * 1.5)
        memory = self.report()
        if memory.leak:
            self._act(memory, final=False)

    def finish(self, step: int, *, act: bool) -> None:
        """Last sample, release the probes, and act on the final verdict.

        Raises:
            MemoryGrowthError: Under the error policy, for a leak not raised yet.
        """
        if not self.active:
            return
        self.active = False
        try:
            self.sampler.sample(step)
        finally:
            self.sampler.close()
        if self._pending is not None:
            err, self._pending = self._pending, None
            if act:
                raise err
        if not act or self._acted or self._policy == "record":
            return
        memory = self.report()
        if memory.leak:
            self._act(memory, final=True)

    def _act(self, memory: MemoryReport, *, final: bool) -> None:
        import threading

        self._acted = True
        when = "over the run" if final else f"so far (step {memory.steps[-1]})"
        message = f"memory keeps growing {when}: {memory.reason}"
        if memory.pattern:
            message += f". {memory.evidence}. Fix: {memory.fix}"
        if self._policy == "warn":
            warnings.warn(message, MemoryGrowthWarning, stacklevel=2)
            return
        error = MemoryGrowthError(message, memory.to_dict())
        if not final and self.thread_ident not in (None, threading.get_ident()):
            self._pending = error
            return
        raise error

    def _sampling_text(self) -> str:
        n = len(self.sampler.steps)
        if self._every is not None:
            return f"every {self._every} step(s); {n} samples"
        strides = sorted(self._strides) or [1]
        span = f"{strides[0]}" if len(strides) == 1 else f"{strides[0]}-{strides[-1]}"
        return (
            f"adaptive (sampling kept under {BUDGET:.2%} of step time): every {span} step(s); "
            f"{n} samples"
        )

    def report(self) -> MemoryReport:
        """The memory section for the report, with the verdict as of now."""
        steps = tuple(self.sampler.steps)
        series = {k: tuple(v) for k, v in self.sampler.values.items()}
        verdict_names = tuple(n for n in self._probeset.verdict_series() if n in series)
        found = analyze(steps, series, warmup=self._warmup, threshold=self._threshold)
        growing = tuple(n for n in verdict_names if found[n].growing)
        leak = bool(growing)
        limit = format_bytes(self._threshold)
        measured = [found[n].samples for n in verdict_names]
        if leak:
            parts = []
            for name in growing:
                v = found[name]
                assert v.slope is not None and v.began_at is not None
                parts.append(
                    f"{name} grew {format_bytes(v.slope)}/step from step {v.began_at} to step "
                    f"{v.last_step} (+{format_bytes(v.growth)})"
                )
            reason = "; ".join(parts) + f", above max_growth_per_step {limit}"
        elif not measured or max(measured) < MIN_SAMPLES:
            reason = (
                f"no verdict: {max(measured, default=0)} samples after warm-up, "
                f"{MIN_SAMPLES} needed"
            )
        else:
            reason = f"no series kept growing faster than max_growth_per_step {limit}"
            jumps = [
                f"{name} {format_bytes(size)} at step {step}"
                for name in verdict_names
                for step, size in found[name].step_changes
            ]
            if jumps:
                reason += "; one-time increases (step changes, not leaks): " + ", ".join(jumps)
        if leak and not self._explained:
            self._explained = True
            first = min(found[n].began_at or 0 for n in growing)
            try:
                self._cause = self._explain(max(1, steps[-1] - first + 1), sys._getframe(1))
            except Exception as exc:
                self.sampler.notes.append(
                    f"looking for a known cause of the growth failed: {type(exc).__name__}: {exc}"
                )
        pattern, fix, evidence = self._cause if leak and self._cause else (None, "", "")
        notes = tuple(dict.fromkeys(self.sampler.notes))
        return MemoryReport(
            steps=steps,
            series=series,
            sources={k: v for k, v in self._probeset.sources.items() if k in series},
            verdict_series=verdict_names,
            slopes={k: v.slope for k, v in found.items() if v.slope is not None},
            growth_began_at={k: v.began_at for k, v in found.items()},
            peak={k: v.peak for k, v in found.items()},
            peak_step={k: v.peak_step for k, v in found.items()},
            step_changes={k: v.step_changes for k, v in found.items() if v.step_changes},
            growing=growing,
            leak=leak,
            threshold=self._threshold,
            warmup_steps=self._warmup,
            reason=reason,
            pattern=pattern,
            fix=fix,
            evidence=evidence,
            sampling=self._sampling_text(),
            notes=notes,
        )
