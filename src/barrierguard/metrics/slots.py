"""The state a :class:`~barrierguard.MetricBuffer` keeps, and the plans of its fast path.

Owns :class:`Slot` (the running state of one metric, on the device and on the
host), :class:`Plan` (the block of rows of one repeated set of names, and the
steps it keeps pending until they are folded in), :func:`admit`, the
metadata-only check that a logged value can be queued in a plan, and
:func:`holdable`, what a pending value may keep alive.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from barrierguard.metrics.spec import SUM_KINDS, ReductionSpec

__all__ = [
    "F64",
    "FLUSH_EVERY",
    "HOLD_BYTES",
    "Plan",
    "Slot",
    "admit",
    "holdable",
    "stacks_lossily",
]

F64: Final = torch.float64
"""The dtype of every running state."""
FLUSH_EVERY: Final = 1024
"""Steps of device values a set of names keeps pending before they are folded in."""
HOLD_BYTES: Final = 1024
"""Largest storage a pending value may keep alive; a view into a larger one is copied.

``logits[0, 0]`` is a view: keeping it would keep all of ``logits`` alive
until the fold.
"""

_VERSION: Final = operator.attrgetter("_version")
_REQUIRES_GRAD: Final = operator.attrgetter("requires_grad")


class Slot:
    """State of one running (or ``cat``) metric.

    The device row is ``[a, w, bad]`` in float64: ``a`` is the weighted sum
    (mean/sum), the running min/max, or the last value; ``w`` is the total weight
    (number of accepted values when unweighted); ``bad`` counts non-finite values
    for ``nan="error"`` (NaN there also means "saw a non-finite value"). The
    ``host_*`` fields hold the same quantities for Python-number inputs, which
    never touch the device.
    """

    __slots__ = (
        "a",
        "bad",
        "host_a",
        "host_bad",
        "host_last",
        "host_w",
        "last_on_host",
        "plan",
        "reduction",
        "row",
        "values",
        "w",
        "weighted",
    )

    def __init__(self, reduction: str, weighted: bool) -> None:
        self.reduction = reduction
        self.weighted = weighted
        self.row: torch.Tensor | None = None
        # 0-d views into ``row``, kept so the hot path does not re-index every step.
        self.a: torch.Tensor | None = None
        self.w: torch.Tensor | None = None
        self.bad: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []
        # The Plan whose block holds ``row`` as a view, if any.
        self.plan: Plan | None = None
        self.reset_host()

    def reset_host(self) -> None:
        self.host_a = self.initial_a()
        self.host_w = 0.0
        self.host_bad = 0.0
        self.host_last = math.nan
        self.last_on_host = False

    def clear(self) -> None:
        """Forget every value; the row stays where it is (a view of a plan's block)."""
        self.reset_host()
        self.values = []
        if self.row is not None:
            # Fill in place (device kernels, no sync) so the views stay valid.
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

    def make_row(self, device: torch.device) -> torch.Tensor:
        # torch.full runs a fill kernel with the value as an argument: no host->device copy.
        row = torch.full((3,), 0.0, dtype=F64, device=device)
        row[0].fill_(self.initial_a())
        self.set_row(row)
        return row

    def set_row(self, row: torch.Tensor | None) -> None:
        self.row = row
        if row is None:
            self.a = self.w = self.bad = None
        else:
            self.a, self.w, self.bad = row[0], row[1], row[2]

    def device_row(
        self, device: torch.device | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The views ``a``, ``w``, ``bad`` of the row, made on ``device`` on first use."""
        if self.row is None:
            assert device is not None  # a tensor was claimed before any row
            self.make_row(device)
        assert self.a is not None and self.w is not None and self.bad is not None
        return self.a, self.w, self.bad

    @property
    def spec(self) -> ReductionSpec:
        return (self.reduction, "weighted") if self.weighted else self.reduction


_GROUP_ORDER: Final = ("weighted", "unweighted", "min", "max", "last")


class Plan:
    """Deferred fast path for one repeated set of names.

    The rows of its tensor-valued metrics are columns of one ``(3, k)`` block,
    ordered by group (weighted sums, unweighted sums, min, max, last). An update
    only appends references to its tensors to ``pending`` (and its weight to
    ``runs``/``weights``); :func:`barrierguard.metrics.fold.flush` folds up to
    :data:`FLUSH_EVERY` steps into the block at once. Names whose value was a
    Python number when the plan was built go to the host-side state directly.

    Once a step of the plan has passed every check (``checked``), a plan of
    tensors only (``steady``) queues later steps with :meth:`queue`, the hot
    path of :meth:`MetricBuffer.update <barrierguard.MetricBuffer.update>`.
    """

    __slots__ = (
        "a",
        "bad",
        "by_column",
        "checked",
        "device",
        "groups",
        "host_unit",
        "host_weighted",
        "lasts",
        "numbers",
        "order",
        "pending",
        "reductions",
        "runs",
        "sizes",
        "steady",
        "steps",
        "take",
        "versions",
        "w_unit",
        "weights",
        "wversions",
    )

    def __init__(
        self, slots: Mapping[str, Slot], numbers: tuple[str, ...], device: torch.device
    ) -> None:
        def group(slot: Slot) -> str:
            if slot.reduction in SUM_KINDS:
                return "weighted" if slot.weighted else "unweighted"
            return slot.reduction

        names = sorted(slots, key=lambda name: _GROUP_ORDER.index(group(slots[name])))
        self.order = tuple(names)
        # The values of a step in plan order, picked at C speed.
        self.take: Callable[[Mapping[str, Any]], tuple[Any, ...]] = (
            operator.itemgetter(*names) if len(names) > 1 else _one(names[0])
        )
        self.reductions = tuple(slots[name].reduction for name in names)
        self.numbers = numbers
        self.device = device
        self.sizes = [sum(group(slots[n]) == g for n in names) for g in _GROUP_ORDER]
        block = torch.empty((3, len(names)), dtype=F64, device=device)
        for j, name in enumerate(names):
            slot = slots[name]
            if slot.row is None:
                block[0, j].fill_(slot.initial_a())
                block[1:, j].zero_()
            else:
                block[:, j].copy_(slot.row)  # device to device: no sync
            slot.set_row(block[:, j])
            slot.plan = self
        self.a = block[0]
        self.bad = block[2]
        self.w_unit = block[1, self.sizes[0] :]
        # Per group: (a view, w view) of the block, in _GROUP_ORDER.
        a_parts = torch.split(block[0], self.sizes)
        w_parts = torch.split(block[1], self.sizes)
        self.groups = list(zip(a_parts, w_parts, strict=True))
        self.host_weighted = [slots[n] for n in names if group(slots[n]) == "weighted"]
        self.host_unit = [slots[n] for n in names if group(slots[n]) != "weighted"]
        self.lasts = [slots[n] for n in names if slots[n].reduction == "last"]
        # Whether a step passed every check, and from its dtypes, whether to stack
        # column by column (see stacks_lossily).
        self.checked = False
        self.by_column = False
        self.steady = False
        self.clear()

    def clear(self) -> None:
        """Drop the pending steps (after folding them in, or on reset)."""
        # Tensors of the pending steps, len(order) per step, and their version counters
        # when logged (an in-place change before the flush would alter the value).
        self.pending: list[torch.Tensor] = []
        self.versions: list[int] = []
        # Weights of the pending steps, as runs [weight, steps]: a float weight, or None
        # for steps whose weight is the next tensor of ``weights``.
        self.runs: list[list[Any]] = []
        self.weights: list[torch.Tensor] = []
        self.wversions: list[int] = []
        self.steps = 0

    def check(self, dtypes: set[torch.dtype]) -> None:
        """Record that a step with values of ``dtypes`` passed every check."""
        self.by_column = stacks_lossily(dtypes)
        self.checked = True
        self.steady = not self.numbers

    def queue(self, items: Mapping[str, Any], weight: float) -> bool:
        """Queue one step of a steady plan; ``False``, with nothing queued, for a non-tensor.

        Reads only each value's version counter, ``requires_grad`` and the size
        of its storage; the fold's stack checks the rest. ``items`` must hold
        the plan's names, ``weight`` is the step's Python weight.
        """
        values = self.take(items)
        try:
            versions = list(map(_VERSION, values))
            fit = not any(map(_REQUIRES_GRAD, values)) and (
                max([v.untyped_storage().nbytes() for v in values]) <= HOLD_BYTES
            )
        except (AttributeError, RuntimeError):  # not a tensor, or no storage: the caller's
            return False
        if not fit:
            values = tuple(map(holdable, values))
            versions = list(map(_VERSION, values))
        self.pending.extend(values)
        self.versions.extend(versions)
        if self.sizes[0]:
            self.add_weight(weight)
        self.steps += 1
        return True

    def add_weight(self, weight: float | None) -> None:
        """Count one step of ``weight`` in ``runs`` (``None``: the next tensor of ``weights``)."""
        runs = self.runs
        if runs and runs[-1][0] == weight:
            runs[-1][1] += 1
        else:
            runs.append([weight, 1])

    def column(self, index: int) -> str:
        """Name of the metric of flat pending index ``index``."""
        return self.order[index % len(self.order)]


def _one(name: str) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """``operator.itemgetter(name)``, but returning a tuple of one value."""

    def take(items: Mapping[str, Any]) -> tuple[Any, ...]:
        return (items[name],)

    return take


def admit(value: object, device: torch.device) -> torch.Tensor | None:
    """``value`` as a 0-d tensor fit to queue on ``device``, or ``None`` for the slow path."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.numel() != 1 or value.is_complex() or value.device != device:
        # Includes "cuda" vs "cuda:0": the slow path claims the device or explains.
        return None
    try:
        value = holdable(value)
    except RuntimeError:  # no storage (a wrapper subclass): the slow path folds it now
        return None
    if value.dim():
        value = value.reshape(())
    return value


def holdable(value: torch.Tensor) -> torch.Tensor:
    """``value`` as it can wait for the fold without keeping anything else alive.

    * A view into a storage of more than :data:`HOLD_BYTES` is copied (one
      element), or its base would stay alive until the fold.
    * A leaf that requires grad is most likely a parameter that the optimizer
      changes in place before the fold: it is copied too.
    * Any other value that requires grad is detached (a view, no kernel), so
      it keeps no graph alive.

    Raises:
        RuntimeError: ``value`` has no storage to measure.

    Example:
        >>> import torch
        >>> logits = torch.zeros(64, 1000)
        >>> held = holdable(logits[0, 0])
        >>> held.untyped_storage().nbytes(), held.item()
        (4, 0.0)
    """
    if value.untyped_storage().nbytes() > HOLD_BYTES or (value.requires_grad and value.is_leaf):
        return value.detach().clone()
    return value.detach() if value.requires_grad else value


def stacks_lossily(dtypes: set[torch.dtype]) -> bool:
    """Whether one ``torch.stack`` of values of these dtypes would round some of them.

    Type promotion takes an integer and a float below float64 to that float: an
    int64 token count stacked with a bfloat16 loss becomes bfloat16 (3001 reads
    3008). Floats promote to the widest, which keeps every value.
    """
    if len(dtypes) < 2:
        return False
    promoted = functools.reduce(torch.promote_types, dtypes)
    return (
        promoted.is_floating_point
        and promoted != F64
        and any(not d.is_floating_point and d != torch.bool for d in dtypes)
    )
