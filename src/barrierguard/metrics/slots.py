"""The state a :class:`~barrierguard.MetricBuffer` keeps: per metric, and per set of names.

Owns :class:`Slot` (the running state of one metric, on the device and on the
host) and :class:`Block` (a preallocated float64 block on the device that one
repeated set of names copies its tensor values into, one row a step, until
the rows are folded into the slots).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from barrierguard.metrics.spec import ReductionSpec

__all__ = ["BLOCK_STEPS", "F64", "Block", "Slot"]

F64: Final = torch.float64
"""The dtype of every running state."""
BLOCK_STEPS: Final = 1024
"""Rows of a block: the steps a set of names copies in before they are folded in."""


class Slot:
    """State of one running (or ``cat``) metric.

    The device row is ``[a, w, bad]`` in float64: ``a`` is the weighted sum
    (mean/sum), the running min/max, or the last value; ``w`` is the total weight
    (number of accepted values when unweighted); ``bad`` counts non-finite values
    for ``nan="error"``. The ``host_*`` fields hold the same quantities for
    Python-number inputs, which never touch the device. ``block`` is the
    :class:`Block` with rows of this metric not folded in yet, if any.
    """

    __slots__ = (
        "a",
        "bad",
        "block",
        "host_a",
        "host_bad",
        "host_last",
        "host_w",
        "last_on_host",
        "reduction",
        "row",
        "values",
        "w",
        "weighted",
    )

    def __init__(self, reduction: str, weighted: bool) -> None:
        self.reduction = reduction
        self.weighted = weighted
        self.values: list[torch.Tensor] = []
        self.block: Block | None = None
        self.set_row(None)
        self.reset_host()

    def reset_host(self) -> None:
        self.host_a = self.initial_a()
        self.host_w = 0.0
        self.host_bad = 0.0
        self.host_last = math.nan
        self.last_on_host = False

    def clear(self) -> None:
        """Forget every value."""
        self.reset_host()
        self.values = []
        if self.row is not None:
            # Fill in place (kernels with the value as an argument: no copy, no sync).
            self.row.zero_()
            self.row[0].fill_(self.initial_a())

    def initial_a(self) -> float:
        if self.reduction == "min":
            return math.inf
        if self.reduction == "max":
            return -math.inf
        if self.reduction == "last":
            return math.nan
        return 0.0

    def set_row(self, row: torch.Tensor | None) -> None:
        self.row = row
        self.a: torch.Tensor | None = None if row is None else row[0]
        self.w: torch.Tensor | None = None if row is None else row[1]
        self.bad: torch.Tensor | None = None if row is None else row[2]

    def device_row(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The views ``a``, ``w``, ``bad`` of the row, made on ``device`` on first use."""
        if self.row is None:
            # torch.full runs a fill kernel with the value as an argument: no copy.
            row = torch.full((3,), 0.0, dtype=F64, device=device)
            row[0].fill_(self.initial_a())
            self.set_row(row)
        assert self.a is not None and self.w is not None and self.bad is not None
        return self.a, self.w, self.bad

    @property
    def spec(self) -> ReductionSpec:
        return (self.reduction, "weighted") if self.weighted else self.reduction


class Block:
    """The rows of one repeated set of names, copied in one step at a time.

    Column ``j`` holds the values of ``tensors[j]``; with weighted metrics
    among them, a last column holds the tensor weight ``n``. Each step copies
    its values (and tensor weight) into the next row with one
    ``torch._foreach_copy_`` (float64, exact, nothing of the caller's kept), or
    records its Python weight in ``weights``. :func:`~barrierguard.metrics.fold.fold_block`
    folds the rows into the slots when the block is full, and before anything
    reads the state. ``numbers`` are the names whose value was a Python number
    when the block was made: they go to the host-side state.
    """

    __slots__ = (
        "data",
        "device",
        "groups",
        "number_slots",
        "numbers",
        "rows",
        "slots",
        "steps",
        "take",
        "tensor_weights",
        "tensors",
        "weighted",
        "weights",
    )

    def __init__(
        self,
        slots: Mapping[str, Slot],
        tensors: tuple[str, ...],
        numbers: tuple[str, ...],
        device: torch.device,
    ) -> None:
        self.tensors = tensors
        self.numbers = numbers
        self.slots = [slots[name] for name in tensors]
        self.number_slots = [slots[name] for name in numbers]
        self.device = device
        self.weighted = any(slot.weighted for slot in self.slots)
        # The tensor values of a step, picked at C speed.
        self.take: Callable[[Mapping[str, Any]], tuple[Any, ...]] = (
            operator.itemgetter(*tensors) if len(tensors) > 1 else _one(tensors[0])
        )
        width = len(tensors) + self.weighted
        self.data = torch.zeros((BLOCK_STEPS, width), dtype=F64, device=device)
        # 0-d views of each row, the copy's destinations: made on a row's first use, kept.
        self.rows: list[list[torch.Tensor] | None] = [None] * BLOCK_STEPS
        # The step's values grouped by dtype (from the first step), by number of values.
        self.groups: dict[int, list[list[int]]] = {}
        self.steps = 0
        self.weights: list[float] = []
        self.tensor_weights = False

    def row(self) -> list[torch.Tensor]:
        """The views of the next row to copy into."""
        views = self.rows[self.steps]
        if views is None:
            views = self.rows[self.steps] = list(self.data[self.steps].unbind(0))
        return views

    def clear(self) -> None:
        """Drop the rows not folded in yet."""
        self.steps = 0
        self.weights = []
        self.tensor_weights = False
        for slot in self.slots:
            slot.block = None


def _one(name: str) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """``operator.itemgetter(name)``, but returning a tuple of one value."""
    return lambda items: (items[name],)
