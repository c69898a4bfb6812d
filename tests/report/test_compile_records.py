"""The compile section and a site's compile fields: JSON, old reports, console and HTML."""

from __future__ import annotations

from barrierguard.report.records import (
    CaptureProbe,
    CompileReport,
    CudagraphSkip,
    GraphBreak,
    Report,
    Site,
)
from barrierguard.report.render import console, html

SITE = Site(
    file="/w/train.py",
    line=12,
    function="step",
    code="v = loss.item()",
    kind="item",
    origin="user",
    count=3,
    step_count=3,
    per_step=1.0,
    graph_break="Unsupported Tensor.item() call with capture_scalar_outputs=False",
    graph_break_id="gb0124",
    compile_flag="capture_scalar_outputs",
)
SECTION = CompileReport(
    graph_breaks=(
        GraphBreak("/w/train.py", 12, SITE.graph_break, gb="gb0124", sync=True),
        GraphBreak("/w/train.py", 20, "Call to `torch._dynamo.graph_break()`", count=2),
    ),
    cudagraph_skips=(CudagraphSkip("cpu device (arg3_1)", "/w/train.py", 30, "loss_fn"),),
    compile_syncs=25,
    probe=CaptureProbe(
        "blocked",
        reason="RuntimeError: operation not permitted when stream is capturing",
        file="/w/train.py",
        line=12,
        code="v = loss.item()",
        captured="one call of step",
    ),
)
REPORT = Report(
    engine="cuda",
    detection=True,
    policy="record",
    steps=3,
    measured_steps=3,
    sites=(SITE,),
    compile=SECTION,
)


def test_round_trip_and_old_reports_load() -> None:
    data = REPORT.to_dict()
    assert data["compile"]["verdict"] == SECTION.verdict
    assert data["sites"][0]["graph_break_id"] == "gb0124"
    assert Report.from_dict(data) == REPORT
    plain = Report(
        engine="cuda",
        detection=True,
        policy="record",
        sites=(
            Site(
                file="/w/t.py", line=1, function="f", code="", kind="item", origin="user", count=1
            ),
        ),
    )
    old = plain.to_dict()
    assert "compile" not in old and "graph_break" not in old["sites"][0]
    assert Report.from_dict(old).compile is None


def test_verdict_names_breaks_skips_and_the_probe() -> None:
    assert SECTION.verdict == (
        "compile: 2 graph breaks in the watched code (train.py:12, train.py:20); "
        "CUDA graphs skipped (cpu device (arg3_1) at train.py:30); "
        "the step is not capturable: first blocked at train.py:12"
    )
    capturable = CompileReport(probe=CaptureProbe("capturable"))
    assert capturable.verdict == (
        "compile: no graph break in the watched code; the step is capturable"
    )


def test_console_shows_the_consequence_beside_the_site_and_the_section() -> None:
    text = console.render(REPORT)
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if "train.py:12" in ln and "item" in ln)
    assert lines[at + 1].strip() == (
        "compile: graph break [gb0124]: Unsupported Tensor.item() call with "
        "capture_scalar_outputs=False; torch._dynamo.config.capture_scalar_outputs = True "
        "keeps it in the graph, but the sync still happens each time the compiled code runs"
    )
    assert SECTION.verdict in lines
    assert "    train.py:20 (2x): Call to `torch._dynamo.graph_break()`" in lines
    assert "  CUDA graphs skipped at train.py:30: cpu device (arg3_1)" in lines
    assert "    first blocked at train.py:12: v = loss.item()" in lines
    assert (
        "  25 syncs while compiling (tracing, inductor, autotuning), counted apart from the steps"
        in lines
    )


def test_html_shows_the_verdict_and_the_consequence() -> None:
    page = html.render(REPORT)
    assert '<p id="compile-verdict">compile: 2 graph breaks' in page
    assert "compile: graph break [gb0124]" in page
    assert "CUDA graphs skipped at train.py:30" in page
