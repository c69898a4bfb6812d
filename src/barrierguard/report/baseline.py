"""The ratchet: today's sites saved as a baseline, and a check that forbids new ones.

A site is matched by (file, function, code, kind), not by its line, and an edited
line by its place; only sites in the loop can regress (docs/ci-gate.md).
"""

from __future__ import annotations

import difflib
import io
import os
import tokenize
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from barrierguard._errors import BarrierGuardError
from barrierguard.report.codec import Record, from_json
from barrierguard.report.jsonio import check_schema, read_json, write_json
from barrierguard.report.records import Report, Site
from barrierguard.report.render.github import relative

__all__ = [
    "BASELINE_SCHEMA",
    "Baseline",
    "Entry",
    "Finding",
    "compare",
    "make_baseline",
    "normalize_code",
    "site_key",
]

BASELINE_SCHEMA = "barrierguard.baseline/1"

# per_step is a float ratio; two runs of the same code can differ in the last bits.
_EPS = 1e-9

# An edited line is the baseline's site when its code is this alike (difflib's ratio),
# or it is this many lines away at most.
_SIMILAR = 0.6
_NEAR_LINES = 5

Key = tuple[str, str, str, str]


def normalize_code(code: str) -> str:
    """The code text as matched: comments dropped, whitespace runs collapsed."""
    text = code.strip()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        # A line cut from a multi-line statement need not tokenize on its own.
        return " ".join(text.split())
    comments = [t.start[1] for t in tokens if t.type == tokenize.COMMENT]
    return " ".join(text[: comments[0] if comments else None].split())


def site_key(site: Site, root: str | None = None) -> Key:
    """The key a site is matched by; a file outside ``root`` is named by its basename."""
    path = relative(site.file, root)
    return (
        os.path.basename(path) if os.path.isabs(path) else path,
        site.function,
        normalize_code(site.code),
        site.kind,
    )


def _counts(site: Site) -> bool:
    return site.blocking and not site.allowed


@dataclass(frozen=True)
class Entry(Record):
    """One baseline entry: a key, how many lines share it, and their syncs per step."""

    file: str
    function: str
    code: str
    kind: str
    lines: int = 1
    per_step: float = 0.0
    count: int = 0
    line: int = 0

    @property
    def key(self) -> Key:
        return (self.file, self.function, self.code, self.kind)

    @property
    def in_loop(self) -> bool:
        """Whether the site synced in measured steps (only those can regress)."""
        return self.per_step > _EPS

    def label(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where} in {self.function}(): {self.code!r} [{self.kind}]"


def _entries(sites: Iterable[Site], root: str | None) -> dict[Key, Entry]:
    out: dict[Key, Entry] = {}
    for site in filter(_counts, sites):
        key = site_key(site, root)
        old = out.get(key) or Entry(*key, 0, 0.0, 0, site.line)
        lines, per_step, count = old.lines + 1, old.per_step + site.per_step, old.count + site.count
        out[key] = Entry(*key, lines, per_step, count, min(old.line, site.line))
    return out


@dataclass(frozen=True)
class Baseline(Record):
    """Today's accepted sites, saved with :meth:`save` and read with :meth:`load`."""

    schema: str = BASELINE_SCHEMA
    engine: str = ""
    source: str = ""
    entries: tuple[Entry, ...] = field(default=(), metadata={"key": "sites"})

    def by_key(self) -> dict[Key, Entry]:
        return {e.key: e for e in self.entries}

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "baseline") -> Baseline:
        """Rebuild a baseline from :meth:`to_dict` output.

        Raises:
            BarrierGuardError: When ``data`` is not a baseline of a schema
                version this release reads; the message starts with ``source``.
        """
        hint = ""
        if isinstance(data, Mapping) and str(data.get("schema")).startswith("barrierguard.report/"):
            hint = (
                " (this is a report: make a baseline from it with "
                "'barrierguard baseline REPORT.json -o BASELINE.json')"
            )
        check_schema(data, source, BASELINE_SCHEMA, " (a barrierguard baseline)", hint)
        if not isinstance(data.get("sites"), list):
            raise BarrierGuardError(f"{source}: malformed baseline ('sites' must be a list)")
        try:
            return from_json(cls, data)
        except ValueError as err:  # only a site can fail to read: "[INDEX]: ERROR"
            raise BarrierGuardError(
                f"{source}: malformed baseline (sites{err}; each site needs "
                "file, function, code and kind)"
            ) from err

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the baseline as JSON to ``path``."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Baseline:
        """Read a baseline written by :meth:`save`.

        Raises:
            BarrierGuardError: When the file is missing, is not JSON, or is not
                a baseline this release reads; the message names the file.
        """
        name, data = read_json(path, "baseline")
        return cls.from_dict(data, source=name)


