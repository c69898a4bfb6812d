"""The Lightning callback: steps, phases, Lightning's mechanisms, figures, resume, DDP."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import barrierguard
from _leaks import guard_step_hooks
from _lightning_helpers import TinyModule, fit, loaders, trainer
from barrierguard import BarrierGuardError, Report
from barrierguard.detect import audit_provenance
from barrierguard.detect.frames import _OWN_EXCEPTIONS, USER, _classifier

pl = pytest.importorskip("lightning.pytorch")
from barrierguard.integrations import lightning_callback as _lightning  # noqa: E402  (needs Lightning)

HERE = os.path.abspath(__file__)


def _by_mechanism(report: Report) -> dict[str, int]:
    total: dict[str, int] = {}
    for site in report.sites:
        for name, n in site.mechanisms:
            base = name.split(" (")[0]
            total[base] = total.get(base, 0) + n
    return total


def test_import_barrierguard_does_not_import_lightning() -> None:
    code = (
        "import sys, barrierguard; print('lightning' in sys.modules); "
        "barrierguard.BarrierGuard; print('lightning' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    # The name is the real class: Lightning is imported when it is first used.
    assert out.stdout.split() == ["False", "True"]


def test_instance_is_a_lightning_callback() -> None:
    cb = barrierguard.BarrierGuard(policy="record")
    assert isinstance(cb, barrierguard.BarrierGuard)
    assert isinstance(cb, pl.Callback)
    assert cb.report.steps == 0
    assert cb.guard is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"polcy": "record"}, TypeError, "did you mean 'policy'"),
        ({"policy": "loud"}, BarrierGuardError, "policy"),
        ({"engine": "gpu"}, BarrierGuardError, "engine"),
        ({"print_report": "yes"}, BarrierGuardError, "print_report='yes'"),
        ({"save_report": 3}, BarrierGuardError, "save_report=3"),
        ({"warmup_steps": -1}, BarrierGuardError, "warmup_steps"),
        ({"rank_reports": 3}, BarrierGuardError, "rank_reports=3"),
        ({"merge_ranks": "no"}, BarrierGuardError, "merge_ranks='no'"),
        ({"merge_ranks": False}, BarrierGuardError, "also pass rank_reports=True"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        barrierguard.BarrierGuard(**kwargs)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, TinyModule, Path]:
    root = tmp_path_factory.mktemp("fit")
    cb = barrierguard.BarrierGuard(policy="record")
    # Lightning copies batches with non_blocking=True on a GPU, which blocks
    # only for pageable batches above the driver's staging size: these small
    # batches stand in for large ones.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(audit_provenance, "PAGEABLE_BLOCKING_BYTES", 0)
        model = fit(root, [cb])
    return cb, model, root


def test_small_pageable_batches_do_not_block(tmp_path: Path) -> None:
    cb = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
    fit(tmp_path, [cb], max_epochs=1)
    assert "batch_transfer" not in _by_mechanism(cb.report)


def test_fit_counts_training_batches_and_marks_epochs(fitted: Any) -> None:
    cb, _, _ = fitted
    report = cb.report
    assert report.engine == "audit"
    assert report.steps == 8  # 2 epochs x 4 training batches; validation is not a step
    assert report.epochs == (0, 4)
    assert len(report.syncs_per_step) == 9


def test_user_and_lightning_sites(fitted: Any) -> None:
    cb, _, _ = fitted
    report = cb.report
    user = [s for s in report.sites if s.origin == "user"]
    assert [(os.path.basename(s.file), s.function, s.kind) for s in user] == [
        ("_lightning_helpers.py", "training_step", "item")
    ]
    assert user[0].count == 2 and not user[0].mechanisms
    mechanisms = _by_mechanism(report)
    # The batch copy (2 tensors per batch), prog_bar conversions, logger conversions.
    assert mechanisms["batch_transfer"] >= 16
    assert mechanisms["prog_bar"] >= 8
    assert mechanisms["logger"] >= 4
    assert all(s.origin == "framework:lightning" for s in report.sites if s.mechanisms)
    copy = next(
        s for s in report.sites if any(m.startswith("batch_transfer") for m, _ in s.mechanisms)
    )
    assert "pin_memory=True" in copy.fix
    item = next(s for s in report.sites if any(m.startswith("prog_bar") for m, _ in s.mechanisms))
    assert "prog_bar" in item.fix


class _Evaluated(TinyModule):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.layer(batch[0]).sum().item()  # THE-EVAL-ITEM

    def predict_step(self, batch: Any, batch_idx: int) -> float:
        return self.layer(batch[0]).sum().item()  # THE-EVAL-ITEM


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_a_test_or_predict_run_is_its_own_phase(tmp_path: Path, stage: str) -> None:
    cb = barrierguard.BarrierGuard(policy="error", print_report=False, save_report=False)
    _, val = loaders()
    getattr(trainer(tmp_path, [cb]), stage)(_Evaluated(), val)
    site = next(s for s in cb.report.sites if "THE-EVAL-ITEM" in (s.code or ""))
    assert site.phases == ((stage, 2),)  # two batches, apart from steps and the policy
    assert site.step_count == 0 and not cb.report.violations


def test_phases_keep_validation_apart(fitted: Any) -> None:
    cb, _, _ = fitted
    report = cb.report
    phases: dict[str, int] = {}
    for site in report.sites:
        for name, n in site.phases:
            phases[name] = phases.get(name, 0) + n
    assert phases["validate"] > 0 and phases["sanity"] > 0 and phases["train"] > 0
    for site in report.sites:
        counted = dict(site.phases)
        # Validation syncs are counted apart: neither setup nor steps.
        apart = counted.get("validate", 0) + counted.get("teardown", 0)
        assert site.count == site.setup_count + site.step_count + apart
    assert sum(report.syncs_per_step) == sum(
        s.count - dict(s.phases).get("validate", 0) - dict(s.phases).get("teardown", 0)
        for s in report.sites
        if s.blocking
    )


def test_report_saved_in_log_dir_and_printed(
    fitted: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cb, _, root = fitted
    assert cb.report_path == os.path.join(str(root), "logs", "version_0", _lightning.REPORT_NAME)
    saved = Report.load(cb.report_path)
    assert saved == Report.from_dict(cb.report.to_dict())
    assert saved.sites and saved.epochs == (0, 4)


def test_figures_reach_the_logger_without_a_sync(fitted: Any) -> None:
    _, _, root = fitted
    with open(os.path.join(root, "logs", "version_0", "metrics.csv"), encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("barrierguard/syncs_per_step")]
    assert len(rows) == 2  # one per epoch
    assert all(float(r["barrierguard/syncs_per_step"]) > 0 for r in rows)


def test_callback_itself_adds_no_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Make the callback's own file count as user code: a sync it caused (a
    # tensor read for the figures, a self.log of a Python number) would then be
    # reported at a line of _lightning.py.
    monkeypatch.setitem(_OWN_EXCEPTIONS, os.path.abspath(_lightning.__file__), (USER, ""))
    monkeypatch.setattr(_classifier, "_cache", {})
    cb = barrierguard.BarrierGuard(policy="record", print_report=False)
    fit(tmp_path, [cb], max_epochs=1)
    files = {os.path.basename(s.file) for s in cb.report.sites}
    assert "_lightning.py" not in files
    assert "_lightning_helpers.py" in files  # the classification patch did not hide the user


def test_steps_come_from_the_callback_with_no_optimizer_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's batch end makes the steps: the guard hooks no optimizer step (it would only
    # cost each step). A capture probe asks the trainer for its optimizers instead, to put
    # their parameters' gradients back.
    from barrierguard.session import capture

    given: list[list[Any]] = []

    def probe(fn: Any, args: Any, kwargs: Any, params: Any, skips: Any) -> Any:
        given.append(list(params))
        return capture.CaptureProbe(status="not run", reason="a stand-in")

    monkeypatch.setattr(capture, "probe", probe)
    cb = barrierguard.BarrierGuard(policy="record", print_report=False, memory=False)
    hooks: list[int] = []

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            hooks.append(guard_step_hooks())
            if len(hooks) == 3:
                assert cb.guard is not None
                cb.guard.probe_capture(lambda: None)

    model = fit(tmp_path, [cb, Look()], max_epochs=1)
    assert len(hooks) == cb.report.steps > 3
    assert set(hooks) == {0}
    assert len(given) == 1
    assert {id(p) for p in given[0]} == {id(p) for p in model.parameters()}


def test_weights_identical_with_and_without_the_callback(tmp_path: Path, fitted: Any) -> None:
    _, with_cb, _ = fitted
    without = fit(tmp_path, [])
    for (name, a), (_, b) in zip(
        with_cb.state_dict().items(), without.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resume_keeps_the_counts(tmp_path: Path) -> None:
    first = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
    t1 = trainer(tmp_path, [first], max_epochs=1)
    model = TinyModule()
    train, val = loaders()
    t1.fit(model, train, val)
    ckpt = tmp_path / "one.ckpt"
    t1.save_checkpoint(ckpt)
    before = first.report
    assert before.steps == 4

    second = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
    t2 = trainer(tmp_path, [second], max_epochs=2)
    t2.fit(TinyModule(), train, val, ckpt_path=str(ckpt))
    after = second.report
    assert after.steps == 8
    assert after.epochs == (0, 4)
    old = {s.key: s.count for s in before.sites}
    new = {s.key: s.count for s in after.sites}
    assert all(new[k] >= n for k, n in old.items())  # nothing lost
    assert sum(new.values()) > sum(old.values())
    prog_bar = _by_mechanism(after)["prog_bar"]
    assert prog_bar > _by_mechanism(before)["prog_bar"]


def test_load_state_dict_without_report_is_an_error() -> None:
    cb = barrierguard.BarrierGuard(policy="record")
    with pytest.raises(BarrierGuardError, match="state_dict"):
        cb.load_state_dict({})


def test_exception_in_fit_restores_and_keeps_the_report(tmp_path: Path) -> None:
    class Boom(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    cb = barrierguard.BarrierGuard(policy="record", print_report=False, save_report=False)
    train, val = loaders()
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, [cb]).fit(Boom(), train, val)
    assert cb.guard is not None and not cb.guard.is_running
    assert cb.report.steps == 2


def test_rank_reports_without_the_merge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cb = barrierguard.BarrierGuard(
        policy="record", rank_reports=True, merge_ranks=False, save_report=False
    )
    fit(tmp_path, [cb], max_epochs=1)
    # One process: no rank suffix is needed, but the file name says which rank.
    path = tmp_path / "barrierguard_report.rank0.json"
    assert cb.rank_report_path == str(path)
    assert Report.load(path).to_dict() == cb.report.to_dict()
    assert "barrierguard report" in capsys.readouterr().out
