"""The report: plain, frozen records that round-trip through JSON."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from barrierguard._errors import BarrierGuardError
from barrierguard._jsonio import read_json, write_json

__all__ = ["SCHEMA", "MemoryReport", "Report", "Site", "Violation"]

SCHEMA = "barrierguard.report/1"


@dataclass(frozen=True)
class Site:
    """One place in the code that synchronizes, with everything known about it.

    ``file``/``line``/``function`` name the user's own frame; when the sync
    happened inside a framework (``origin`` ``"framework:<name>"``), the
    ``framework_*`` fields name the framework's line.

    Example:
        >>> s = Site(file="/w/train.py", line=12, function="train", code="loss.item()",
        ...          kind="item", origin="user", count=3, step_count=3, per_step=1.0)
        >>> s.location
        'train.py:12'
    """

    file: str
    line: int
    function: str
    code: str
    kind: str
    origin: str
    count: int
    detail: str = ""
    setup_count: int = 0
    step_count: int = 0
    per_step: float = 0.0
    steps: tuple[tuple[int, int], ...] = ()
    stall_s: float | None = None
    stall_count: int = 0
    setup_stall_s: float | None = None
    threads: tuple[str, ...] = ("MainThread",)
    allowed: bool = False
    blocking: bool = True
    fix: str = ""
    framework_file: str | None = None
    framework_line: int | None = None
    framework_function: str | None = None
    phases: tuple[tuple[str, int], ...] = ()
    mechanisms: tuple[tuple[str, int], ...] = ()
    rank_counts: tuple[tuple[int, int], ...] = ()

    @property
    def location(self) -> str:
        """``basename:line`` of the user's frame."""
        return f"{os.path.basename(self.file)}:{self.line}"

    @property
    def key(self) -> tuple[str, int, str, str]:
        """What makes two records the same site: file, line, kind and origin."""
        return (self.file, self.line, self.kind, self.origin)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["steps"] = [list(r) for r in self.steps]
        d["threads"] = list(self.threads)
        # Optional sections appear only when set, so reports of plain watch()
        # runs read exactly as before.
        for name in ("phases", "mechanisms"):
            pairs = d.pop(name)
            if pairs:
                d[name] = dict(pairs)
        ranks = d.pop("rank_counts")
        if ranks:
            d["rank_counts"] = {str(r): n for r, n in ranks}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Site:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["steps"] = tuple((int(a), int(b)) for a, b in data.get("steps", ()))
        kwargs["threads"] = tuple(data.get("threads", ("MainThread",)))
        for name in ("phases", "mechanisms"):
            kwargs[name] = tuple((str(k), int(v)) for k, v in dict(data.get(name, {})).items())
        kwargs["rank_counts"] = tuple(
            (int(k), int(v)) for k, v in dict(data.get("rank_counts", {})).items()
        )
        return cls(**kwargs)


def _sum_pairs(groups: Sequence[tuple[tuple[str, int], ...]]) -> tuple[tuple[str, int], ...]:
    total: dict[str, int] = {}
    for pairs in groups:
        for name, n in pairs:
            total[name] = total.get(name, 0) + n
    return tuple(total.items())


def _merge_sites(group: Sequence[tuple[int, Site]], measured: int) -> Site:
    first = group[0][1]
    ranges = sorted({r for _, s in group for r in s.steps})
    threads = dict.fromkeys(t for _, s in group for t in s.threads)
    step_count = sum(s.step_count for _, s in group)
    stalls = [s.stall_s for _, s in group if s.stall_s is not None]
    return replace(
        first,
        count=sum(s.count for _, s in group),
        setup_count=sum(s.setup_count for _, s in group),
        step_count=step_count,
        per_step=step_count / measured if measured else 0.0,
        steps=tuple(ranges),
        threads=tuple(threads),
        stall_s=sum(stalls) if stalls else None,
        phases=_sum_pairs([s.phases for _, s in group]),
        mechanisms=_sum_pairs([s.mechanisms for _, s in group]),
        rank_counts=tuple((rank, s.count) for rank, s in group),
    )


