"""The report: plain, frozen records that round-trip through JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from barrierguard._errors import BarrierGuardError

__all__ = ["SCHEMA", "Report", "Site", "Violation"]

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
    threads: tuple[str, ...] = ("MainThread",)
    allowed: bool = False
    blocking: bool = True
    fix: str = ""
    framework_file: str | None = None
    framework_line: int | None = None
    framework_function: str | None = None

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
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Site:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["steps"] = tuple((int(a), int(b)) for a, b in data.get("steps", ()))
        kwargs["threads"] = tuple(data.get("threads", ("MainThread",)))
        return cls(**kwargs)


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
            )
        except (KeyError, TypeError, ValueError) as err:
            raise BarrierGuardError(f"{source}: malformed report ({err!r})") from err

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the report as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2)
            fh.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Report:
        """Read a report written by :meth:`save`.

        Raises:
            BarrierGuardError: When the file is missing, is not JSON, or is not
                a report this release reads; the message names the file.
        """
        name = os.fspath(path)
        try:
            with open(name, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError as err:
            raise BarrierGuardError(f"{name}: no such report file") from err
        except json.JSONDecodeError as err:
            raise BarrierGuardError(f"{name}: not JSON ({err})") from err
        return cls.from_dict(data, source=name)

    def __str__(self) -> str:
        from barrierguard._render.console import render

        return render(self)
