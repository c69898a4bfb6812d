"""The detection-quality benchmark on CPU: the audit half, with the table it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_audit_half_counts_every_annotated_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_detection

    out = tmp_path / "detection.json"
    bench_detection.main(["--engines", "audit", "--out", str(out)])
    r = json.loads(out.read_text())["engines"]["audit"]
    assert r["annotated"] == r["syncing"] + r["quiet"]
    assert r["agree"] + r["disagree"] == r["annotated"]
    assert r["quiet"] >= 38 and r["quiet_flagged"] == 0
    assert r["agreement"] >= 0.95
    # The two lines the audit cannot reach on CPU need a CUDA stream or event.
    assert {d["code"].split("  #")[0] for d in r["disagreements"]} <= {
        "torch.cuda.current_stream().synchronize()",
        'd["event"].synchronize()',
    }
    assert "| audit" in capsys.readouterr().out
