"""The public name of the Hugging Face ``TrainerCallback``, importable without transformers.

``import barrierguard`` never imports transformers: it is imported when an
:class:`HFBarrierGuard` is created, and the instance is then a real
``transformers.TrainerCallback`` (the class in ``hf_callback``, registered as a
virtual subclass, so ``isinstance(cb, HFBarrierGuard)`` holds).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from barrierguard.report.records import Report

__all__ = ["HFBarrierGuard"]

_MISSING = (
    "HFBarrierGuard needs the transformers package, which is not installed here: "
    "pip install 'barrierguard[hf]' (or pip install transformers)"
)


class HFBarrierGuard(abc.ABC):
    """A ``transformers.TrainerCallback`` that watches a ``Trainer`` run for host-device syncs.

    ``Trainer(..., callbacks=[HFBarrierGuard()])`` runs the same guard as
    :func:`~barrierguard.watch` around ``trainer.train()``. Steps are the
    Trainer's optimizer steps (``on_step_end``; with gradient accumulation one
    step spans several micro-batches). Evaluation, prediction, checkpoint
    saving and what runs after the last step are counted apart (each site's
    ``phases``) and never held against the policy. Syncs inside transformers
    and accelerate are named by mechanism with the ``TrainingArguments``
    setting that removes them, or plainly that none does (docs/huggingface.md).

    At the end of training the report is printed on the main process and saved
    as JSON (``barrierguard_report.json`` in ``args.output_dir``). Under DDP
    every rank collects and rank 0 merges the reports (one collective, after
    training).

    Args:
        policy: As in :func:`~barrierguard.watch`.
        engine: As in :func:`~barrierguard.watch`.
        warmup_steps: As in :func:`~barrierguard.watch` (optimizer steps).
        allow: As in :func:`~barrierguard.watch`; ``"framework:transformers"``
            accepts all of transformers' own syncs.
        max_syncs_per_step: As in :func:`~barrierguard.watch`.
        memory: As in :func:`~barrierguard.watch`.
        max_growth_per_step: As in :func:`~barrierguard.watch`.
        memory_every: As in :func:`~barrierguard.watch`.
        memory_children: As in :func:`~barrierguard.watch`.
        print_report: Print the report at the end of training (main process).
        save_report: Where to save the merged JSON report: ``True`` for
            ``<args.output_dir>/barrierguard_report.json``, a path, or ``False``.
        rank_reports: Also write each rank's own report: ``True`` for
            ``<args.output_dir>/barrierguard_report.rank{rank}.json``, a path
            (``{rank}`` is replaced, else ``.rank<N>`` is inserted), or ``False``;
            ``barrierguard merge`` joins the files offline.
        merge_ranks: Merge the ranks' reports on rank 0 at the end (one
            collective); ``False`` needs ``rank_reports``.

    Raises:
        BarrierGuardError: For a bad option value (the message names it and
            the accepted forms).
        TypeError: For an unknown keyword argument.
        ModuleNotFoundError: When transformers is not installed (the message
            names the extra to install).

    Example:
        >>> import barrierguard
        >>> cb = barrierguard.HFBarrierGuard(policy="record")  # doctest: +SKIP
        >>> trainer = transformers.Trainer(model, args, train_dataset=ds, callbacks=[cb])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> cb.report.steps  # doctest: +SKIP
        60
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> HFBarrierGuard:
        try:
            from barrierguard.integrations.hf_callback import HFBarrierGuardCallback
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] == "transformers":
                raise ModuleNotFoundError(_MISSING, name="transformers") from exc
            raise
        cls.register(HFBarrierGuardCallback)
        # Not a real subclass, so Python calls no __init__ on the result: the
        # callback is built here, whole.
        return HFBarrierGuardCallback(*args, **kwargs)  # type: ignore[return-value]

    @property
    @abc.abstractmethod
    def report(self) -> Report:
        """The report so far (the same :class:`~barrierguard.Report` as ``watch()``)."""
