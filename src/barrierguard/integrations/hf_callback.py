"""``HFBarrierGuard``: the Trainer's events mapped onto the guard that ``watch()`` builds."""

from __future__ import annotations

import functools
import sys
import weakref
from types import FrameType
from typing import Any

from transformers import Trainer, TrainerCallback

from barrierguard.integrations.adapter import Adapter, hold_weakly

__all__ = ["HFBarrierGuard"]


class HFBarrierGuard(Adapter, TrainerCallback):
    """A ``transformers.TrainerCallback`` that watches a ``Trainer`` run for host-device syncs.

    ``Trainer(..., callbacks=[HFBarrierGuard()])`` runs the guard of :func:`~barrierguard.watch`
    around ``trainer.train()``. Steps are optimizer steps (``on_step_end``: with gradient
    accumulation one step spans several micro-batches). Evaluation, prediction, checkpointing
    and what follows the last step are counted apart (each site's ``phases``), never against
    the policy. Syncs inside transformers and accelerate are named by mechanism with the
    ``TrainingArguments`` setting that removes them, if any (docs/huggingface.md).

    At the end of training the main process prints the report and saves it as JSON
    (``barrierguard_report.json`` in ``args.output_dir``), merged over the DDP ranks (one
    collective). The Trainer has no event for a failed run, so the callback wraps ``train`` of
    its Trainer (found at ``on_init_end``, or the first ``on_train_begin`` after
    ``add_callback``): when it raises, the guard stops first, whatever the policy.

    Args:
        **options: The options of :func:`~barrierguard.watch` but ``out`` (``warmup_steps`` in
            optimizer steps; ``allow=["framework:transformers"]`` accepts its own syncs).
        print_report: Print the report at the end of training (main process).
        save_report: ``True`` for ``<args.output_dir>/barrierguard_report.json``, a path, or
            ``False``; the merged report.
        rank_reports: Also write each rank's own report: ``True`` for
            ``<args.output_dir>/barrierguard_report.rank{rank}.json``, a path (``{rank}`` is
            replaced, else ``.rank<N>`` is inserted), or ``False``.
        merge_ranks: Merge the ranks' reports on rank 0 at the end (one collective); ``False``
            needs ``rank_reports``.

    Raises:
        BarrierGuardError: For a bad option value (the message names the accepted forms).
        TypeError: For an unknown keyword argument.
        ModuleNotFoundError: When transformers is not installed (the message names the extra).

    Example:
        >>> import barrierguard
        >>> cb = barrierguard.HFBarrierGuard(policy="record")  # doctest: +SKIP
        >>> trainer = transformers.Trainer(model, args, train_dataset=ds, callbacks=[cb])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        >>> cb.report.steps  # doctest: +SKIP
        60
    """

    _transient = ("_guard", "_trainers")

    def __init__(self, **options: Any) -> None:
        self._configure("HFBarrierGuard", "args.output_dir", options)
        self._trainers: weakref.WeakSet[Any] | None = weakref.WeakSet()

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._protect(sys._getframe(1))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._protect(sys._getframe(1))
        held = hold_weakly(kwargs.get("optimizer"))
        self._begin("train", lambda: () if (opt := held()) is None else (opt,))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        guard = self._guard  # _running() inline, no call: this runs every step
        if guard is not None and guard.is_running:
            guard.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._set_phase("teardown")
        output_dir = str(getattr(args, "output_dir", None) or ".")
        self._end(lambda: output_dir, lambda: output_dir)

    def _protect(self, frame: FrameType | None) -> None:
        """Wrap ``train`` of the Trainer a few frames up, so that a failed run stops the guard."""
        if self._trainers is None:  # unpickled
            self._trainers = weakref.WeakSet()
        trainer = None
        for _ in range(8):
            if frame is None or isinstance(trainer := frame.f_locals.get("self"), Trainer):
                break
            frame = frame.f_back
        if not isinstance(trainer, Trainer) or trainer in self._trainers:
            return
        self._trainers.add(trainer)
        train = trainer.train
        callback = weakref.ref(self)

        @functools.wraps(train)
        def guarded_train(*args: Any, **kwargs: Any) -> Any:
            try:
                return train(*args, **kwargs)
            except BaseException:
                if (cb := callback()) is not None:
                    cb._abort()
                raise

        trainer.train = guarded_train  # type: ignore[method-assign]
