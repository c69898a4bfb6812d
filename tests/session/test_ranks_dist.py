"""Two gloo ranks on CPU: host barriers at the user's lines, per-rank files, and the merge.

The in-process merge (one all_gather_object after the run) and the offline one
(``barrierguard merge`` of the per-rank files) must build the same report.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _ranks_dist import STEPS, SYNC_WAIT_S, line, run_world
from barrierguard import Report
from barrierguard.cli.gate import merge_files
from barrierguard.cli.main import main

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def _site(report: Report, marker: str, kind: str) -> object:
    want = line(marker)
    (site,) = [s for s in report.sites if s.line == want and s.kind == kind]
    return site


@pytest.mark.parametrize("engine", ["audit", "cuda"])
def test_two_gloo_ranks(tmp_path: Path, engine: str) -> None:
    run_world(tmp_path, engine)
    files = sorted(tmp_path.glob("bg.rank*.json"))
    assert [f.name for f in files] == ["bg.rank0.json", "bg.rank1.json"]
    assert [Report.load(f).rank for f in files] == [0, 1]
    merged = Report.load(tmp_path / "merged.json")
    assert merged.rank is None and [r.rank for r in merged.ranks] == [0, 1]

    # The host barriers of torch.distributed, at the user's lines, on both ranks.
    barrier = _site(merged, "# L-barrier", "collective")
    gather = _site(merged, "# L-object", "collective")
    for site, detail in ((barrier, "barrier"), (gather, "all_gather_object")):
        assert site.detail == detail  # type: ignore[attr-defined]
        assert site.origin == "user"  # type: ignore[attr-defined]
        assert dict(site.rank_counts) == {0: STEPS, 1: STEPS}  # type: ignore[attr-defined]
        assert not site.asymmetric  # type: ignore[attr-defined]
    # Nothing inside all_gather_object is a site of its own.
    assert not [s for s in merged.sites if s.origin == "framework:torch.distributed"]

    # Rank 0's own synchronize: on rank 0 only, so rank-asymmetric.
    sync = _site(merged, "# L-sync", "synchronize")
    assert sync.rank_counts == ((0, STEPS),)  # type: ignore[attr-defined]
    assert sync.asymmetric  # type: ignore[attr-defined]
    assert [s.rank for s in merged.rank_summaries] == [0, 1]
    assert merged.to_dict()["gating"]["ranks"] == [0]

    if engine == "audit":
        item = _site(merged, "# L-item", "item")
        assert item.asymmetric  # type: ignore[attr-defined]
        assert merged.gating_site is item  # no cost timed: the first of equals
        assert item.job_cost_s is None  # type: ignore[attr-defined]
    else:
        # Timed: each stall is the wait around the call. Rank 1 waits at the
        # next barrier for rank 0's synchronize.
        assert merged.gating_site is sync
        assert dict(sync.rank_stalls)[0] >= STEPS * SYNC_WAIT_S * 0.9  # type: ignore[attr-defined]
        assert dict(barrier.rank_stalls)[1] > dict(barrier.rank_stalls)[0]  # type: ignore[attr-defined]
        cost = sync.job_cost_s  # type: ignore[attr-defined]
        assert cost is not None and 0 < cost <= SYNC_WAIT_S * 1.5
        r0, r1 = merged.rank_summaries
        assert r0.wait_s == 0.0 and r1.wait_s == cost
        assert r0.host_step_s is not None and r1.host_step_s is not None

    # The offline merge of the per-rank files builds the same report.
    assert merge_files([str(f) for f in reversed(files)]) == merged
    out = tmp_path / "offline.json"
    assert main(["merge", str(tmp_path / "bg.rank*.json"), "-o", str(out)]) == 0
    assert Report.load(out) == merged
