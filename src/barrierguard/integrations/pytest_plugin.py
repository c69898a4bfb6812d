"""The pytest plugin: watch tests for host-device synchronizations.

Registered through the ``pytest11`` entry point; it does nothing unless asked:

* ``--barrierguard=record|warn|error`` (or the ini key ``barrierguard``) watches
  every test; the command line wins over the ini file;
* ``@pytest.mark.barrierguard(...)`` watches one test, with its own options;
* the ``barrierguard`` fixture yields a running guard (to call ``guard.step()``).

Under ``error`` a test fails after its body when a sync broke the policy; the
failure lists every offending line with its kind, code and fix. Under ``warn``
each new site gives one :class:`~barrierguard.SyncWarning` (pytest's warning
summary shows them); ``record`` only counts. ``--barrierguard-report=FILE``
writes the sites of all watched tests as one report for ``barrierguard check``.

Under pytest-xdist each worker sends its tests' reports to the controller
(``workeroutput``, read in ``pytest_testnodedown``, as pytest-cov does), which
writes the one report file and the summary, as a serial run would.

As everywhere in barrierguard, syncs before the first step (``optimizer.step()``
or ``guard.step()``) are setup and never held against the policy.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from barrierguard._errors import BarrierGuardError
from barrierguard.report.records import Report, Site, SiteKey, Violation
from barrierguard.report.site_records import add_sites
from barrierguard.session.guard import Guard
from barrierguard.session.options import (
    GUARD_OPTIONS,
    POLICIES,
    make_options,
    parse_bytes,
    resolve_policy,
)
from barrierguard.session.watch import watch

__all__: list[str] = []

_MARK_OPTIONS = GUARD_OPTIONS
_MARKER_HELP = (
    f"barrierguard(**options): watch this test for host-device synchronizations; "
    f"the options of barrierguard.watch(): {', '.join(GUARD_OPTIONS)}"
)


@dataclass(frozen=True)
class _Plan:
    """How to watch one test: its policy, its memory budget, watch()'s other options."""

    policy: str
    max_growth_per_step: int | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Outcome:
    nodeid: str
    report: Report
    failed: bool


@dataclass
class _State:
    policy: str | None
    # The options of the command line and the ini file, which a marker overrides
    # or (allow) extends.
    defaults: dict[str, Any]
    report_path: str | None
    outcomes: list[_Outcome] = field(default_factory=list)


_STATE = pytest.StashKey[_State]()
_GUARD = pytest.StashKey[Guard]()
_PLAN = pytest.StashKey[_Plan]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("barrierguard", "host-device synchronizations (barrierguard)")
    group.addoption(
        "--barrierguard",
        dest="barrierguard",
        default=None,
        metavar="POLICY",
        help="watch every test: record, warn or error (overrides the ini key barrierguard)",
    )
    group.addoption(
        "--barrierguard-report",
        dest="barrierguard_report",
        default=None,
        metavar="FILE",
        help="write the sites of every watched test as one JSON report to FILE",
    )
    group.addoption(
        "--barrierguard-format",
        dest="barrierguard_format",
        default="text",
        choices=("text", "github", "sarif"),
        help="also write the sites in the measured steps as github (GitHub Actions "
        "annotations, one per site, on stdout) or sarif (a SARIF 2.1.0 log for code scanning)",
    )
    group.addoption(
        "--barrierguard-format-out",
        dest="barrierguard_format_out",
        default=None,
        metavar="FILE",
        help="write the --barrierguard-format output to FILE instead of the terminal "
        "(for sarif: default barrierguard.sarif)",
    )
    parser.addini("barrierguard", "watch every test: record, warn or error", default="")
    parser.addini("barrierguard_engine", "barrierguard engine: auto, cuda or audit", default="")
    parser.addini("barrierguard_allow", "barrierguard allow rules, one per line", type="linelist")
    parser.addini("barrierguard_warmup_steps", "barrierguard warm-up steps", default="")
    parser.addini(
        "barrierguard_max_syncs_per_step",
        "budget of syncs per step not allowed by a rule",
        default="",
    )
    parser.addini("barrierguard_report", "write one JSON report of all watched tests", default="")


def _int_ini(config: pytest.Config, name: str) -> int | None:
    raw = str(config.getini(name)).strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise pytest.UsageError(f"ini key {name} = {raw!r} is not valid: expected an int >= 0")
    return value


