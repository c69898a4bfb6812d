"""Both callbacks x every exit path of a fit: nothing of barrierguard outlives the run.

After a fit that returns, raises, is interrupted, exits, or fails inside a
framework hook, every global is as before (``tests/_leaks.py``) and plain user
code that syncs runs untouched, even under the ``"error"`` policy. And both
callbacks are real classes: a subclass's overridden hook is called.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import barrierguard
from _leaks import EXITS, RAISED, global_state

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")
from _hf_helpers import trainer as hf_trainer  # noqa: E402  (needs transformers)
from _lightning_helpers import TinyModule, loaders  # noqa: E402  (needs Lightning)
from _lightning_helpers import trainer as pl_trainer  # noqa: E402

# Allowed: the frameworks' own syncs, so that only a guard left running would
# judge the user's sync after the fit (and raise SyncError under "error").
_OPTIONS: dict[str, Any] = {
    "policy": "error",
    "allow": ("framework:*",),
    "print_report": False,
    "save_report": False,
}


def _user_code_after_the_fit() -> float:
    return torch.ones(3).to(torch.device("cpu")).sum().item()


def _outcome(call: Any) -> Any:
    try:
        call()
    except BaseException as exc:  # the exit path itself is what is compared
        return type(exc)
    return None


# -- Lightning ------------------------------------------------------------------------


def _lightning_module(exit_path: str) -> Any:
    class Module(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 1 and exit_path in ("exception", "keyboard_interrupt", "system_exit"):
                raise RAISED[exit_path]("out")
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

    return Module()


class _FailingHook(pl.Callback):  # type: ignore[misc]
    def on_train_batch_end(self, *args: Any) -> None:
        raise ZeroDivisionError("a framework hook failed")


@pytest.mark.parametrize("exit_path", EXITS)
def test_lightning_fit_leaves_nothing_behind(tmp_path: Path, exit_path: str) -> None:
    before = global_state()
    cb = barrierguard.BarrierGuard(**_OPTIONS)
    callbacks = [cb, _FailingHook()] if exit_path == "hook_exception" else [cb]
    train, _val = loaders()
    fit = pl_trainer(tmp_path, callbacks, max_epochs=1, limit_val_batches=0)
    got = _outcome(lambda: fit.fit(_lightning_module(exit_path), train))
    # Lightning turns Ctrl-C into a graceful shutdown (it may exit instead).
    expected = RAISED.get(exit_path)
    assert got is expected or (exit_path == "keyboard_interrupt" and got in (None, SystemExit))
    assert cb.guard is not None and not cb.guard.is_running
    assert global_state() == before
    assert _user_code_after_the_fit() == 3.0


def test_a_lightning_subclass_hook_is_called(tmp_path: Path) -> None:
    calls: list[int] = []

    class Mine(barrierguard.BarrierGuard):  # type: ignore[misc]
        def on_train_batch_end(self, *args: Any) -> None:
            calls.append(args[-1])
            super().on_train_batch_end(*args)

    cb = Mine(policy="record", print_report=False, save_report=False)
    assert isinstance(cb, pl.Callback)
    train, _val = loaders()
    pl_trainer(tmp_path, [cb], max_epochs=1, limit_val_batches=0).fit(TinyModule(), train)
    assert calls == [0, 1, 2, 3]
    assert cb.report.steps == 4  # the base class's hook ran too


def test_unknown_lightning_option_names_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"'polcy' \(did you mean 'policy'\?\).*log_figures"):
        barrierguard.BarrierGuard(polcy="record")


# -- Hugging Face ------------------------------------------------------------------------


class _Forward(torch.nn.Module):
    """Wraps a model's forward to leave by ``exit_path`` at the second call."""

    def __init__(self, exit_path: str) -> None:
        super().__init__()
        self.exit_path = exit_path
        self.calls = 0

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.exit_path in ("exception", "keyboard_interrupt", "system_exit"):
            raise RAISED[self.exit_path]("out")


class _FailingStep(transformers.TrainerCallback):  # type: ignore[misc]
    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a framework hook failed")


@pytest.mark.parametrize(
    ("exit_path", "added_later"), [*((e, False) for e in EXITS), ("exception", True)]
)
def test_hf_train_leaves_nothing_behind(tmp_path: Path, exit_path: str, added_later: bool) -> None:
    before = global_state()
    cb = barrierguard.HFBarrierGuard(**_OPTIONS)
    callbacks = [_FailingStep()] if exit_path == "hook_exception" else []
    if added_later:
        trainer = hf_trainer(tmp_path, callbacks, steps=3, eval_strategy="no")
        trainer.add_callback(cb)
        # The first run finds the trainer (no on_init_end for a callback added
        # later) and guards the runs after it.
        trainer.train()
    else:
        trainer = hf_trainer(tmp_path, [cb, *callbacks], steps=3, eval_strategy="no")
    trainer.model.register_forward_pre_hook(_Forward(exit_path), with_kwargs=True)
    got = _outcome(trainer.train)
    assert got is RAISED.get(exit_path)
    assert cb.guard is not None and not cb.guard.is_running
    assert global_state() == before
    assert _user_code_after_the_fit() == 3.0


def test_an_hf_subclass_hook_is_called(tmp_path: Path) -> None:
    calls: list[int] = []

    class Mine(barrierguard.HFBarrierGuard):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            calls.append(state.global_step)
            super().on_step_end(args, state, control, **kwargs)

    cb = Mine(policy="record", print_report=False, save_report=False)
    assert isinstance(cb, transformers.TrainerCallback)
    hf_trainer(tmp_path, [cb], steps=3, eval_strategy="no").train()
    assert calls == [1, 2, 3]
    assert cb.report.steps == 3  # the base class's event ran too


def test_import_barrierguard_imports_no_framework() -> None:
    import subprocess

    code = (
        "import sys, barrierguard; "
        "print(sorted(m for m in ('lightning', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert {"BarrierGuard", "HFBarrierGuard"} <= set(dir(barrierguard))
