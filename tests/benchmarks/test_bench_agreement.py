"""bench_agreement.py's bookkeeping on CPU: lines, the comparison, the raw runner's stack walk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_agreement as bench  # noqa: E402

MNIST = next(s for s in bench.SCRIPTS if s.name == "mnist")
FOLDER = bench.CORPUS / MNIST.folder


def _report(path: Path, lines: list[int], other: str = "/elsewhere/lib.py") -> None:
    sites = [{"file": str(FOLDER / "main.py"), "line": n, "count": 2} for n in lines]
    sites.append({"file": other, "line": 1, "count": 1})
    path.write_text(json.dumps({"sites": sites}))


def test_lines_are_the_scripts_own_and_the_comparison_counts_them(tmp_path: Path) -> None:
    _report(tmp_path / "mnist.audit.json", [44, 53, 99])
    _report(tmp_path / "mnist.cuda.json", [44, 53, 64])
    raw = [{"file": str(FOLDER / "main.py"), "line": n, "count": 1} for n in (44, 53)]
    (tmp_path / "mnist.raw.json").write_text(json.dumps({"lines": raw}))
    got = {m: bench.lines_of(MNIST, m, tmp_path) for m in bench.MODES}
    assert got["audit"] == {"main.py:44": 2, "main.py:53": 2, "main.py:99": 2}
    row = bench.compare(MNIST, got["audit"], got["cuda"], got["raw"])
    assert row["found"] == ["main.py:44", "main.py:53"]
    assert list(row["missed"]) == ["main.py:64"]
    assert list(row["false"]) == ["main.py:99"]
    assert row["missed"]["main.py:64"].startswith("data, target = data.to(device)")
    assert list(row["cuda_not_raw"]) == ["main.py:64"] and row["raw_not_cuda"] == {}
    total = bench.print_table([row])
    assert (total["found"], total["missed"], total["false"]) == (2, 1, 1)
    assert total["found_share"] == pytest.approx(2 / 3, abs=1e-4)


def test_a_part_not_run_reads_as_missing(tmp_path: Path) -> None:
    assert bench.lines_of(MNIST, "cuda", tmp_path) is None
    row = bench.compare(MNIST, {"main.py:1": 1}, None, None)
    assert "found" not in row and "raw_lines" not in row


def test_raw_runner_counts_the_innermost_line_in_the_scripts_folder(tmp_path: Path) -> None:
    folder = tmp_path / "script"
    folder.mkdir()
    (folder / "helper.py").write_text(
        "import warnings\n\ndef sync():\n    warnings.warn('called a synchronizing CUDA operation')\n"
    )
    (folder / "main.py").write_text(
        textwrap.dedent(
            """
            import helper
            for _ in range(3):
                helper.sync()
            """
        )
    )
    out = tmp_path / "raw.json"
    # No CUDA here: the mode's switch is a no-op; the warnings stand in for its own.
    code = (
        "import sys, runpy, torch; torch.cuda.set_sync_debug_mode = lambda mode: None; "
        f"sys.argv = [{str(ROOT / 'benchmarks/bench_agreement.py')!r}, '--raw-child', "
        f"{str(out)!r}, {str(folder / 'main.py')!r}]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = json.loads(out.read_text())["lines"]
    assert lines == [{"file": os.path.abspath(folder / "helper.py"), "line": 4, "count": 3}]
