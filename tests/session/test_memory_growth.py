"""The growth verdict on synthetic series, and the known causes of a leak."""

from __future__ import annotations

import pytest
import torch

from barrierguard.session.memory import analyze_series, explain

MB = 1_000_000
BASE = 500 * MB


# -- the analysis, on synthetic series ------------------------------------------
def _flat(n: int) -> list[int]:
    return [BASE] * n


def _leak(n: int, rate: int = 3 * MB, start: int = 0) -> list[int]:
    return [BASE + rate * max(0, s - start) for s in range(n)]


def _jump(n: int, at: int, size: int = 64 * MB) -> list[int]:
    return [BASE + (size if s >= at else 0) for s in range(n)]


def _noisy(values: list[int], amp: int = 300_000) -> list[int]:
    # Deterministic jitter of +-amp, like RSS wobbling under a flat load.
    return [
        v + (amp if (s * 7919) % 3 == 0 else -amp if s % 2 else 0) for s, v in enumerate(values)
    ]


def _two_jumps(n: int) -> list[int]:
    return [BASE + (64 * MB if s >= 3 else 0) + (32 * MB if s >= 60 else 0) for s in range(n)]


def _grew_then_stopped(n: int) -> list[int]:
    return [BASE + 3 * MB * min(s, n // 3) for s in range(n)]


def _chunky(n: int) -> list[int]:
    # Reserved memory grows by 20 MB segments every 4 steps: 5 MB/step.
    return [BASE + 20 * MB * (s // 4) for s in range(n)]


@pytest.mark.parametrize(
    ("name", "values", "growing", "began"),
    [
        ("flat", _flat(100), False, None),
        ("noisy flat", _noisy(_flat(100)), False, None),
        ("steady leak", _leak(100), True, 1),
        ("noisy leak", _noisy(_leak(100)), True, 1),
        ("leak from step 30", _leak(100, start=30), True, 31),
        ("one buffer at step 3", _jump(100, 3), False, None),
        ("one buffer mid-run", _jump(100, 50), False, None),
        ("two buffers", _two_jumps(100), False, None),
        ("grew, then stopped", _grew_then_stopped(100), False, None),
        ("chunky growth", _chunky(100), True, 4),
        ("slow leak under threshold", _leak(100, rate=MB // 4), False, None),
    ],
)
def test_growth_verdict(name: str, values: list[int], growing: bool, began: int | None) -> None:
    v = analyze_series(range(len(values)), values, warmup=0, threshold=MB)
    assert v.growing is growing, (name, v)
    assert v.began_at == began, (name, v)


@pytest.mark.parametrize(
    ("values", "slope"),
    [(_leak(100), 3 * MB), (_flat(100), 0), (_jump(100, 3), 0), (_chunky(100), 5 * MB)],
)
def test_slope_is_robust(values: list[int], slope: float) -> None:
    v = analyze_series(range(len(values)), values, warmup=0, threshold=MB)
    assert v.slope == pytest.approx(slope, rel=0.1, abs=1.0)


def test_step_change_is_named_with_its_step() -> None:
    v = analyze_series(range(40), _jump(40, 3), warmup=0, threshold=MB)
    assert v.step_changes == ((3, 64 * MB),)
    assert not v.growing


def test_peak_and_sparse_steps() -> None:
    steps = [0, 1, 2, 10, 20, 40, 80, 120, 160, 200, 240]
    values = [BASE + 2 * MB * s for s in steps]
    v = analyze_series(steps, values, warmup=0, threshold=MB)
    assert v.growing and v.slope == pytest.approx(2 * MB)
    assert (v.peak, v.peak_step) == (values[-1], 240)


def test_warmup_samples_are_not_measured() -> None:
    # Growth during warm-up only (steps 0-10), flat afterwards.
    values = [BASE + 5 * MB * min(s, 10) for s in range(60)]
    assert analyze_series(range(60), values, warmup=0, threshold=MB).growing is False
    assert analyze_series(range(60), values, warmup=10, threshold=MB).slope == 0


def test_too_few_samples_give_no_verdict() -> None:
    v = analyze_series(range(5), _leak(5), warmup=0, threshold=MB)
    assert not v.growing and v.samples == 5


def test_missing_values_are_skipped() -> None:
    values: list[int | None] = [None, None, *_leak(40)[2:]]
    v = analyze_series(range(40), values, warmup=0, threshold=MB)
    assert v.growing and v.slope == pytest.approx(3 * MB)


# -- known patterns ------------------------------------------------------------------
def _step_graph(model: torch.nn.Module) -> torch.Tensor:
    return model(torch.randn(4, 8)).square().mean()


def test_explain_finds_an_accumulated_loss() -> None:
    import sys

    model = torch.nn.Linear(8, 8)
    total_loss: torch.Tensor | int = 0
    for _ in range(30):
        total_loss = total_loss + _step_graph(model)
    found = explain(30, sys._getframe())
    assert found is not None
    pattern, fix, evidence = found
    assert pattern == "accumulated_graph" and "detach" in fix
    assert "`total_loss`" in evidence and "30 additions" in evidence and "likely" in evidence


def test_explain_finds_a_growing_list_of_tensors() -> None:
    import sys

    model = torch.nn.Linear(8, 8)
    kept_losses = []
    for _ in range(30):
        kept_losses.append(_step_graph(model))
    found = explain(30, sys._getframe())
    assert found is not None
    pattern, _, evidence = found
    assert pattern == "tensor_list"
    assert "`kept_losses`" in evidence and "30 cpu tensors" in evidence
    assert "autograd graphs" in evidence


def test_explain_finds_nothing_in_a_clean_loop() -> None:
    import sys

    model = torch.nn.Linear(8, 8)
    total = torch.zeros(())
    for _ in range(30):
        total += _step_graph(model).detach()
    assert explain(30, sys._getframe()) is None
