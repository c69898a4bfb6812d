"""The console table, compared exactly against a report built by hand."""

from __future__ import annotations

from _samples import site
from barrierguard import Report, Site
from barrierguard.report.render.console import render


def test_console_table_exact() -> None:
    report = Report(
        engine="cuda",
        detection=True,
        policy="warn",
        steps=4,
        measured_steps=4,
        duration_s=0.5,
        sites=(
            site(
                line=7,
                rule="BG101",
                count=5,
                setup_count=1,
                step_count=4,
                per_step=1.0,
                fix="keep it on the device",
            ),
            site(
                line=3,
                code="model.to(dev)",
                kind="copy",
                detail="h2d",
                count=2,
                setup_count=2,
                step_count=0,
                fix="pin it",
            ),
        ),
    )
    assert render(report).splitlines() == [
        "barrierguard report: engine cuda (CUDA sync-debug mode + intercepted calls), policy warn",
        "  steps 4 (warm-up 0, measured 4) | syncs in measured steps 4 (1.00 per step) | setup syncs 3 (1 at lines also in the steps) | 0.50 s",
        "",
        "in the measured steps (ranked by cost):",
        "  #  where       rule   kind  origin  count  /step  stall ms  code",
        "  1  train.py:7  BG101  item  user    4      1.00   -         loss.item()",
        "       also 1 in setup and warm-up",
        "       fix: keep it on the device",
        "",
        "setup, warm-up, and phases counted apart (validation, checkpoints, teardown, after the loop; never counted against the policy):",
        "  #  where       rule  kind      origin  count  /step  stall ms  code",
        "  1  train.py:3  -     copy/h2d  user    2      -      -         model.to(dev)",
    ]


def test_framework_sites_say_why_and_show_phases_counted_apart() -> None:
    report = Report(
        engine="cuda",
        detection=True,
        policy="warn",
        steps=2,
        measured_steps=2,
        sites=(
            site(
                file="/w/fit.py",
                line=9,
                function="main",
                code="trainer.fit(model)",
                origin="framework:lightning",
                count=5,
                step_count=2,
                per_step=1.0,
                cause="values logged with prog_bar=True are converted",
                fix="prog_bar: self.log(..., prog_bar=False)",
                framework_file="/sp/lightning/pytorch/trainer/connectors/logger_connector/result.py",
                framework_line=492,
                framework_function="metrics",
                phases=(("train", 2), ("validate", 3)),
            ),
            site(
                file="/w/fit.py",
                line=9,
                function="main",
                code="trainer.fit(model)",
                kind="copy",
                detail="d2h",
                origin="framework:lightning",
                count=31,
                step_count=0,
                phases=(("teardown", 31),),
                fix="model_to_device: no setting removes it: once per run",
            ),
        ),
    )
    lines = render(report).splitlines()
    assert lines[5:10] == [
        "  1  fit.py:9  -     item  framework:lightning  2      1.00   -         trainer.fit(model)",
        "       inside ...ing/pytorch/trainer/connectors/logger_connector/result.py:492 (metrics)",
        "       why: values logged with prog_bar=True are converted",
        "       also counted apart: validate 3",
        "       fix: prog_bar: self.log(..., prog_bar=False)",
    ]
    assert lines[-3:] == [
        "  #  where     rule  kind      origin               count  /step  stall ms  code",
        "  1  fit.py:9  -     copy/d2h  framework:lightning  31     -      -         trainer.fit(model)",
        "       counted apart: teardown 31",
    ]


def test_no_detection_is_said_plainly() -> None:
    text = render(Report(engine="none", detection=False, policy="record", notes=("why",)))
    assert "no detection ran" in text
    assert text.endswith("note: why")


def test_ranks_section() -> None:
    from _samples import merged_report

    text = render(merged_report(2)).splitlines()
    start = text.index(
        "ranks (2): the gating site is train.py:42 (item, rank 0 only): the other ranks wait "
        "about 4.00 ms per step at the next collective"
    )
    assert text[start + 1 : start + 5] == [
        "  rank  steps  syncs/step  stall ms/step  step ms host  device  waits",
        "  0     10     1.00        4.00           14.00         8.00    0.00 ms",
        "  1     10     0.00        -              10.00         8.00    4.00 ms (40% of its step)",
        "  median step per rank (the longer of host and device): 10.00 ms (fastest) to "
        "14.00 ms (slowest)",
    ]
    assert (
        "       rank-asymmetric: fires on rank 0 only (of 2); every other rank waits about "
        "4.00 ms per step for it [gating site]"
    ) in text


def test_many_ranks_are_cut_short() -> None:
    from _samples import merged_report

    text = render(merged_report(20))
    assert "  ... and 4 more ranks (rank_summaries in the JSON)" in text
    assert "rank 0 only (of 20)" in text


def test_the_setup_count_adds_up_across_header_tables_and_html() -> None:
    import re

    from barrierguard.report.render.html import render as render_html

    sites = tuple(
        Site(
            file="/w/demo.py",
            line=line,
            function="train",
            code=f"line {line}",
            kind="copy",
            origin="user",
            count=setup + steps,
            setup_count=setup,
            step_count=steps,
            per_step=steps / 30,
        )
        for line, setup, steps in ((24, 4, 0), (30, 1, 29), (31, 1, 29))
    )
    report = Report(
        engine="audit", detection=True, policy="record", steps=30, measured_steps=30, sites=sites
    )
    text = render(report)
    header = re.search(r"setup syncs (\d+) \((\d+) at lines also in the steps\)", text)
    assert header is not None
    total, shared = int(header.group(1)), int(header.group(2))
    also = sum(int(n) for n in re.findall(r"also (\d+) in setup and warm-up", text))
    setup_table = text.split("never counted against the policy):")[1].splitlines()[2:]
    cold = sum(int(row.split()[5]) for row in setup_table if row.strip()[:1].isdigit())
    assert (total, shared, also, cold) == (6, 2, 2, 4)
    assert total == shared + cold
    assert '<b>6</b><span class="small">setup syncs</span>' in render_html(report)
