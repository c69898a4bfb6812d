"""bench_versions.py on CPU with tiny settings (a smoke test, no timing claims)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("read", [False, True])
def test_versions_compares_this_src_with_a_commit_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read: bool
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_versions

    out = tmp_path / "versions.json"
    argv = ["--device", "cpu", "--old", "HEAD", "--layers", "1", "--width", "32"]
    argv += ["--read"] if read else []
    bench_versions.main([*argv, "--steps", "2", "--pairs", "3", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["read"] is read
    for pair in ("new/bare", "old/bare", "new/old"):
        row = data[pair]
        assert row["ci"][0] <= row["ratio"] <= row["ci"][1]
        assert row["cpu_ci"][0] <= row["cpu_us"] <= row["cpu_ci"][1]
    # The old package is gone again: nothing of it stays imported or on the path.
    assert not [m for m in sys.modules if m.startswith("barrierguard_old")]
    assert not any("barrierguard_old" in p for p in sys.path)
