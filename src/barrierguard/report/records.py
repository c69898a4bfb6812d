"""The report and its sections: frozen records that round-trip through JSON.

Also the per-rank view of a merged report; re-exports ``site_records`` and ``compiled``.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby, zip_longest
from typing import Any

from barrierguard._errors import BarrierGuardError
from barrierguard.report.codec import OMIT_EMPTY, OMIT_NONE, Record, from_json, to_json
from barrierguard.report.compile_records import (
    CaptureProbe,
    CompileReport,
    CudagraphSkip,
    GraphBreak,
)
from barrierguard.report.jsonio import check_schema, read_json, write_json, write_text
from barrierguard.report.site_records import Site, SiteKey, Violation, add_sites

__all__ = [
    "SCHEMA",
    "CaptureProbe",
    "CompileReport",
    "CudagraphSkip",
    "GraphBreak",
    "MemoryReport",
    "RankSummary",
    "Report",
    "Site",
    "SiteKey",
    "Timeline",
    "Violation",
    "format_bytes",
    "hidden_fraction",
    "job_cost",
    "rank_ranges",
]

SCHEMA = "barrierguard.report/1"

# The report's JSON begins with these keys; the other fields follow in their order.
_FIRST_KEYS = [
    "schema",
    "engine",
    "detection",
    "policy",
    "steps",
    "warmup_steps",
    "measured_steps",
    "duration_s",
    "total_syncs",
    "step_syncs",
]

# Renderers by name, filled by ``barrierguard.report`` (the renderers import the records).
RENDERERS: dict[str, Callable[[Any], str]] = {}


@dataclass(frozen=True)
class MemoryReport(Record):
    """Memory per step, and whether it kept growing: the report's ``memory`` section.

    ``series[name][i]``: bytes at the end of step ``steps[i]`` (``None``: unreadable) for
    ``host_rss``, ``workers_rss``, ``device_allocated``, ``device_reserved``, ``device_used``
    (NVML); ``slopes``: robust growth in bytes per measured step; ``leak``: the verdict.

    Example:
        >>> m = MemoryReport(steps=(1, 2), series={"host_rss": (10, 10)})
        >>> MemoryReport.from_dict(m.to_dict()) == m
        True
    """

    steps: tuple[int, ...] = ()
    series: Mapping[str, tuple[int | None, ...]] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    verdict_series: tuple[str, ...] = ()
    slopes: Mapping[str, float] = field(default_factory=dict)
    growth_began_at: Mapping[str, int | None] = field(default_factory=dict)
    peak: Mapping[str, int] = field(default_factory=dict)
    peak_step: Mapping[str, int] = field(default_factory=dict)
    step_changes: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    growing: tuple[str, ...] = ()
    leak: bool = False
    threshold: int = 0
    warmup_steps: int = 0
    reason: str = ""
    pattern: str | None = None
    fix: str = ""
    evidence: str = ""
    sampling: str = ""
    notes: tuple[str, ...] = ()


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest decimal unit that keeps it above 1."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B"


@dataclass(frozen=True)
class Timeline(Record):
    """Per measured step on a GPU: host time, stall, device time, run-ahead, saving.

    ``device_s[i]``: ``None`` where only a sync could measure it; ``saving_s``: what
    removing the syncs would save, ``summary`` in words.
    """

    steps: tuple[int, ...] = ()
    host_s: tuple[float, ...] = ()
    stall_s: tuple[float, ...] = ()
    device_s: tuple[float | None, ...] = ()
    ahead: tuple[int, ...] = ()
    saving_s: float = 0.0
    saving_fraction: float = 0.0
    serialized: bool = False
    summary: str = ""
    sampling: str = ""


@dataclass(frozen=True)
class RankSummary(Record):
    """One rank of a merged report: its steps, syncs, stall and step time.

    ``host_step_s``/``device_step_s``: medians over its timed steps (``None``: none);
    ``wait_s``: its estimated wait per step for the gating site (0 where that site fires).
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
        """This rank's step time: the longer of its host and device medians."""
        known = [t for t in (self.host_step_s, self.device_step_s) if t is not None]
        return max(known) if known else None

    @property
    def syncs_per_step(self) -> float:
        """Blocking syncs per measured step on this rank."""
        return self.step_syncs / self.measured_steps if self.measured_steps else 0.0


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def hidden_fraction(timeline: Timeline | None) -> float | None:
    """The share of a rank's stall that lengthened its steps: saving over stall, at most 1."""
    if timeline is None or (stall := sum(timeline.stall_s)) <= 0:
        return None
    return max(0.0, min(1.0, timeline.saving_s / stall))


