"""``BarrierGuard``: Lightning's hooks mapped onto the guard that ``watch()`` builds."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl

from barrierguard._errors import BarrierGuardError
from barrierguard.integrations.adapter import Adapter, hold_weakly
from barrierguard.report.combine import combine
from barrierguard.report.records import Report
from barrierguard.session.rank_reports import RANK_REPORT_NAME, REPORT_NAME

__all__ = ["RANK_REPORT_NAME", "REPORT_NAME", "BarrierGuard"]


class BarrierGuard(Adapter, pl.Callback):
    """A Lightning callback that watches a ``Trainer`` run for host-device syncs.

    ``Trainer(callbacks=[BarrierGuard()])`` runs the guard of :func:`~barrierguard.watch` around
    ``fit`` (and ``validate``/``test``/``predict``). Training batches are steps; validation, test
    and predict batches are counted apart (each site's ``phases``), never against the policy;
    setup and the sanity check are setup. Lightning's own syncs (the batch copy, ``prog_bar``
    metrics, ...) are named by mechanism, with the hook in flight and the fix; those in your
    ``training_step`` and friends stay ``origin: "user"``.

    Each training epoch end logs syncs and memory growth per step (Python numbers: no sync). At
    the end of ``fit`` rank 0 prints the report and saves it as JSON (``barrierguard_report.json``
    in ``trainer.log_dir``), merged over the DDP ranks (one collective). Checkpoints carry the
    counts, so a resumed run keeps them. Subclass it like any callback (call ``super()``).

    Args:
        **options: The options of :func:`~barrierguard.watch` but ``out`` (``warmup_steps`` in
            training batches; ``allow=["framework:lightning"]`` accepts Lightning's own syncs).
        print_report: Print the report at the end of ``fit`` (rank 0).
        save_report: ``True`` for ``<trainer.log_dir>/barrierguard_report.json``, a path, or
            ``False``. Under DDP, rank 0 saves the merged report.
        rank_reports: Every rank also saves its own report (atomically, before any merge):
            ``True`` for ``<trainer.default_root_dir>/barrierguard_report.rank<N>.json``, or a
            path (``{rank}`` in it is the rank, else ``.rank<N>`` goes before the suffix).
        merge_ranks: Merge the ranks' reports on rank 0 at the end of ``fit`` (one
            ``all_gather_object``); ``False`` (a multi-node job) needs ``rank_reports``.
        log_figures: Send syncs per step and memory growth to the loggers at each epoch end.

    Raises:
        BarrierGuardError: For a bad option value (the message names the accepted forms).
        TypeError: For an unknown keyword argument.
        ModuleNotFoundError: When Lightning is not installed.

    Example:
        >>> import barrierguard
        >>> cb = barrierguard.BarrierGuard(policy="record")  # doctest: +SKIP
        >>> trainer = lightning.pytorch.Trainer(callbacks=[cb])  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> cb.report.steps  # doctest: +SKIP
        200
    """

    def __init__(self, *, log_figures: bool = True, **options: Any) -> None:
        self._configure("BarrierGuard", "trainer.log_dir", options, own=("log_figures",))
        if not isinstance(log_figures, bool):
            raise BarrierGuardError(
                f"BarrierGuard(log_figures={log_figures!r}) is not valid: expected True or False"
            )
        self.log_figures = log_figures
        self._before: Report | None = None
        self._epochs: list[int] = []
        self._epoch_start = 0
        self._resume_phase = "setup"

    def _local_report(self) -> Report:
        current = replace(super()._local_report(), epochs=tuple(self._epochs))
        return current if self._before is None else combine(self._before, current)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A test or predict run is that phase from its setup on (each run ends at teardown).
        held = hold_weakly(trainer)  # asked by a capture probe; the run's end frees the trainer
        self._begin(
            stage if stage in ("validate", "test", "predict") else "setup",
            lambda: getattr(held(), "optimizers", ()),
        )

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
        guard = self._guard  # _running() inline, no call: this runs every step
        if guard is not None and guard.is_running:
            guard.step()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("sanity" if trainer.sanity_checking else "validate")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("setup" if trainer.sanity_checking else self._resume_phase)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("teardown")
        self._resume_phase = "teardown"

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guard = self._guard
        if not self.log_figures or not trainer.loggers or guard is None:
            return
        try:  # Python numbers: logging them adds no sync
            end = guard.steps
            start = min(self._epoch_start, end)
            syncs = sum(guard.syncs_in_steps(start, end)) / (end - start) if end > start else 0.0
            metrics = {"barrierguard/syncs_per_step": syncs}
            for name, slope in guard.memory_slopes().items():
                metrics[f"barrierguard/memory_growth_per_step/{name}"] = float(slope)
        except Exception as exc:
            guard.fault(exc)
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._abort()

    def _finish(self, trainer: pl.Trainer) -> None:
        # trainer.log_dir is a collective under DDP: every rank asks for it; the per-rank files
        # (asked first) use default_root_dir, which is not one.
        self._end(
            lambda: trainer.log_dir or trainer.default_root_dir, lambda: trainer.default_root_dir
        )

    def state_dict(self) -> dict[str, Any]:
        """The counts so far, so that a resumed run goes on from them."""
        # Through JSON, so the checkpoint holds plain types only and loads with
        # torch.load(weights_only=True) (the environment holds str subclasses).
        return {"report": json.loads(json.dumps(self._local_report().to_dict()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Go on from the counts of a checkpoint written by :meth:`state_dict`.

        Raises:
            BarrierGuardError: When the state holds no report this release reads.
        """
        if (data := state_dict.get("report")) is None:
            raise BarrierGuardError(
                "BarrierGuard.load_state_dict(): the state has no 'report' entry; expected "
                "what BarrierGuard.state_dict() returns"
            )
        # The checkpoint's report already holds everything before it.
        self._before = Report.from_dict(data, source="checkpoint")