def _policy(config: pytest.Config) -> str | None:
    cli = config.getoption("barrierguard")
    if cli is not None:
        source, raw = "--barrierguard", str(cli)
    else:
        source, raw = "ini key barrierguard", str(config.getini("barrierguard"))
        if not raw.strip():
            return None
    value = raw.strip().lower()
    if value not in POLICIES:
        raise pytest.UsageError(
            f"{source}={raw!r} is not a valid policy: expected one of "
            + ", ".join(repr(p) for p in POLICIES)
        )
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", _MARKER_HELP)
    defaults: dict[str, Any] = {
        "engine": str(config.getini("barrierguard_engine")).strip() or "auto",
        "warmup_steps": _int_ini(config, "barrierguard_warmup_steps") or 0,
        "allow": tuple(str(r) for r in config.getini("barrierguard_allow")),
        "max_syncs_per_step": _int_ini(config, "barrierguard_max_syncs_per_step"),
    }
    try:
        # Validate once, up front: a typo in the ini file stops the run at once.
        make_options(policy="record", owner="barrierguard ini", **defaults)
    except BarrierGuardError as err:
        raise pytest.UsageError(str(err)) from err
    report_path = config.getoption("barrierguard_report") or (
        str(config.getini("barrierguard_report")).strip() or None
    )
    config.stash[_STATE] = _State(_policy(config), defaults, report_path)


def _plan(item: pytest.Item, state: _State, forced: bool) -> _Plan | None:
    mark = item.get_closest_marker("barrierguard")
    if mark is None and state.policy is None and not forced:
        return None
    kw: dict[str, Any] = dict(mark.kwargs) if mark is not None else {}
    if mark is not None and mark.args:
        raise BarrierGuardError(
            f"@pytest.mark.barrierguard{mark.args!r}: takes keyword arguments only; "
            f"accepted: {', '.join(_MARK_OPTIONS)}"
        )
    unknown = sorted(set(kw) - set(_MARK_OPTIONS))
    if unknown:
        raise BarrierGuardError(
            f"@pytest.mark.barrierguard: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(_MARK_OPTIONS)}"
        )
    owner = "@pytest.mark.barrierguard"
    policy = resolve_policy(kw.pop("policy", None) or state.policy, owner=owner)
    growth = kw.pop("max_growth_per_step", None)
    allow = kw.pop("allow", ())
    allow = (allow,) if isinstance(allow, str) else tuple(allow)
    options = {**state.defaults, **kw, "allow": state.defaults["allow"] + allow}
    # Validate now, so a bad marker is an error at setup, not a surprise later.
    make_options(policy=policy, owner=owner, **options)
    return _Plan(policy, None if growth is None else parse_bytes(growth, owner=owner), options)


def _start(plan: _Plan) -> Guard:
    # "error" records and fails the test afterwards, listing every offending
    # line: raising inside the test would show only the first one, and could be
    # caught by the test's own code.
    guard: Guard = watch(
        policy="warn" if plan.policy == "warn" else "record",
        max_growth_per_step="1MB" if plan.max_growth_per_step is None else plan.max_growth_per_step,
        **plan.options,
    )
    return guard.start()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    state = item.config.stash.get(_STATE, None)
    if state is None:
        return
    forced = "barrierguard" in getattr(item, "fixturenames", ())
    try:
        plan = _plan(item, state, forced)
    except BarrierGuardError as err:
        pytest.fail(str(err), pytrace=False)
    if plan is not None:
        item.stash[_PLAN] = plan


@pytest.fixture
def barrierguard(request: pytest.FixtureRequest) -> Iterator[Guard]:
    """A running guard for this test; call ``barrierguard.step()`` at each step.

    Its options come from ``--barrierguard``/the ini keys and the test's
    ``@pytest.mark.barrierguard``; the policy is checked when the test ends.

    Example:
        def test_loop(barrierguard):
            for batch in data:
                train_step(batch)
                barrierguard.step()
    """
    item = request.node
    plan = item.stash.get(_PLAN, None)
    if plan is None:  # the plugin's setup hook did not run (plugin loaded late)
        plan = _Plan("warn")
        item.stash[_PLAN] = plan
    guard = _start(plan)
    item.stash[_GUARD] = guard
    try:
        yield guard
    finally:
        guard.stop()


