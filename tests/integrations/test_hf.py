"""The Hugging Face TrainerCallback, and HF Trainer phases under a plain watch(), on CPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import barrierguard
from _leaks import guard_step_hooks
from barrierguard import BarrierGuardError, Report

transformers = pytest.importorskip("transformers")
from _hf_helpers import HINTED, trainer  # noqa: E402  (needs transformers)


def _mechanisms(report: Report) -> dict[str, int]:
    total: dict[str, int] = {}
    for site in report.sites:
        for name, n in site.mechanisms:
            base = name.split(" (", 1)[0]
            total[base] = total.get(base, 0) + n
    return total


def _apart(report: Report, phase: str) -> int:
    return sum(n for s in report.sites for p, n in s.phases if p == phase)


@pytest.fixture(scope="module")
def default_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, int]:
    out = tmp_path_factory.mktemp("hf")
    cb = barrierguard.HFBarrierGuard(policy="record", print_report=False, memory=False)
    tr = trainer(out, [cb])
    tr.train()
    assert cb.report_path == str(out / "barrierguard_report.json")
    return cb.report, tr.state.global_step


def test_steps_are_the_trainers_optimizer_steps(default_fit: tuple[Report, int]) -> None:
    report, global_step = default_fit
    assert global_step == 6
    assert report.steps == 6 and report.measured_steps == 6


def test_evaluation_and_teardown_are_counted_apart(default_fit: tuple[Report, int]) -> None:
    report, _ = default_fit
    # eval_steps=3 over 6 steps: two evaluations of 2 batches each.
    assert _apart(report, "validate") > 0
    assert _apart(report, "teardown") == 1  # train_loss after the last step
    for site in report.sites:
        apart = sum(n for p, n in site.phases if p in ("validate", "teardown"))
        assert site.step_count + site.setup_count + apart == site.count, site
    eval_only = [s for s in report.sites if dict(s.mechanisms).get("eval_to_cpu")]
    assert eval_only and all(s.step_count == 0 for s in eval_only)
    assert not any(v.step > 6 for v in report.violations)


def test_framework_sites_are_named_with_why_and_fix(default_fit: tuple[Report, int]) -> None:
    report, _ = default_fit
    by_mechanism = {name.split(" (", 1)[0]: s for s in report.sites for name, _ in s.mechanisms}
    assert {"send_to_device", "packed_sequence_check", "loss_nan_filter", "hf_logging"} <= set(
        by_mechanism
    )
    nan = by_mechanism["loss_nan_filter"]
    assert nan.framework_function == "_run_epoch" and nan.kind == "bool"
    assert nan.per_step == pytest.approx(2.0 * 5 / 6)  # two reads per step, step 1 is setup
    assert "logging_nan_inf_filter=False" in nan.fix and "NaN" in nan.cause
    assert "use_cache=True" in by_mechanism["packed_sequence_check"].fix
    assert "non_blocking" in by_mechanism["send_to_device"].fix
    # Distinct framework lines behind the one user line are distinct sites.
    assert len({s.key for s in report.sites}) == len(report.sites)
    assert len({s.framework_line for s in report.sites if s.framework_line}) >= 5


def test_steps_come_from_the_callback_with_no_optimizer_hook(tmp_path: Path) -> None:
    # The Trainer's step end makes the steps: the guard hooks no optimizer step; a capture
    # probe asks for the Trainer's optimizer instead.
    cb = barrierguard.HFBarrierGuard(policy="record", print_report=False, memory=False)
    seen: list[tuple[int, bool]] = []

    class Look(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            assert cb.guard is not None
            source = cb.guard._optimizer_source
            found = list(source()) if source is not None else []
            seen.append((guard_step_hooks(), found == [kwargs["optimizer"]]))

    trainer(tmp_path, [cb, Look()]).train()
    assert len(seen) == cb.report.steps == 6
    assert set(seen) == {(0, True)}


def test_an_optimizer_without_weak_references_is_held_for_the_run() -> None:
    # The Trainer's optimizer is held weakly for a capture probe; one that takes no weak
    # reference is held for the run instead, and the run starts all the same.
    cb = barrierguard.HFBarrierGuard(
        policy="record", print_report=False, save_report=False, memory=False
    )

    class Slotted:
        __slots__ = ("param_groups",)

    opt = Slotted()
    opt.param_groups = []
    cb.on_train_begin(None, None, None, optimizer=opt)
    try:
        assert cb.guard is not None and cb.guard.is_running
        source = cb.guard._optimizer_source
        assert source is not None and list(source()) == [opt]
    finally:
        cb.guard.stop()


def test_weights_are_identical_with_and_without_the_callback(tmp_path: Path) -> None:
    plain = trainer(tmp_path / "a")
    plain.train()
    cb = barrierguard.HFBarrierGuard(policy="record", print_report=False, save_report=False)
    watched = trainer(tmp_path / "b", [cb])
    watched.train()
    for (name, a), (_, b) in zip(
        plain.model.state_dict().items(), watched.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert cb.guard is not None and not cb.guard.is_running


def test_a_fit_configured_by_the_hints_has_no_step_sync_with_a_fix(tmp_path: Path) -> None:
    # No callback: the guard still knows the Trainer's phases from the stack.
    guard = barrierguard.watch(policy="error", memory=False, allow=["mechanism:hf_logging"])
    with guard:
        trainer(tmp_path, **HINTED).train()
    report = guard.report
    assert report.ok and report.steps == 6
    hot = [s for s in report.sites if s.step_count and not s.allowed]
    assert hot == []
    left = _mechanisms(report)
    assert "loss_nan_filter" not in left and "packed_sequence_check" not in left
    assert "send_to_device" not in left
    assert _apart(report, "teardown") == 1 and _apart(report, "validate") > 0


def test_the_default_fit_fails_the_error_policy_at_a_step(tmp_path: Path) -> None:
    with (
        pytest.raises(barrierguard.SyncError, match="Fix: "),
        barrierguard.watch(policy="error", memory=False),
    ):
        trainer(tmp_path).train()


def test_bad_options_are_named(tmp_path: Path) -> None:
    with pytest.raises(BarrierGuardError, match=r"HFBarrierGuard\(policy='loud'\)"):
        barrierguard.HFBarrierGuard(policy="loud")
    with pytest.raises(BarrierGuardError, match="save_report=3"):
        barrierguard.HFBarrierGuard(save_report=3)
    with pytest.raises(TypeError, match="print_reports"):
        barrierguard.HFBarrierGuard(print_reports=False)
    assert isinstance(barrierguard.HFBarrierGuard(), transformers.TrainerCallback)
    assert isinstance(barrierguard.HFBarrierGuard(), barrierguard.HFBarrierGuard)


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "barrierguard.integrations.hf_callback", raising=False)
    monkeypatch.delitem(vars(barrierguard), "HFBarrierGuard", raising=False)  # not via __getattr__
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'barrierguard\[hf\]'"):
        barrierguard.HFBarrierGuard()


def test_import_barrierguard_does_not_import_transformers() -> None:
    import subprocess

    code = "import sys, barrierguard; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_rank_reports_are_written_for_an_offline_merge(tmp_path: Path) -> None:
    cb = barrierguard.HFBarrierGuard(
        policy="record", print_report=False, memory=False, rank_reports=True, merge_ranks=False
    )
    trainer(tmp_path, [cb], steps=2, eval_strategy="no").train()
    assert cb.rank_report_path == str(tmp_path / "barrierguard_report.rank0.json")
    assert Report.load(cb.rank_report_path).steps == 2
    assert cb.report_path is None  # no merge asked for
    with pytest.raises(BarrierGuardError, match=r"merge_ranks=False.*rank_reports=True"):
        barrierguard.HFBarrierGuard(merge_ranks=False)
    with pytest.raises(BarrierGuardError, match="rank_reports=3"):
        barrierguard.HFBarrierGuard(rank_reports=3)
