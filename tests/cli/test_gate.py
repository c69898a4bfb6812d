"""The gate's commands: baseline, check, report and diff, end to end on real reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _fake_cuda import FakeMode
from _gate_helpers import LOOP, PLAIN_LOOP, READ_IN_LOOP, run_loop
from barrierguard import Report
from barrierguard.cli.main import main

WITH_EXTRA_ITEM = LOOP.replace(
    "        value = loss.item()\n",
    "        value = loss.item()\n        extra = loss.item()\n",
)
WITH_LINES_ABOVE = LOOP.replace(
    "def train(guard, steps=4):\n",
    "# a comment\nSCALE = 2\n\n\ndef helper():\n    return SCALE\n\n\n"
    "def train(guard, steps=4):\n    '''Now documented.'''\n",
)


@pytest.fixture
def today(fake_cuda: FakeMode, tmp_path: Path) -> tuple[Path, Path]:
    """Today's report and its baseline, made with the command line."""
    report = tmp_path / "today.json"
    run_loop(tmp_path / "v1", LOOP).save(report)
    baseline = tmp_path / "baseline.json"
    assert main(["baseline", str(report), "-o", str(baseline), "--root", str(tmp_path / "v1")]) == 0
    return report, baseline


def _check(tmp_path: Path, source: str, baseline: Path, version: str) -> int:
    report = tmp_path / f"{version}.json"
    run_loop(tmp_path / version, source).save(report)
    return main(
        ["check", str(report), "--baseline", str(baseline), "--root", str(tmp_path / version)]
    )