@dataclass(frozen=True)
class Violation:
    """A point where the policy was broken: which site, at which step, and why."""

    file: str
    line: int
    kind: str
    origin: str
    step: int
    reason: str
    thread: str = "MainThread"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Violation:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class MemoryReport:
    """Memory per step, and whether it kept growing: the report's ``memory`` section.

    ``series[name][i]`` is the value in bytes sampled at the end of step
    ``steps[i]`` (``None`` where that series could not be read then). Series:
    ``host_rss`` (this process), ``workers_rss`` (child processes such as
    DataLoader workers, when asked for), ``device_allocated`` and
    ``device_reserved`` (torch's CUDA caching allocator), ``device_used`` (the
    driver's view through NVML). ``slopes`` are robust growth rates in bytes per
    step over the measured (post warm-up) samples; ``leak`` is the verdict.

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

    def to_dict(self) -> dict[str, Any]:
        """The section as plain JSON-able data (the report's ``"memory"`` object)."""
        return {
            "steps": list(self.steps),
            "series": {k: list(v) for k, v in self.series.items()},
            "sources": dict(self.sources),
            "verdict_series": list(self.verdict_series),
            "slopes": dict(self.slopes),
            "growth_began_at": dict(self.growth_began_at),
            "peak": dict(self.peak),
            "peak_step": dict(self.peak_step),
            "step_changes": {k: [list(c) for c in v] for k, v in self.step_changes.items()},
            "growing": list(self.growing),
            "leak": self.leak,
            "threshold": self.threshold,
            "warmup_steps": self.warmup_steps,
            "reason": self.reason,
            "pattern": self.pattern,
            "fix": self.fix,
            "evidence": self.evidence,
            "sampling": self.sampling,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryReport:
        """Rebuild the section from :meth:`to_dict` output."""

        def _opt(v: Any) -> int | None:
            return None if v is None else int(v)

        return cls(
            steps=tuple(int(s) for s in data.get("steps", ())),
            series={k: tuple(_opt(v) for v in vs) for k, vs in data.get("series", {}).items()},
            sources={str(k): str(v) for k, v in data.get("sources", {}).items()},
            verdict_series=tuple(str(s) for s in data.get("verdict_series", ())),
            slopes={str(k): float(v) for k, v in data.get("slopes", {}).items()},
            growth_began_at={str(k): _opt(v) for k, v in data.get("growth_began_at", {}).items()},
            peak={str(k): int(v) for k, v in data.get("peak", {}).items()},
            peak_step={str(k): int(v) for k, v in data.get("peak_step", {}).items()},
            step_changes={
                str(k): tuple((int(a), int(b)) for a, b in v)
                for k, v in data.get("step_changes", {}).items()
            },
            growing=tuple(str(s) for s in data.get("growing", ())),
            leak=bool(data.get("leak", False)),
            threshold=int(data.get("threshold", 0)),
            warmup_steps=int(data.get("warmup_steps", 0)),
            reason=str(data.get("reason", "")),
            pattern=None if data.get("pattern") is None else str(data["pattern"]),
            fix=str(data.get("fix", "")),
            evidence=str(data.get("evidence", "")),
            sampling=str(data.get("sampling", "")),
            notes=tuple(str(n) for n in data.get("notes", ())),
        )


@dataclass(frozen=True)
class Timeline:
    """Per measured step on a GPU: host time, stall, device time, run-ahead, saving.

    ``device_s[i]`` is ``None`` where the device time could not be measured
    without a sync (the host was not ahead, so the device idled in between).
    ``saving_s`` estimates what removing the syncs would save over the run;
    ``summary`` says it in words.

    Example:
        >>> t = Timeline(steps=(1,), host_s=(0.002,), stall_s=(0.001,), device_s=(None,),
        ...              ahead=(0,), saving_s=0.001, serialized=True, summary="...")
        >>> Timeline.from_dict(t.to_dict()) == t
        True
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "host_s": list(self.host_s),
            "stall_s": list(self.stall_s),
            "device_s": list(self.device_s),
            "ahead": list(self.ahead),
            "saving_s": self.saving_s,
            "saving_fraction": self.saving_fraction,
            "serialized": self.serialized,
            "summary": self.summary,
            "sampling": self.sampling,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        return cls(
            steps=tuple(int(x) for x in data.get("steps", ())),
            host_s=tuple(float(x) for x in data.get("host_s", ())),
            stall_s=tuple(float(x) for x in data.get("stall_s", ())),
            device_s=tuple(None if x is None else float(x) for x in data.get("device_s", ())),
            ahead=tuple(int(x) for x in data.get("ahead", ())),
            saving_s=float(data.get("saving_s", 0.0)),
            saving_fraction=float(data.get("saving_fraction", 0.0)),
            serialized=bool(data.get("serialized", False)),
            summary=str(data.get("summary", "")),
            sampling=str(data.get("sampling", "")),
        )


@dataclass(frozen=True)
class Report:
    """What a guard found: the sites, the steps, and what the policy made of them.

    ``syncs_per_step[i]`` counts the blocking syncs of step ``i`` (index 0 is
    everything before the first step). ``print(report)`` shows the console table; :meth:`to_dict`/:meth:`save` write
    versioned JSON (``schema`` ``"barrierguard.report/1"``) that
    :meth:`from_dict`/:meth:`load` read back.

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
    memory: MemoryReport | None = None
    timeline: Timeline | None = None
    epochs: tuple[int, ...] = ()
    ranks: tuple[Report, ...] = ()

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

    def ranked(self) -> list[Site]:
        """Sites by cost: stall time where measured, else syncs in steps, then count."""
        return sorted(
            self.sites,
            key=lambda s: (
                s.allowed,
                -(s.stall_s or 0.0),
                -s.step_count,
                -s.count,
                s.file,
                s.line,
            ),
        )

    @classmethod
    def merge(cls, reports: Sequence[Report]) -> Report:
        """One report for a distributed run: the ranks' reports, in rank order.

        Sites are matched by :attr:`Site.key`; each merged site sums the
        counts over ranks and keeps them per rank in ``rank_counts``.
        ``per_step`` is the mean over ranks. Steps, policy, engine and memory
        are rank 0's; every rank's full report stays in ``ranks`` (memory per
        rank included).

        Args:
            reports: ``reports[i]`` is rank ``i``'s report.

        Raises:
            BarrierGuardError: When ``reports`` is empty.

        Example:
            >>> a = Report(engine="audit", detection=True, policy="record", steps=2)
            >>> Report.merge([a, a]).ranks == (a, a)
            True
        """
        if not reports:
            raise BarrierGuardError("Report.merge() needs at least one report (rank 0's)")
        merged: dict[tuple[str, int, str, str], list[tuple[int, Site]]] = {}
        for rank, report in enumerate(reports):
            for site in report.sites:
                merged.setdefault(site.key, []).append((rank, site))
        measured = sum(r.measured_steps for r in reports)
        sites = [_merge_sites(group, measured) for group in merged.values()]
        first = reports[0]
        per_step = [0] * max(len(r.syncs_per_step) for r in reports)
        for r in reports:
            for i, n in enumerate(r.syncs_per_step):
                per_step[i] += n
        notes = list(first.notes)
        notes.append(
            f"merged from {len(reports)} ranks: counts are summed over ranks (per rank in each "
            "site's rank_counts), syncs_per_step is summed over ranks, steps and memory are "
            "rank 0's (every rank's report is under 'ranks')"
        )
        return replace(
            first,
            sites=tuple(sites),
            violations=tuple(v for r in reports for v in r.violations),
            syncs_per_step=tuple(per_step),
            notes=tuple(notes),
            ranks=tuple(reports),
        )

    def with_sites(self, sites: Sequence[Site]) -> Report:
        """A copy of this report holding ``sites`` instead."""
        return replace(self, sites=tuple(sites))

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able data (see docs/report-schema.md)."""
        return {
            "schema": self.schema,
            "engine": self.engine,
            "detection": self.detection,
            "policy": self.policy,
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "measured_steps": self.measured_steps,
            "duration_s": self.duration_s,
            "total_syncs": self.total_syncs,
            "step_syncs": self.step_syncs,
            "sites": [s.to_dict() for s in self.ranked()],
            "violations": [v.to_dict() for v in self.violations],
            "syncs_per_step": list(self.syncs_per_step),
            "notes": list(self.notes),
            "environment": dict(self.environment),
            **({"memory": self.memory.to_dict()} if self.memory is not None else {}),
            **({"timeline": self.timeline.to_dict()} if self.timeline is not None else {}),
            **({"epochs": list(self.epochs)} if self.epochs else {}),
            **({"ranks": [r.to_dict() for r in self.ranks]} if self.ranks else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "report") -> Report:
        """Rebuild a report from :meth:`to_dict` output.

        Raises:
            BarrierGuardError: When ``data`` is not a barrierguard report of a
                schema version this release reads.
        """
        if not isinstance(data, Mapping):
            raise BarrierGuardError(f"{source}: expected a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise BarrierGuardError(
                f"{source}: schema {schema!r} is not supported; this barrierguard reads {SCHEMA!r}"
            )
        try:
            return cls(
                engine=str(data["engine"]),
                detection=bool(data["detection"]),
                policy=str(data["policy"]),
                steps=int(data.get("steps", 0)),
                warmup_steps=int(data.get("warmup_steps", 0)),
                measured_steps=int(data.get("measured_steps", 0)),
                sites=tuple(Site.from_dict(s) for s in data.get("sites", ())),
                violations=tuple(Violation.from_dict(v) for v in data.get("violations", ())),
                syncs_per_step=tuple(int(n) for n in data.get("syncs_per_step", ())),
                notes=tuple(data.get("notes", ())),
                duration_s=float(data.get("duration_s", 0.0)),
                environment=dict(data.get("environment", {})),
                memory=(
                    MemoryReport.from_dict(data["memory"])
                    if data.get("memory") is not None
                    else None
                ),
                timeline=(
                    Timeline.from_dict(data["timeline"])
                    if isinstance(data.get("timeline"), Mapping)
                    else None
                ),
                epochs=tuple(int(e) for e in data.get("epochs", ())),
                ranks=tuple(
                    cls.from_dict(r, source=f"{source} rank {i}")
                    for i, r in enumerate(data.get("ranks", ()))
                ),
            )
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
        from barrierguard._render.memory_chart import render_svg

        with open(path, "w", encoding="utf-8") as fh:
            fh.write(render_svg(self.memory))

    def __str__(self) -> str:
        from barrierguard._render.console import render

        return render(self)
