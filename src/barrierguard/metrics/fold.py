"""Folding logged values into the running state: the reductions themselves.

Owns the arithmetic of every running reduction under every NaN policy:
:func:`fold_columns` folds a ``(steps, metrics)`` float64 block of device
values into the slots (:func:`fold_block`: a
:class:`~barrierguard.metrics.slots.Block`'s rows);
:func:`update_number` folds a Python number with host arithmetic;
:func:`update_cat` keeps a ``cat`` value. Nothing here reads a device value back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.slots import F64, Block, Slot
from barrierguard.metrics.spec import SUM_KINDS, describe

__all__ = [
    "fold_block",
    "fold_columns",
    "update_cat",
    "update_number",
    "update_torchmetric",
]

Weight = float | torch.Tensor
"""A step's weight: a Python number, or a float64 device vector with one weight a row."""


def fold_block(block: Block, nan: str) -> None:
    """Fold the rows of ``block`` into its slots; the block is then empty."""
    steps = block.steps
    if not steps:
        return
    data = block.data[:steps]
    weight: Weight = 1.0
    if block.tensor_weights:
        weight = data[:, -1]
    elif block.weighted:
        values = block.weights
        if all(v == values[0] for v in values):
            weight = values[0]  # a kernel argument
        else:
            # One pinned staging tensor, copied without blocking the host.
            pinned = block.device.type == "cuda"
            staged = torch.tensor(values, dtype=F64, pin_memory=pinned)
            weight = staged.to(block.device, non_blocking=True)
    block.clear()
    fold_columns(block.slots, data, weight, nan, block.device)


def fold_columns(
    slots: Sequence[Slot], data: torch.Tensor, weight: Weight, nan: str, device: torch.device
) -> None:
    """Fold column ``j`` of the float64 ``(steps, metrics)`` ``data`` into ``slots[j]``.

    Device kernels only, with host numbers as kernel arguments: no sync.
    """
    steps = data.shape[0]
    finite = torch.isfinite(data) if nan != "propagate" else None
    with torch.no_grad():
        for j, slot in enumerate(slots):
            col = data[:, j]
            a, w, bad = slot.device_row(device)
            ok = None if finite is None else finite[:, j]
            if nan == "error":
                assert ok is not None
                bad.add_(ok.logical_not().sum())
                ok = None  # the values themselves are folded in as they are
            _fold_column(slot, col, ok, weight if slot.weighted else 1.0, a, w, steps)


def _fold_column(
    slot: Slot,
    col: torch.Tensor,
    ok: torch.Tensor | None,
    weight: Weight,
    a: torch.Tensor,
    w: torch.Tensor,
    steps: int,
) -> None:
    red = slot.reduction
    if red in SUM_KINDS:
        # Non-finite values contribute nothing under "ignore": fixed-shape masking.
        x = col if ok is None else torch.where(ok, col, 0.0)
        if red != "count":
            if isinstance(weight, torch.Tensor):
                a.add_(x @ weight)
            else:
                a.add_(x.sum(), alpha=weight)
        if ok is not None:
            okf = ok.to(F64)
            if isinstance(weight, torch.Tensor):
                w.add_(okf @ weight)
            else:
                w.add_(okf.sum(), alpha=weight)
        elif isinstance(weight, torch.Tensor):
            w.add_(weight.sum())
        else:
            slot.host_w += weight * steps
        return
    if ok is None:
        slot.host_w += steps
    else:
        w.add_(ok.sum())
    if red == "min":
        part = col if ok is None else torch.where(ok, col, math.inf)
        torch.minimum(a, part.amin(), out=a)
    elif red == "max":
        part = col if ok is None else torch.where(ok, col, -math.inf)
        torch.maximum(a, part.amax(), out=a)
    else:  # last: the latest (finite) value, or the previous one if none
        previous: torch.Tensor | float = slot.host_last if slot.last_on_host else a
        if ok is None:
            a.copy_(col[-1])
        else:
            index = torch.arange(steps, device=col.device)
            latest = torch.where(ok, index, -1).amax()
            picked = col.gather(0, latest.clamp(min=0).reshape(1)).reshape(())
            a.copy_(torch.where(latest >= 0, picked, previous))
        slot.last_on_host = False


def update_number(
    slot: Slot,
    x: float,
    n_tensor: torch.Tensor | None,
    n_float: float,
    nan: str,
    device: torch.device | None,
) -> None:
    """Fold one Python number into ``slot``, with host arithmetic.

    The caller folds the block with rows of ``slot`` in first: they come
    before this value (for ``last``).
    """
    red = slot.reduction
    if red == "cat":
        # Kept on the host until compute(): a device copy here would block.
        slot.values.append(torch.tensor([x], dtype=F64))
        if nan == "error" and not math.isfinite(x):
            slot.host_bad += 1.0
        return
    if not math.isfinite(x):
        if nan == "ignore":
            return
        if nan == "error":
            slot.host_bad += 1.0
    if red in SUM_KINDS:
        if slot.weighted and n_tensor is not None:
            # A device weight: the product lives on the device; x is a kernel argument.
            assert device is not None
            a, w, _ = slot.device_row(device)
            with torch.no_grad():
                a.add_(n_tensor.reshape(()), alpha=x)
                w.add_(n_tensor.reshape(()))
            return
        weight = n_float if slot.weighted else 1.0
        slot.host_a += weight * x
        slot.host_w += weight
        return
    if red == "min":
        slot.host_a = math.nan if math.isnan(x) or math.isnan(slot.host_a) else min(slot.host_a, x)
    elif red == "max":
        slot.host_a = math.nan if math.isnan(x) or math.isnan(slot.host_a) else max(slot.host_a, x)
    else:
        slot.host_last = x
        slot.last_on_host = True
    slot.host_w += 1.0


def update_cat(name: str, slot: Slot, x: torch.Tensor, nan: str, device: torch.device) -> None:
    """Keep one tensor of a ``cat`` slot (a device clone).

    Raises:
        BarrierGuardError: ``x`` does not share the trailing shape of earlier values.
    """
    value = x.detach()
    if value.dim() == 0:
        value = value.reshape(1)
    if slot.values and slot.values[0].shape[1:] != value.shape[1:]:
        raise BarrierGuardError(
            f"MetricBuffer.update({name}={describe(x)}) cannot be concatenated with "
            f"earlier values: expected trailing shape {tuple(slot.values[0].shape[1:])}"
        )
    # Cloned on the device so later in-place changes to the caller's tensor don't leak in.
    slot.values.append(value.clone())
    if nan == "error":
        _, _, bad = slot.device_row(device)
        bad.add_(torch.isfinite(value).logical_not().sum())


def update_torchmetric(metric: object, value: object) -> None:
    """Forward one logged value to a torchmetrics metric's own ``update``."""
    update = metric.update  # type: ignore[attr-defined]
    if isinstance(value, tuple):
        update(*value)
    elif isinstance(value, Mapping):
        update(**value)
    else:
        update(value)
