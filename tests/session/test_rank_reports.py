"""One report per rank: the rank, its file name, atomic writes, and watch(out=...)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

import barrierguard
from barrierguard import BarrierGuardError, Report
from barrierguard.session import rank_reports


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize(
    ("path", "rank", "world", "want"),
    [
        ("bg.json", 0, 1, "bg.json"),
        ("bg.json", 3, 8, "bg.rank3.json"),
        ("out/bg.json", 1, 2, os.path.join("out", "bg.rank1.json")),
        ("bg", 2, 4, "bg.rank2"),
        ("bg-{rank}.json", 5, 8, "bg-5.json"),
        ("{rank}/bg.json", 0, 1, "0/bg.json"),  # a placeholder is honoured with one rank too
        ("bg.json", "*", 8, "bg.rank*.json"),
    ],
)
def test_rank_path(path: str, rank: int | str, world: int, want: str) -> None:
    assert rank_reports.rank_path(path, rank=rank, world=world) == want


def test_rank_and_world_from_the_launcher(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    assert rank_reports.current_rank() is None and rank_reports.world_size() == 1
    assert rank_reports.rank_path("bg.json") == "bg.json"
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_reports.current_rank() == 3 and rank_reports.world_size() == 4
    assert rank_reports.rank_path("bg.json") == "bg.rank3.json"
    monkeypatch.setenv("RANK", "x")
    assert rank_reports.current_rank() is None


def test_rank_from_the_process_group(no_launcher: None) -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert rank_reports.current_rank() == 0 and rank_reports.world_size() == 1
        with barrierguard.watch(policy="record", memory=False) as guard:
            pass
        assert guard.report.rank == 0
    finally:
        dist.destroy_process_group()


def test_save_is_atomic_and_makes_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    report = Report(engine="audit", detection=True, policy="record", rank=1)
    path = rank_reports.save(report, tmp_path / "sub" / "bg.json")
    assert path == str(tmp_path / "sub" / "bg.rank1.json")
    assert Report.load(path) == report
    assert os.listdir(tmp_path / "sub") == ["bg.rank1.json"]  # no temporary file left
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask  # as open() would make it


def test_a_failed_write_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "bg.json"
    target.write_text("old")
    report = Report(engine="audit", detection=True, policy="record")

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        report.save(target)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["bg.json"]


def test_watch_out_saves_at_stop(tmp_path: Path, no_launcher: None) -> None:
    out = tmp_path / "bg.json"
    with barrierguard.watch(policy="record", memory=False, out=out) as guard:
        guard.step()
    assert guard.report_path == str(out)
    assert Report.load(out) == guard.report


def test_watch_out_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with barrierguard.watch(policy="record", memory=False, out=str(tmp_path / "bg.json")) as g:
        g.step()
    assert g.report_path == str(tmp_path / "bg.rank1.json")
    assert Report.load(g.report_path).rank == 1


def test_an_unwritable_out_is_noted_not_raised(
    tmp_path: Path, no_launcher: None, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "bg.json"  # a folder that is a file
    with barrierguard.watch(policy="record", memory=False, out=out) as guard:
        pass
    assert guard.report_path is None
    assert any("could not be written" in n for n in guard.report.notes)
    assert "could not be written" in caplog.text


@pytest.mark.parametrize("value", ["", "  ", 3, b"bg.json"])
def test_watch_out_is_validated(value: object) -> None:
    with pytest.raises(BarrierGuardError, match=r"watch\(out=.*expected None or a file path"):
        barrierguard.watch(out=value)
