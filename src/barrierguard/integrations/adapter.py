"""What the framework callbacks share: their options, and the start and end of a run."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from barrierguard.report.records import Report
from barrierguard.session import rank_reports
from barrierguard.session.guard import Guard
from barrierguard.session.options import (
    GUARD_OPTIONS,
    REPORT_OPTIONS,
    Options,
    make_options,
    make_report_options,
    unknown_options,
)
from barrierguard.session.rank_reports import RANK_REPORT_NAME, REPORT_NAME, report_file

__all__ = ["Adapter", "hold_weakly"]


def hold_weakly(obj: Any) -> Callable[[], Any]:
    """``obj`` when called: through a weak reference (``None`` once it is gone), or held for
    the run where it takes none (``None`` itself, a class with ``__slots__``).

    Example:
        >>> class Box: ...
        >>> box = Box()
        >>> hold_weakly(box)() is box, hold_weakly(None)()
        (True, None)
    """
    try:
        return weakref.ref(obj)
    except TypeError:
        return functools.partial(_same, obj)


def _same(obj: Any) -> Any:
    return obj


_REPORT_DEFAULTS = dict(print_report=True, save_report=True, rank_reports=False, merge_ranks=True)


class Adapter:
    """A framework callback's guard and report: :meth:`_begin` when its run starts, :meth:`_end`
    when it ends (stop, print, save, merge the ranks), :meth:`_abort` when it fails."""

    _transient: ClassVar[tuple[str, ...]] = ("_guard",)
    _options: Options
    _guard: Guard | None
    _final: Report | None

    def _configure(
        self, owner: str, where: str, given: dict[str, Any], own: Iterable[str] = ()
    ) -> None:
        """Validate ``given`` (TypeError for a keyword not an option nor named in ``own``)."""
        accepted = (*GUARD_OPTIONS, *REPORT_OPTIONS, *own)
        if unknown := [k for k in given if k not in accepted]:
            raise unknown_options(owner, unknown, accepted)
        self._options = make_options(
            owner=owner, **{k: v for k, v in given.items() if k in GUARD_OPTIONS}
        )
        reports = make_report_options(
            owner, where, **{k: given.get(k, v) for k, v in _REPORT_DEFAULTS.items()}
        )
        self.print_report = reports.print_report
        self.save_report = reports.save_report
        self.rank_reports = reports.rank_reports
        self.merge_ranks = reports.merge_ranks
        self.report_path: str | None = None
        self.rank_report_path: str | None = None
        self._guard = None
        self._final = None

    # A running guard holds locks and hooks: a framework that pickles or deep-copies its callbacks
    # (ddp_spawn, the Trainer) gets the settings only, without the ``_transient`` attributes.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **dict.fromkeys(self._transient)}

    @property
    def guard(self) -> Guard | None:
        """The guard behind the callback (``None`` before the run begins)."""
        return self._guard

    @property
    def report(self) -> Report:
        """The report so far: merged over ranks after a distributed run."""
        if self._final is not None and self._running() is None:
            return self._final
        return self._local_report()

    def _local_report(self) -> Report:
        if self._guard is None:
            return rank_reports.not_run_report(self._options.policy)
        return self._guard.report

    def _running(self) -> Guard | None:
        guard = self._guard
        return guard if guard is not None and guard.is_running else None

    def _set_phase(self, phase: str) -> None:
        if self._guard is not None:
            self._guard.set_phase(phase)

    def _begin(self, phase: str, optimizers: Callable[[], Iterable[Any]]) -> None:
        """Start the guard (made on first use) in ``phase``, unless it runs already;
        ``optimizers`` gives the framework's optimizers when a capture probe asks."""
        if self._guard is None:
            self._guard = Guard(self._options)
        if not self._guard.is_running:
            # The callback's step(), not an optimizer hook, from this run's framework.
            self._guard.steps_by_caller(optimizers)
            self._final = None
            self._guard.set_phase(phase)
            self._guard.start()

    def _end(self, save_dir: Callable[[], str], rank_dir: Callable[[], str]) -> None:
        """Stop the guard, then print, save and merge the report (a policy error still raises);
        ``save_dir``/``rank_dir`` give the folders ``True`` means, asked only when needed."""
        if (guard := self._running()) is None:
            return
        try:
            guard.stop()
        finally:
            self._final, self.rank_report_path, self.report_path = rank_reports.publish(
                self._local_report(),
                rank_file=report_file(self.rank_reports, rank_dir, RANK_REPORT_NAME),
                merged_file=report_file(self.save_report, save_dir, REPORT_NAME)
                if self.merge_ranks
                else None,
                merge_ranks=self.merge_ranks,
                print_report=self.print_report,
                fault=guard.fault,
            )

    def _abort(self) -> None:
        """The run is failing: restore every global, keep what was found, raise nothing (no merge:
        the other ranks may be gone; no policy error: the framework's exception is the news)."""
        if (guard := self._running()) is not None:
            guard.abandon()
            self._final = self._local_report()