def _offenders(report: Report) -> list[tuple[Violation, Site | None]]:
    by_key = {(s.file, s.line, s.kind, s.origin): s for s in report.sites}
    seen: dict[tuple[str, int, str, str], tuple[Violation, Site | None]] = {}
    for v in report.violations:
        key = (v.file, v.line, v.kind, v.origin)
        seen.setdefault(key, (v, by_key.get(key)))
    return list(seen.values())


def _failure_text(report: Report, plan: _Plan) -> str:
    offenders = _offenders(report)
    most = plan.options.get("max_syncs_per_step")
    budget = f"a budget of {most} per step" if most is not None else "no budget"
    lines = [
        f"barrierguard: {len(report.violations)} synchronization(s) broke the policy "
        f"(error; {budget}; {report.measured_steps} measured steps) at {len(offenders)} line(s):"
    ]
    for v, site in offenders:
        code = site.code if site is not None else ""
        count = f", {site.step_count} in steps" if site is not None else ""
        lines.append(
            f"  {v.file}:{v.line}: {v.kind} ({v.origin}) first in step {v.step}{count}: {v.reason}"
        )
        if code:
            lines.append(f"      {code}")
        if site is not None and site.framework_file:
            lines.append(
                f"      inside {os.path.basename(site.framework_file)}:{site.framework_line}"
            )
        if site is not None and site.fix:
            lines.append(f"      fix: {site.fix}")
    if offenders:
        first = offenders[0][0]
        lines.append(
            "  to accept a line: @pytest.mark.barrierguard(allow="
            f"['{os.path.basename(first.file)}:{first.line}']) or allow=['{first.kind}'], "
            "or '# barrierguard: allow' on the line (docs/ci-gate.md)"
        )
    return "\n".join(lines)


def _growth_failure(report: Report) -> str | None:
    """A message when the memory verdict of ``report`` is a leak."""
    memory = report.memory
    if memory is None or not memory.leak:
        return None
    lines = [
        f"barrierguard: memory grows faster than max_growth_per_step ({memory.threshold:,} bytes):"
    ]
    lines.append(f"  {memory.reason}")
    if memory.fix:
        lines.append(f"  fix: {memory.fix}")
    return "\n".join(lines)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    plan = item.stash.get(_PLAN, None)
    if plan is None:
        return (yield)
    own = item.stash.get(_GUARD, None) is None
    guard = item.stash[_GUARD] if not own else _start(plan)
    try:
        result = yield
    finally:
        report = guard.stop() if own else guard.report
        failure = _judge(item, plan, report)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    return result


def _judge(item: pytest.Item, plan: _Plan, report: Report) -> str | None:
    """The failure message for this test, or None; never raises (a fault is a warning)."""
    try:
        failure = None
        if plan.policy == "error" and report.violations:
            failure = _failure_text(report, plan)
        if plan.max_growth_per_step is not None:
            grew = _growth_failure(report)
            if grew is not None:
                failure = grew if failure is None else failure + "\n" + grew
            elif report.memory is None or not report.memory.steps:
                warnings.warn(
                    pytest.PytestWarning(
                        f"{item.nodeid}: max_growth_per_step was not checked: the report has no "
                        "memory samples"
                    ),
                    stacklevel=1,
                )
        item.config.stash[_STATE].outcomes.append(
            _Outcome(item.nodeid, report, failure is not None)
        )
        return failure
    except Exception as exc:  # barrierguard's own bug must not decide the test
        warnings.warn(
            pytest.PytestWarning(
                f"{item.nodeid}: internal error in barrierguard: {type(exc).__name__}: {exc}"
            ),
            stacklevel=1,
        )
        return None


def _merge(outcomes: Sequence[_Outcome]) -> Report:
    """One report of many tests: sites of the same line summed, per step the highest."""
    sites: dict[SiteKey, Site] = {}
    for out in outcomes:
        for s in out.report.sites:
            old = sites.get(s.key)
            sites[s.key] = (
                replace(s, steps=())
                if old is None
                else add_sites(
                    [old, s],
                    per_step=max(old.per_step, s.per_step),
                    allowed=old.allowed and s.allowed,
                )
            )
    reports = [o.report for o in outcomes]
    first = reports[0]
    return Report(
        engine=first.engine,
        detection=all(r.detection for r in reports),
        policy=first.policy,
        steps=sum(r.steps for r in reports),
        warmup_steps=sum(r.warmup_steps for r in reports),
        measured_steps=sum(r.measured_steps for r in reports),
        sites=tuple(sites.values()),
        violations=tuple(v for r in reports for v in r.violations)[:1000],
        notes=(f"merged from {len(reports)} tests by the pytest plugin",),
        duration_s=sum(r.duration_s for r in reports),
        environment=dict(first.environment),
    )


