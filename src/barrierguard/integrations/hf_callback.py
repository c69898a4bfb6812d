"""The Hugging Face ``TrainerCallback``: a thin adapter over the guard that ``watch()`` builds.

Imported only when an :class:`~barrierguard.HFBarrierGuard` is created (it
imports transformers). What it adds to a plain guard:

* steps are the Trainer's optimizer steps (``on_step_end``), not the
  optimizer hook's, so a skipped fp16 step still ends a step;
* the training region is phase ``train``; evaluation, prediction, checkpoint
  saving and the teardown after the last step are named from the stack by the
  guard itself (``detect/frameworks.PHASES``), since the Trainer has no event
  when an evaluation or a save starts;
* the report printed and saved at the end of training, and the ranks' reports
  merged.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from barrierguard.report.records import Report
from barrierguard.session import ranks
from barrierguard.session.guard import Guard
from barrierguard.session.options import (
    GUARD_OPTIONS,
    REPORT_OPTIONS,
    make_options,
    make_report_options,
    unknown_options,
)
from barrierguard.session.ranks import RANK_REPORT_NAME, REPORT_NAME

__all__ = ["RANK_REPORT_NAME", "REPORT_NAME", "HFBarrierGuardCallback"]


_OPTIONS = (*GUARD_OPTIONS, *REPORT_OPTIONS)


class HFBarrierGuardCallback(TrainerCallback):
    """The transformers implementation behind :class:`~barrierguard.HFBarrierGuard`."""

    def __init__(
        self,
        *,
        policy: str | None = None,
        engine: str = "auto",
        warmup_steps: int = 0,
        allow: Any = (),
        max_syncs_per_step: int | None = None,
        memory: bool = True,
        max_growth_per_step: int | str = "1MB",
        memory_every: int | None = None,
        memory_children: bool = False,
        print_report: bool = True,
        save_report: bool | str | os.PathLike[str] = True,
        rank_reports: bool | str | os.PathLike[str] = False,
        merge_ranks: bool = True,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise unknown_options("HFBarrierGuard", unknown, _OPTIONS)
        self._options = make_options(
            policy=policy,
            engine=engine,
            warmup_steps=warmup_steps,
            allow=allow,
            max_syncs_per_step=max_syncs_per_step,
            memory=memory,
            max_growth_per_step=max_growth_per_step,
            memory_every=memory_every,
            memory_children=memory_children,
            owner="HFBarrierGuard",
        )
        reports = make_report_options(
            "HFBarrierGuard",
            "args.output_dir",
            print_report=print_report,
            save_report=save_report,
            rank_reports=rank_reports,
            merge_ranks=merge_ranks,
        )
        self.print_report = reports.print_report
        self.save_report = reports.save_report
        self.rank_reports = reports.rank_reports
        self.merge_ranks = reports.merge_ranks
        self.report_path: str | None = None
        self.rank_report_path: str | None = None
        self._guard: Guard | None = None
        self._final: Report | None = None

    # The Trainer may deep-copy or pickle its callbacks; a running guard holds
    # locks and hooks, so only the settings travel.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_guard"] = None
        return state

    @property
    def guard(self) -> Guard | None:
        """The guard behind the callback (``None`` before training begins)."""
        return self._guard

    @property
    def report(self) -> Report:
        """The report so far: merged over ranks after a distributed run."""
        if self._final is not None and (self._guard is None or not self._guard.is_running):
            return self._final
        if self._guard is None:
            return ranks.not_run_report(self._options.policy)
        return self._guard.report

    # -- the Trainer's events ------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._guard is None:
            guard = Guard(self._options)
            # Steps are the Trainer's optimizer steps (on_step_end).
            guard._manual = True
            self._guard = guard
        if not self._guard.is_running:
            self._final = None
            self._guard.set_phase("train")
            self._guard.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._guard is not None and self._guard.is_running:
            self._guard.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        guard = self._guard
        if guard is None or not guard.is_running:
            return
        guard.set_phase("teardown")
        try:
            guard.stop()
        finally:
            self._final, self.rank_report_path, self.report_path = ranks.publish(
                guard.report,
                rank_file=self._rank_path(args),
                merged_file=self._path(args) if self.merge_ranks else None,
                merge_ranks=self.merge_ranks,
                print_report=self.print_report,
                fault=guard.fault,
            )

    def _path(self, args: Any) -> str | None:
        return ranks.report_file(self.save_report, lambda: _output_dir(args), REPORT_NAME)

    def _rank_path(self, args: Any) -> str | None:
        return ranks.report_file(self.rank_reports, lambda: _output_dir(args), RANK_REPORT_NAME)


def _output_dir(args: Any) -> str:
    return str(getattr(args, "output_dir", None) or ".")
