"""The CI gate on a real GPU: the pytest plugin fails a test for a real .item(),
and the ratchet catches a new one.

Run on a CUDA machine: ``PYTHONPATH=src python -m pytest -q tests/cli/test_gate_gpu.py``
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _runif import run_if
from barrierguard.cli.main import main

pytestmark = run_if(min_cuda_gpus=1)

LOOP = """\
import torch


def _loop(extra):
    model = torch.nn.Linear(8, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8, device="cuda")
    for _ in range(4):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.item()  # THE-ITEM
        if extra:
            again = float(loss)  # THE-FLOAT


def test_loop():
    _loop(EXTRA)
"""


def _warm() -> None:
    # Import what optimizer.step() and CUDA init import lazily, outside
    # pytester's in-process runs (which drop modules first imported inside).
    model = torch.nn.Linear(8, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def _only_this_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    # With barrierguard installed, its entry point would load the plugin a
    # second time next to "-p": load plugins by hand only.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _run(pytester: pytest.Pytester, extra: bool, *args: str) -> pytest.RunResult:
    _warm()
    pytester.makepyfile(test_gpu_loop=LOOP.replace("EXTRA", str(extra)))
    return pytester.runpytest(
        "-p",
        "barrierguard.integrations.pytest_plugin",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        *args,
    )


def test_plugin_fails_a_real_item(pytester: pytest.Pytester) -> None:
    result = _run(pytester, False, "--barrierguard=error")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "test_gpu_loop.py:13: item (user)" in out
    assert "total = loss.item()  # THE-ITEM" in out
    assert "fix: keep the value on the device" in out


def test_plugin_allows_by_ini_rule(pytester: pytest.Pytester) -> None:
    result = _run(pytester, False, "--barrierguard=error", "-o", "barrierguard_allow=item")
    result.assert_outcomes(passed=1)


def test_ratchet_on_gpu(pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    report, baseline = pytester.path / "r.json", pytester.path / "b.json"
    root = str(pytester.path)
    _run(pytester, False, "--barrierguard=record", f"--barrierguard-report={report}")
    assert main(["baseline", str(report), "-o", str(baseline), "--root", root]) == 0
    assert main(["check", str(report), "--baseline", str(baseline), "--root", root]) == 0
    _run(pytester, True, "--barrierguard=record", f"--barrierguard-report={report}")
    capsys.readouterr()
    assert main(["check", str(report), "--baseline", str(baseline), "--root", root]) == 1
    assert "'again = float(loss)' [float]" in capsys.readouterr().out
