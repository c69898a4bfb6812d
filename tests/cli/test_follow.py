"""Following the job's child processes: which children, the environment, the bootstrap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _gate_helpers import barrierguard_cli
from barrierguard.cli import follow
from barrierguard.cli.main import main


@pytest.mark.parametrize(
    ("argv", "orig", "followed"),
    [
        (["/w/train.py", "--lr", "1"], ["python", "/w/train.py", "--lr", "1"], True),
        (["/w/other.py"], ["python", "/w/other.py"], False),
        (["-m", "--x"], ["python", "-u", "-m", "pkg.train", "--x"], True),
        (["-m"], ["python", "-mpkg.train"], True),
        (["-m"], ["python", "-m", "torch._inductor.compile_worker"], False),
        (["-c"], ["python", "-c", "from multiprocessing.spawn import spawn_main"], False),
        ([""], ["python"], False),
    ],
)
def test_which_children_are_followed(
    argv: list[str], orig: list[str], followed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os.path, "isfile", lambda p: p.endswith(".py"))
    monkeypatch.setattr(os.path, "realpath", lambda p: p)
    job = follow.settings({}, "/w/train.py", None, [])
    job_module = follow.settings({}, None, "pkg.train", [])
    assert (follow.follows(job, argv, orig) or follow.follows(job_module, argv, orig)) is followed


def test_a_launcher_follows_what_its_arguments_name(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    job = follow.settings({}, None, "torch.distributed.run", ["--nproc-per-node", "2", str(script)])
    assert follow.follows(job, [str(script)], ["python", "-u", str(script)])
    assert not follow.follows(job, ["-m"], ["python", "-m", "torch._inductor.compile_worker"])


def test_the_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/mine")
    monkeypatch.delenv(follow.ENV, raising=False)
    with follow.following({"script": "/w/t.py"}):
        assert os.environ["PYTHONPATH"].split(os.pathsep) == [follow.bootstrap_dir(), "/mine"]
        assert json.loads(os.environ[follow.ENV]) == {"script": "/w/t.py"}
    assert os.environ["PYTHONPATH"] == "/mine" and follow.ENV not in os.environ


def test_the_bootstrap_never_breaks_a_child_and_chains_a_sitecustomize(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([follow.bootstrap_dir(), str(mine)])
    env[follow.ENV] = "{not json"  # a broken setting: one line, never an error
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('CHAINED'))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "yes"


def test_run_follows_a_subprocess_of_the_same_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys
            import torch

            child = "--child" in sys.argv
            if not child:
                env = dict(os.environ, RANK="1", WORLD_SIZE="2")
                subprocess.run([sys.executable, __file__, "--child"], env=env, check=True)
                subprocess.run([sys.executable, "-c", "pass"], check=True)  # not followed
                os.environ.update(RANK="0", WORLD_SIZE="2")
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            for _ in range(3 if child else 2):
                opt.step()
            """
        )
    )
    out = tmp_path / "r.json"
    proc = barrierguard_cli(
        "run", "--policy", "record", "--out", str(out), str(script), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.glob("r*.json")) == ["r.rank0.json", "r.rank1.json"]
    assert "2 of 2 rank reports written" in proc.stderr
    code = main(["merge", str(tmp_path / "r.rank*.json"), "-o", str(tmp_path / "m.json")])
    assert code == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert [(r["rank"], r["steps"]) for r in merged["ranks"]] == [(0, 2), (1, 3)]
