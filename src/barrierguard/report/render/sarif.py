"""SARIF 2.1.0 for code scanning: one result per site, its rule from the code table.

Levels as for the GitHub annotations; an allowed site is a suppressed ``note``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from barrierguard.report.records import Report, Site, SiteKey
from barrierguard.report.render.github import judged, relative

__all__ = ["SARIF_SCHEMA", "render"]

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


def _rule(code: str, kind: str, rules: Mapping[str, tuple[str, str, str]]) -> dict[str, Any]:
    name, what, fix = rules.get(code, (kind, f"{kind}: a host-device synchronization", ""))
    rule: dict[str, Any] = {
        "id": code,
        "name": name,
        "shortDescription": {"text": what},
        "defaultConfiguration": {"level": "warning"},
    }
    if fix:
        rule["help"] = {"text": f"Fix: {fix}"}
    return rule


def _result(site: Site, level: str, index: int, root: str | None, text: str) -> dict[str, Any]:
    region: dict[str, Any] = {"startLine": max(site.line, 1)}
    if site.code:
        region["snippet"] = {"text": site.code}
    location = {"artifactLocation": {"uri": relative(site.file, root)}, "region": region}
    result: dict[str, Any] = {
        "ruleId": site.rule,
        "ruleIndex": index,
        "level": level,
        "message": {"text": text},
        "locations": [{"physicalLocation": location}],
        "properties": {
            "kind": site.kind,
            "origin": site.origin,
            "count": site.count,
            "stepCount": site.step_count,
            "perStep": site.per_step,
        },
    }
    if site.allowed:
        result["suppressions"] = [{"kind": "inSource", "justification": "an allow rule"}]
    return result


def render(
    report: Report,
    rules: Mapping[str, tuple[str, str, str]] | None = None,
    root: str | None = None,
    failing: Collection[SiteKey] | None = None,
    messages: Mapping[SiteKey, str] | None = None,
) -> str:
    """``report`` as a SARIF 2.1.0 log (indented JSON), the other arguments as for
    :func:`barrierguard.report.render.github.render`; ``rules`` is the code table,
    ``code -> (kind, what it is, fix)``, all of it listed in ``tool.driver.rules``
    (default: the codes of the report's sites, described by their kind)."""
    table = dict(rules or {})
    chosen = [(s, level, text) for s, level, text in judged(report, failing, messages) if s.rule]
    codes = list(dict.fromkeys([*table, *(site.rule for site, _, _ in chosen)]))
    index = {code: i for i, code in enumerate(codes)}
    kinds = {site.rule: site.kind for site, _, _ in chosen}
    driver = {
        "name": "barrierguard",
        "version": report.environment.get("barrierguard", "0"),
        "rules": [_rule(c, kinds.get(c, c), table) for c in codes],
    }
    run = {
        "tool": {"driver": driver},
        "results": [_result(s, level, index[s.rule], root, text) for s, level, text in chosen],
        "properties": {
            "engine": report.engine,
            "policy": report.policy,
            "measuredSteps": report.measured_steps,
        },
    }
    log = {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}
    return json.dumps(log, indent=2) + "\n"
