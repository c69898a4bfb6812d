"""Options of a guard, validated in one place, at construction."""

from __future__ import annotations

import difflib
import fnmatch
import inspect
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeGuard

from barrierguard._errors import BarrierGuardError
from barrierguard.detect import frameworks
from barrierguard.detect.kinds import KINDS, kind_named

__all__ = [
    "ENGINES",
    "GUARD_OPTIONS",
    "POLICIES",
    "REPORT_OPTIONS",
    "AllowRule",
    "Options",
    "ReportOptions",
    "make_options",
    "make_report_options",
    "parse_allow",
    "parse_bytes",
    "parse_out",
]

POLICIES = ("record", "warn", "error")
ENGINES = ("auto", "cuda", "audit")
DEFAULT_POLICY = "warn"
POLICY_ENV = "BARRIERGUARD_POLICY"

_ALLOW_FORMS = (
    "a line rule 'path/to/file.py:LINE' with LINE one of N, N-M or * (e.g. 'train.py:42', "
    "'train.py:40-50', 'src/*/metrics.py:*'), a kind or rule code (e.g. 'item', 'BG101'), "
    "an origin ('user', 'framework:<name>', 'framework:*'), or a framework mechanism "
    "('mechanism:<name>', e.g. 'mechanism:hf_logging'); the kinds are "
    + ", ".join(sorted(KINDS))
    + " (docs/rules.md)"
)
_MECHANISMS = tuple(m.name for m in frameworks.MECHANISMS)


@dataclass(frozen=True)
class AllowRule:
    """One allow rule, parsed from its string form (see :func:`parse_allow`)."""

    text: str
    kind: str | None = None
    origin: str | None = None
    path: str | None = None
    first_line: int = 0
    last_line: int = 0
    mechanism: str | None = None

    def matches(
        self, file: str, line: int, kind: str, origin: str, mechanism: str | None = None
    ) -> bool:
        """Whether a sync at ``file:line`` of ``kind``, ``origin`` and ``mechanism`` is allowed."""
        if self.mechanism is not None:
            return mechanism == self.mechanism
        if self.kind is not None:
            return kind == self.kind
        if self.origin == "framework:*":
            return origin.startswith("framework:")
        if self.origin is not None:
            return origin == self.origin or origin.startswith(self.origin + ".")
        assert self.path is not None
        if self.last_line and not self.first_line <= line <= self.last_line:
            return False
        norm = file.replace(os.sep, "/")
        tail = self.path.lstrip("/")
        return (
            fnmatch.fnmatchcase(norm, self.path)
            or fnmatch.fnmatchcase(norm, "*/" + tail)
            or norm.endswith("/" + tail)
        )


def parse_allow(rule: str) -> AllowRule:
    """Parse one allow rule (the forms: ``_ALLOW_FORMS``); a malformed one is an error."""
    if not isinstance(rule, str):
        raise BarrierGuardError(f"allow rule {rule!r} is not a string: expected {_ALLOW_FORMS}")
    text = rule.strip()
    kind = kind_named(text)
    if kind is not None:
        return AllowRule(text=rule, kind=kind)
    if text == "user" or (text.startswith("framework:") and len(text) > len("framework:")):
        return AllowRule(text=rule, origin=text)
    if text.startswith("mechanism:"):
        name = text[len("mechanism:") :]
        if name in _MECHANISMS:
            return AllowRule(text=rule, mechanism=name)
        raise BarrierGuardError(
            f"allow rule {rule!r} names no known framework mechanism"
            f"{_did_you_mean(name, _MECHANISMS, 'mechanism:{}')}; the mechanisms "
            f"are {', '.join(_MECHANISMS)} (docs/frameworks.md)"
        )
    path, _, spec = text.rpartition(":")
    if path and spec == "*":
        return AllowRule(text=rule, path=path)
    lo, sep, hi = spec.partition("-")
    if path and lo.isdigit() and (not sep or hi.isdigit()):
        first, last = int(lo), int(hi) if sep else int(lo)
        if first <= last:
            return AllowRule(text=rule, path=path, first_line=first, last_line=last)
    raise BarrierGuardError(
        f"allow rule {rule!r} is malformed{_did_you_mean(text, KINDS)}: expected {_ALLOW_FORMS}"
    )