def _summary(rank: int, report: Report) -> RankSummary:
    measured, timeline = report.measured_steps, report.timeline or Timeline()
    stalls = [s.stall_s for s in report.sites if s.blocking and s.stall_s is not None]
    return RankSummary(
        rank=rank,
        steps=report.steps,
        measured_steps=measured,
        step_syncs=report.step_syncs,
        stall_per_step_s=sum(stalls) / measured if stalls and measured else None,
        host_step_s=_median(timeline.host_s),
        device_step_s=_median(timeline.device_s),
        timed_steps=len(timeline.host_s),
        stall_fraction=hidden_fraction(timeline),
    )


def job_cost(
    rank_stalls: Sequence[tuple[int, float]], summaries: Mapping[int, RankSummary]
) -> float | None:
    """Estimated time per step that a rank-asymmetric site costs every other rank.

    The largest stall per measured step times :func:`hidden_fraction` over the ranks
    in ``rank_stalls`` (``(rank, stall)``), capped by the shortest step of the ranks
    waiting for it; ``None`` when no stall was measured.
    """
    costs = [
        stall / s.measured_steps * (1.0 if s.stall_fraction is None else s.stall_fraction)
        for rank, stall in rank_stalls
        if (s := summaries.get(rank)) is not None and s.measured_steps
    ]
    if not costs:
        return None
    fired = {r for r, _ in rank_stalls}
    waiting = [s.step_s for r, s in summaries.items() if r not in fired and s.step_s is not None]
    return min([max(costs), *waiting])


