"""Helpers for the CI-gate tests: run a small loop file under the CUDA engine faked on CPU."""

from __future__ import annotations

import runpy
import subprocess
import sys
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


# A plain loop under `barrierguard run` (the audit engine): its only syncs are
# setup copies of the model and one read after the loop, as the fix messages advise.
PLAIN_LOOP = """\
import torch
from torch import nn

device = "cpu"
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
total = torch.zeros((), device=device)
for i in range(4):
    loss = model(torch.randn(8, 4, device=device)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    total += loss.detach()
print("mean", (total / 4).item())
"""
# The same loop with a read inside: a barrier in every step.
READ_IN_LOOP = PLAIN_LOOP.replace(
    "    total += loss.detach()\n", "    total += loss.detach()\n    print(loss.item())\n"
)


def barrierguard_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m barrierguard ARGS`` in a process of its own (as a launcher sees it)."""
    return subprocess.run(
        [sys.executable, "-m", "barrierguard", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
