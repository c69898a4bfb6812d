"""The HTML report: self-contained, escaped, with its table and charts."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from _samples import sample_memory, sample_report
from barrierguard import MemoryReport, Report
from barrierguard.report.render.html import render


def test_page_is_self_contained() -> None:
    page = render(replace(sample_report(), memory=sample_memory()))
    for needle in ("<link", " src=", "href=", "@import", "url(", "https://", "//cdn"):
        assert needle not in page
    # The one URL is the SVG namespace, which names, never fetches.
    assert set(re.findall(r"http://[^\"']+", page)) == {"http://www.w3.org/2000/svg"}


def test_code_and_fixes_are_escaped() -> None:
    page = render(sample_report())
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "fix: &lt;b&gt;no&lt;/b&gt;" in page
    assert page.count("<script>") == 1  # only our own sorting script


def test_table_rows_are_ranked_with_sort_keys() -> None:
    report = sample_report()
    page = render(report)
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", page.split("<tbody>")[1])
    assert len(rows) == len(report.sites)
    codes = [re.search(r"<code>(.*?)</code>", r).group(1) for r in rows]  # type: ignore[union-attr]
    assert codes[0] == "if (pred &gt; 0.9).any():"  # ranked by stall time first
    assert 'data-sort="81"' in rows[0]
    assert "inside module.py:512 (log)" in page
    assert "[allowed]" in page


def test_syncs_chart_has_a_bar_per_step() -> None:
    report = sample_report(steps=40)
    page = render(report)
    bars = re.findall(r'<rect class="bar"[^>]*data-step="(\d+)" data-syncs="(\d+)"', page)
    assert [int(s) for s, _ in bars] == list(range(41))
    assert [int(n) for _, n in bars] == list(report.syncs_per_step)
    assert '<div class="empty" id="no-memory">no memory samples in this report</div>' in page


@pytest.mark.parametrize(
    "memory",
    [
        None,
        MemoryReport(),
        MemoryReport(steps=(), series={"a": ()}),
        MemoryReport(steps=(0, 1), series={"a": (1,)}),  # lengths differ
        MemoryReport(steps=(0, 1), series={"a": (None, None)}),
    ],
)
def test_memory_chart_falls_back_on_missing_or_bad_data(memory: MemoryReport | None) -> None:
    page = render(replace(sample_report(), memory=memory))
    assert "no memory samples in this report" in page


def test_memory_chart_from_the_report() -> None:
    page = render(replace(sample_report(), memory=sample_memory()))
    # One panel per series, in the report's order, as Report.save_memory_chart draws them.
    assert re.findall(r'data-series="([a-z_]+)"', page) == ["host_rss", "device_allocated"]
    assert "leak suspected" in page
    assert " GB" in page and "MiB" not in page and "GiB" not in page


@pytest.mark.parametrize(
    ("report", "status"),
    [
        (Report(engine="none", detection=False, policy="warn"), "no detection"),
        (Report(engine="cuda", detection=True, policy="warn"), "policy kept"),
        (sample_report(), "fails at 1 site"),
    ],
)
def test_status_badge(report: Report, status: str) -> None:
    page = render(report)
    assert f'id="status">{status}</span>' in page


def test_empty_reports_say_so() -> None:
    assert "no detection ran" in render(Report(engine="none", detection=False, policy="warn"))
    found = render(Report(engine="cuda", detection=True, policy="warn"))
    assert "no synchronization found" in found
    assert "no per-step series" in found


def test_ranks_table_marks_the_gating_site() -> None:
    from _samples import merged_report

    page = render(merged_report(3))
    ranks = page.split('<table id="ranks">')[1].split("</table>")[0]
    rows = re.findall(r'<tr data-rank="(\d+)">(.*?)</tr>', ranks)
    assert [r for r, _ in rows] == ["0", "1", "2"]
    cells = [re.findall(r'<td class="num">(.*?)</td>', row) for _, row in rows]
    assert cells[0][:5] == ["0", "10", "1.00", "4.00", "14.00"]
    assert cells[0][5] == "8.00"  # the median of the device times known
    assert cells[1][6].startswith("4.00 <span")  # rank 1 waits for rank 0's line
    assert "(40% of its step)" in cells[1][6]
    assert cells[0][6] == "0.00"
    gating = page.split('id="gating">')[1].split("</div>")[0]
    assert "<code>train.py:42</code>" in gating and "rank 0 only" in gating
    assert "4.00 ms per step" in gating
    assert "&lt;{loss.item()}&gt;" in gating  # escaped
    sites = page.split('<table id="sites"')[1].split("</table>")[0]
    assert '<tr class="gating">' in sites
    assert "[rank-asymmetric: rank 0 only, gating site]" in sites


def test_no_ranks_section_for_one_process() -> None:
    page = render(sample_report())
    assert 'id="ranks"' not in page and 'id="gating"' not in page


def _demo_like_report(policy: str) -> Report:
    """Six sites in the steps, 160 violations among them, as a demo run makes."""
    from barrierguard import Site, Violation

    sites = []
    violations = []
    for i, (kind, n) in enumerate(
        [("item", 30), ("index", 30), ("bool", 30), ("copy", 29), ("copy", 29), ("format", 12)]
    ):
        line = 30 + i
        sites.append(
            Site(
                file="/w/demo.py",
                line=line,
                function="train",
                code=f"line {line}",
                kind=kind,
                rule=f"BG{101 + i}",
                origin="user",
                count=n,
                step_count=n,
                per_step=n / 30,
                fix=f"fix {i}",
            )
        )
        violations += [
            Violation("/w/demo.py", line, kind, "user", step, "not allowed") for step in range(n)
        ]
    return Report(
        engine="audit",
        detection=True,
        policy=policy,
        steps=30,
        measured_steps=30,
        sites=tuple(sites),
        violations=tuple(violations),
        notes=("audit engine: no GPU here, so no synchronization was observed",),
    )


@pytest.mark.parametrize("policy", ["record", "error"])
def test_verdict_first_one_row_per_site(policy: str) -> None:
    report = _demo_like_report(policy)
    assert len(report.violations) == 160
    page = render(report)
    verdict = page.split('id="verdict"')[1].split("</div>\n")[0]
    assert len(re.findall(r'<li class="verdict-site">', verdict)) == 6
    assert "demo.py:30</b> item" in verdict and "fix: fix 0" in verdict
    line = re.search(r'<p id="verdict-line">(.*?)</p>', page)
    assert line is not None
    if policy == "error":
        assert line.group(1) == "Policy violations: 160 at 6 site(s), one line per site:"
        assert 'id="status">fails at 6 sites</span>' in page
    else:
        assert line.group(1).startswith("Not allowed (policy record: counted, not enforced")
        assert 'id="status">6 sites not allowed</span>' in page
    # The answer, then the caveat, then the table.
    assert page.index('id="verdict"') < page.index('id="caveat"') < page.index('id="sites"')


def test_memory_verdict_is_on_the_page() -> None:
    from barrierguard import MemoryReport

    memory = MemoryReport(
        steps=(1, 2),
        series={"host_rss": (2_000_000, 3_000_000)},
        verdict_series=("host_rss",),
        slopes={"host_rss": 1e6},
        reason="no verdict: 2 samples after warm-up, 9 needed",
    )
    page = render(Report(engine="audit", detection=True, policy="record", memory=memory))
    assert "Memory: <b>no leak</b> - no verdict: 2 samples" in page
    row = page.split('<table id="memory">')[1].split("</table>")[0]
    assert "<td>not judged</td>" in row and "flat" not in row
