"""Which ``optimizer.step()`` calls end a training step, with several optimizers.

Together (a GAN: one iteration is one step) or one after another (layer-wise: every step
counts). The first to step after a boundary *leads* and makes it; the others *follow*. A
follower stepping again before the lead takes the lead, and both steps count.

Example:
    >>> rule = OptimizerSteps()
    >>> [rule.boundaries(o) for o in "DGDGDG"]  # a GAN: 3 iterations
    [1, 0, 1, 0, 1, 0]
    >>> rule = OptimizerSteps()
    >>> sum(rule.boundaries(o) for o in "A" * 30 + "B" * 30)  # layer-wise
    60
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["OptimizerSteps"]


class OptimizerSteps:
    """Counts the step boundaries that a sequence of optimizer steps makes."""

    def __init__(self) -> None:
        self._lead: Hashable | None = None
        self._followers: set[Hashable] = set()  # stepped since the lead's last step

    def boundaries(self, optimizer: Hashable) -> int:
        """Take one optimizer step; return how many step boundaries it makes (0 to 2)."""
        if self._lead is None or optimizer == self._lead:
            boundaries = 1
        elif optimizer in self._followers:
            # A follower stepped twice without the lead between: its first step
            # was a training step of its own, which ends here with this one.
            boundaries = 2
        else:
            self._followers.add(optimizer)
            return 0
        self._lead = optimizer
        self._followers.clear()
        return boundaries

    def alone(self, optimizer: Hashable) -> bool:
        """Whether ``optimizer`` leads with no follower: its next step makes one boundary."""
        return optimizer == self._lead and not self._followers
