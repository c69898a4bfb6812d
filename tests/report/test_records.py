"""Reports: JSON round trip, files, and errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import barrierguard
from _samples import site
from barrierguard import Report, Violation


def _report() -> Report:
    sites = (
        site(
            code="running += loss.item()",
            count=11,
            setup_count=1,
            step_count=10,
            per_step=1.0,
            steps=((1, 10),),
            fix="keep it on the device",
        ),
        site(
            line=30,
            function="fit",
            code="trainer.fit(model)",
            kind="copy",
            detail="h2d",
            origin="framework:lightning",
            count=10,
            step_count=10,
            per_step=1.0,
            steps=((1, 5), (7, 11)),
            threads=("MainThread", "pin"),
            framework_file="/site/lightning/fabric/utilities/apply_func.py",
            framework_line=134,
            framework_function="move",
        ),
    )
    return Report(
        engine="cuda",
        detection=True,
        policy="error",
        steps=10,
        measured_steps=10,
        sites=sites,
        violations=(Violation("/w/train.py", 12, "item", "user", 1, "not allowed"),),
        syncs_per_step=(1, 2, 2),
        notes=("a note",),
        duration_s=1.5,
        environment={"torch": "2.13"},
    )


def test_round_trip_through_dict_and_json(tmp_path: Path) -> None:
    report = _report()
    again = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.to_dict() == report.to_dict()
    path = tmp_path / "r.json"
    report.save(path)
    assert Report.load(path).to_dict() == report.to_dict()


def test_json_has_the_documented_fields() -> None:
    d = _report().to_dict()
    assert d["schema"] == "barrierguard.report/1"
    for key in ("engine", "steps", "sites", "violations", "syncs_per_step", "notes"):
        assert key in d
    site = d["sites"][0]
    for key in ("file", "line", "function", "code", "kind", "origin", "count", "stall_s"):
        assert key in site
    assert site["stall_s"] is None
    assert d["total_syncs"] == 21 and d["step_syncs"] == 20


def test_ranked_by_stall_then_step_count() -> None:
    report = _report()
    assert [s.line for s in report.ranked()] == [12, 30]
    slow = report.sites[1].__class__(**{**report.sites[1].__dict__, "stall_s": 0.5})
    assert [s.line for s in report.with_sites([report.sites[0], slow]).ranked()] == [30, 12]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"schema": "barrierguard.report/9"}', "schema 'barrierguard.report/9' is not supported"),
        ('{"schema": "barrierguard.report/1"}', "malformed report"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(barrierguard.BarrierGuardError) as info:
        Report.load(path)
    assert str(path) in str(info.value) and needle in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(barrierguard.BarrierGuardError, match="no such report file"):
        Report.load(tmp_path / "nope.json")


def test_binary_file_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(barrierguard.BarrierGuardError, match="not JSON"):
        Report.load(path)
