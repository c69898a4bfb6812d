"""The public name of the Lightning callback, importable without Lightning.

``import barrierguard`` must stay light: Lightning is imported only when a
``BarrierGuard`` is created, and the instance is then a real
``lightning.pytorch.Callback`` (the class in ``lightning_callback``, which is
registered as a virtual subclass, so ``isinstance(cb, BarrierGuard)`` holds
while that module needs nothing from this one).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from barrierguard.report.records import Report

__all__ = ["BarrierGuard"]


class BarrierGuard(abc.ABC):
    """A Lightning callback that watches a ``Trainer`` run for host-device syncs.

    ``Trainer(callbacks=[BarrierGuard()])`` runs the same guard as
    :func:`~barrierguard.watch` around ``fit`` (and ``validate``/``test``/
    ``predict``). Training batches are steps; validation, test and predict
    batches are counted apart (each site's ``phases``) and never held against
    the policy; setup and the sanity check count as setup. Lightning's own syncs
    (the batch copy to the device, ``prog_bar`` metrics, logger conversions,
    ...) are named by mechanism, with the Lightning hook in flight and the fix,
    in each site's ``mechanisms``; syncs in your ``training_step`` and friends
    stay ``origin: "user"``.

    At each training epoch end, barrierguard's own figures (syncs per step in
    the epoch, memory growth per step) go to the trainer's loggers as Python
    numbers (no sync). At the end of ``fit`` the report is printed on rank 0 and
    saved as JSON (``barrierguard_report.json`` in ``trainer.log_dir``). Under
    DDP every rank collects and rank 0 merges the reports (one collective,
    after training). The counts travel in checkpoints, so a resumed run keeps
    them.

    The instance is a ``lightning.pytorch.Callback``: creating one imports
    Lightning, ``import barrierguard`` does not.

    Args:
        policy: As in :func:`~barrierguard.watch`.
        engine: As in :func:`~barrierguard.watch`.
        warmup_steps: As in :func:`~barrierguard.watch` (training batches).
        allow: As in :func:`~barrierguard.watch`; ``"framework:lightning"``
            accepts all of Lightning's own syncs.
        max_syncs_per_step: As in :func:`~barrierguard.watch`.
        memory: As in :func:`~barrierguard.watch`.
        max_growth_per_step: As in :func:`~barrierguard.watch`.
        memory_every: As in :func:`~barrierguard.watch`.
        memory_children: As in :func:`~barrierguard.watch`.
        print_report: Print the report at the end of ``fit`` (rank 0).
        save_report: Where to save the JSON report: ``True`` for
            ``<trainer.log_dir>/barrierguard_report.json``, a path, or
            ``False``. Under DDP, rank 0 saves the merged report.
        rank_reports: Every rank also saves its own report (atomically, before
            any merge): ``True`` for
            ``<trainer.default_root_dir>/barrierguard_report.rank<N>.json``,
            or a path (``{rank}`` in it is the rank; without it, a run of
            several ranks inserts ``.rank<N>`` before the suffix); ``barrierguard
            merge`` joins the files offline.
        merge_ranks: Merge the ranks' reports on rank 0 at the end of ``fit``
            (one ``all_gather_object``). ``False`` skips that collective (a
            multi-node job); it needs ``rank_reports``.
        log_figures: Send syncs per step and memory growth to the trainer's
            loggers at each training epoch end.

    Raises:
        BarrierGuardError: For a bad option value (the message names it and
            the accepted forms).
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

    def __new__(cls, *args: Any, **kwargs: Any) -> BarrierGuard:
        from barrierguard.integrations.lightning_callback import BarrierGuardCallback

        cls.register(BarrierGuardCallback)
        # Not a real subclass, so Python calls no __init__ on the result: the
        # callback is built here, whole.
        return BarrierGuardCallback(*args, **kwargs)  # type: ignore[return-value]

    @property
    @abc.abstractmethod
    def report(self) -> Report:
        """The report so far (the same :class:`~barrierguard.Report` as ``watch()``)."""
