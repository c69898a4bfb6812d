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

# The callbacks need a framework: each is loaded on first use (PEP 562), so that
# ``import barrierguard`` imports neither Lightning nor transformers. Name ->
# (its module in barrierguard.integrations, the framework package, how to install it).
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
        # Not kept: installing the framework later in the process is enough.
        return _unavailable(name, package, install)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _unavailable(name: str, package: str, install: str) -> type:
    """A stand-in for a callback whose framework is not installed: creating one says so."""
    text = f"{name} needs the {package} package, which is not installed here: {install}"

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ModuleNotFoundError(text, name=package)

    return type(name, (), {"__init__": __init__, "__doc__": text, "__module__": __name__})
