"""``barrierguard merge``: per-rank files into one report, offline; and ``run --out`` per rank."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from _samples import site
from barrierguard import Report
from barrierguard.cli.main import main


def _rank_file(folder: Path, rank: int | None, *, item: bool, name: str | None = None) -> Path:
    sites = ()
    if item:
        sites = (
            site(
                line=42,
                function="main",
                code="log(loss.item())",
                count=5,
                per_step=1.0,
                stall_s=0.02,
                stall_count=5,
            ),
        )
    report = Report(
        engine="cuda",
        detection=True,
        policy="record",
        steps=5,
        measured_steps=5,
        sites=sites,
        rank=rank,
    )
    path = folder / (name or f"bg.rank{rank}.json")
    report.save(path)
    return path


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    return [_rank_file(tmp_path, r, item=r == 0) for r in range(3)]


def test_merge_orders_by_rank_and_writes_json(
    files: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "merged.json"
    assert main(["merge", *map(str, reversed(files)), "-o", str(out)]) == 0
    merged = Report.load(out)
    assert merged == Report.merge([Report.load(f) for f in files])
    assert [r.rank for r in merged.ranks] == [0, 1, 2]
    (site,) = merged.sites
    assert site.asymmetric and site.rank_counts == ((0, 5),)
    text, err = capsys.readouterr()
    assert "3 rank report(s) merged into" in err
    assert "the gating site is train.py:42 (item, rank 0 only)" in text
    assert "rank-asymmetric: fires on rank 0 only (of 3)" in text


def test_merge_expands_a_quoted_glob(files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "merged.json"
    assert main(["merge", str(tmp_path / "bg.rank*.json"), "--out", str(out)]) == 0
    assert len(Report.load(out).ranks) == 3


@pytest.mark.parametrize("fmt", ["json", "html"])
def test_merge_renders_to_stdout(
    files: list[Path], fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["merge", *map(str, files), "--format", fmt]) == 0
    out = capsys.readouterr().out
    if fmt == "json":
        assert json.loads(out)["gating"]["location"] == "train.py:42"
    else:
        assert 'id="ranks"' in out and 'id="gating"' in out


def test_files_without_ranks_follow_the_argument_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _rank_file(tmp_path, None, item=False, name="a.json")
    b = _rank_file(tmp_path, None, item=True, name="b.json")
    assert main(["merge", str(a), str(b), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["sites"][0]["rank_counts"] == {"1": 5}
    assert "ranks follow the order of the files" in err


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "no such report file"),
        ("not json", "not JSON"),
        ("no match", "no file matches"),
        ("same rank", "both hold rank 0"),
        ("merged", "already a merged report"),
    ],
)
def test_bad_input_exits_2_naming_the_file(
    tmp_path: Path, setup: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _rank_file(tmp_path, 0, item=True)
    if setup == "missing":
        args = [str(good), str(tmp_path / "gone.json")]
        named = "gone.json"
    elif setup == "not json":
        bad = tmp_path / "bad.json"
        bad.write_text("{")
        args, named = [str(good), str(bad)], "bad.json"
    elif setup == "no match":
        args, named = [str(tmp_path / "nothing*.json")], "nothing*.json"
    elif setup == "same rank":
        twin = _rank_file(tmp_path, 0, item=False, name="other.json")
        args, named = [str(good), str(twin)], "other.json"
    else:
        merged = tmp_path / "merged.json"
        Report.merge([Report.load(good), Report.load(good)]).save(merged)
        args, named = [str(merged)], "merged.json"
    assert main(["merge", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and named in err


def test_run_under_a_launcher_writes_this_ranks_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("x = 1\n"))
    out = tmp_path / "bg.json"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        assert main(["run", "--policy", "record", "--out", str(out), str(script)]) == 0
        err = capsys.readouterr().err
        assert f"rank {rank} report written to {tmp_path / f'bg.rank{rank}.json'}" in err
        # Rank 0 prints the report and how to merge; the others one line.
        assert ("barrierguard report" in err) == (rank == 0)
        assert ("barrierguard merge" in err) == (rank == 0)
        assert ("2 of 2 rank reports written" in err) == (rank == 0)
    assert [Report.load(tmp_path / f"bg.rank{r}.json").rank for r in (0, 1)] == [0, 1]


def test_rank_zero_says_which_rank_files_were_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from barrierguard.cli import main as cli_main

    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    out = tmp_path / "bg.json"
    monkeypatch.setattr(cli_main, "RANK_FILES_WAIT_S", 0.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "bg.rank1.json").write_text("{}")  # a file of an earlier run: too old
    os.utime(tmp_path / "bg.rank1.json", (1.0, 1.0))
    assert main(["run", "--policy", "record", "--out", str(out), str(script)]) == 0
    err = capsys.readouterr().err
    assert (
        f"1 of 2 rank reports written ({tmp_path / 'bg.rank0.json'}); none yet from rank 1" in err
    )
    assert f"barrierguard merge '{tmp_path / 'bg.rank*.json'}'" in err
