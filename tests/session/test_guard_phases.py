"""Guard phases and mechanism annotations, as framework adapters set them."""

from __future__ import annotations

import pytest

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
    guard._phase = phase
    guard._record(Sync(LOC, "logger", None), 1)
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
    guard._phase = adapter
    guard._record(Sync(LOC, None, stack), 1)
    assert guard.report.sites[0].phases == ((counted, 1),)
