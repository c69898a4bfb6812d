"""Memory per step, host and device: the probes, the sampler, the growth verdict, the monitor.

Sampled at step boundaries, never synchronizing with the device: ``host_rss`` from
``/proc/self/statm`` (about 2 us; psutil off Linux), ``workers_rss`` from psutil, the
``device_*`` series from torch's allocator and NVML. Adaptive sampling keeps a sample, counted
``AFTERMATH`` times for what it leaves the steps after it, under ``BUDGET`` of the step time,
its stride doubling at most every ``RAMP`` samples; at ``MAX_SAMPLES`` every other one is
dropped, the stride doubled.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import math
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any

from barrierguard._errors import MemoryGrowthError, MemoryGrowthWarning
from barrierguard.report.records import MemoryReport, format_bytes

__all__ = ["MemoryMonitor", "ProbeSet", "Sampler", "analyze_series", "default_probes", "explain"]

BUDGET = 0.001
AFTERMATH = 2.0  # a sample counts twice: the launches after it pay 0.3-0.8x its own time
MAX_SAMPLES = 2048
MAX_STRIDE = 256
MIN_SAMPLES = 9  # after warm-up, for a verdict
RAMP = 4  # adaptive: the stride doubles at most every RAMP samples
_CHILDREN_EVERY = 16  # reads between two listings of the child processes

Probe = Callable[[], Mapping[str, int]]
"""Reads some series now: ``{"host_rss": 123456, ...}`` in bytes."""


# -- the probes ----------------------------------------------------------------
class _HostRss:
    """This process's RSS: one ``pread`` of ``/proc/self/statm``, else psutil."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._page = 4096
        self._proc: Any = None
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            self._page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):
            import psutil

            self._proc = psutil.Process()

    def __call__(self) -> Mapping[str, int]:
        if self._fd is not None:
            return {"host_rss": int(os.pread(self._fd, 128, 0).split()[1]) * self._page}
        return {"host_rss": int(self._proc.memory_info().rss)}

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _WorkersRss:
    """Summed RSS of child processes."""

    def __init__(self) -> None:
        import psutil

        self._gone = (psutil.NoSuchProcess, psutil.AccessDenied)  # ZombieProcess is a NoSuchProcess
        self._me = psutil.Process()
        self._children: list[Any] = []
        self._reads = 0

    def __call__(self) -> Mapping[str, int]:
        if self._reads % _CHILDREN_EVERY == 0:
            self._children = self._me.children(recursive=True)
        self._reads += 1
        total = 0
        for child in self._children:
            with contextlib.suppress(*self._gone):
                total += int(child.memory_info().rss)
        return {"workers_rss": total}


def _allocator() -> Probe:
    """Allocated and reserved bytes of torch's CUDA caching allocator (0 before CUDA starts)."""
    import torch

    cuda = torch.cuda
    stats: Callable[[int], Mapping[str, Any]] = (
        getattr(torch._C, "_cuda_memoryStats", None) or cuda.memory_stats_as_nested_dict
    )

    def read() -> Mapping[str, int]:
        if not cuda.is_initialized():  # type: ignore[no-untyped-call]
            return {"device_allocated": 0, "device_reserved": 0}
        now = stats(cuda.current_device())
        return {
            "device_allocated": int(now["allocated_bytes"]["all"]["current"]),
            "device_reserved": int(now["reserved_bytes"]["all"]["current"]),
        }

    return read


