"""Which ``optimizer.step()`` calls end a training step, with several optimizers.

One optimizer: every step of it ends a training step. Several optimizers step
in two patterns that a guard must tell apart from the order of their steps
alone:

* **together** (a GAN's discriminator and generator, an encoder and a decoder
  with optimizers of their own): each steps once per iteration, so one
  iteration is one training step;
* **one after another** (layer-wise training: optimizer A steps 30 times, then
  optimizer B 30 times): every step of each is a training step of its own.

The rule: the optimizer that steps first after a boundary makes the boundary
(it *leads*); the others that step after it in the same iteration *follow*
and end nothing. A follower that steps again before the lead has stepped
again shows that the lead has stopped: it takes the lead, and both of its
steps count (its first step, taken for a follower's, is counted then).

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
        # The followers that stepped since the lead's last step.
        self._followers: set[Hashable] = set()

    def boundaries(self, optimizer: Hashable) -> int:
        """Take one optimizer step; return how many step boundaries it makes (0 to 2).

        Two: a follower stepped twice without the lead between, so its first
        step was a training step of its own (layer-wise training) that ends
        here together with this one.

        Example:
            >>> rule = OptimizerSteps()
            >>> rule.boundaries("A"), rule.boundaries("B"), rule.boundaries("B")
            (1, 0, 2)
        """
        if self._lead is None or optimizer == self._lead:
            self._lead = optimizer
            self._followers.clear()
            return 1
        if optimizer in self._followers:
            self._lead = optimizer
            self._followers.clear()
            return 2
        self._followers.add(optimizer)
        return 0
