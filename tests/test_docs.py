"""The README and the docs: the commands CI runs, the pictures they show, the words they use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_ci_runs_the_readmes_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{command}\n```" in readme


def test_the_readmes_demo_command_is_there() -> None:
    readme = (ROOT / "README.md").read_text()
    assert (
        'python3 -m venv .venv && . .venv/bin/activate && pip install "torch==2.13.0" -e . '
        "&& barrierguard demo"
    ) in readme


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pictures_and_page_links_exist(page: Path) -> None:
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_in_house_words(page: Path) -> None:
    # Prose only: commands and JSON keys in backticks keep their names.
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(), flags=re.S)
    found = re.findall(
        r"\b(?:leases?|null rows?|seed experiments?|balanced loops?)\b", prose, flags=re.I
    )
    assert found == []


def test_the_readmes_demo_report_is_what_the_demo_prints(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sample is the CPU report (the audit engine); a GPU machine's has stalls in it.
    from barrierguard import _env
    from barrierguard.cli.main import main

    if _env.cuda_available():
        pytest.skip("the README shows the demo's CPU report")
    monkeypatch.delenv("BARRIERGUARD_POLICY", raising=False)
    readme = (ROOT / "README.md").read_text()
    sample = readme.split("## What you will see", 1)[1].split("```", 2)[1]
    # The sites, their counts, lines and fixes, and the memory verdict's gist; not the timings.
    rows = [
        line
        for line in sample.splitlines()
        if re.match(r"\s+(\d+\s+)?demo\.py:\d+ |\s+fix: ", line)
    ]
    assert len(rows) >= 14
    assert main(["demo"]) == 0
    captured = capsys.readouterr()
    printed = (captured.out + captured.err).splitlines()
    missing = [row for row in rows if row not in printed]
    assert not missing, f"the README's demo report differs from the demo's: {missing}"
    verdict = "  verdict: no leak - "
    assert verdict in sample and any(line.startswith(verdict) for line in printed)
