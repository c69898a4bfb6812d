"""Exceptions and warnings raised by barrierguard."""

from __future__ import annotations

__all__ = [
    "BarrierGuardError",
    "MemoryGrowthError",
    "MemoryGrowthWarning",
    "SyncError",
    "SyncWarning",
]


class BarrierGuardError(Exception):
    """Base class of barrierguard's errors: bad options, misuse, broken files.

    Example:
        >>> import barrierguard
        >>> try:
        ...     barrierguard.watch(policy="loud")
        ... except barrierguard.BarrierGuardError as err:
        ...     print(str(err).split(":")[0])
        watch(policy='loud') is not a valid policy
    """


class SyncError(BarrierGuardError):
    """A host-device synchronization broke the ``"error"`` policy.

    Raised from the user's own line, at the first sync that no allow rule or budget admits.

    Attributes:
        site: The site (file, line, kind, ...) that broke the policy, as a dict.
    """

    def __init__(self, message: str, site: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.site = site


class SyncWarning(UserWarning):
    """One warning per new synchronizing site under the ``"warn"`` policy.

    A ``UserWarning``: make it fatal with ``filterwarnings = ["error::barrierguard.SyncWarning"]``.
    """


class MemoryGrowthError(BarrierGuardError):
    """Memory kept growing per step beyond ``max_growth_per_step`` (``"error"`` policy).

    Raised at the step where the growth verdict first turns to "leak", or at ``stop()`` when
    the verdict over the whole run is a leak.

    Attributes:
        memory: The report's memory section at that point, as a dict (the JSON's ``"memory"``).
    """

    def __init__(self, message: str, memory: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.memory = memory


class MemoryGrowthWarning(UserWarning):
    """Memory keeps growing per step (``"warn"`` policy); issued once per guard.

    A ``UserWarning``: make it fatal with
    ``filterwarnings = ["error::barrierguard.MemoryGrowthWarning"]``.
    """
