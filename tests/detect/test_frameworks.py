"""The framework table: which mechanism and phase a stack shows, and the fix it gives."""

from __future__ import annotations

import os
from types import FrameType
from typing import Any

import pytest

from barrierguard.detect import frameworks, stack


@pytest.fixture(autouse=True)
def _framework_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    # The walk looks for hooks and phases only once a framework that has them
    # is imported; these fake framework files stand in for one.
    monkeypatch.setattr(frameworks, "PHASE_PACKAGES", ("sys",))


def _define(namespace: dict[str, Any], path: str, src: str) -> None:
    """Run ``src`` into ``namespace`` as if it were the framework file ``path``."""
    exec(compile(src, os.path.join(os.sep, "sp", path), "exec"), namespace)


def _frame_in(path: str, function: str) -> FrameType:
    """A live frame of ``function`` in a file named ``path`` (a fake framework file)."""
    namespace: dict[str, Any] = {}
    _define(namespace, path, f"import sys\ndef {function}():\n    return sys._getframe()\n")
    frame: FrameType = namespace[function]()
    return frame


@pytest.mark.parametrize(
    ("path", "function", "mechanism"),
    [
        ("lightning/pytorch/core/module.py", "_apply_batch_transfer_handler", "batch_transfer"),
        ("lightning/pytorch/trainer/connectors/logger_connector/result.py", "metrics", "prog_bar"),
        (
            "lightning/pytorch/trainer/connectors/logger_connector/logger_connector.py",
            "log_metrics",
            "logger",
        ),
        ("pytorch_lightning/core/module.py", "log", "self_log"),
        ("lightning/pytorch/callbacks/model_checkpoint.py", "_save_topk", "checkpoint"),
        ("lightning/pytorch/strategies/parallel.py", "reduce_boolean_decision", "ddp_decision"),
        ("lightning/pytorch/core/module.py", "forward_hooks", None),
    ],
)
def test_mechanism_table(path: str, function: str, mechanism: str | None) -> None:
    frame = _frame_in(os.path.join("site-packages", path), function)
    assert stack.annotate(frame)[0] == mechanism


def test_every_mechanism_has_a_fix_or_says_plainly_that_none_exists() -> None:
    names = [m.name for m in frameworks.MECHANISMS]
    assert len(names) == len(set(names))
    for m in frameworks.MECHANISMS:
        assert m.why and m.functions
        assert bool(m.fix) != bool(m.no_fix), m.name
        assert m.hint == m.fix or m.hint.startswith("no setting removes it: ")
        for where in m.functions:
            path, _, function = where.rpartition(":")
            assert path.endswith(".py") and function, where


def test_a_file_is_classified_once_by_its_name() -> None:
    # The walk looks frames up by file name: a second function of a known
    # file is read from the same entry, by its function's name.
    frame = _frame_in("lightning/pytorch/core/module.py", "log")
    assert stack.annotate(frame)[0] == "self_log"
    other = _frame_in("lightning/pytorch/core/module.py", "forward_hooks")
    assert stack.annotate(other)[0] is None
    assert os.path.join(os.sep, "sp", "lightning/pytorch/core/module.py") in stack._files


def test_the_hook_in_flight_is_named() -> None:
    namespace: dict[str, Any] = {}
    _define(
        namespace,
        "lightning/pytorch/trainer/call.py",
        "def _call_callback_hooks(inner):\n"
        "    hook_name = 'on_train_batch_end'\n"
        "    return inner()\n",
    )
    _define(
        namespace,
        "lightning/pytorch/trainer/connectors/logger_connector/result.py",
        "def metrics(probe):\n    return probe()\n",
    )
    seen: list[tuple[str | None, str | None]] = []

    def probe() -> None:
        seen.append(stack.annotate(__import__("sys")._getframe()))

    namespace["_call_callback_hooks"](lambda: namespace["metrics"](probe))
    assert seen == [("prog_bar (on_train_batch_end)", None)]


def test_the_walk_ends_at_the_phase_marker() -> None:
    # A loop's run() is outward of every hook in flight: the walk stops there
    # and does not take a hook caller beyond it (a nested fit) for this sync's.
    namespace: dict[str, Any] = {}
    _define(
        namespace,
        "lightning/pytorch/trainer/call.py",
        "def _call_callback_hooks(inner):\n    hook_name = 'on_fit_start'\n    return inner()\n",
    )
    _define(
        namespace, "lightning/pytorch/loops/fit_loop.py", "def run(inner):\n    return inner()\n"
    )
    _define(
        namespace,
        "lightning/pytorch/trainer/connectors/logger_connector/result.py",
        "def metrics(inner):\n    return inner()\n",
    )
    seen: list[tuple[str | None, str | None]] = []

    def probe() -> None:
        seen.append(stack.annotate(__import__("sys")._getframe()))

    namespace["_call_callback_hooks"](lambda: namespace["run"](lambda: namespace["metrics"](probe)))
    namespace["_call_callback_hooks"](lambda: namespace["metrics"](probe))
    assert seen == [("prog_bar", "train"), ("prog_bar (on_fit_start)", None)]


