"""Exceptions and warnings raised by barrierguard."""

from __future__ import annotations

__all__ = ["BarrierGuardError", "SyncError", "SyncWarning"]


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

    Raised from the user's own line, at the first synchronization that no allow
    rule or budget admits.

    Attributes:
        site: The site (file, line, kind, ...) that broke the policy, as a dict.
    """

    def __init__(self, message: str, site: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.site = site


class SyncWarning(UserWarning):
    """One warning per new synchronizing site under the ``"warn"`` policy.

    It is a ``UserWarning`` subclass, so a test suite can make it fatal with
    ``filterwarnings = ["error::barrierguard.SyncWarning"]``.
    """
