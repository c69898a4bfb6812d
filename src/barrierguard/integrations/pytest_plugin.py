"""The pytest plugin (entry point ``pytest11``): watch tests for host-device synchronizations.

Off unless asked: ``--barrierguard=record|warn|error`` (or the ini key) watches every test,
``@pytest.mark.barrierguard(...)`` one test with its own options, and the ``barrierguard`` fixture
yields a running guard. Under ``error`` a test fails after its body, listing every offending line.
pytest-xdist workers send their reports to the controller (``workeroutput``), which sums up.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from barrierguard._errors import BarrierGuardError
from barrierguard.report.records import Report, Site, SiteKey
from barrierguard.report.render.console import violation_groups
from barrierguard.report.site_records import add_sites
from barrierguard.session.guard import Guard
from barrierguard.session.options import (
    GUARD_OPTIONS,
    POLICIES,
    Options,
    make_options,
    resolve_policy,
)
from barrierguard.session.site_stats import ci_text

__all__: list[str] = []


@dataclass(frozen=True)
class _Plan:
    """How to watch one test: its guard's options, its policy, its memory budget (if any)."""

    options: Options
    policy: str
    max_growth_per_step: int | None = None


@dataclass
class _Outcome:
    nodeid: str
    report: Report
    failed: bool


@dataclass
class _State:
    policy: str | None
    defaults: dict[str, Any]  # the ini file's options: a marker overrides or (allow) extends
    report_path: str | None
    outcomes: list[_Outcome] = field(default_factory=list)


_STATE = pytest.StashKey[_State]()
_GUARD = pytest.StashKey[Guard]()
_PLAN = pytest.StashKey[_Plan]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("barrierguard", "host-device synchronizations (barrierguard)")
    group.addoption(
        "--barrierguard",
        metavar="POLICY",
        help="watch every test: record, warn or error (overrides the ini key barrierguard)",
    )
    group.addoption(
        "--barrierguard-report",
        metavar="FILE",
        help="write the sites of every watched test as one JSON report to FILE",
    )
    group.addoption(
        "--barrierguard-format",
        default="text",
        choices=("text", "github", "sarif"),
        help="also write the sites in the measured steps as github (GitHub Actions "
        "annotations, one per site, on stdout) or sarif (a SARIF 2.1.0 log for code scanning)",
    )
    group.addoption(
        "--barrierguard-format-out",
        metavar="FILE",
        help="write the --barrierguard-format output to FILE instead of the terminal "
        "(for sarif: default barrierguard.sarif)",
    )
    parser.addini("barrierguard_allow", "barrierguard allow rules, one per line", type="linelist")
    for name, text in (
        ("barrierguard", "watch every test: record, warn or error"),
        ("barrierguard_engine", "barrierguard engine: auto, cuda or audit"),
        ("barrierguard_warmup_steps", "barrierguard warm-up steps"),
        ("barrierguard_max_syncs_per_step", "budget of syncs per step not allowed by a rule"),
        ("barrierguard_report", "write one JSON report of all watched tests"),
    ):
        parser.addini(name, text, default="")


def _int_ini(config: pytest.Config, name: str) -> int | None:
    raw = str(config.getini(name)).strip()
    try:
        value = int(raw) if raw else None
    except ValueError:
        value = -1
    if value is not None and value < 0:
        raise pytest.UsageError(f"ini key {name} = {raw!r} is not valid: expected an int >= 0")
    return value


def _policy(config: pytest.Config) -> str | None:
    cli = config.getoption("barrierguard")
    raw = str(config.getini("barrierguard") if cli is None else cli)
    policy = raw.strip().lower()
    if policy in POLICIES or (cli is None and not policy):
        return policy or None
    source = "ini key barrierguard" if cli is None else "--barrierguard"
    raise pytest.UsageError(
        f"{source}={raw!r} is not a valid policy: expected one of "
        + ", ".join(repr(p) for p in POLICIES)
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "barrierguard(**options): watch this test for host-device synchronizations; "
        f"the options of barrierguard.watch(): {', '.join(GUARD_OPTIONS)}",
    )
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