def make_baseline(report: Report, root: str | None = None, source: str = "") -> Baseline:
    """Today's blocking sites of ``report`` that no rule allows, as a baseline; files
    under ``root`` (default: the current directory) are keyed by their relative path."""
    entries = sorted(_entries(report.sites, root).values(), key=lambda e: e.key)
    return Baseline(entries=tuple(entries), engine=report.engine, source=source)


@dataclass(frozen=True)
class Finding:
    """One way a report is worse than the baseline (or, for ``gone``, better)."""

    # "new", "more" (more lines share the key), "grew" (per step), "gone",
    # "matched" (an edited line matched to the baseline's entry by its place)
    change: str
    entry: Entry
    before: Entry | None = None
    site: Site | None = None

    @property
    def fails(self) -> bool:
        """A regression: a new site, more lines or more syncs per step *in the loop*."""
        return self.change in ("new", "more", "grew") and self.entry.in_loop

    def explain(self) -> str:
        e, b = self.entry, self.before
        if self.change in ("new", "more") and not e.in_loop:
            what = "new site" if self.change == "new" else "more lines"
            return (
                f"{what} outside the loop (setup, warm-up or a phase counted apart; "
                f"never a regression): {e.label()}"
            )
        if self.change == "matched" and b is not None:
            return (
                f"edited: {e.label()} is the baseline's {b.code!r}"
                f"{f' (line {b.line})' if b.line else ''}, matched by its place"
            )
        if self.change == "new":
            text = f"new site: {e.label()} - {e.per_step:.2f} syncs per step"
        elif self.change == "more" and b is not None:
            text = f"more lines: {e.label()} - {e.lines} lines now, {b.lines} in the baseline"
        elif self.change == "grew" and b is not None:
            text = (
                f"more syncs per step: {e.label()} - {e.per_step:.2f} per step now, "
                f"{b.per_step:.2f} in the baseline"
            )
        else:
            text = f"gone: {e.label()}"
        if self.fails and self.site is not None and self.site.fix:
            text += f"\n    fix: {self.site.fix}"
        return text


def compare(
    baseline: Baseline, report: Report, root: str | None = None, tolerance: float = 0.0
) -> list[Finding]:
    """What ``report`` adds over ``baseline``: new sites, more lines, more syncs per step.

    Only sites in the loop fail, never ``"matched"`` (an edited line found by its place)
    or ``"gone"`` (listed last). ``tolerance``: how much a site's syncs per step may
    grow; ``root`` as for :func:`make_baseline`.

    Raises:
        BarrierGuardError: When ``tolerance`` is negative.
    """
    if not tolerance >= 0:
        raise BarrierGuardError(f"tolerance={tolerance!r} is not valid: expected a number >= 0")
    old = baseline.by_key()
    first_site: dict[Key, Site] = {}
    for ranked in filter(_counts, report.ranked()):
        first_site.setdefault(site_key(ranked, root), ranked)
    found: list[Finding] = []
    now = _entries(report.sites, root)
    unmatched = {key: entry for key, entry in old.items() if key not in now}
    for key, entry in sorted(now.items(), key=lambda kv: (kv[1].file, kv[1].line)):
        site = first_site.get(key)
        if (before := old.get(key)) is None:
            if (before := _by_place(entry, unmatched)) is None:
                found.append(Finding("new", entry, None, site))
                continue
            found.append(Finding("matched", entry, before, site))
        if entry.lines > before.lines:
            found.append(Finding("more", entry, before, site))
        elif entry.per_step > before.per_step + tolerance + _EPS:
            found.append(Finding("grew", entry, before, site))
    return found + [Finding("gone", entry) for entry in unmatched.values()]


def _by_place(entry: Entry, unmatched: dict[Key, Entry]) -> Entry | None:
    """The entry of the same file, function and kind that ``entry`` is an edit of (the
    most alike, then the nearest), taken out of ``unmatched``; None if none is close."""
    close: list[tuple[float, int, Key]] = []
    for key, old in unmatched.items():
        if (old.file, old.function, old.kind) != (entry.file, entry.function, entry.kind):
            continue
        alike = difflib.SequenceMatcher(None, old.code, entry.code).ratio()
        apart = abs(old.line - entry.line) if old.line and entry.line else _NEAR_LINES + 1
        if alike >= _SIMILAR or apart <= _NEAR_LINES:
            close.append((alike, -apart, key))
    return unmatched.pop(max(close, key=lambda c: c[:2])[2]) if close else None
