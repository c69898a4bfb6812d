from __future__ import annotations

import barrierguard


def test_audit_engine_detects_and_says_how() -> None:
    with barrierguard.watch(policy="record", engine="audit") as guard:
        guard.step()
    assert guard.report.engine == "audit"
    assert guard.report.detection is True
    assert any(n.startswith("audit engine:") for n in guard.report.notes)
    assert not any("no detection ran" in n for n in guard.report.notes)
