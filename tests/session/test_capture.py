"""The capture probe: what it reports, and that it leaves the training alone."""

from __future__ import annotations

import pytest
import torch

import barrierguard
from barrierguard.report.records import Report
from barrierguard.session.capture import blocking_line, probe


def _blocked_here() -> None:
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")


def test_blocking_line_is_the_users_innermost_line() -> None:
    try:
        _blocked_here()
    except RuntimeError as exc:
        file, line, function = blocking_line(exc)
    assert (file, function) == (__file__, "_blocked_here")
    assert line == _blocked_here.__code__.co_firstlineno + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_the_probe_says_it_did_not_run() -> None:
    calls: list[int] = []
    result = probe(lambda: calls.append(1))
    assert result.status == "not run"
    assert "no CUDA device" in result.reason
    assert calls == []  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_watch_capture_probe_on_a_decorated_step() -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    @barrierguard.watch(policy="record", engine="audit", memory=False, capture_probe=True)
    def step(x: torch.Tensor) -> None:
        calls.append(1)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step(torch.ones(2, 3))
    guard = step.guard  # type: ignore[attr-defined]
    assert guard.report.compile is None  # no probe before the first step ended
    step(torch.ones(2, 3))
    section = guard.report.compile
    assert section is not None and section.probe is not None
    assert section.probe.status == "not run"
    assert "capture probe not run (no CUDA device" in section.verdict
    assert len(calls) == 2 and guard.steps == 2
    assert Report.from_dict(guard.report.to_dict()).compile == section


def test_capture_probe_option_is_validated() -> None:
    with pytest.raises(barrierguard.BarrierGuardError, match="capture_probe"):
        barrierguard.watch(capture_probe="yes")  # type: ignore[arg-type]
