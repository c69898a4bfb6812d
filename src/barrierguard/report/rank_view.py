"""The per-rank view of a merged report: each rank's steps, and the site that gates them.

In a data-parallel job every rank waits for the slowest one at each collective
(DDP's gradient all-reduce, a barrier), so a sync that fires on one rank costs
every rank. Plain functions over plain values, used by
:meth:`barrierguard.Report.merge` (this module imports no other record, so the
records can import it):

* :func:`summarize_rank`: a rank's measured step time (the medians of its
  timeline's host and device time per step), syncs and stall per step;
* :func:`job_cost`: what a rank-asymmetric site (one that fires on some ranks
  only) costs the whole job per step. On a rank where it fires, it lengthens
  the step by its stall per step, less what the overlap of host and device hid
  (the timeline's saving over its stall); the other ranks wait about that long
  at the next collective. The slowest rank sets the pace, so the cost is the
  largest over the ranks it fires on, and no rank can wait longer than its
  whole step.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from barrierguard.report.codec import Record

__all__ = ["RankSummary", "hidden_fraction", "job_cost", "rank_ranges", "summarize_rank"]


class _TimelineLike(Protocol):
    @property
    def host_s(self) -> tuple[float, ...]: ...

    @property
    def device_s(self) -> tuple[float | None, ...]: ...

    @property
    def stall_s(self) -> tuple[float, ...]: ...

    @property
    def saving_s(self) -> float: ...


class _SiteLike(Protocol):
    @property
    def blocking(self) -> bool: ...

    @property
    def step_count(self) -> int: ...

    @property
    def stall_s(self) -> float | None: ...


@dataclass(frozen=True)
class RankSummary(Record):
    """One rank of a merged report: its steps, syncs, stall and step time.

    ``host_step_s`` and ``device_step_s`` are medians over the steps its
    timeline timed (a GPU run under the CUDA engine); ``None`` where nothing
    was timed (the audit engine, or no device time could be read without a
    sync). ``stall_fraction`` is how much of its stall lengthened its steps
    (the timeline's saving over its stall, 1.0 when the overlap hid nothing).
    ``wait_s`` is the estimated time per step this rank waits for the gating
    site of the merged report (0 on the ranks where that site fires itself).

    Example:
        >>> s = RankSummary(rank=1, steps=4, measured_steps=4, step_syncs=0)
        >>> RankSummary.from_dict(s.to_dict()) == s
        True
    """

    rank: int
    steps: int
    measured_steps: int
    step_syncs: int
    stall_per_step_s: float | None = None
    host_step_s: float | None = None
    device_step_s: float | None = None
    timed_steps: int = 0
    stall_fraction: float | None = None
    wait_s: float | None = None

    @property
    def step_s(self) -> float | None:
        """This rank's step time: the longer of its host and device medians.

        A rank whose host runs ahead of its device has short host steps; its
        device sets its pace, and the device time is then known.
        """
        known = [t for t in (self.host_step_s, self.device_step_s) if t is not None]
        return max(known) if known else None

    @property
    def syncs_per_step(self) -> float:
        """Blocking syncs per measured step on this rank."""
        return self.step_syncs / self.measured_steps if self.measured_steps else 0.0


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def hidden_fraction(timeline: _TimelineLike | None) -> float | None:
    """The share of a rank's stall that lengthened its steps: saving over stall, at most 1.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> hidden_fraction(NS(host_s=(1.0,), device_s=(None,), stall_s=(0.4,), saving_s=0.2))
        0.5
    """
    if timeline is None:
        return None
    stall = sum(timeline.stall_s)
    if stall <= 0:
        return None
    return max(0.0, min(1.0, timeline.saving_s / stall))


def summarize_rank(
    rank: int,
    *,
    steps: int,
    measured_steps: int,
    sites: Iterable[_SiteLike],
    timeline: _TimelineLike | None,
) -> RankSummary:
    """The summary of one rank's report (its sites and its timeline)."""
    sites = list(sites)
    step_syncs = sum(s.step_count for s in sites if s.blocking)
    stalls = [s.stall_s for s in sites if s.blocking and s.stall_s is not None]
    stall_per_step = sum(stalls) / measured_steps if stalls and measured_steps else None
    return RankSummary(
        rank=rank,
        steps=steps,
        measured_steps=measured_steps,
        step_syncs=step_syncs,
        stall_per_step_s=stall_per_step,
        host_step_s=_median(timeline.host_s) if timeline is not None else None,
        device_step_s=_median(timeline.device_s) if timeline is not None else None,
        timed_steps=len(timeline.host_s) if timeline is not None else 0,
        stall_fraction=hidden_fraction(timeline),
    )


def job_cost(
    rank_stalls: Sequence[tuple[int, float]], summaries: Mapping[int, RankSummary]
) -> float | None:
    """Estimated time per step that a rank-asymmetric site costs every other rank.

    Args:
        rank_stalls: ``(rank, stall in seconds over the measured steps)`` for
            each rank the site fired on with a measured stall.
        summaries: Every rank's summary, by rank.

    Returns:
        The largest over those ranks of the stall per measured step times the
        share of stall that lengthened that rank's steps (all of it when its
        timeline does not say), capped by the shortest median step of the
        ranks that wait (:attr:`RankSummary.step_s`); ``None`` when no stall
        was measured.

    Example:
        >>> a = RankSummary(rank=0, steps=10, measured_steps=10, step_syncs=10,
        ...                 stall_fraction=0.5)
        >>> b = RankSummary(rank=1, steps=10, measured_steps=10, step_syncs=0,
        ...                 host_step_s=0.020)
        >>> round(job_cost([(0, 0.040)], {0: a, 1: b}), 6)
        0.002
    """
    costs = []
    for rank, stall in rank_stalls:
        summary = summaries.get(rank)
        if summary is None or not summary.measured_steps:
            continue
        fraction = summary.stall_fraction if summary.stall_fraction is not None else 1.0
        costs.append(stall / summary.measured_steps * fraction)
    if not costs:
        return None
    cost = max(costs)
    fired = {r for r, _ in rank_stalls}
    waiting = [s.step_s for r, s in summaries.items() if r not in fired and s.step_s is not None]
    return min(cost, min(waiting)) if waiting else cost


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks in few words: runs of consecutive ranks as ``a-b``.

    Example:
        >>> rank_ranges([0, 1, 2, 3, 7, 9, 10])
        '0-3, 7, 9-10'
    """
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
