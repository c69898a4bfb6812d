"""The GitHub annotations and the SARIF log, compared against records built by hand.

sarif-schema-2.1.0.json beside this file is the OASIS SARIF 2.1.0 schema, copied
from github.com/oasis-tcs/sarif-spec (sarif-2.1/schema/sarif-schema-2.1.0.json)
so that the test needs no network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from barrierguard import Report, Site, Violation
from barrierguard.report.render import github, sarif
from barrierguard.session.site_stats import rule_table

SCHEMA = json.loads(Path(__file__).with_name("sarif-schema-2.1.0.json").read_text())


def _site(line: int, kind: str, rule: str, step_count: int, **kw: object) -> Site:
    return Site(
        file="/repo/src/train.py",
        line=line,
        function="train",
        code=f"code at {line}",
        kind=kind,
        rule=rule,
        origin="user",
        count=step_count + 1,
        setup_count=1,
        step_count=step_count,
        per_step=step_count / 4,
        fix="the fix",
        **kw,  # type: ignore[arg-type]
    )


HOT = _site(7, "item", "BG101", 4)
ALLOWED = _site(9, "index", "BG301", 4, allowed=True)
SETUP = _site(3, "copy", "BG201", 0)


def _report(policy: str) -> Report:
    return Report(
        engine="audit",
        detection=True,
        policy=policy,
        steps=4,
        measured_steps=4,
        sites=(HOT, ALLOWED, SETUP),
        violations=(Violation("/repo/src/train.py", 7, "item", "user", 1, "not allowed"),),
        environment={"barrierguard": "1.2.3"},
    )


@pytest.mark.parametrize(("policy", "level"), [("error", "error"), ("warn", "warning")])
def test_github_annotates_steps_sites_only(policy: str, level: str) -> None:
    assert github.render(_report(policy), root="/repo") == (
        f"::{level} file=src/train.py,line=7,title=barrierguard BG101 item::item sync: "
        "`code at 7` 4 in the measured steps (1.00 per step). Fix: the fix\n"
    )


def test_github_escapes_what_would_end_the_command() -> None:
    line = github.annotation("warning", "a,b:c.py", 1, "t", "50% done\nnext")
    assert line == "::warning file=a%2Cb%3Ac.py,line=1,title=t::50%25 done%0Anext"


@pytest.mark.parametrize("policy", ["record", "warn", "error"])
def test_sarif_validates_and_levels_follow_the_policy(policy: str) -> None:
    log = json.loads(sarif.render(_report(policy), rules=rule_table(), root="/repo"))
    import jsonschema

    jsonschema.validate(log, SCHEMA)
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == list(rule_table())
    assert run["tool"]["driver"]["version"] == "1.2.3"
    results = {r["ruleId"]: r for r in run["results"]}
    assert set(results) == {"BG101", "BG301"}
    assert results["BG101"]["level"] == ("error" if policy == "error" else "warning")
    assert results["BG301"]["level"] == "note"
    assert results["BG301"]["suppressions"] == [
        {"kind": "inSource", "justification": "an allow rule"}
    ]
    for r in results.values():
        assert rules[r["ruleIndex"]]["id"] == r["ruleId"]
    region = results["BG101"]["locations"][0]["physicalLocation"]["region"]
    assert region == {"startLine": 7, "snippet": {"text": "code at 7"}}


def test_every_kind_has_one_code() -> None:
    from barrierguard.detect.kinds import CODES, KINDS

    assert set(CODES) == set(KINDS)
    assert len(set(CODES.values())) == len(CODES)