_XDIST_KEY = "barrierguard"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand this worker's outcomes to the controller."""
    config = session.config
    state = config.stash.get(_STATE, None)
    output = getattr(config, "workeroutput", None)
    if state is None or output is None:
        return
    output[_XDIST_KEY] = json.dumps(
        [
            {"nodeid": o.nodeid, "failed": o.failed, "report": o.report.to_dict()}
            for o in state.outcomes
        ]
    )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the pytest-xdist controller: take in a finished worker's outcomes."""
    state = node.config.stash.get(_STATE, None)
    data = getattr(node, "workeroutput", {}).get(_XDIST_KEY)
    if state is None or not data:
        return
    try:
        for raw in json.loads(data):
            report = Report.from_dict(raw["report"], source=f"worker {raw['nodeid']}")
            state.outcomes.append(_Outcome(str(raw["nodeid"]), report, bool(raw["failed"])))
    except (BarrierGuardError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(
            pytest.PytestWarning(f"barrierguard: a worker's reports could not be read: {exc}"),
            stacklevel=1,
        )


def _ci_output(tr: Any, config: pytest.Config, merged: Report, outs: Sequence[_Outcome]) -> None:
    """GitHub annotations or a SARIF log of the watched tests' sites."""
    fmt = config.getoption("barrierguard_format", "text")
    if fmt == "text":
        return
    from barrierguard.report.render import github, sarif
    from barrierguard.session.site_stats import rule_table

    # A site fails where a test that barrierguard failed has a violation there.
    failed = [o.report for o in outs if o.failed]
    broke = {(v.file, v.line, v.kind, v.origin) for r in failed for v in r.violations}
    failing = {s.key for s in merged.sites if (s.file, s.line, s.kind, s.origin) in broke}
    if failing:
        merged = replace(merged, policy="error")
    path = config.getoption("barrierguard_format_out", None)
    if fmt == "github":
        text = github.render(merged, failing=failing)
    else:
        text = sarif.render(merged, rules=rule_table(), failing=failing)
        path = path or "barrierguard.sarif"
    if path is None:
        for line in text.splitlines():
            tr.write_line(line)
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        tr.write_line(f"{fmt} output written to {path}")
    except OSError as err:
        tr.write_line(f"could not write the {fmt} output to {path}: {err}", red=True)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not state.outcomes:
        return
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller sums up and writes the report
    outs = state.outcomes
    merged = _merge(outs)
    tr = terminalreporter
    tr.write_sep("=", "barrierguard")
    engines = sorted({o.report.engine for o in outs})
    failed = sum(o.failed for o in outs)
    no_steps = sum(1 for o in outs if o.report.steps == 0)
    tr.write_line(
        f"{len(outs)} test(s) watched (engine {', '.join(engines)}): {len(merged.sites)} site(s), "
        f"{merged.total_syncs} syncs ({merged.step_syncs} in measured steps), "
        f"{sum(len(o.report.violations) for o in outs)} policy violation(s), "
        f"{failed} test(s) failed by barrierguard"
    )
    if not merged.detection:
        tr.write_line("no detection ran in some tests (no CUDA, and no CPU engine chosen)")
    if no_steps:
        tr.write_line(
            f"{no_steps} test(s) saw no step boundary: their syncs are setup, never held "
            "against the policy (call optimizer.step() or barrierguard.step())"
        )
    for site in merged.ranked()[:5]:
        if site.step_count:
            tr.write_line(
                f"  {site.location} {site.kind} ({site.origin}): {site.step_count} in steps, "
                f"{site.per_step:.2f} per step: {site.code}"
            )
    _ci_output(tr, config, merged, outs)
    if state.report_path:
        try:
            merged.save(state.report_path)
            tr.write_line(f"report written to {state.report_path}")
        except OSError as err:
            tr.write_line(f"could not write the report to {state.report_path}: {err}", red=True)