def _merge_sites(
    group: Sequence[tuple[int, Site]], measured: int, summaries: Mapping[int, RankSummary]
) -> Site:
    sites = [s for _, s in group]
    rank_stalls = tuple((rank, s.stall_s) for rank, s in group if s.stall_s is not None)
    asymmetric = len(summaries) > 1 and len({rank for rank, _ in group}) < len(summaries)
    merged = add_sites(
        sites,
        steps=tuple(sorted({r for s in sites for r in s.steps})),
        stall_s=sum(stall for _, stall in rank_stalls) if rank_stalls else None,
        rank_counts=tuple((rank, s.count) for rank, s in group),
        rank_stalls=rank_stalls,
        asymmetric=asymmetric,
        job_cost_s=job_cost(rank_stalls, summaries) if asymmetric else None,
    )
    return replace(merged, per_step=merged.step_count / measured if measured else 0.0)


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks in few words: runs of consecutive ranks as ``a-b`` (``'0-3, 7, 9-10'``)."""
    pairs = enumerate(sorted(set(ranks)))
    runs = [[r for _, r in run] for _, run in groupby(pairs, lambda p: p[1] - p[0])]
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


@dataclass(frozen=True)
class Report:
    """What a guard found: the sites, the steps, and what the policy made of them.

    ``syncs_per_step[i]``: blocking syncs of step ``i`` (0: before the first step).
    ``print(report)`` shows the console table; :meth:`save` writes versioned JSON that
    :meth:`load` reads. ``rank``: the rank that wrote it (a :meth:`merge` holds the
    ranks' in ``ranks``); ``compile``: what torch.compile said (docs/compile.md).

    Example:
        >>> r = Report(engine="none", detection=False, policy="record")
        >>> Report.from_dict(r.to_dict()) == r
        True
    """

    engine: str
    detection: bool
    policy: str
    steps: int = 0
    warmup_steps: int = 0
    measured_steps: int = 0
    sites: tuple[Site, ...] = ()
    violations: tuple[Violation, ...] = ()
    syncs_per_step: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    duration_s: float = 0.0
    environment: Mapping[str, str] = field(default_factory=dict)
    schema: str = SCHEMA
    memory: MemoryReport | None = field(default=None, metadata=OMIT_NONE)
    timeline: Timeline | None = field(default=None, metadata=OMIT_NONE)
    epochs: tuple[int, ...] = field(default=(), metadata=OMIT_EMPTY)
    ranks: tuple[Report, ...] = field(default=(), metadata=OMIT_EMPTY)
    rank: int | None = field(default=None, metadata=OMIT_NONE)
    rank_summaries: tuple[RankSummary, ...] = field(default=(), metadata=OMIT_EMPTY)
    compile: CompileReport | None = field(default=None, metadata=OMIT_NONE)

    @property
    def total_syncs(self) -> int:
        """Number of blocking synchronizations recorded, setup included."""
        return sum(s.count for s in self.sites if s.blocking)

    @property
    def step_syncs(self) -> int:
        """Number of blocking synchronizations inside measured steps."""
        return sum(s.step_count for s in self.sites if s.blocking)

    @property
    def ok(self) -> bool:
        """True when the policy was not violated."""
        return not self.violations

    @property
    def gating_site(self) -> Site | None:
        """The rank-asymmetric site that holds the other ranks back most, if any: the
        largest ``job_cost_s``, or where none was measured, the most syncs in steps."""
        return min(
            (s for s in self.sites if s.asymmetric and s.blocking and s.step_count),
            key=lambda s: (s.job_cost_s is None, -(s.job_cost_s or 0.0), -s.step_count, *s.key[:2]),
            default=None,
        )

    def ranked(self) -> list[Site]:
        """Sites by cost: stall time where measured, else syncs in steps, then count."""
        return sorted(
            self.sites,
            key=lambda s: (s.allowed, -(s.stall_s or 0.0), -s.step_count, -s.count, *s.key[:4]),
        )

    @classmethod
    def merge(cls, reports: Sequence[Report]) -> Report:
        """One report for a distributed run: the ranks' reports, in rank order.

        Sites matched by :attr:`Site.key` sum their counts (per rank in ``rank_counts``
        and ``rank_stalls``); one that fired on some ranks only is ``asymmetric``, with
        ``job_cost_s``. Steps, policy, engine and memory are rank 0's; every report stays
        in ``ranks``. Ranks are the reports' own when all differ, else their indices.

        Args:
            reports: The ranks' reports.

        Raises:
            BarrierGuardError: When ``reports`` is empty.

        Example:
            >>> a = Report(engine="audit", detection=True, policy="record", steps=2)
            >>> Report.merge([a, a]).ranks == (a, a)
            True
        """
        if not reports:
            raise BarrierGuardError("Report.merge() needs at least one report (rank 0's)")
        # Sites in ranked order, as the JSON holds them: a merge equals its reload.
        reports = [r.with_sites(r.ranked()) for r in reports]
        by_rank = {r.rank: r for r in reports if r.rank is not None}
        if len(by_rank) < len(reports):
            by_rank = dict(enumerate(reports))
        by_rank = {rank: by_rank[rank] for rank in sorted(by_rank)}
        reports = list(by_rank.values())
        merged: dict[SiteKey, list[tuple[int, Site]]] = {}
        for rank, report in by_rank.items():
            for site in report.sites:
                merged.setdefault(site.key, []).append((rank, site))
        measured = sum(r.measured_steps for r in reports)
        summaries = {rank: _summary(rank, r) for rank, r in by_rank.items()}
        sites = [_merge_sites(group, measured, summaries) for group in merged.values()]
        per_step = zip_longest(*(r.syncs_per_step for r in reports), fillvalue=0)
        note = (
            f"merged from {len(reports)} ranks: counts are summed over ranks (per rank in each "
            "site's rank_counts), syncs_per_step is summed over ranks, steps and memory are "
            "rank 0's (every rank's report is under 'ranks')"
        )
        result = replace(
            reports[0],
            sites=tuple(sites),
            violations=tuple(v for r in reports for v in r.violations),
            syncs_per_step=tuple(sum(column) for column in per_step),
            notes=(*reports[0].notes, note),
            ranks=tuple(reports),
            rank=None,
            rank_summaries=tuple(summaries.values()),
        )
        result = result.with_sites(result.ranked())
        gate = result.gating_site
        if gate is None or gate.job_cost_s is None:
            return result
        fired = {r for r, _ in gate.rank_counts}
        waits = [
            replace(s, wait_s=0.0 if s.rank in fired else gate.job_cost_s)
            for s in summaries.values()
        ]
        return replace(result, rank_summaries=tuple(waits))

    def with_sites(self, sites: Sequence[Site]) -> Report:
        """A copy of this report holding ``sites`` instead."""
        return replace(self, sites=tuple(sites))

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able data (see docs/report-schema.md)."""
        data = to_json(self.with_sites(self.ranked()))
        data.update(total_syncs=self.total_syncs, step_syncs=self.step_syncs)
        if (gate := self.gating_site) is not None:
            named = ("file", "line", "kind", "origin", "location")
            data["gating"] = {
                **{k: getattr(gate, k) for k in named},
                "ranks": [r for r, _ in gate.rank_counts],
                "job_cost_s": gate.job_cost_s,
            }
        return {**{k: data.pop(k) for k in _FIRST_KEYS}, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "report") -> Report:
        """Rebuild a report from :meth:`to_dict` output.

        Raises:
            BarrierGuardError: When ``data`` is not a barrierguard report of a
                schema version this release reads.
        """
        check_schema(data, source, SCHEMA)
        try:
            return from_json(cls, data)
        except (KeyError, TypeError, ValueError) as err:
            raise BarrierGuardError(f"{source}: malformed report ({err!r})") from err

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the report as JSON to ``path``."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        """Read a report written by :meth:`save`.

        Raises:
            BarrierGuardError: When the file is missing, is not JSON, or is not
                a report this release reads; the message names the file.
        """
        name, data = read_json(path, "report")
        return cls.from_dict(data, source=name)

    def save_memory_chart(self, path: str | os.PathLike[str]) -> None:
        """Write the picture of memory per step as an SVG file to ``path``.

        Raises:
            BarrierGuardError: When the report has no memory section (the guard
                ran with ``memory=False``).
        """
        if self.memory is None:
            raise BarrierGuardError(
                "this report has no memory section (watch(memory=False)); nothing to chart"
            )
        write_text(path, RENDERERS["memory_svg"](self.memory))

    def __str__(self) -> str:
        return str(RENDERERS["console"](self))
