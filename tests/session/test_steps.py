"""The step rule with several optimizers (session/steps.py)."""

from __future__ import annotations

import pytest

from barrierguard.session.steps import OptimizerSteps


def _count(order: str) -> int:
    rule = OptimizerSteps()
    return sum(rule.boundaries(o) for o in order)


@pytest.mark.parametrize(
    ("order", "steps"),
    [
        ("A" * 5, 5),  # one optimizer: every step
        ("DG" * 3, 3),  # a GAN: one step per iteration
        ("GD" * 3, 3),
        ("ABC" * 4, 4),  # three optimizers stepping together
        ("A" * 30 + "B" * 30, 60),  # layer-wise training
        ("A" * 3 + "B" * 3 + "C" * 3, 9),
        ("A" * 3 + "B" * 3 + "A" * 3, 9),  # back to the first layer
        ("DDDDDG" * 2, 10),  # a WGAN critic: each critic step is a step
        ("", 0),
    ],
)
def test_boundaries_per_pattern(order: str, steps: int) -> None:
    assert _count(order) == steps


def test_a_follower_that_steps_twice_counts_its_first_step_then() -> None:
    rule = OptimizerSteps()
    assert [rule.boundaries(o) for o in "AABBB"] == [1, 1, 0, 2, 1]
