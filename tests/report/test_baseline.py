"""The ratchet: baselines, matching by code not line, and the check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _fake_cuda import FakeMode
from _gate_helpers import LOOP, run_loop
from _samples import report, site
from barrierguard import BarrierGuardError, Site
from barrierguard.report.baseline import (
    BASELINE_SCHEMA,
    Baseline,
    compare,
    make_baseline,
    normalize_code,
    site_key,
)


def _site(**kw: object) -> Site:
    base: dict[str, object] = {"file": "/repo/pkg/train.py", "line": 10, "count": 4}
    return site(**{**base, "per_step": 1.0, **kw})


_report = report


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("loss.item()", "loss.item()"),
        ("  loss.item()   # log it", "loss.item()"),
        ("x  =   loss.item()", "x = loss.item()"),
        ("print(f'{loss:.2f} # not a comment')", "print(f'{loss:.2f} # not a comment')"),
        ("d['#'] = t.item()  # real", "d['#'] = t.item()"),
        ("foo(a,", "foo(a,"),  # a line cut from a longer statement
        ('"""open docstring', '"""open docstring'),
    ],
)
def test_normalize_code(code: str, expected: str) -> None:
    assert normalize_code(code) == expected


@pytest.mark.parametrize(
    ("file", "root", "expected"),
    [
        ("/repo/pkg/train.py", "/repo", "pkg/train.py"),
        ("/repo/pkg/train.py", "/repo/pkg", "train.py"),
        ("/elsewhere/lib/train.py", "/repo", "train.py"),
        ("/repository/train.py", "/repo", "train.py"),  # a prefix is not a parent
    ],
)
def test_site_key_file_is_relative_to_root_else_basename(
    file: str, root: str, expected: str
) -> None:
    assert site_key(_site(file=file), root) == (expected, "train", "loss.item()", "item")


def test_line_numbers_do_not_matter_code_does() -> None:
    base = make_baseline(_report(_site(line=10)), root="/repo")
    assert not [f for f in compare(base, _report(_site(line=99)), root="/repo") if f.fails]
    # Other code far away is another site; the old one is gone.
    found = compare(base, _report(_site(line=40, code="acc = hits.sum().item()")), root="/repo")
    assert [f.change for f in found] == ["new", "gone"]


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (10, "value = loss.item() * 2"),  # reworded in place
        (13, "value = float(loss.item())"),  # reworded and moved a few lines
        (30, "val = loss.item()"),  # moved further, but alike
    ],
)
def test_an_edited_line_is_matched_by_its_place(line: int, code: str) -> None:
    base = make_baseline(_report(_site(line=10, code="value = loss.item()")), root="/repo")
    found = compare(base, _report(_site(line=line, code=code)), root="/repo")
    assert [f.change for f in found] == ["matched"]
    assert not found[0].fails
    assert "is the baseline's 'value = loss.item()' (line 10)" in found[0].explain()


def test_an_edited_loop_line_that_syncs_more_still_fails() -> None:
    base = make_baseline(_report(_site(code="value = loss.item()")), root="/repo")
    now = _report(_site(code="value = loss.item() + 1", per_step=2.0))
    assert [(f.change, f.fails) for f in compare(base, now, root="/repo")] == [
        ("matched", False),
        ("grew", True),
    ]


def _setup_site(**kw: object) -> Site:
    return _site(**{"step_count": 0, "per_step": 0.0, "setup_count": 4, **kw})


@pytest.mark.parametrize(
    "now",
    [
        _setup_site(code="opt = make_optimizer(model)", line=3),  # a new setup line
        _setup_site(code="model = build().to(device)", line=3),  # twice as many setup lines
        _setup_site(kind="copy", code="x = batch.to(device)", line=3),
    ],
)
def test_sites_outside_the_loop_never_regress(now: Site) -> None:
    base = make_baseline(
        _report(_site(), _setup_site(code="model = build().to(device)", line=2)), root="/repo"
    )
    found = compare(
        base,
        _report(_site(), _setup_site(code="model = build().to(device)", line=2), now),
        root="/repo",
    )
    assert found and not [f for f in found if f.fails]
    assert "outside the loop" in found[0].explain()


def test_a_setup_line_moved_into_the_loop_fails() -> None:
    base = make_baseline(_report(_setup_site()), root="/repo")
    found = compare(base, _report(_site()), root="/repo")
    assert [(f.change, f.fails) for f in found] == [("grew", True)]


@pytest.mark.parametrize(
    ("now", "change"),
    [
        (_site(kind="float"), "new"),
        (_site(function="validate"), "new"),
        (_site(file="/repo/pkg/other.py"), "new"),
        (_site(per_step=1.5), "grew"),
        (_site(per_step=1.0 + 1e-12), None),  # float noise is no regression
        (_site(per_step=0.5), None),
        (_site(allowed=True, kind="float"), None),  # an allowed site never fails
        (_site(blocking=False, kind="async_d2h"), None),  # a race, not a barrier
    ],
)
def test_compare_changes(now: Site, change: str | None) -> None:
    base = make_baseline(_report(_site()), root="/repo")
    found = [f for f in compare(base, _report(now), root="/repo") if f.fails]
    assert [f.change for f in found] == ([change] if change else [])


def test_a_second_identical_line_is_more() -> None:
    base = make_baseline(_report(_site(line=10)), root="/repo")
    found = compare(base, _report(_site(line=10), _site(line=12)), root="/repo")
    assert [f.change for f in found] == ["more"]
    assert "2 lines now, 1 in the baseline" in found[0].explain()


def test_tolerance_admits_small_growth() -> None:
    base = make_baseline(_report(_site(per_step=1.0)), root="/repo")
    grown = _report(_site(per_step=1.2))
    assert [f.change for f in compare(base, grown, root="/repo")] == ["grew"]
    assert compare(base, grown, root="/repo", tolerance=0.25) == []
    with pytest.raises(BarrierGuardError, match=r"tolerance=-1 is not valid"):
        compare(base, grown, tolerance=-1)


def test_baseline_round_trips(tmp_path: Path) -> None:
    base = make_baseline(_report(_site(), _site(kind="float", code="float(x)")), root="/repo")
    path = tmp_path / "b.json"
    base.save(path)
    assert Baseline.load(path) == base
    assert json.loads(path.read_text())["schema"] == BASELINE_SCHEMA


GOLDEN = Path(__file__).parent / "data" / "baseline.json"


def test_golden_baseline_reads_back_and_writes_the_same_bytes(tmp_path: Path) -> None:
    base = Baseline.load(GOLDEN)
    assert (base.engine, base.source, base.schema) == ("cuda", "barrierguard.json", BASELINE_SCHEMA)
    assert [(e.file, e.code, e.lines, e.count, e.line) for e in base.entries] == [
        ("pkg/data.py", "batch = batch.to('cuda')", 1, 3, 7),
        ("pkg/train.py", "if (pred > 0.9).any():", 1, 27, 22),
        ("pkg/train.py", "value = loss.item()", 2, 82, 10),
        ("util.py", "log(f'\u00e9 {float(x)}')", 1, 5, 99),
    ]
    assert base.entries[1].per_step == 2 / 3
    out = tmp_path / "again.json"
    base.save(out)
    assert out.read_bytes() == GOLDEN.read_bytes()
    assert Baseline.load(out) == base


def test_a_baseline_with_only_the_keys_needed_loads() -> None:
    # The optional keys take their defaults; a key this release does not know is ignored.
    base = Baseline.load(GOLDEN.with_name("baseline_minimal.json"))
    assert (base.engine, base.source) == ("", "")
    assert [(e.code, e.kind, e.lines, e.per_step, e.count, e.line) for e in base.entries] == [
        ("value = loss.item()", "item", 1, 0.0, 0, 0),
        ("x.cpu()", "copy", 1, 0.0, 0, 0),
    ]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"schema": "barrierguard.baseline/9", "sites": []}', "schema 'barrierguard.baseline/9'"),
        ('{"sites": []}', "schema None is not supported"),
        ('{"schema": "barrierguard.report/1"}', "this is a report"),
        ('{"schema": "barrierguard.baseline/1", "sites": {}}', "'sites' must be a list"),
        ('{"schema": "barrierguard.baseline/1", "sites": [{"file": "a.py"}]}', "sites[0]"),
        ('{"schema": "barrierguard.baseline/1", "sites": [7]}', "sites[0]"),
    ],
)
def test_bad_baseline_files_name_file_and_problem(
    tmp_path: Path, content: str, problem: str
) -> None:
    path = tmp_path / "bad-baseline.json"
    path.write_text(content)
    with pytest.raises(BarrierGuardError) as info:
        Baseline.load(path)
    assert str(info.value).startswith(str(path))
    assert problem in str(info.value)


def test_missing_baseline_file(tmp_path: Path) -> None:
    with pytest.raises(BarrierGuardError, match="no such baseline file"):
        Baseline.load(tmp_path / "nope.json")


def test_real_run_baseline_keys_by_code(fake_cuda: FakeMode, tmp_path: Path) -> None:
    report = run_loop(tmp_path / "v1", LOOP)
    base = make_baseline(report, root=str(tmp_path / "v1"))
    assert [(e.file, e.function, e.code, e.kind, e.line) for e in base.entries] == [
        ("train.py", "train", "value = loss.item()", "item", 7)
    ]
    assert base.entries[0].per_step == pytest.approx(0.75)