class _Nvml:
    """The driver's used memory of the current device: this process's, else the device's."""

    def __init__(self, notes: list[str], sources: dict[str, str]) -> None:
        import pynvml
        import torch

        self._nvml, self._cuda = pynvml, torch.cuda
        self._notes, self._sources = notes, sources
        self._handle: Any = None
        self.per_process = self._opened = self._broken = False
        self.setup_s = 0.0

    def _open(self) -> None:
        t0 = time.perf_counter()
        nvml = self._nvml
        nvml.nvmlInit()
        self._opened = True
        index = self._cuda.current_device()
        uuid = getattr(self._cuda.get_device_properties(index), "uuid", None)
        if uuid is None:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        else:
            text = str(uuid)
            self._handle = nvml.nvmlDeviceGetHandleByUUID(
                text if text.startswith(("GPU-", "MIG-")) else "GPU-" + text
            )
        self.per_process = self._own_usage() is not None
        self._sources["device_used"] = (
            "NVML, this process" if self.per_process else "NVML, whole device (all processes)"
        )
        if not self.per_process:
            self._notes.append(
                "device_used is the whole device's used memory: the driver does not report "
                "this process's own usage here (e.g. a container's PID namespace); it is "
                "shown but left out of the verdict"
            )
        self.setup_s += time.perf_counter() - t0

    def _own_usage(self) -> int | None:
        pid = os.getpid()
        procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        used = next((getattr(p, "usedGpuMemory", None) for p in procs if p.pid == pid), None)
        return None if used is None else int(used)

    def __call__(self) -> Mapping[str, int]:
        if self._handle is None:
            if self._broken or not self._cuda.is_initialized():  # type: ignore[no-untyped-call]
                return {}
            try:
                self._open()
            except Exception as exc:
                self._broken = True
                self.close()
                self._notes.append(
                    f"device_used series absent: NVML is not usable here "
                    f"({type(exc).__name__}: {exc})"
                )
                return {}
        if self.per_process:
            used = self._own_usage()
            return {} if used is None else {"device_used": used}
        return {"device_used": int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)}

    def close(self) -> None:
        if self._opened:
            self._opened = False
            self._handle = None
            self._nvml.nvmlShutdown()


@dataclass
class ProbeSet:
    """The probes a sampler reads, how each series is read, and why any is absent."""

    probes: dict[str, Probe]
    sources: dict[str, str]
    notes: list[str]
    verdict_series: Callable[[], tuple[str, ...]]


def default_probes(notes: list[str], *, cuda: bool, children: bool = False) -> ProbeSet:
    """The real probes for this machine; a missing one leaves a note saying why."""
    probes: dict[str, Probe] = {"host": _HostRss()}
    sources = {"host_rss": "/proc/self/statm" if os.path.exists("/proc/self/statm") else "psutil"}
    if children:
        probes["workers"] = _WorkersRss()
        sources["workers_rss"] = "psutil, child processes"
    nvml: _Nvml | None = None
    if not cuda:
        notes.append("device memory series absent: CUDA is not available here")
    else:
        probes["allocator"] = _allocator()
        sources["device_allocated"] = sources["device_reserved"] = "torch CUDA caching allocator"
        try:
            probes["nvml"] = nvml = _Nvml(notes, sources)
        except ImportError as err:
            notes.append(f"device_used series absent: pynvml cannot be imported ({err})")

    def verdict_series() -> tuple[str, ...]:
        own = ("device_used",) if nvml is not None and nvml.per_process else ()
        return ("host_rss", "workers_rss", "device_allocated", "device_reserved", *own)

    return ProbeSet(probes, sources, notes, verdict_series)


