"""The HTML report in a real headless browser: the scripts run, the table sorts.

Needs Debian's chromium (``apt-get install -y chromium``); skipped without it.
Set ``BARRIERGUARD_SCREENSHOT_DIR`` to keep the screenshot for a look.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from _samples import sample_memory, sample_report
from barrierguard.report.render.html import render

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs chromium at {CHROMIUM}"),
]


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=180, check=False
    )


@pytest.fixture
def page(tmp_path: Path) -> Path:
    path = tmp_path / "report.html"
    path.write_text(render(replace(sample_report(), memory=sample_memory())), encoding="utf-8")
    return path


def _counts(dom: str) -> list[int]:
    body = dom.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    return [int(re.findall(r'data-sort="([0-9.]+)"', r)[1]) for r in rows]


@pytest.mark.parametrize(
    ("fragment", "sorted_by", "expected"),
    [
        ("", "rank:asc", [81, 41, 5, 3, 8]),
        ("#sort=count", "count:asc", [3, 5, 8, 41, 81]),
        ("#sort=-count", "count:desc", [81, 41, 8, 5, 3]),
    ],
)
def test_table_sorts_in_the_browser(
    tmp_path: Path, page: Path, fragment: str, sorted_by: str, expected: list[int]
) -> None:
    done = _chromium(tmp_path, "--dump-dom", page.as_uri() + fragment)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert f'data-sorted-by="{sorted_by}"' in dom
    assert _counts(dom) == expected
    if fragment:
        assert re.search(r'data-key="count"[^>]*aria-sort="(a|de)scending"', dom)
    assert len(re.findall(r'<rect class="bar"', dom)) == 41
    assert len(re.findall(r'<polyline class="series"', dom)) == 2


def test_screenshot(tmp_path: Path, page: Path) -> None:
    shot = tmp_path / "report.png"
    done = _chromium(
        tmp_path, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri() + "#sort=-count"
    )
    assert shot.exists(), done.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a blank page compresses to a few KiB
    keep = os.environ.get("BARRIERGUARD_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "report.png")
        shutil.copy(page, Path(keep) / "report.html")


def test_verdict_line_leads_the_page(tmp_path: Path, page: Path) -> None:
    done = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    line = re.search(r'<p id="verdict-line">(.*?)</p>', dom)
    assert line is not None
    assert line.group(1) == "Policy violations: 1 at 1 site(s), one line per site:"
    assert dom.index('id="verdict"') < dom.index('id="sites"') < dom.index('id="syncs-chart"')
