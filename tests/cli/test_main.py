"""The command line: run, demo, exit codes and errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _gate_helpers import PLAIN_LOOP, READ_IN_LOOP
from barrierguard.cli.main import main

FAKE = str(Path(__file__).with_name("_fake_cuda.py").parent)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_run_passes_argv_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        print("args", sys.argv[1:], __name__)
        sys.exit(4)
        """,
    )
    code = main(["run", "--policy", "record", str(script), "--lr", "3e-4"])
    out, err = capsys.readouterr()
    assert code == 4
    assert "args ['--lr', '3e-4'] __main__" in out
    assert "barrierguard report" in err


def test_run_writes_json(tmp_path: Path) -> None:
    script = _script(tmp_path, "x = 1\n")
    out = tmp_path / "r.json"
    assert main(["run", "--policy", "record", "--out", str(out), str(script)]) == 0
    assert json.loads(out.read_text())["schema"] == "barrierguard.report/1"


def test_run_by_a_relative_path_stores_absolute_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(tmp_path, "import sys, torch\ndevice = 'cpu'\nx = torch.ones(2).to(device)\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    args = ["run", "--engine", "audit", "--policy", "record", "--out", "r.json", "train.py"]
    assert main(args) == 0
    sites = json.loads(out.read_text())["sites"]
    assert [(s["file"], s["line"], s["kind"]) for s in sites] == [
        (str(tmp_path / "train.py"), 3, "copy")
    ]
    err = capsys.readouterr().err
    # The console shows short paths (the line naming the report file is absolute).
    assert "train.py:3" in err and str(tmp_path / "train.py") not in err


def test_run_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pkg = tmp_path / "mytrain.py"
    pkg.write_text("import sys\nprint('module', sys.argv[1:])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["run", "--policy", "record", "-m", "mytrain", "--epochs", "1"]) == 0
    assert "module ['--epochs', '1']" in capsys.readouterr().out
    # The module's own options pass through after any of run's options that take a value.
    args = ["run", "--capture-probe", "step", "--policy", "record", "-m", "mytrain"]
    assert main([*args, "--policy", "x"]) == 0
    assert "module ['--policy', 'x']" in capsys.readouterr().out


def test_script_exception_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, "raise ValueError('bad data')\n")
    assert main(["run", "--policy", "record", str(script)]) == 1
    err = capsys.readouterr().err
    assert "ValueError: bad data" in err and "barrierguard report" in err


def test_error_policy_violation_exits_3(
    tmp_path: Path,
    fake_cuda: object,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.syspath_prepend(FAKE)
    script = _script(
        tmp_path,
        """
        import torch
        from _fake_cuda import FakeTensor
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            FakeTensor().item()
        """,
    )
    code = main(["run", "--policy", "error", "--engine", "cuda", str(script)])
    err = capsys.readouterr().err
    assert code == 3
    assert "SyncError" in err and "train.py:9" in err


@pytest.mark.parametrize(("inside", "code"), [(False, 0), (True, 3)])
def test_a_read_after_the_loop_passes_the_error_policy_one_inside_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inside: bool, code: int
) -> None:
    source = READ_IN_LOOP if inside else PLAIN_LOOP
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "r.json"
    assert main(["run", "--policy", "error", "--out", str(out), str(script)]) == code
    err = capsys.readouterr().err
    report = json.loads(out.read_text())
    if inside:
        assert "SyncError: BG101 item sync at" in err and f"{script}:14 in step 2" in err
        assert "print(loss.item())" in err
    else:
        read = next(s for s in report["sites"] if s["code"].startswith("print("))
        assert read["phases"] == {"after-loop": 1} and read["step_count"] == 0
        assert report["violations"] == [] and "SyncError" not in err
        assert "after-loop 1" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["run", "missing.py"], "can't open script 'missing.py': no such file"),
        (["run", "-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
        (["run"], "expected a script"),
        (["run", "--policy", "loud", __file__], "not a valid policy"),
        (["run", "--allow", "bogus", __file__], "allow rule 'bogus' is malformed"),
        (["demo", "--device", "tpu"], "demo --device 'tpu': expected auto, cpu or cuda"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "3", "--policy", "record"]) == 0
    assert "barrierguard report" in capsys.readouterr().err


def test_demo_defaults_to_the_record_policy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("BARRIERGUARD_POLICY", raising=False)
    assert main(["demo", "--steps", "3"]) == 0
    assert "policy record" in capsys.readouterr().err


def test_python_dash_m(tmp_path: Path) -> None:
    script = _script(tmp_path, "print('hello')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "barrierguard", "run", "--policy", "record", str(script)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "hello"


def test_every_option_has_help_text() -> None:
    import argparse

    from barrierguard.cli.main import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, command in sub.choices.items()
        for action in command._actions
        if action.option_strings and not action.help
    ]
    assert missing == []


def test_demo_help_states_the_policy_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "$BARRIERGUARD_POLICY, else record)" in text


def test_allow_help_lists_the_line_range_and_glob_forms(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "train.py:40-50" in text and "'src/*/metrics.py:*'" in text


def test_run_capture_probe_names_the_step_function(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            train_step(torch.ones(1, 2))
        """,
    )
    out = tmp_path / "r.json"
    argv = ["run", "--policy", "record", "--capture-probe", "train_step", "--out", str(out)]
    assert main([*argv, str(script)]) == 0
    probe = json.loads(out.read_text())["compile"]["probe"]
    assert "train_step" in probe["captured"]
    assert probe["status"] in ("not run", "capturable")