def _plan(mark: pytest.Mark | None, state: _State) -> _Plan:
    owner, accepted = "@pytest.mark.barrierguard", ", ".join(GUARD_OPTIONS)
    if mark is not None and mark.args:
        raise BarrierGuardError(
            f"{owner}{mark.args!r}: takes keyword arguments only; accepted: {accepted}"
        )
    kw: dict[str, Any] = dict(mark.kwargs) if mark is not None else {}
    if unknown := sorted(set(kw) - set(GUARD_OPTIONS)):
        raise BarrierGuardError(
            f"{owner}: unknown option(s) {', '.join(map(repr, unknown))}; accepted: {accepted}"
        )
    policy = resolve_policy(kw.pop("policy", None) or state.policy, owner=owner)
    growth = kw.pop("max_growth_per_step", None)
    allow = kw.pop("allow", ())
    allow = state.defaults["allow"] + ((allow,) if isinstance(allow, str) else tuple(allow))
    # Made at setup, so a bad marker fails there. "error" records, then fails the test listing
    # every offending line (raising inside the test would show one, and could be caught).
    options = make_options(
        policy="warn" if policy == "warn" else "record",
        owner=owner,
        max_growth_per_step="1MB" if growth is None else growth,
        **{**state.defaults, **kw, "allow": allow},
    )
    return _Plan(options, policy, None if growth is None else options.max_growth_per_step)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    state = item.config.stash.get(_STATE, None)
    mark = item.get_closest_marker("barrierguard")
    forced = "barrierguard" in getattr(item, "fixturenames", ())
    if state is not None and (mark is not None or state.policy is not None or forced):
        try:
            item.stash[_PLAN] = _plan(mark, state)
        except BarrierGuardError as err:
            pytest.fail(str(err), pytrace=False)


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
    if _PLAN not in item.stash:  # the plugin's setup hook did not run (plugin loaded late)
        item.stash[_PLAN] = _Plan(make_options(policy="warn"), "warn")
    guard = item.stash[_GUARD] = Guard(item.stash[_PLAN].options).start()
    try:
        yield guard
    finally:
        guard.stop()


def _failure_text(report: Report, plan: _Plan) -> str:
    sites = {(s.file, s.line, s.kind, s.origin): s for s in report.sites}
    offenders = violation_groups(report)
    most = plan.options.max_syncs_per_step
    budget = f"a budget of {most} per step" if most is not None else "no budget"
    lines = [
        f"barrierguard: {len(report.violations)} synchronization(s) broke the policy "
        f"(error; {budget}; {report.measured_steps} measured steps) at {len(offenders)} line(s):"
    ]
    for key, (v, *_) in offenders.items():
        site = sites.get(key)
        count = f", {site.step_count} in steps" if site is not None else ""
        lines.append(
            f"  {v.file}:{v.line}: {v.kind} ({v.origin}) first in step {v.step}{count}: {v.reason}"
        )
        if site is None:
            continue
        if site.code:
            lines.append(f"      {site.code}")
        if site.framework_file:
            lines.append(
                f"      inside {os.path.basename(site.framework_file)}:{site.framework_line}"
            )
        if site.fix:
            lines.append(f"      fix: {site.fix}")
    if offenders:
        first = next(iter(offenders.values()))[0]
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
    fix = f"\n  fix: {memory.fix}" if memory.fix else ""
    return (
        "barrierguard: memory grows faster than max_growth_per_step "
        f"({memory.threshold:,} bytes):\n  {memory.reason}{fix}"
    )


