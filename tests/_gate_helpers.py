"""Helpers for the CI-gate tests: run a small loop file under the CUDA engine faked on CPU."""

from __future__ import annotations

import runpy
import textwrap
from pathlib import Path

import barrierguard

LOOP = """\
from _fake_cuda import FakeTensor


def train(guard, steps=4):
    loss = FakeTensor(1.0)
    for i in range(steps):
        value = loss.item()
        guard.step()
"""


def run_loop(folder: Path, source: str, steps: int = 4) -> barrierguard.Report:
    """Write ``source`` to ``folder/train.py``, run its ``train`` watched, return the report.

    Needs the ``fake_cuda`` fixture active. Each version goes to its own folder
    so that ``linecache`` never serves an older text of the same file.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.py"
    path.write_text(textwrap.dedent(source))
    namespace = runpy.run_path(str(path))
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        namespace["train"](guard, steps=steps)
    return guard.report
