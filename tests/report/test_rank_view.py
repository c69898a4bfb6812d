"""The per-rank view of a merged report, on synthetic ranks: 1, 2 and 8 of them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from _samples import site
from barrierguard import Report, Site
from barrierguard.report.records import (
    RankSummary,
    Timeline,
    hidden_fraction,
    job_cost,
    rank_ranges,
)


def _site(line: int, steps: int, stall: float | None, kind: str = "item") -> Site:
    return site(
        line=line,
        function="main",
        code=f"line {line}",
        kind=kind,
        count=steps,
        per_step=1.0,
        steps=((1, steps),),
        stall_s=stall,
        stall_count=steps if stall is not None else 0,
    )


def _timeline(step_s: float, stall_s: float, saving_s: float, n: int = 4) -> Timeline:
    return Timeline(
        steps=tuple(range(1, n + 1)),
        host_s=(step_s,) * n,
        stall_s=(stall_s,) * n,
        device_s=(None,) * n,
        ahead=(0,) * n,
        saving_s=saving_s * n,
    )


def _rank(
    rank: int | None, *sites: Site, steps: int = 10, timeline: Timeline | None = None
) -> Report:
    return Report(
        engine="cuda",
        detection=True,
        policy="record",
        steps=steps,
        measured_steps=steps,
        sites=sites,
        syncs_per_step=(0,) + (len(sites),) * steps,
        rank=rank,
        timeline=timeline,
    )


def _job(world: int, *, logger: int = 0, step_s: float = 0.010, stall: float = 0.004) -> Report:
    """``world`` ranks with a barrier on every rank and ``.item()`` on rank ``logger`` only."""
    reports = []
    for r in range(world):
        sites = [_site(20, 10, 0.001 * 10, kind="collective")]
        stall_total = 0.001
        if r == logger:
            sites.append(_site(12, 10, stall * 10))
            stall_total += stall
        tl = _timeline(step_s + (stall if r == logger else 0.0), stall_total, stall_total)
        reports.append(_rank(r, *sites, timeline=tl))
    return Report.merge(reports)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_merge_marks_the_rank_asymmetric_site(world: int) -> None:
    merged = _job(world)
    assert [s.rank for s in merged.rank_summaries] == list(range(world))
    barrier = next(s for s in merged.sites if s.kind == "collective")
    item = next(s for s in merged.sites if s.kind == "item")
    assert not barrier.asymmetric and barrier.job_cost_s is None
    assert dict(barrier.rank_counts) == dict.fromkeys(range(world), 10)
    assert item.rank_counts == ((0, 10),)
    assert item.rank_stalls == ((0, pytest.approx(0.04)),)
    if world == 1:
        # One rank holds nobody back.
        assert not item.asymmetric and merged.gating_site is None
        assert merged.rank_summaries[0].wait_s is None
        return
    assert item.asymmetric
    assert merged.gating_site is item
    assert item.job_cost_s == pytest.approx(0.004)  # its stall per step, all of it costly
    waits = [s.wait_s for s in merged.rank_summaries]
    assert waits == [0.0] + [pytest.approx(0.004)] * (world - 1)
    assert merged.to_dict()["gating"] == {
        "file": "/w/train.py",
        "line": 12,
        "kind": "item",
        "origin": "user",
        "location": "train.py:12",
        "ranks": [0],
        "job_cost_s": pytest.approx(0.004),
    }


@pytest.mark.parametrize("world", [1, 2, 8])
def test_merged_report_round_trips(world: int) -> None:
    merged = _job(world)
    again = Report.from_dict(merged.to_dict())
    assert again == merged
    assert again.gating_site == merged.gating_site


def test_the_ranks_come_from_the_reports_not_their_order() -> None:
    in_order = _job(8, logger=5)
    shuffled = Report.merge([in_order.ranks[i] for i in (3, 7, 0, 5, 1, 6, 2, 4)])
    assert shuffled == in_order
    item = next(s for s in shuffled.sites if s.kind == "item")
    assert item.rank_counts == ((5, 10),)
    assert [s.wait_s for s in shuffled.rank_summaries][5] == 0.0


def test_reports_without_a_rank_merge_in_argument_order() -> None:
    a, b = _rank(None, _site(3, 10, None)), _rank(None)
    merged = Report.merge([b, a])
    (site,) = merged.sites
    assert site.rank_counts == ((1, 10),) and site.asymmetric
    assert site.job_cost_s is None  # nothing timed (the audit engine)
    assert merged.gating_site is site  # the most syncs in steps, then


def test_the_overlap_hides_part_of_a_stall() -> None:
    # Rank 0 waits 6 ms per step in .item(), but 4 ms of it were device work
    # that overlapped host work: its steps grew by 2 ms, the others wait 2 ms.
    zero = _rank(0, _site(12, 10, 0.060), timeline=_timeline(0.012, 0.006, 0.002))
    one = _rank(1, timeline=_timeline(0.012, 0.0, 0.0))
    merged = Report.merge([zero, one])
    item = merged.sites[0]
    assert item.job_cost_s == pytest.approx(0.002)
    assert merged.rank_summaries[0].stall_fraction == pytest.approx(1 / 3)
    assert merged.rank_summaries[1].host_step_s == pytest.approx(0.012)


def test_no_rank_waits_longer_than_its_step() -> None:
    summaries = {
        0: RankSummary(0, 10, 10, 10, stall_fraction=1.0),
        1: RankSummary(1, 10, 10, 0, host_step_s=0.003),
        2: RankSummary(2, 10, 10, 0, host_step_s=0.005),
    }
    assert job_cost([(0, 0.1)], summaries) == pytest.approx(0.003)
    assert job_cost([], summaries) is None
    # A rank whose host runs ahead waits as long as its device step.
    summaries[1] = RankSummary(1, 10, 10, 0, host_step_s=0.003, device_step_s=0.2)
    assert job_cost([(0, 0.1)], summaries) == pytest.approx(0.005)
    # The slowest of the ranks it fires on sets the pace.
    summaries[3] = RankSummary(3, 10, 10, 10, stall_fraction=0.1)
    assert job_cost([(0, 0.02), (3, 0.02)], summaries) == pytest.approx(0.002)


@pytest.mark.parametrize(
    ("timeline", "want"),
    [
        (None, None),
        (_timeline(0.01, 0.0, 0.0), None),
        (_timeline(0.01, 0.004, 0.002), 0.5),
        (_timeline(0.01, 0.004, 0.009), 1.0),
    ],
)
def test_hidden_fraction(timeline: Timeline | None, want: float | None) -> None:
    assert hidden_fraction(timeline) == (pytest.approx(want) if want is not None else None)


def test_rank_summary_round_trips_and_counts() -> None:
    s = RankSummary(2, 8, 6, 12, 0.001, 0.01, None, 4, 0.5, 0.002)
    assert RankSummary.from_dict(s.to_dict()) == s
    assert s.syncs_per_step == 2.0
    assert s.step_s == 0.01
    assert RankSummary(0, 0, 0, 0).syncs_per_step == 0.0
    assert RankSummary(0, 0, 0, 0).step_s is None


def test_plain_reports_gain_no_rank_keys() -> None:
    d = _rank(None, _site(3, 1, None)).to_dict()
    assert not {"rank", "rank_summaries", "gating"} & set(d)
    assert not {"rank_stalls", "asymmetric", "job_cost_s"} & set(d["sites"][0])
    assert _rank(4).to_dict()["rank"] == 4


def test_rank_ranges() -> None:
    assert rank_ranges([]) == ""
    assert rank_ranges([5, 1, 2, 3, 3]) == "1-3, 5"


def test_a_non_blocking_site_never_gates() -> None:
    race = replace(_site(9, 10, None, kind="async_d2h"), blocking=False)
    merged = Report.merge([_rank(0, race), _rank(1)])
    assert merged.sites[0].asymmetric and merged.gating_site is None
