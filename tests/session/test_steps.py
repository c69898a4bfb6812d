"""The step rule with several optimizers (session/steps.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

import barrierguard
from barrierguard.session.steps import OptimizerSteps


def _count(order: str) -> int:
    rule = OptimizerSteps()
    return sum(rule.boundaries(o) for o in order)


_PATTERNS = pytest.mark.parametrize(
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


@_PATTERNS
def test_boundaries_per_pattern(order: str, steps: int) -> None:
    assert _count(order) == steps


def test_a_follower_that_steps_twice_counts_its_first_step_then() -> None:
    rule = OptimizerSteps()
    assert [rule.boundaries(o) for o in "AABBB"] == [1, 1, 0, 2, 1]


@_PATTERNS
@pytest.mark.parametrize("pattern", ["AABBBA", ""])
def test_a_guard_counts_the_rules_boundaries_after_each_optimizer_step(
    order: str, steps: int, pattern: str
) -> None:
    # The guard skips the rule while one optimizer steps alone: after each
    # step its count must still be the rule's, whatever came before.
    order = pattern + order
    params = {name: torch.zeros(1, requires_grad=True) for name in set(order)}
    optimizers = {name: torch.optim.SGD([p], lr=0.1) for name, p in params.items()}
    rule = OptimizerSteps()
    expected = list(itertools.accumulate(rule.boundaries(name) for name in order))
    seen = []
    with barrierguard.watch(policy="record", memory=False) as guard:
        for name in order:
            params[name].grad = torch.ones(1)
            optimizers[name].step()
            seen.append(guard.steps)
    assert seen == expected
    assert guard.steps == (expected[-1] if expected else 0)
