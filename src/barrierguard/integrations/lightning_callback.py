"""The Lightning callback: a thin adapter over the guard that ``watch()`` builds.

Imported only when a :class:`~barrierguard.BarrierGuard` is created (it imports
Lightning). What it adds to a plain guard:

* steps are training batches, validation/test/predict batches are a phase of
  their own (counted apart), setup and the sanity check are setup;
* its phases follow Lightning's events (the guard itself names each
  framework sync's mechanism and fix, with or without the callback);
* figures to the loggers at epoch end, the report printed and saved at the end
  of ``fit``, counts kept in checkpoints, the ranks' reports merged (one
  collective) and, when asked, one report file per rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl

from barrierguard._errors import BarrierGuardError
from barrierguard.report.combine import combine
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

__all__ = ["RANK_REPORT_NAME", "REPORT_NAME", "BarrierGuardCallback"]


_OPTIONS = (*GUARD_OPTIONS, *REPORT_OPTIONS, "log_figures")


class BarrierGuardCallback(pl.Callback):
    """The Lightning implementation behind :class:`~barrierguard.BarrierGuard`."""

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
        log_figures: bool = True,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise unknown_options("BarrierGuard", unknown, _OPTIONS)
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
            owner="BarrierGuard",
        )
        if not isinstance(log_figures, bool):
            raise BarrierGuardError(
                f"BarrierGuard(log_figures={log_figures!r}) is not valid: expected True or False"
            )
        reports = make_report_options(
            "BarrierGuard",
            "trainer.log_dir",
            print_report=print_report,
            save_report=save_report,
            rank_reports=rank_reports,
            merge_ranks=merge_ranks,
        )
        self.print_report = reports.print_report
        self.save_report = reports.save_report
        self.rank_reports = reports.rank_reports
        self.merge_ranks = reports.merge_ranks
        self.rank_report_path: str | None = None
        self.log_figures = log_figures
        self.report_path: str | None = None
        self._guard: Guard | None = None
        self._before: Report | None = None
        self._final: Report | None = None
        self._epochs: list[int] = []
        self._epoch_start = 0
        self._resume_phase = "setup"

    # Guards hold locks and hooks: ddp_spawn pickles the callback before the
    # run, so only the settings and the restored counts travel.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_guard"] = None
        return state

    # -- the report ---------------------------------------------------------
    @property
    def guard(self) -> Guard | None:
        """The guard behind the callback (``None`` before the first ``setup``)."""
        return self._guard

    @property
    def report(self) -> Report:
        """The report so far: merged over ranks after a distributed ``fit``."""
        if self._final is not None and (self._guard is None or not self._guard.is_running):
            return self._final
        return self._local_report()

    def _local_report(self) -> Report:
        if self._guard is None:
            current = ranks.not_run_report(self._options.policy)
        else:
            current = self._guard.report
        current = replace(current, epochs=tuple(self._epochs))
        if self._before is not None:
            current = combine(self._before, current)
        return current

    # -- lifecycle ------------------------------------------------------------
    def _start(self, phase: str) -> None:
        if self._guard is None:
            guard = Guard(self._options)
            # Steps are training batches (marked at on_train_batch_end), so the
            # optimizer hook must not count them as well.
            guard._manual = True
            self._guard = guard
        if not self._guard.is_running:
            self._final = None
            self._guard.set_phase(phase)
            self._guard.start()

    def _set_phase(self, phase: str) -> None:
        if self._guard is not None:
            self._guard.set_phase(phase)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._start("setup" if stage == "fit" else _STAGE_PHASES.get(stage, "setup"))

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("sanity")

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("setup")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("train")
        self._resume_phase = "train"
        if self._guard is not None:
            self._epoch_start = self._guard.steps
            self._epochs.append(self._epoch_start)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._guard is not None and self._guard.is_running:
            self._guard.step()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("sanity" if trainer.sanity_checking else "validate")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("setup" if trainer.sanity_checking else self._resume_phase)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("predict")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("teardown")
        self._resume_phase = "teardown"

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.log_figures or not trainer.loggers or self._guard is None:
            return
        try:
            metrics = self._figures()
        except Exception as exc:
            self._guard.fault(exc)
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _figures(self) -> dict[str, float]:
        """This epoch's figures, as Python numbers: logging them adds no sync."""
        guard = self._guard
        assert guard is not None
        end = guard.steps
        start = min(self._epoch_start, end)
        # _per_step[k] holds the syncs recorded after k steps, i.e. in step k + 1.
        series = guard._per_step[start:end]
        steps = end - start
        metrics: dict[str, float] = {
            "barrierguard/syncs_per_step": (sum(series) / steps) if steps else 0.0,
        }
        memory = guard._memory
        if memory is not None:
            slopes = memory.report().slopes
            for name, slope in slopes.items():
                metrics[f"barrierguard/memory_growth_per_step/{name}"] = float(slope)
        return metrics

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._guard is not None and self._guard.is_running:
            self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The run is failing: restore every global, keep what was found, and
        # neither merge (the other ranks may be gone) nor raise a policy error.
        if self._guard is not None and self._guard.is_running:
            self._guard._deferred.clear()
            self._guard._stop(act=False)
            self._final = self._local_report()

    def _finish(self, trainer: pl.Trainer) -> None:
        guard = self._guard
        assert guard is not None
        try:
            guard.stop()
        finally:
            local = self._local_report()
            self._final, self.rank_report_path, self.report_path = ranks.publish(
                local,
                rank_file=self._rank_path(trainer),
                merged_file=self._path(trainer) if self.merge_ranks else None,
                merge_ranks=self.merge_ranks,
                print_report=self.print_report,
                fault=guard.fault,
            )

    def _path(self, trainer: pl.Trainer) -> str | None:
        # trainer.log_dir is a collective under DDP: every rank asks.
        return ranks.report_file(
            self.save_report,
            lambda: trainer.log_dir or trainer.default_root_dir,
            REPORT_NAME,
        )

    def _rank_path(self, trainer: pl.Trainer) -> str | None:
        # Not trainer.log_dir: a collective under DDP, which per-rank files avoid.
        return ranks.report_file(
            self.rank_reports, lambda: trainer.default_root_dir, RANK_REPORT_NAME
        )

    # -- checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counts so far, so that a resumed run goes on from them."""
        # Through JSON, so the checkpoint holds plain types only and loads with
        # torch.load(weights_only=True) (the environment holds str subclasses).
        return {"report": json.loads(json.dumps(self._local_report().to_dict()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Go on from the counts of a checkpoint written by :meth:`state_dict`.

        Raises:
            BarrierGuardError: When the state holds no report this release
                reads.
        """
        data = state_dict.get("report")
        if data is None:
            raise BarrierGuardError(
                "BarrierGuard.load_state_dict(): the state has no 'report' entry; expected "
                "what BarrierGuard.state_dict() returns"
            )
        # The checkpoint's report already holds everything before it.
        self._before = Report.from_dict(data, source="checkpoint")


_STAGE_PHASES = {"validate": "validate", "test": "test", "predict": "predict"}
