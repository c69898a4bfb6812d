"""barrierguard: find the hidden CPU-GPU barriers in PyTorch training loops.

Example:
    >>> import barrierguard
    >>> with barrierguard.watch(policy="record") as guard:
    ...     pass
    >>> isinstance(guard.report, barrierguard.Report)
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from barrierguard._errors import (
    BarrierGuardError,
    MemoryGrowthError,
    MemoryGrowthWarning,
    SyncError,
    SyncWarning,
)
from barrierguard._version import __version__
from barrierguard.metrics.buffer import MetricBuffer
from barrierguard.report.records import MemoryReport, Report, Site, Violation
from barrierguard.session.allowing import allowed
from barrierguard.session.guard import Guard
from barrierguard.session.watch import watch

if TYPE_CHECKING:
    from barrierguard.integrations.hf_callback import HFBarrierGuard
    from barrierguard.integrations.lightning_callback import BarrierGuard

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

# Each callback and its framework load on first use (PEP 562): ``import barrierguard`` imports
# neither Lightning nor transformers. Name -> (module in integrations, framework, how to install).
_LAZY = {
    "BarrierGuard": ("lightning_callback", "lightning", "pip install lightning"),
    "HFBarrierGuard": (
        "hf_callback",
        "transformers",
        "pip install 'barrierguard[hf]' (or pip install transformers)",
    ),
}


def __getattr__(name: str) -> Any:
    try:
        module, package, install = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'barrierguard' has no attribute {name!r}") from None
    try:
        value = getattr(importlib.import_module(f"barrierguard.integrations.{module}"), name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != package:
            raise
        # A stand-in that says so when created; not kept, so a later install is enough.
        text = f"{name} needs the {package} package, which is not installed here: {install}"

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            raise ModuleNotFoundError(text, name=package)

        return type(name, (), {"__init__": __init__, "__doc__": text, "__module__": __name__})
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