def _did_you_mean(name: str, choices: Iterable[str], form: str = "{}") -> str:
    hint = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {form.format(hint[0])!r}?)" if hint else ""


@dataclass(frozen=True)
class Options:
    """A guard's validated options."""

    policy: str
    engine: str
    warmup_steps: int
    allow: tuple[AllowRule, ...]
    max_syncs_per_step: int | None
    memory: bool = True
    max_growth_per_step: int = 1_000_000
    memory_every: int | None = None
    memory_children: bool = False
    out: str | None = None
    capture_probe: bool | str = False

    def allowed(
        self, file: str, line: int, kind: str, origin: str, mechanism: str | None = None
    ) -> bool:
        # MetricBuffer.compute(), the deliberate transfer barrierguard recommends: no violation.
        if origin == "framework:barrierguard":
            return True
        return any(r.matches(file, line, kind, origin, mechanism) for r in self.allow)


def _invalid(owner: str, name: str, value: object, expected: str) -> BarrierGuardError:
    return BarrierGuardError(f"{owner}({name}={value!r}) is not valid: expected {expected}")


def _is_int(value: object, least: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _choice(value: object, choices: tuple[str, ...], what: str, name: str) -> str:
    """``value`` normalized, if one of ``choices``; ``what``: the setting as the error shows it."""
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise BarrierGuardError(
        f"{what} is not a valid {name}: expected one of {', '.join(repr(c) for c in choices)}"
    )


def resolve_policy(value: str | None, owner: str = "watch") -> str:
    """The policy to use: ``value``, else ``$BARRIERGUARD_POLICY``, else ``"warn"``."""
    if value is not None:
        return _choice(value, POLICIES, f"{owner}(policy={value!r})", "policy")
    env = os.environ.get(POLICY_ENV, "")
    if not env.strip():
        return DEFAULT_POLICY
    return _choice(env, POLICIES, f"{POLICY_ENV}={env!r}", "policy")


def _count(owner: str, name: str, value: object, expected: str, least: int = 0) -> int | None:
    if value is None or _is_int(value, least):
        return value
    raise _invalid(owner, name, value, expected)


def _probe(owner: str, value: object) -> bool | str:
    if isinstance(value, bool) or (isinstance(value, str) and value.isidentifier()):
        return value
    raise _invalid(
        owner,
        "capture_probe",
        value,
        "True (the decorated step function), False, or the name of the step function to probe, "
        "e.g. 'train_step'",
    )


def make_options(
    *,
    policy: str | None = None,
    engine: str = "auto",
    warmup_steps: int = 0,
    allow: Iterable[str] | str = (),
    max_syncs_per_step: int | None = None,
    memory: bool = True,
    max_growth_per_step: int | str = "1MB",
    memory_every: int | None = None,
    memory_children: bool = False,
    out: str | os.PathLike[str] | None = None,
    capture_probe: bool | str = False,
    owner: str = "watch",
) -> Options:
    """Validate and freeze a guard's options; every error names the argument. The one
    declaration of the options that ``watch()``, the callbacks and the pytest marker take."""
    if isinstance(allow, str):
        allow = [allow]
    elif not isinstance(allow, Iterable) or isinstance(allow, (bytes, dict)):
        raise _invalid(
            owner, "allow", allow, f"a rule or a list of rules (() for none), each {_ALLOW_FORMS}"
        )
    if not _is_int(warmup_steps, 0):
        raise _invalid(owner, "warmup_steps", warmup_steps, "a non-negative int")
    return Options(
        policy=resolve_policy(policy, owner),
        engine=_choice(engine, ENGINES, f"{owner}(engine={engine!r})", "engine"),
        warmup_steps=warmup_steps,
        allow=tuple(parse_allow(r) for r in list(allow)),
        max_syncs_per_step=_count(
            owner, "max_syncs_per_step", max_syncs_per_step, "a non-negative int or None"
        ),
        memory=_flag(owner, "memory", memory),
        max_growth_per_step=parse_bytes(max_growth_per_step, owner=owner),
        memory_every=_count(
            owner,
            "memory_every",
            memory_every,
            "None (adaptive sampling) or an int >= 1 (sample every N steps)",
            least=1,
        ),
        memory_children=_flag(owner, "memory_children", memory_children),
        out=parse_out(out, owner=owner),
        capture_probe=_probe(owner, capture_probe),
    )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_UNITS.update(kib=2**10, mib=2**20, gib=2**30)
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object, *, owner: str = "watch", name: str = "max_growth_per_step") -> int:
    """A size in bytes: an int, or a number with a unit (``"1.5MiB"``, ``"512KB"``)."""
    if _is_int(value, 0):
        return value
    match = _BYTES_RE.match(value) if isinstance(value, str) else None
    if match is not None and match.group(2).lower() in _UNITS:
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise BarrierGuardError(
        f"{owner}({name}={value!r}) is not a valid size: expected an int number of bytes (>= 0) "
        "or a string like '512KB', '1MB', '1.5MiB', '2GB' (B, KB/MB/GB = 1000^n, "
        "KiB/MiB/GiB = 1024^n)"
    )