def test_unchanged_code_passes(
    today: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _check(tmp_path, LOOP, today[1], "v2") == 0
    assert "ok, nothing new" in capsys.readouterr().out


def test_a_new_item_fails_and_names_the_site(
    today: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert _check(tmp_path, WITH_EXTRA_ITEM, today[1], "v2") == 1
    out = capsys.readouterr()
    assert "new site: train.py:8 in train(): 'extra = loss.item()' [item]" in out.out
    assert "fix: keep the value on the device" in out.out
    assert "1 regression(s)" in out.err
    assert "value = loss.item()" not in out.out  # the old site is accepted


def test_lines_inserted_above_the_site_still_pass(
    today: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = run_loop(tmp_path / "probe", WITH_LINES_ABOVE)
    assert [s.line for s in moved.sites] == [16]  # it really moved (from line 7)
    assert _check(tmp_path, WITH_LINES_ABOVE, today[1], "v2") == 0


def test_more_syncs_per_step_fails(
    today: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Same line, but now it also runs in a nested loop: more syncs per step.
    nested = LOOP.replace(
        "        value = loss.item()\n",
        "        for _ in range(2):\n            value = loss.item()\n",
    )
    capsys.readouterr()
    assert _check(tmp_path, nested, today[1], "v2") == 1
    assert "more syncs per step" in capsys.readouterr().out


def test_report_formats(today: tuple[Path, Path], tmp_path: Path) -> None:
    report, _ = today
    for fmt, probe in (
        ("text", "barrierguard report: engine cuda"),
        ("json", '"schema": "barrierguard.report/1"'),
        ("html", '<table id="sites"'),
    ):
        out = tmp_path / f"out.{fmt}"
        assert main(["report", str(report), "--format", fmt, "-o", str(out)]) == 0
        assert probe in out.read_text()
    assert Report.from_dict(json.loads((tmp_path / "out.json").read_text())) == Report.load(report)


def test_report_html_uses_memory_from_the_json(tmp_path: Path) -> None:
    data = Report(engine="cuda", detection=True, policy="record", syncs_per_step=(1, 2)).to_dict()
    data["memory"] = {"steps": [0, 1, 2], "series": {"host_rss": [1e9, 1.1e9, 1.2e9]}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "r.html"
    assert main(["report", str(path), "--format", "html", "-o", str(out)]) == 0
    assert 'data-series="host_rss"' in out.read_text()


def test_report_to_stdout(today: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["report", str(today[0])]) == 0
    assert "value = loss.item()" in capsys.readouterr().out


def test_diff(today: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Outside the current directory, files match by basename without --root.
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    run_loop(tmp_path / "a", LOOP).save(before)
    run_loop(tmp_path / "b", WITH_EXTRA_ITEM).save(after)
    capsys.readouterr()
    assert main(["diff", str(before), str(after)]) == 1
    out = capsys.readouterr().out
    assert "new site: train.py:8 in train(): 'extra = loss.item()'" in out
    assert "syncs per measured step 0.75 -> 1.50" in out
    assert main(["diff", str(after), str(before)]) == 0
    out = capsys.readouterr().out
    assert "gone: train.py:8 in train(): 'extra = loss.item()'" in out


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "not-json": "{oops",
        "wrong-version": json.dumps({"schema": "barrierguard.report/7", "engine": "cuda"}),
        "list": "[]",
        "malformed": json.dumps({"schema": "barrierguard.report/1", "engine": "cuda"}),
    }
    out = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        out[name] = path
    out["missing"] = tmp_path / "missing.json"
    return out


@pytest.mark.parametrize(
    ("which", "problem"),
    [
        ("not-json", "not JSON"),
        ("wrong-version", "schema 'barrierguard.report/7' is not supported"),
        ("list", "expected a JSON object"),
        ("malformed", "malformed report"),
        ("missing", "no such report file"),
    ],
)
@pytest.mark.parametrize("command", ["check", "baseline", "report", "diff"])
def test_bad_report_files_exit_2_naming_file(
    today: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    which: str,
    problem: str,
    command: str,
) -> None:
    bad = _bad_files(tmp_path)[which]
    argv = {
        "check": ["check", str(bad), "--baseline", str(today[1])],
        "baseline": ["baseline", str(bad), "-o", str(tmp_path / "b.json")],
        "report": ["report", str(bad)],
        "diff": ["diff", str(today[0]), str(bad)],
    }[command]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"barrierguard: error: {bad}: " in err
    assert problem in err


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"schema": "barrierguard.baseline/2", "sites": []}', "schema 'barrierguard.baseline/2'"),
        ("{", "not JSON"),
    ],
)
def test_bad_baseline_exits_2(
    today: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    problem: str,
) -> None:
    bad = tmp_path / "old-baseline.json"
    bad.write_text(content)
    capsys.readouterr()
    assert main(["check", str(today[0]), "--baseline", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: " in err and problem in err


def test_report_as_baseline_says_so(
    today: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["check", str(today[0]), "--baseline", str(today[0])]) == 2
    assert "this is a report" in capsys.readouterr().err


def test_no_detection_report_cannot_be_checked(
    today: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blind = tmp_path / "blind.json"
    Report(engine="none", detection=False, policy="record").save(blind)
    capsys.readouterr()
    assert main(["check", str(blind), "--baseline", str(today[1])]) == 2
    assert "no detection ran" in capsys.readouterr().err


def test_unwritable_output_exits_2(
    today: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "dir" / "b.json"
    capsys.readouterr()
    assert main(["baseline", str(today[0]), "-o", str(target)]) == 2
    assert str(target) in capsys.readouterr().err


ONE_MORE_LAYER = PLAIN_LOOP.replace(
    "nn.Linear(8, 1)).to(device)", "nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)"
)


def _run_plain(tmp_path: Path, version: str, source: str) -> Path:
    folder = tmp_path / version
    folder.mkdir()
    (folder / "train.py").write_text(source)
    out = folder / "r.json"
    assert main(["run", "--policy", "record", "--out", str(out), str(folder / "train.py")]) == 0
    return out


def test_the_ratchet_passes_a_setup_edit_and_fails_a_read_in_the_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.json"
    report = _run_plain(tmp_path, "v1", PLAIN_LOOP)
    assert main(["baseline", str(report), "-o", str(baseline), "--root", str(tmp_path / "v1")]) == 0
    capsys.readouterr()

    edited = _run_plain(tmp_path, "v2", ONE_MORE_LAYER)
    code = main(["check", str(edited), "--baseline", str(baseline), "--root", str(tmp_path / "v2")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "info: edited: train.py:5 in <module>()" in out
    assert "ok, nothing new" in out

    dirty = _run_plain(tmp_path, "v3", READ_IN_LOOP)
    code = main(["check", str(dirty), "--baseline", str(baseline), "--root", str(tmp_path / "v3")])
    out = capsys.readouterr().out
    assert code == 1
    assert "new site: train.py:14 in <module>(): 'print(loss.item())' [item]" in out