class _Stage:
    def __init__(self, value: str) -> None:
        self.value = value


@pytest.mark.parametrize(
    ("stage", "phase"),
    [("sanity_check", "sanity"), ("validate", "validate"), ("test", "test"), ("odd", "validate")],
)
def test_the_evaluation_loop_names_its_stage(stage: str, phase: str) -> None:
    namespace: dict[str, Any] = {}
    _define(
        namespace,
        "lightning/pytorch/loops/evaluation_loop.py",
        "class _EvaluationLoop:\n"
        "    def __init__(self, stage):\n        self._stage = stage\n"
        "    def run(self, probe):\n        return probe()\n",
    )
    loop = namespace["_EvaluationLoop"](_Stage(stage))
    got = loop.run(lambda: stack.annotate(__import__("sys")._getframe()))
    assert got == (None, phase)


def test_a_stack_without_frameworks_has_no_mechanism_nor_phase() -> None:
    assert stack.annotate(__import__("sys")._getframe()) == (None, None)


def test_mechanism_fixes_orders_fixes_by_count_and_skips_unknown_names() -> None:
    text = frameworks.mechanism_fixes(
        [("logger", 1), ("prog_bar (on_train_batch_end)", 3), ("x", 9)]
    )
    assert text is not None
    first, second = text.split(" | ")
    assert first.startswith("prog_bar: self.log(..., prog_bar=False)")
    assert second.startswith("logger: raise Trainer(log_every_n_steps")
    assert frameworks.mechanism_fixes([("x", 1)]) is None
    assert frameworks.mechanism_fixes([("results_to_cpu", 1)]) == (
        "results_to_cpu: no setting removes it: once per loop, outside the steps"
    )


def _probe_caller() -> tuple[str | None, str | None]:
    """Annotate from the caller's frame, as if the sync happened right there."""
    return stack.annotate(__import__("sys")._getframe(1))


def test_a_direct_mechanism_names_only_syncs_made_in_its_own_function() -> None:
    namespace: dict[str, Any] = {}
    _define(
        namespace,
        "transformers/trainer.py",
        "def _run_epoch(probe, callee):\n    return probe() if callee is None else callee(probe)\n",
    )
    _define(namespace, "transformers/models/gpt2.py", "def forward(probe):\n    return probe()\n")
    assert namespace["_run_epoch"](_probe_caller, None) == ("loss_nan_filter", None)
    # A sync in a function the loop body calls is not the NaN filter's.
    assert namespace["_run_epoch"](_probe_caller, namespace["forward"]) == (None, None)


@pytest.mark.parametrize(
    ("function", "phase"),
    [
        ("evaluate", "validate"),
        ("predict", "predict"),
        ("_save_checkpoint", "checkpoint"),
        ("_finalize_training", "teardown"),
        ("_inner_training_loop", "train"),
    ],
)
def test_hugging_face_phases(function: str, phase: str) -> None:
    namespace: dict[str, Any] = {}
    _define(namespace, "transformers/trainer.py", f"def {function}(probe):\n    return probe()\n")
    _define(
        namespace,
        "transformers/masking_utils.py",
        "def find_packed_sequence_indices(probe):\n    return probe()\n",
    )
    got = namespace[function](lambda: namespace["find_packed_sequence_indices"](_probe_caller))
    assert got == ("packed_sequence_check", phase)


def test_the_innermost_phase_wins_a_save_inside_a_training_loop() -> None:
    namespace: dict[str, Any] = {}
    _define(
        namespace,
        "transformers/trainer.py",
        "def _inner_training_loop(inner):\n    return inner()\n"
        "def _save_checkpoint(inner):\n    return inner()\n",
    )
    _define(namespace, "torch/serialization.py", "def _save(probe):\n    return probe()\n")
    got = namespace["_inner_training_loop"](
        lambda: namespace["_save_checkpoint"](lambda: namespace["_save"](_probe_caller))
    )
    assert got == ("save_to_host", "checkpoint")


@pytest.mark.parametrize(
    ("path", "function", "mechanism"),
    [
        ("accelerate/utils/operations.py", "send_to_device", "send_to_device"),
        ("torchmetrics/aggregation.py", "_cast_and_nan_check_input", "nan_check"),
        ("torch/amp/grad_scaler.py", "_maybe_opt_step", "grad_scaler_step"),
        ("torch/nn/utils/clip_grad.py", "_get_total_norm", "clip_grad_nonfinite"),
        ("safetensors/torch.py", "_to_ndarray", "save_to_host"),
        ("pytorch_lightning/loops/utilities.py", "check_finite_loss", "finite_loss_check"),
    ],
)
def test_table_rows_of_other_frameworks(path: str, function: str, mechanism: str) -> None:
    frame = _frame_in(os.path.join("site-packages", path), function)
    assert stack.annotate(frame)[0] == mechanism


def test_the_docs_list_every_mechanism() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "frameworks.md").read_text()
    missing = [m.name for m in frameworks.MECHANISMS if f"| `{m.name}` |" not in text]
    assert not missing
