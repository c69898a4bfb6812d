"""The CI formats from the command line: GitHub annotations and SARIF from run and check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from barrierguard.cli.main import main

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = Path(__file__).parents[1] / "report" / "render" / "sarif-schema-2.1.0.json"

LOOP = """\
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    total = loss.item()
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(LOOP)
    return path


def test_failing_run_prints_a_github_error_at_the_users_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--policy", "error", "--engine", "audit", "--format", "github", "train.py"])
    out, err = capsys.readouterr()
    assert code == 3, err
    errors = [line for line in out.splitlines() if line.startswith("::error ")]
    assert errors == [
        "::error file=train.py,line=10,title=barrierguard BG101 item::item sync: "
        "`total = loss.item()` 2 in the measured steps (1.00 per step). Fix: "
        + errors[0].split("Fix: ", 1)[1]
    ]
    assert script.read_text().splitlines()[9].strip() == "total = loss.item()"


def test_record_run_marks_sites_as_warnings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = main(
        ["run", "--policy", "record", "--engine", "audit", "--format", "github", "train.py"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("::warning file=train.py,line=10,title=barrierguard BG101 item::")
    assert "::error" not in out


def test_run_writes_sarif_that_validates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = ["run", "--policy", "error", "--engine", "audit", "--format", "sarif"]
    code = main([*argv, "--format-out", "out.sarif", "train.py"])
    assert code == 3
    log = json.loads((tmp_path / "out.sarif").read_text())
    jsonschema.validate(log, json.loads(SCHEMA.read_text()))
    run = log["runs"][0]
    (result,) = run["results"]
    assert result["ruleId"] == "BG101"
    assert result["level"] == "error"
    assert run["tool"]["driver"]["rules"][result["ruleIndex"]]["id"] == "BG101"
    where = result["locations"][0]["physicalLocation"]
    assert where["artifactLocation"]["uri"] == "train.py"
    assert where["region"]["startLine"] == 10
    assert "written to out.sarif" in capsys.readouterr().err


def test_check_annotates_only_the_regression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path)
    script.write_text(LOOP.replace("total = loss.item()", "pass"))
    base = ["run", "--policy", "record", "--engine", "audit"]
    assert main([*base, "--out", "old.json", "train.py"]) == 0
    script.write_text(LOOP)
    assert main([*base, "--out", "new.json", "train.py"]) == 0
    assert main(["baseline", "old.json", "-o", "base.json", "--root", str(tmp_path)]) == 0
    capsys.readouterr()
    argv = ["check", "new.json", "--baseline", "base.json", "--root", str(tmp_path)]
    assert main([*argv, "--format", "github"]) == 1
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("::")]
    assert len(notes) == 1
    assert notes[0].startswith(
        "::error file=train.py,line=10,title=barrierguard BG101 item::new site"
    )
    assert main([*argv, "--format", "sarif", "--format-out", "check.sarif"]) == 1
    log = json.loads((tmp_path / "check.sarif").read_text())
    jsonschema.validate(log, json.loads(SCHEMA.read_text()))
    assert [r["level"] for r in log["runs"][0]["results"]] == ["error"]


def test_run_writes_the_html_page_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--policy", "record", "--engine", "audit", "--html", "r.html", "train.py"])
    assert code == 0
    page = (tmp_path / "r.html").read_text()
    assert '<li class="verdict-site"><b>train.py:10</b> item' in page
    assert "HTML report written to r.html" in capsys.readouterr().err
