"""The console table, compared exactly against a report built by hand."""

from __future__ import annotations

from barrierguard import Report, Site
from barrierguard._render.console import render


def test_console_table_exact() -> None:
    report = Report(
        engine="cuda",
        detection=True,
        policy="warn",
        steps=4,
        measured_steps=4,
        duration_s=0.5,
        sites=(
            Site(
                file="/w/train.py",
                line=7,
                function="train",
                code="loss.item()",
                kind="item",
                origin="user",
                count=5,
                setup_count=1,
                step_count=4,
                per_step=1.0,
                fix="keep it on the device",
            ),
            Site(
                file="/w/train.py",
                line=3,
                function="train",
                code="model.to(dev)",
                kind="copy",
                detail="h2d",
                origin="user",
                count=2,
                setup_count=2,
                fix="pin it",
            ),
        ),
    )
    assert render(report).splitlines() == [
        "barrierguard report: engine cuda (CUDA sync-debug mode + intercepted calls), policy warn",
        "  steps 4 (warm-up 0, measured 4) | syncs in measured steps 4 (1.00 per step) | setup syncs 3 | 0.50 s",
        "",
        "in the measured steps (ranked by cost):",
        "  #  where       kind  origin  count  /step  stall ms  code",
        "  1  train.py:7  item  user    4      1.00   -         loss.item()",
        "       fix: keep it on the device",
        "",
        "setup and warm-up only (never counted against the policy):",
        "  #  where       kind      origin  count  /step  stall ms  code",
        "  1  train.py:3  copy/h2d  user    2      -      -         model.to(dev)",
    ]


def test_no_detection_is_said_plainly() -> None:
    text = render(Report(engine="none", detection=False, policy="record", notes=("why",)))
    assert "no detection ran" in text
    assert text.endswith("note: why")
