"""barrierguard: find the hidden CPU-GPU barriers in PyTorch training loops.

Example:
    >>> import barrierguard
    >>> with barrierguard.watch(policy="record") as guard:
    ...     pass
    >>> isinstance(guard.report, barrierguard.Report)
    True
"""

from __future__ import annotations

from barrierguard._errors import (
    BarrierGuardError,
    MemoryGrowthError,
    MemoryGrowthWarning,
    SyncError,
    SyncWarning,
)
from barrierguard._version import __version__
from barrierguard.integrations.hf import HFBarrierGuard
from barrierguard.integrations.lightning import BarrierGuard
from barrierguard.metrics.buffer import MetricBuffer
from barrierguard.report.records import MemoryReport, Report, Site, Violation
from barrierguard.session.allowing import allowed
from barrierguard.session.guard import Guard
from barrierguard.session.watch import watch

__all__ = [
    "BarrierGuard",
    "BarrierGuardError",
    "Guard",
    "HFBarrierGuard",
    "MemoryGrowthError",
    "MemoryGrowthWarning",
    "MemoryReport",
    "MetricBuffer",
    "Report",
    "Site",
    "SyncError",
    "SyncWarning",
    "Violation",
    "__version__",
    "allowed",
    "watch",
]
