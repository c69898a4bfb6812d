"""The report JSON, pinned: a committed rich report reads back and writes out unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

from barrierguard import Report

GOLDEN = Path(__file__).parent / "data" / "rich_report.json"
SCHEMA_DOC = Path(__file__).parents[2] / "docs" / "report-schema.md"


def test_load_then_save_gives_the_file_back(tmp_path: Path) -> None:
    report = Report.load(GOLDEN)
    out = tmp_path / "again.json"
    report.save(out)
    assert out.read_text() == GOLDEN.read_text()
    assert Report.load(out) == report


def test_the_golden_report_is_rich() -> None:
    report = Report.load(GOLDEN)
    assert report.memory is not None and report.memory.leak
    assert report.timeline is not None and None in report.timeline.device_s
    assert [r.rank for r in report.ranks] == [0, 1]
    assert report.ranks[0].memory == report.memory
    assert report.gating_site is not None and report.gating_site.job_cost_s
    assert [s.wait_s for s in report.rank_summaries] == [report.gating_site.job_cost_s, 0.0]
    assert report.violations[1].thread == "Thread-2"
    framework = next(s for s in report.sites if s.origin != "user")
    assert framework.phases == (("sanity", 4), ("train", 12))
    assert framework.rank_counts == ((0, 8), (1, 8))
    assert next(s for s in report.sites if s.line == 31).events == 164
    assert report.sites[0].steps and isinstance(report.sites[0].steps[0], tuple)


def _documented(section: str) -> set[str]:
    text = SCHEMA_DOC.read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([a-z_]+)`", body))


def test_every_key_written_is_documented() -> None:
    data = json.loads(GOLDEN.read_text())
    assert set(data) <= _documented("Top level")
    # cause and events predate this test undocumented; it keeps them from being joined.
    site_keys = _documented("A site") | {"cause", "events"}
    assert {k for s in data["sites"] for k in s} <= site_keys
    assert {k for s in data["rank_summaries"] for k in s} <= _documented("A rank summary")
    assert set(data["timeline"]) <= _documented("`timeline`")
    assert set(data["memory"]) <= _documented("`memory`") | {"verdict_series", "warmup_steps"}
    assert set(data["violations"][0]) <= _documented("A violation")
