from __future__ import annotations

import barrierguard


def test_watch_without_detection_says_so() -> None:
    with barrierguard.watch(policy="record", engine="audit") as guard:
        guard.step()
    assert guard.report.detection is False
    assert any("no detection ran" in n for n in guard.report.notes)
