"""Loading and running the scripts under ``examples/`` from tests (CPU and GPU alike)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SRC = ROOT / "src"


def load_example(name: str, monkeypatch: pytest.MonkeyPatch, prefix: str) -> ModuleType:
    """Import ``examples/NAME.py`` as module ``PREFIX_NAME``."""
    # The examples import their helper module from their own folder.
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"{prefix}_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def line_of(name: str, text: str) -> int:
    """The number of the one line of ``examples/NAME.py`` that contains ``text``."""
    lines = (EXAMPLES / f"{name}.py").read_text().splitlines()
    hits = [n for n, line in enumerate(lines, 1) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def run_example(name: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``examples/NAME.py ARGS`` in a fresh interpreter (barrierguard from ``src``)."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=timeout,
        check=False,
    )