def _warn(text: str) -> None:
    warnings.warn(pytest.PytestWarning(text), stacklevel=1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if (plan := item.stash.get(_PLAN, None)) is None:
        return (yield)
    own = _GUARD not in item.stash
    guard = Guard(plan.options).start() if own else item.stash[_GUARD]
    try:
        result = yield
    finally:
        failure = _judge(item, plan, guard.stop() if own else guard.report)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    return result


def _judge(item: pytest.Item, plan: _Plan, report: Report) -> str | None:
    """The failure message for this test, or None; never raises (a fault is a warning)."""
    try:
        failures = []
        if plan.policy == "error" and report.violations:
            failures.append(_failure_text(report, plan))
        if plan.max_growth_per_step is not None:
            if (grew := _growth_failure(report)) is not None:
                failures.append(grew)
            elif report.memory is None or not report.memory.steps:
                _warn(
                    f"{item.nodeid}: max_growth_per_step was not checked: the report has no "
                    "memory samples"
                )
        item.config.stash[_STATE].outcomes.append(_Outcome(item.nodeid, report, bool(failures)))
        return "\n".join(failures) if failures else None
    except Exception as exc:  # barrierguard's own bug must not decide the test
        _warn(f"{item.nodeid}: internal error in barrierguard: {type(exc).__name__}: {exc}")
        return None


def _merge(outcomes: Sequence[_Outcome]) -> Report:
    """One report of many tests: sites of the same line summed, per step the highest."""
    reports = [o.report for o in outcomes]
    sites: dict[SiteKey, Site] = {}
    for s in (s for r in reports for s in r.sites):
        if (old := sites.get(s.key)) is None:
            sites[s.key] = replace(s, steps=())
        else:
            sites[s.key] = add_sites(
                [old, s], per_step=max(old.per_step, s.per_step), allowed=old.allowed and s.allowed
            )
    return Report(
        engine=reports[0].engine,
        detection=all(r.detection for r in reports),
        policy=reports[0].policy,
        steps=sum(r.steps for r in reports),
        warmup_steps=sum(r.warmup_steps for r in reports),
        measured_steps=sum(r.measured_steps for r in reports),
        sites=tuple(sites.values()),
        violations=tuple(v for r in reports for v in r.violations)[:1000],
        notes=(f"merged from {len(reports)} tests by the pytest plugin",),
        duration_s=sum(r.duration_s for r in reports),
        environment=dict(reports[0].environment),
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand this worker's outcomes to the controller."""
    state = session.config.stash.get(_STATE, None)
    output = getattr(session.config, "workeroutput", None)
    if state is not None and output is not None:
        output["barrierguard"] = json.dumps(
            [
                {"nodeid": o.nodeid, "failed": o.failed, "report": o.report.to_dict()}
                for o in state.outcomes
            ]
        )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the pytest-xdist controller: take in a finished worker's outcomes."""
    state = node.config.stash.get(_STATE, None)
    data = getattr(node, "workeroutput", {}).get("barrierguard")
    if state is None or not data:
        return
    try:
        for raw in json.loads(data):
            report = Report.from_dict(raw["report"], source=f"worker {raw['nodeid']}")
            state.outcomes.append(_Outcome(str(raw["nodeid"]), report, bool(raw["failed"])))
    except (BarrierGuardError, ValueError, KeyError, TypeError) as exc:
        _warn(f"barrierguard: a worker's reports could not be read: {exc}")


def _ci_output(tr: Any, config: pytest.Config, merged: Report, outs: Sequence[_Outcome]) -> None:
    """GitHub annotations or a SARIF log of the watched tests' sites."""
    fmt = config.getoption("barrierguard_format", "text")
    # A site fails where a test that barrierguard failed has a violation there.
    broke = tuple(v for o in outs if o.failed for v in o.report.violations)
    shown = replace(merged, violations=broke, policy="error" if broke else merged.policy)
    if (text := ci_text(shown, fmt)) is None:
        return
    path = config.getoption("barrierguard_format_out", None)
    path = path or ("barrierguard.sarif" if fmt == "sarif" else None)
    if path is None:
        for line in text.splitlines():
            tr.write_line(line)
        return
    _write(tr, f"{fmt} output", path, lambda: Path(path).write_text(text, encoding="utf-8"))


def _write(tr: Any, what: str, path: str, write: Callable[[], object]) -> None:
    try:
        write()
        tr.write_line(f"{what} written to {path}")
    except OSError as err:
        tr.write_line(f"could not write the {what} to {path}: {err}", red=True)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    # On an xdist worker the controller sums up and writes the report.
    if state is None or not state.outcomes or hasattr(config, "workerinput"):
        return
    outs = state.outcomes
    merged = _merge(outs)
    tr = terminalreporter
    tr.write_sep("=", "barrierguard")
    engines = sorted({o.report.engine for o in outs})
    no_steps = sum(o.report.steps == 0 for o in outs)
    tr.write_line(
        f"{len(outs)} test(s) watched (engine {', '.join(engines)}): {len(merged.sites)} site(s), "
        f"{merged.total_syncs} syncs ({merged.step_syncs} in measured steps), "
        f"{sum(len(o.report.violations) for o in outs)} policy violation(s), "
        f"{sum(o.failed for o in outs)} test(s) failed by barrierguard"
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
    if path := state.report_path:
        _write(tr, "report", path, lambda: merged.save(path))
