"""Guard phases and mechanism annotations, as framework adapters set them."""

from __future__ import annotations

import os

import pytest
import torch

import barrierguard
from barrierguard.detect.frames import Location
from barrierguard.detect.stack import Sync

LOC = Location("/w/train.py", 7, "main", "item", "", "user")


@pytest.mark.parametrize(
    ("phase", "in_steps"),
    [("train", True), (None, True), ("sanity", True), ("validate", False), ("test", False)],
)
def test_apart_phases_stay_out_of_steps_and_policy(phase: str | None, in_steps: bool) -> None:
    guard = barrierguard.watch(policy="record", engine="audit", memory=False)
    guard.step()
    guard.set_phase(phase)
    guard.record(Sync(LOC, "logger", None), 1)
    guard.step()  # closes step 1: the verdict on a site first seen there is given here
    report = guard.report
    (site,) = report.sites
    assert site.count == 1
    assert site.step_count == (1 if in_steps else 0)
    assert len(report.violations) == (1 if in_steps else 0)
    assert report.syncs_per_step[1] == (1 if in_steps else 0)
    assert site.phases == (((phase, 1),) if phase else ())
    assert site.mechanisms == (("logger", 1),)


@pytest.mark.parametrize(
    ("adapter", "stack", "counted"),
    [
        ("train", "checkpoint", "checkpoint"),  # a save inside the training loop
        ("setup", "train", "setup"),  # the adapter's events know the setup hooks
        (None, "validate", "validate"),
        ("teardown", None, "teardown"),
    ],
)
def test_the_stack_phase_wins_but_for_plain_training(
    adapter: str | None, stack: str | None, counted: str
) -> None:
    guard = barrierguard.watch(policy="record", engine="audit", memory=False)
    guard.set_phase(adapter)
    guard.record(Sync(LOC, None, stack), 1)
    assert guard.report.sites[0].phases == ((counted, 1),)


def _framework_file(path: str, src: str) -> dict[str, object]:
    namespace: dict[str, object] = {}
    exec(compile(src, os.path.join(os.sep, "sp", "site-packages", path), "exec"), namespace)
    return namespace


def test_a_framework_sync_from_two_user_lines_is_two_sites_with_their_phases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from barrierguard.detect import frameworks

    monkeypatch.setattr(frameworks, "PHASE_PACKAGES", ("sys",))
    metrics = _framework_file(
        "lightning/pytorch/trainer/connectors/logger_connector/result.py",
        "def metrics(t):\n    return t.item()\n",
    )["metrics"]
    run = _framework_file(
        "lightning/pytorch/loops/fit_loop.py", "def run(inner):\n    return inner()\n"
    )["run"]
    device = torch.device("cpu")

    def deep(n: int, t: torch.Tensor) -> object:
        return metrics(t) if n == 0 else deep(n - 1, t)  # type: ignore[operator]

    with barrierguard.watch(policy="record", engine="audit", memory=False) as guard:
        x = torch.ones(1).to(device)
        for _ in range(3):
            metrics(x)  # type: ignore[operator]
            metrics(x)  # type: ignore[operator]
            run(lambda: deep(40, x))  # type: ignore[operator]
        guard.step()
    items = [s for s in guard.report.sites if s.kind == "item"]
    sites = sorted(items, key=lambda s: (s.function, s.line))
    assert [(s.function, s.count) for s in sites] == [
        ("deep", 3),
        (_THIS, 3),
        (_THIS, 3),
    ]
    assert sites[1].line != sites[2].line
    assert all(s.mechanisms == (("prog_bar", 3),) for s in sites)
    assert sites[0].phases == (("train", 3),)
    assert sites[1].phases == sites[2].phases == ()


_THIS = "test_a_framework_sync_from_two_user_lines_is_two_sites_with_their_phases"
