"""Guard phases and mechanism annotations, as framework adapters set them."""

from __future__ import annotations

import pytest

import barrierguard
from barrierguard.detect import frameworks
from barrierguard.detect.frames import Location

LOC = Location("/w/train.py", 7, "main", "item", "", "user")


@pytest.mark.parametrize(
    ("phase", "in_steps"),
    [("train", True), (None, True), ("sanity", True), ("validate", False), ("test", False)],
)
def test_apart_phases_stay_out_of_steps_and_policy(
    phase: str | None, in_steps: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    guard = barrierguard.watch(policy="record", engine="audit", memory=False)
    guard.step()
    guard._phase = phase
    monkeypatch.setattr(frameworks, "annotate", lambda frame: ("logger", None))
    guard._record(LOC, 1)
    guard.step()  # closes step 1: the verdict on a site first seen there is given here
    report = guard.report
    (site,) = report.sites
    assert site.count == 1
    assert site.step_count == (1 if in_steps else 0)
    assert len(report.violations) == (1 if in_steps else 0)
    assert report.syncs_per_step[1] == (1 if in_steps else 0)
    assert site.phases == (((phase, 1),) if phase else ())
    assert site.mechanisms == (("logger", 1),)


def test_a_failing_annotation_is_a_fault_not_a_lost_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    guard = barrierguard.watch(policy="record", engine="audit", memory=False)

    def broken(frame: object) -> tuple[str, str]:
        raise ValueError("nope")

    monkeypatch.setattr(frameworks, "annotate", broken)
    guard._record(LOC, 1)
    report = guard.report
    assert report.sites[0].count == 1
    assert any("ValueError: nope" in n for n in report.notes)
