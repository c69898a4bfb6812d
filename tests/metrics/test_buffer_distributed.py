"""MetricBuffer across 2 gloo ranks on CPU gives the 1-process answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _metrics_dist import assert_same, reference, run_world
from barrierguard import MetricBuffer
from barrierguard._errors import BarrierGuardError

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def test_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    want = reference(torch.device("cpu"))
    got = run_world(2, "gloo", tmp_path / "rank0.json")
    assert_same(got, want, world=2)
    assert got["rare"] == 19.0  # only rank 0 logged it: the max skips the empty rank
    assert got["lr"] == want["lr"]  # last = the highest rank that logged one


def test_sync_dist_false_stays_local() -> None:
    buf = MetricBuffer({"loss": "mean"}, sync_dist=False)
    buf.update(loss=1.0)
    assert buf.compute() == {"loss": 1.0}


def test_layout_hash_mismatch_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fake a 2-rank gather in which the other rank registered different metrics.
    buf = MetricBuffer({"loss": "mean"})
    buf.update(loss=1.0)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)

    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group: object = None) -> None:
        out[0].copy_(tensor)
        out[1].copy_(tensor)
        out[1][0] += 1  # another layout hash

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    with pytest.raises(BarrierGuardError, match="different metrics on different ranks"):
        buf.compute()
