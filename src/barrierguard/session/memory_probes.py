"""The memory probes: host RSS, DataLoader workers, the CUDA allocator, NVML.

Each probe reads some series now, in bytes, without synchronizing with the
device; the costs are in the docstring of ``barrierguard.session.memory``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

__all__ = ["Probe", "ProbeSet", "default_probes"]

Probe = Callable[[], Mapping[str, int]]
"""Reads some series now: ``{"host_rss": 123456, ...}`` in bytes."""

_CHILDREN_EVERY = 16


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
    """Summed RSS of child processes; the list is refreshed every 16th read."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._children: list[Any] = []
        self._reads = 0

    def __call__(self) -> Mapping[str, int]:
        psutil = self._psutil
        if self._reads % _CHILDREN_EVERY == 0:
            self._children = self._me.children(recursive=True)
        self._reads += 1
        total = 0
        for child in self._children:
            try:
                total += int(child.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return {"workers_rss": total}


def _cuda_stats_reader() -> Callable[[int], Mapping[str, Any]]:
    import torch

    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        return cast("Callable[[int], Mapping[str, Any]]", raw)
    return torch.cuda.memory_stats_as_nested_dict


class _Allocator:
    """Allocated and reserved bytes of torch's CUDA caching allocator.

    Reads nothing before CUDA is initialized (nothing is allocated then) and
    never initializes it.
    """

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        # torch leaves is_initialized unannotated.
        self._initialized: Callable[[], bool] = torch.cuda.is_initialized
        self._stats = _cuda_stats_reader()

    def __call__(self) -> Mapping[str, int]:
        if not self._initialized():
            return {"device_allocated": 0, "device_reserved": 0}
        stats = self._stats(self._cuda.current_device())
        return {
            "device_allocated": int(stats["allocated_bytes"]["all"]["current"]),
            "device_reserved": int(stats["reserved_bytes"]["all"]["current"]),
        }


class _Nvml:
    """The driver's used memory of the current device, through NVML.

    Opens (``nvmlInit``) at the first read after CUDA is initialized, finds the
    device by UUID, and decides once whether this process's own usage can be
    read (``nvmlDeviceGetComputeRunningProcesses`` lists our PID) or only the
    device's total. :meth:`close` shuts NVML down again.
    """

    def __init__(self, notes: list[str], sources: dict[str, str]) -> None:
        import pynvml
        import torch

        self._nvml = pynvml
        self._cuda = torch.cuda
        self._initialized: Callable[[], bool] = torch.cuda.is_initialized
        self._notes = notes
        self._sources = sources
        self._handle: Any = None
        self._per_process = False
        self._opened = False
        self._broken = False
        self.setup_s = 0.0

    def _open(self) -> None:
        t0 = time.perf_counter()
        nvml = self._nvml
        nvml.nvmlInit()
        self._opened = True
        index = self._cuda.current_device()
        uuid = getattr(self._cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            text = str(uuid)
            self._handle = nvml.nvmlDeviceGetHandleByUUID(
                text if text.startswith(("GPU-", "MIG-")) else "GPU-" + text
            )
        else:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self._per_process = self._own_usage() is not None
        if self._per_process:
            self._sources["device_used"] = "NVML, this process"
        else:
            self._sources["device_used"] = "NVML, whole device (all processes)"
            self._notes.append(
                "device_used is the whole device's used memory: the driver does not report "
                "this process's own usage here (e.g. a container's PID namespace); it is "
                "shown but left out of the verdict"
            )
        self.setup_s += time.perf_counter() - t0

    def _own_usage(self) -> int | None:
        pid = os.getpid()
        for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if proc.pid == pid:
                used = getattr(proc, "usedGpuMemory", None)
                return None if used is None else int(used)
        return None

    @property
    def per_process(self) -> bool:
        return self._per_process

    def __call__(self) -> Mapping[str, int]:
        if self._handle is None:
            if self._broken or not self._initialized():
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
        if self._per_process:
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
    """The real probes for this machine; missing ones leave a note saying why.

    Args:
        notes: Where notes go, now and while sampling.
        cuda: Whether CUDA is available (device series are read only then).
        children: Whether to read the RSS of child processes too.
    """
    probes: dict[str, Probe] = {"host": _HostRss()}
    sources = {"host_rss": "/proc/self/statm" if os.path.exists("/proc/self/statm") else "psutil"}
    if children:
        probes["workers"] = _WorkersRss()
        sources["workers_rss"] = "psutil, child processes"
    nvml: _Nvml | None = None
    if not cuda:
        notes.append("device memory series absent: CUDA is not available here")
    else:
        probes["allocator"] = _Allocator()
        sources["device_allocated"] = "torch CUDA caching allocator"
        sources["device_reserved"] = "torch CUDA caching allocator"
        try:
            nvml = _Nvml(notes, sources)
            probes["nvml"] = nvml
        except ImportError as err:
            notes.append(f"device_used series absent: pynvml cannot be imported ({err})")

    def verdict_series() -> tuple[str, ...]:
        names = ["host_rss", "workers_rss", "device_allocated", "device_reserved"]
        if nvml is not None and nvml.per_process:
            names.append("device_used")
        return tuple(names)

    return ProbeSet(probes, sources, notes, verdict_series)