class Sampler:
    """Reads the probes every ``every`` steps, or adaptively; drops a probe that raises."""

    def __init__(
        self,
        probes: Mapping[str, Probe],
        *,
        every: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        max_samples: int = MAX_SAMPLES,
        notes: list[str] | None = None,
    ) -> None:
        self._probes = dict(probes)
        self._every = every
        self._clock = clock
        self._max = max(4, max_samples)
        self.notes = notes if notes is not None else []
        self.steps: list[int] = []
        self.values: dict[str, list[int | None]] = {}
        self._next = self._last_step = 0
        self._min_stride = 1
        self._cost: float | None = None
        self._step_s: float | None = None
        self._last_t: float | None = None
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
        for key in row:
            self.values.setdefault(key, [None] * len(self.steps))
        for key, column in self.values.items():
            column.append(row.get(key))
        self.steps.append(step)
        if len(self.steps) >= self._max:
            self.steps = self.steps[::2]
            self.values = {key: column[::2] for key, column in self.values.items()}
            self._min_stride *= 2
            self.stride = max(self.stride, self._min_stride)

    def on_step(self, step: int) -> bool:
        """Called at every step boundary; returns whether a sample was taken."""
        # Steps between samples cost one comparison; step time is measured over the stride.
        if step < self._next:
            return False
        now = self._clock()
        if self._last_t is not None and step > self._last_step:
            dt = (now - self._last_t) / (step - self._last_step)
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        setup = self._setup_s()
        self.sample(step)
        # The step pays the sample and this bookkeeping; a probe's one-time setup is not counted.
        cost = max(0.0, self._clock() - now - (self._setup_s() - setup))
        self._cost = cost if self._cost is None else 0.7 * self._cost + 0.3 * cost
        if self._every is not None:
            stride = self._every
        elif self._step_s is None or self._step_s <= 0:
            stride = 1
        else:
            spent = AFTERMATH * self._cost
            stride = min(MAX_STRIDE, max(1, math.ceil(spent / (BUDGET * self._step_s))))
            # A short run still gets its MIN_SAMPLES for a verdict; a long one reaches its
            # budget's stride within a few dozen samples (MAX_STRIDE 256 after 32).
            doublings = min(MAX_STRIDE.bit_length(), len(self.steps) // RAMP)
            stride = min(stride, 1 << doublings)
        self.stride = max(stride, self._min_stride)
        self._next = step + self.stride
        # Steps are timed from here, so the sample's own cost is not step time.
        self._last_t, self._last_step = self._clock(), step
        return True

    @property
    def next_step(self) -> int:
        """The step :meth:`on_step` samples next."""
        return self._next

    def open(self, probes: Mapping[str, Probe]) -> None:
        """Read ``probes`` from now on (a restarted guard keeps its samples)."""
        self._probes = dict(probes)
        self._last_t = None

    def _setup_s(self) -> float:
        return sum(float(getattr(p, "setup_s", 0.0)) for p in self._probes.values())

    def close(self) -> None:
        """Release what the probes hold (file descriptors, NVML)."""
        for name, probe in self._probes.items():
            try:
                getattr(probe, "close", lambda: None)()
            except Exception as exc:
                self.notes.append(f"{name} memory probe failed to close: {exc}")


# -- the growth verdict, and the known causes of a leak ----------------------------
@dataclass(frozen=True)
class SeriesVerdict:
    """What the growth analysis found in one series."""

    slope: float | None = None
    growing: bool = False
    began_at: int | None = None
    peak: int = 0
    peak_step: int = 0
    step_changes: tuple[tuple[int, int], ...] = ()
    samples: int = 0
    growth: int = 0
    last_step: int = 0


def analyze_series(
    steps: Sequence[int], values: Sequence[int | None], *, warmup: int, threshold: int
) -> SeriesVerdict:
    """Robust growth of one series after warm-up (``threshold``: bytes per step).

    Up to 8 windows: *growing* when at least the last 3 all grow faster than half the
    threshold, with a median above it; a one-time allocation raises one window only.
    """
    # One sample per step (the last): two at one step would make a zero run.
    pts = list({s: (s, v) for s, v in zip(steps, values, strict=True) if v is not None}.values())
    if not pts:
        return SeriesVerdict()
    peak_step, peak = max(pts, key=lambda p: (p[1], -p[0]))
    # The sample at the end of the last warm-up step is the measured baseline.
    measured = [p for p in pts if p[0] >= warmup]
    n = len(measured)
    verdict = SeriesVerdict(peak=peak, peak_step=peak_step, samples=n)
    if n < 2:
        return verdict
    xs, ys = zip(*measured, strict=True)
    deltas = [(xs[i], ys[i + 1] - ys[i], xs[i + 1] - xs[i]) for i in range(n - 1)]
    jumps = [(x + 1, dy) for x, dy, dx in deltas if dy > max(4 * threshold * dx, 0)]
    verdict = replace(verdict, step_changes=tuple(sorted(sorted(jumps, key=lambda j: -j[1])[:3])))
    if n < MIN_SAMPLES:
        return replace(verdict, slope=(ys[-1] - ys[0]) / (xs[-1] - xs[0]))
    count = min(8, (n - 1) // 2)
    bounds = [round(k * (n - 1) / count) for k in range(count + 1)]
    rates = [(ys[b] - ys[a]) / (xs[b] - xs[a]) for a, b in itertools.pairwise(bounds)]
    run = next((i for i, r in enumerate(reversed(rates)) if r <= threshold / 2), len(rates))
    trailing = rates[len(rates) - run :]
    if run < 3 or statistics.median(trailing) <= threshold:
        return replace(verdict, slope=float(statistics.median(rates)))
    a, b = bounds[len(rates) - run], bounds[len(rates) - run + 1]
    began = next((x + 1 for x, dy, dx in deltas[a:b] if dy / dx > threshold / 2), xs[a] + 1)
    return replace(
        verdict,
        slope=float(statistics.median(trailing)),
        growing=True,
        began_at=began,
        growth=ys[-1] - ys[a],
        last_step=xs[-1],
    )


def _add_chain(fn: Any, limit: int) -> int:
    """Length of a chain of additions in an autograd graph (``total += loss``)."""
    depth = 0
    while fn is not None and depth < limit and type(fn).__name__.startswith("AddBackward"):
        depth += 1
        parents = (p for p, _ in fn.next_functions if p is not None)
        fn = next((p for p in parents if type(p).__name__.startswith("AddBackward")), None)
    return depth


def _name_of(obj: object, frame: FrameType | None) -> str | None:
    """The name of a local bound to ``obj``, from ``frame`` outward."""
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

    Scans ``gc.get_objects()`` (tens of ms: only after a leak verdict) for a chain of
    additions (``total_loss += loss``) or a list of tensors (``losses.append(loss)``) at
    least half of ``measured_steps`` long. Alive now is no proof: the evidence says "likely".
    """
    import torch

    need = max(8, measured_steps // 2)
    chain: tuple[int, Any] | None = None
    biggest: tuple[int, Any] | None = None
    tensor_type = torch.Tensor
    seen = "(found among live objects after the growth was seen)"
    for obj in gc.get_objects():
        # type(), not isinstance(): some objects warn when __class__ is read (torch aliases).
        kind = type(obj)
        if issubclass(kind, tensor_type):
            depth = _add_chain(obj.grad_fn, 10 * need + 1000)  # 0 unless an addition
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
            f"the activations it saved stay alive {seen}"
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
            f"({format_bytes(size)} of tensor data) after {measured_steps} steps{graph} {seen}"
        )
        fix = (
            "append detached values (losses.append(loss.detach())), reduce them on the device "
            "when you log (torch.stack(losses).mean()), and clear the list after logging"
        )
        return "tensor_list", fix, evidence
    return None


class MemoryMonitor:
    """The sampler, the verdict and the policy's action, for one guard (``probes`` makes the
    probes at each start). A leak found outside ``thread_ident`` raises at :meth:`finish`."""

    def __init__(
        self,
        probes: Callable[[list[str]], ProbeSet],
        *,
        policy: str,
        threshold: int,
        warmup: int,
        every: int | None = None,
        explain_fn: Callable[[int, FrameType | None], tuple[str, str, str] | None] = explain,
    ) -> None:
        self._make_probes = probes
        self._probeset = ProbeSet({}, {}, [], tuple)
        self.sampler = Sampler({}, every=every)
        self._policy, self._threshold, self._warmup = policy, threshold, warmup
        self._every = every
        self._explain = explain_fn
        self._checkpoint = 16
        self.active = self._acted = self._explained = False
        self._cause: tuple[str, str, str] | None = None
        self._pending: MemoryGrowthError | None = None
        self.thread_ident: int | None = None
        self._strides: set[int] = set()

    def start(self, step: int) -> None:
        """Open the probes and take the baseline sample (the guard starts at ``step``)."""
        self._probeset = self._make_probes(self.sampler.notes)
        self.sampler.open(self._probeset.probes)
        self.active = True
        self.sampler.sample(step)

    def on_step(self, step: int) -> int | None:
        """The guard's step listener: sample, act on a leak; returns the next sample's step."""
        if not self.active:
            return None
        sampler = self.sampler
        if sampler.on_step(step):
            self._strides.add(sampler.stride)
            if not self._acted and self._policy != "record":
                # Samples are in step order: count the measured ones without a scan.
                steps = sampler.steps
                if len(steps) - bisect.bisect_left(steps, self._warmup) >= self._checkpoint:
                    self._checkpoint = math.ceil(self._checkpoint * 1.5)
                    self._act(final=False)
        return sampler.next_step

    def finish(self, step: int, *, act: bool) -> None:
        """Last sample, release probes, act on the final verdict (may raise MemoryGrowthError)."""
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
        if act and not self._acted and self._policy != "record":
            self._act(final=True)

    def _act(self, *, final: bool) -> None:
        """Warn or raise on the verdict as of now, if memory is leaking."""
        memory = self.report()
        if not memory.leak:
            return
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

    def report(self) -> MemoryReport:
        """The memory section for the report, with the verdict as of now."""
        steps = tuple(self.sampler.steps)
        series = {k: tuple(v) for k, v in self.sampler.values.items()}
        names = tuple(n for n in self._probeset.verdict_series() if n in series)
        found = {
            name: analyze_series(steps, values, warmup=self._warmup, threshold=self._threshold)
            for name, values in series.items()
        }
        growing = tuple(n for n in names if found[n].growing)
        limit = format_bytes(self._threshold)
        most = max((found[n].samples for n in names), default=0)
        if growing:
            reason = "; ".join(
                f"{n} grew {format_bytes(found[n].slope or 0)}/step from step "
                f"{found[n].began_at} to step {found[n].last_step} "
                f"(+{format_bytes(found[n].growth)})"
                for n in growing
            )
            reason += f", above max_growth_per_step {limit}"
        elif most < MIN_SAMPLES:
            reason = f"no verdict: {most} samples after warm-up, {MIN_SAMPLES} needed"
        else:
            reason = f"no series kept growing faster than max_growth_per_step {limit}"
            jumps = [
                f"{name} {format_bytes(size)} at step {step}"
                for name in names
                for step, size in found[name].step_changes
            ]
            if jumps:
                reason += "; one-time increases (step changes, not leaks): " + ", ".join(jumps)
        if growing and not self._explained:
            self._explained = True
            first = min(found[n].began_at or 0 for n in growing)
            try:
                self._cause = self._explain(max(1, steps[-1] - first + 1), sys._getframe(1))
            except Exception as exc:
                self.sampler.notes.append(
                    f"looking for a known cause of the growth failed: {type(exc).__name__}: {exc}"
                )
        pattern, fix, evidence = self._cause if growing and self._cause else (None, "", "")
        if self._every is not None:
            sampling = f"every {self._every} step(s)"
        else:
            strides = sorted(self._strides) or [1]
            span = f"{strides[0]}" if len(strides) == 1 else f"{strides[0]}-{strides[-1]}"
            sampling = (
                f"adaptive (sampling kept under {BUDGET:.1%} of step time): every {span} step(s)"
            )
        return MemoryReport(
            steps=steps,
            series=series,
            sources={k: v for k, v in self._probeset.sources.items() if k in series},
            verdict_series=names,
            slopes={k: v.slope for k, v in found.items() if v.slope is not None},
            growth_began_at={k: v.began_at for k, v in found.items()},
            peak={k: v.peak for k, v in found.items()},
            peak_step={k: v.peak_step for k, v in found.items()},
            step_changes={k: v.step_changes for k, v in found.items() if v.step_changes},
            growing=growing,
            leak=bool(growing),
            threshold=self._threshold,
            warmup_steps=self._warmup,
            reason=reason,
            pattern=pattern,
            fix=fix,
            evidence=evidence,
            sampling=f"{sampling}; {len(steps)} samples",
            notes=tuple(dict.fromkeys(self.sampler.notes)),
        )
