"""barrierguard: find the hidden CPU-GPU barriers in PyTorch training loops.

Example:
    >>> import barrierguard
    >>> with barrierguard.watch(policy="record") as guard:
    ...     pass
    >>> isinstance(guard.report, barrierguard.Report)
    True
"""

from __future__ import annotations

__version__ = "0.1.0"

from barrierguard._callback import BarrierGuard
from barrierguard._errors import (
    BarrierGuardError,
    MemoryGrowthError,
    MemoryGrowthWarning,
    SyncError,
    SyncWarning,
)
from barrierguard._guard import Guard, watch
from barrierguard._metrics import MetricBuffer
from barrierguard._report import MemoryReport, Report, Site, Violation

__all__ = [
    "BarrierGuard",
    "BarrierGuardError",
    "Guard",
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
    "watch",
]