def parse_out(value: object, *, owner: str = "watch", name: str = "out") -> str | None:
    """A report path (``{rank}`` allowed, see ``rank_reports.rank_path``), or ``None``."""
    if value is None:
        return None
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if isinstance(text, str) and text.strip():
        return text
    raise _invalid(
        owner,
        name,
        value,
        "None or a file path such as 'report.json' (each rank of a distributed run writes "
        "report.rank<N>.json) or 'report-{rank}.json'",
    )


def _flag(owner: str, name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise _invalid(owner, name, value, "True or False")


# The options of every entry point (out and capture_probe are watch()'s own), and those
# of the framework adapters' end-of-run report (make_report_options).
GUARD_OPTIONS = tuple(
    name
    for name in inspect.signature(make_options).parameters
    if name not in ("out", "owner", "capture_probe")
)
REPORT_OPTIONS = ("print_report", "save_report", "rank_reports", "merge_ranks")


def unknown_options(owner: str, unknown: Iterable[str], accepted: Iterable[str]) -> TypeError:
    """A TypeError for unknown keyword arguments, naming the accepted ones."""
    accepted = sorted(accepted)
    parts = [f"{n!r}{_did_you_mean(n, accepted)}" for n in sorted(unknown)]
    return TypeError(
        f"{owner}() got unknown keyword argument(s) {', '.join(parts)}; "
        f"accepted: {', '.join(accepted)}"
    )


@dataclass(frozen=True)
class ReportOptions:
    """Where a framework adapter puts its report at the end of a run."""

    print_report: bool
    save_report: bool | str | os.PathLike[str]
    rank_reports: bool | str | os.PathLike[str]
    merge_ranks: bool


def _setting(owner: str, name: str, value: object, true: str) -> bool | str | os.PathLike[str]:
    if isinstance(value, (bool, str, os.PathLike)):
        return value
    raise _invalid(owner, name, value, f"True ({true}), False, or a file path")


def make_report_options(
    owner: str,
    where: str,
    *,
    print_report: object,
    save_report: object,
    rank_reports: object,
    merge_ranks: object,
) -> ReportOptions:
    """Validate an adapter's report options (``where``: the folder ``True`` means)."""
    rank_file = f"barrierguard_report.rank{{rank}}.json in {where}"
    saved = _setting(owner, "save_report", save_report, f"barrierguard_report.json in {where}")
    ranks = _setting(owner, "rank_reports", rank_reports, f"each rank writes {rank_file}")
    if not isinstance(rank_reports, bool):
        parse_out(rank_reports, owner=owner, name="rank_reports")
    if merge_ranks is False and rank_reports is False:
        raise BarrierGuardError(
            f"{owner}(merge_ranks=False) keeps each rank's report in its own process only: "
            f"also pass rank_reports=True (each rank writes {rank_file}) or a path, and join "
            "the files with barrierguard merge"
        )
    return ReportOptions(
        _flag(owner, "print_report", print_report),
        saved,
        ranks,
        _flag(owner, "merge_ranks", merge_ranks),
    )
