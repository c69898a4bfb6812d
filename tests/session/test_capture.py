"""The capture probe: what it reports, and that it leaves the training alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import barrierguard
from barrierguard.report.records import CaptureProbe, CompileReport, Report
from barrierguard.session.capture import (
    _backward_by_inductor,
    blocking_line,
    inductor_cuda_graphs,
    probe,
)


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
    for bad in ("train step", 3):
        with pytest.raises(barrierguard.BarrierGuardError, match="name of the step function"):
            barrierguard.watch(capture_probe=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_capture_probe_by_name_probes_the_first_call_after_warmup() -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []

    def train_step(x: torch.Tensor, *, scale: float = 1.0) -> None:
        calls.append(1)
        (model(x).sum() * scale).backward()
        opt.step()
        opt.zero_grad()

    with barrierguard.watch(
        policy="record", engine="audit", memory=False, capture_probe="train_step", warmup_steps=2
    ) as guard:
        for _ in range(4):
            train_step(torch.ones(2, 3), scale=0.5)
    section = guard.report.compile
    assert section is not None and section.probe is not None
    assert section.probe.status == "not run"  # no CUDA here; it was asked once, after warm-up
    assert "train_step" in section.probe.captured
    assert len(calls) == 4 and guard.steps == 4
    import sys

    assert sys.getprofile() is None


def test_capture_probe_by_name_that_never_runs_is_noted() -> None:
    with barrierguard.watch(
        policy="record", engine="audit", memory=False, capture_probe="never_called"
    ) as guard:
        torch.ones(2).sum()
    assert any("no call of 'never_called'" in n for n in guard.report.notes)


def _backward_joined_default_stream() -> None:
    raise RuntimeError(
        "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
    )


def _mismatch() -> RuntimeError:
    try:
        _backward_joined_default_stream()
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_backward_by_inductor_when_its_graphs_run_and_none_was_skipped() -> None:
    result = _backward_by_inductor(_mismatch(), 3, [], "one call of step")
    assert result.status == "capturable"
    assert result.reason.startswith("backward by inductor's verdict: the forward was captured")
    assert "inductor's 3 CUDA graphs" in result.reason
    assert "Not checked: autograd hooks" in result.reason
    assert not result.file  # no line blocked
    section = CompileReport(probe=result)
    assert section.verdict.endswith("the step is capturable (backward by inductor's verdict)")


def test_backward_not_by_inductor_when_it_skipped_or_does_not_run() -> None:
    skipped = _backward_by_inductor(_mismatch(), 2, ["cpu device at t.py:3"], "x")
    assert skipped.status == "not run"
    assert "kept ops out of its CUDA graphs (cpu device at t.py:3)" in skipped.reason
    alone = _backward_by_inductor(_mismatch(), 0, [], "x")
    assert alone.status == "not run"
    assert "del loss" in alone.reason and alone.reason.startswith("inconclusive")


def test_no_inductor_cuda_graphs_without_cuda() -> None:
    assert inductor_cuda_graphs() == 0


def test_the_guard_hands_its_cudagraph_skips_to_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import barrierguard.session.capture as capture
    from barrierguard.detect.compile_logs import CompileEvent

    seen: list[Sequence[str]] = []

    def fake_probe(
        fn: object, args: object, kwargs: object, params: object, skips: Sequence[str]
    ) -> CaptureProbe:
        seen.append(skips)
        return CaptureProbe(status="not run", reason="fake")

    monkeypatch.setattr(capture, "probe", fake_probe)
    with barrierguard.watch(policy="record", engine="audit", memory=False) as guard:
        guard._compile.listener.events.append(
            CompileEvent(
                what="cudagraph_skip", file="/w/t.py", line=3, function="f", reason="cpu device"
            )
        )
        guard.probe_capture(lambda: None)
    assert seen == [["cpu device at t.py:3"]]


@pytest.mark.skipif(
    not hasattr(torch.autograd.graph, "set_override_stale_capture_stream"),
    reason="a torch without the stale-stream override",
)
def test_stale_streams_follow_the_capture_only_inside_and_are_restored() -> None:
    from barrierguard.session.capture import _stale_streams_follow_capture

    assert torch._C._override_stale_capture_stream() is False
    with _stale_streams_follow_capture() as follow:
        assert follow and torch._C._override_stale_capture_stream() is True
    assert torch._C._override_stale_capture_stream() is False
    with pytest.raises(ValueError), _stale_streams_follow_capture():
        raise ValueError
    assert torch._C._override_stale_capture_stream() is False


def test_stream_mismatch_is_read_from_the_cuda_error_and_torchs_own() -> None:
    from barrierguard.session.capture import _stream_mismatch

    assert _stream_mismatch(_mismatch())
    assert _stream_mismatch(RuntimeError("... see set_override_stale_capture_stream ..."))
    assert not _stream_mismatch(RuntimeError("operation not permitted when stream is capturing"))


class _FakeGraph:
    """Records and never runs: enough of torch.cuda.CUDAGraph for the probe's flow."""

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        pass

    def capture_end(self) -> None:
        pass

    def reset(self) -> None:
        pass


class _FakeStream:
    def wait_stream(self, other: object) -> None:
        pass


def _fake_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda as far as the probe uses it, on a CPU: every capture succeeds."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", list)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in for CUDA")
def test_the_probed_call_runs_compiled_code_as_plain_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch._dynamo.eval_frame import _stance
    from torch._dynamo.utils import counters

    seen: list[bool] = []

    @torch.compile(backend="eager", dynamic=False)
    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x * 2

    step(torch.ones(2))
    frames = counters["frames"]["total"]
    seen.clear()
    _fake_capture(monkeypatch)
    # A new shape would recompile; under the probe nothing compiles.
    result = probe(step, (torch.ones(3),))
    assert result.status == "capturable", result
    assert "its compiled functions run as plain Python (force_eager)" in result.captured
    assert seen == [False]  # the Python body ran, not traced
    assert counters["frames"]["total"] == frames
    assert _stance.stance == "default"  # the stance before is back


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU stand-in for CUDA")
def test_probe_takes_inductors_verdict_on_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    import barrierguard.session.capture as capture

    _fake_capture(monkeypatch)
    monkeypatch.setattr(capture, "inductor_cuda_graphs", lambda: 4)
    model = torch.nn.Linear(2, 1)
    model.weight.grad = before = torch.ones(1, 2)

    def step() -> None:
        model(torch.ones(1, 2)).sum().backward()
        _backward_joined_default_stream()  # as the backward of a capture on a side stream

    result = probe(step, params=[model.weight])
    assert result.status == "capturable"
    assert result.reason.startswith("backward by inductor's verdict")
    assert model.weight.grad is before  # put back
    skipped = probe(step, skips=["cpu device at t.py:3"])
    assert skipped.status == "not run" and "cpu device at t.py:3" in skipped.reason


def test_the_call_probe_reads_the_arguments_as_the_function_received_them() -> None:
    import sys

    from barrierguard.session.capture import _arguments

    seen: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def step(a: int, b: int = 2, *rest: int, c: int, d: int = 4, **more: int) -> None:
        seen.append(_arguments(sys._getframe()))

    def plain(a: int, *, c: int) -> None:
        seen.append(_arguments(sys._getframe()))

    step(1, 5, 6, 7, c=3, e=8)
    plain(1, c=2)
    assert seen == [((1, 5, 6, 7), {"c": 3, "d": 4, "e": 8}), ((1,), {"c": 2})]
