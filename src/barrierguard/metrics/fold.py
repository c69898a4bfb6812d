"""Folding logged values into the running state: the reductions themselves.

Owns the arithmetic of every running reduction under every NaN policy, in its
two forms: per value, for the slow path of :meth:`MetricBuffer.update
<barrierguard.MetricBuffer.update>` (:func:`update_tensor`, :func:`update_number`,
:func:`update_cat`), and per block of pending steps, for the fast path
(:func:`flush`, which folds a whole :class:`~barrierguard.metrics.slots.Plan`
in with one ``torch.stack``, after checking that no pending tensor changed).
Nothing here reads a device value back.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any, Final

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.slots import F64, Plan, Slot, admit
from barrierguard.metrics.spec import (
    SUM_KINDS,
    describe,
    not_real,
    not_single_value,
    other_device,
)

__all__ = ["flush", "update_cat", "update_number", "update_tensor", "update_torchmetric"]

_VERSION: Final = operator.attrgetter("_version")


def flush(plan: Plan, nan: str) -> None:
    """Fold the pending steps of ``plan`` into its block: one stack, a few reductions.

    After the first step of a plan, :meth:`MetricBuffer.update
    <barrierguard.MetricBuffer.update>` checks only each value's type and
    ``requires_grad``; the stack checks the rest at once (one element, real,
    on the plan's device), and a value that fails is explained here.
    The plan is left with no pending steps, whether or not this raises.

    Raises:
        BarrierGuardError: A pending tensor was changed in place after it was
            logged (its version counter moved), so its logged value is lost; or a
            pending tensor has more than one element, is complex, or is on
            another device than the plan.
    """
    steps = plan.steps
    if not steps:
        return
    values, versions = plan.pending, plan.versions
    weights, wversions, runs = plan.weights, plan.wversions, plan.runs
    plan.clear()
    with torch.no_grad():
        # The stack first: the version counters it leaves in the cache are then cheap.
        block = _stack(plan, values, steps)
        _check_versions(plan, values, versions)
        if list(map(_VERSION, weights)) != wversions:
            raise BarrierGuardError(
                "MetricBuffer.update(n=<tensor>) was changed in place after it was logged: "
                "expected logged tensors to keep their value until they are folded in "
                "(pass a copy)"
            )
        _fold(plan, block, weights, runs, steps, nan)


def _check_versions(plan: Plan, values: list[torch.Tensor], versions: list[int]) -> None:
    if list(map(_VERSION, values)) != versions:
        i = next(i for i, v in enumerate(values) if v._version != versions[i])
        raise BarrierGuardError(
            f"MetricBuffer.update({plan.column(i)}=<tensor>) was changed in place "
            f"after it was logged: expected logged tensors to keep their value "
            f"until they are folded in (log a copy, e.g. value.detach().clone())"
        )


def _stack(plan: Plan, values: list[torch.Tensor], steps: int) -> torch.Tensor:
    """The ``(steps, metrics)`` block of the pending values: the one stack."""
    k = len(plan.order)
    try:
        block: torch.Tensor | None = _stack_block(plan, values, k)
    except (RuntimeError, TypeError):  # shapes or devices differ, or not a tensor
        block = None
    if (
        block is None
        or block.shape != (steps, k)
        or block.device != plan.device
        or block.is_complex()
    ):
        # Rare: a value of one element in another shape is reshaped; any other
        # value that does not fit gets the error update() gives it on a first step.
        fit = [_fit(plan, i, v, steps) for i, v in enumerate(values)]
        block = _stack_block(plan, fit, k)
    return block


def _stack_block(plan: Plan, values: list[torch.Tensor], k: int) -> torch.Tensor:
    if plan.by_column:
        # Integer columns beside floats below float64: a stack per column keeps each
        # column's dtype until its conversion to float64.
        return torch.stack([torch.stack(values[j::k]).to(F64) for j in range(k)], dim=1)
    flat = torch.stack(values)
    return flat.view(-1, k) if flat.dim() == 1 else flat


def _fit(plan: Plan, index: int, value: object, steps: int) -> torch.Tensor:
    """Pending value ``index`` as a 0-d tensor, or the error that explains why it cannot be."""
    fit = admit(value, plan.device)  # the fast path's own test of a value
    if fit is not None:
        return fit
    name = plan.column(index)
    if not isinstance(value, torch.Tensor):
        error = BarrierGuardError(
            f"MetricBuffer.update({name}={value!r}) is not a valid value: expected a "
            f"tensor or a Python number"
        )
    elif value.device != plan.device:
        error = other_device(name, value, plan.device)
    elif value.numel() != 1:
        error = not_single_value(name, value, plan.reductions[index % len(plan.order)])
    else:
        error = not_real(name)
    # Found at the fold, not in the update() that logged it: say so.
    raise BarrierGuardError(f"{error} (found when the last {steps} steps were folded in)")


def _fold(
    plan: Plan,
    block: torch.Tensor,
    weights: list[torch.Tensor],
    runs: list[list[Any]],
    steps: int,
    nan: str,
) -> None:
    """The device work of a flush, over the ``(steps, metrics)`` block of values."""
    if block.dtype != F64:
        block = block.to(F64)
    s_w, s_u, s_min, s_max, s_last = plan.sizes
    o_min = s_w + s_u
    o_max = o_min + s_min
    o_last = o_max + s_max
    (a_w, w_w), (a_u, _), (a_min, _), (a_max, _), (a_last, _) = plan.groups
    finite: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    src = block
    if nan == "ignore":
        # Non-finite values contribute nothing: fixed-shape masking, no branch on data.
        finite = torch.isfinite(block)
        counts = finite.to(F64)
        src = torch.where(finite, block, 0.0)
    if s_w:
        n_block = torch.stack(weights).to(F64) if weights else None
        row = n_i = 0
        for weight, count in runs:
            rows = src[row : row + count, :s_w]
            if weight is None:  # a run of tensor weights
                assert n_block is not None
                n_run = n_block[n_i : n_i + count]
                n_i += count
                a_w.addmv_(rows.T, n_run)
                if counts is not None:
                    w_w.addmv_(counts[row : row + count, :s_w].T, n_run)
                else:
                    w_w.add_(n_run.sum())
            else:  # a run of steps with the same Python weight: a kernel argument
                a_w.add_(rows.sum(0), alpha=weight)
                if counts is not None:
                    w_w.add_(counts[row : row + count, :s_w].sum(0), alpha=weight)
                else:
                    for slot in plan.host_weighted:
                        slot.host_w += weight * count
            row += count
    if s_u:
        a_u.add_(src[:, s_w:o_min].sum(0))
    if counts is None:
        for slot in plan.host_unit:
            slot.host_w += steps
    elif len(plan.order) > s_w:
        plan.w_unit.add_(counts[:, s_w:].sum(0))
    if s_min:
        part = block[:, o_min:o_max]
        if finite is not None:
            part = torch.where(finite[:, o_min:o_max], part, math.inf)
        torch.minimum(a_min, part.amin(0), out=a_min)
    if s_max:
        part = block[:, o_max:o_last]
        if finite is not None:
            part = torch.where(finite[:, o_max:o_last], part, -math.inf)
        torch.maximum(a_max, part.amax(0), out=a_max)
    if s_last:
        part = block[:, o_last:]
        if finite is not None:
            # The latest finite value of each column, or the previous value if none.
            for slot in plan.lasts:
                if slot.last_on_host:
                    assert slot.a is not None
                    slot.a.fill_(slot.host_last)  # a kernel argument, not a copy
            index = torch.arange(steps, device=block.device).unsqueeze(1)
            latest = torch.where(finite[:, o_last:], index, -1).amax(0)
            picked = part.gather(0, latest.clamp(min=0).unsqueeze(0)).squeeze(0)
            a_last.copy_(torch.where(latest >= 0, picked, a_last))
        else:
            a_last.copy_(part[-1])
        for slot in plan.lasts:
            slot.last_on_host = False
    if nan == "error":
        # Count the non-finite values of every column: min, max, last and count
        # could hide one otherwise (a mean or sum also ends non-finite).
        plan.bad.add_(torch.isfinite(block).logical_not().sum(0))


def update_tensor(
    name: str,
    slot: Slot,
    x: torch.Tensor,
    n_tensor: torch.Tensor | None,
    n_float: float,
    nan: str,
    device: torch.device | None,
) -> None:
    """Fold one single-value tensor into ``slot`` (slow path): device kernels, no sync.

    Raises:
        BarrierGuardError: ``x`` has more than one element or is complex.
    """
    if x.numel() != 1:
        raise not_single_value(name, x, slot.reduction)
    if x.is_complex():
        raise not_real(name)
    x = x.reshape(())
    a, w, bad = slot.device_row(device)
    red = slot.reduction
    weight_t = n_tensor if slot.weighted else None
    weight_f = n_float if slot.weighted else 1.0
    if nan == "ignore":
        # Fixed-shape masking: a non-finite value contributes nothing, with no branch
        # on its value (that would need it on the host).
        x = x.to(F64)
        finite = torch.isfinite(x)
        if red in SUM_KINDS:
            if red != "count":
                clean = torch.where(finite, x, 0.0)
                if weight_t is not None:
                    a.addcmul_(clean, weight_t)
                else:
                    a.add_(clean, alpha=weight_f)
            if weight_t is not None:
                w.addcmul_(finite, weight_t)
            else:
                w.add_(finite, alpha=weight_f)
            return
        if red == "min":
            torch.minimum(a, torch.where(finite, x, math.inf), out=a)
        elif red == "max":
            torch.maximum(a, torch.where(finite, x, -math.inf), out=a)
        else:  # last: keep the previous value, wherever it lives, on a bad one
            previous: torch.Tensor | float = slot.host_last if slot.last_on_host else a
            a.copy_(torch.where(finite, x, previous))
            slot.last_on_host = False
        w.add_(finite)
        return
    # propagate / error: plain arithmetic. Under "error", a sum or mean with a
    # non-finite input ends non-finite itself, which compute() checks; the other
    # reductions can hide one (min of +inf, an overwritten last), so they add
    # x * 0 (NaN exactly when x is NaN or inf) to the bad counter.
    if red in SUM_KINDS:
        # count accumulates a too (unused by its result): under "error" a bad count
        # value then shows as a non-finite a, as for mean and sum.
        if weight_t is not None:
            a.addcmul_(x, weight_t)
        else:
            a.add_(x, alpha=weight_f)
        if weight_t is not None:
            w.add_(weight_t)
        else:
            slot.host_w += weight_f
    else:
        if red == "min":
            torch.minimum(a, x, out=a)
        elif red == "max":
            torch.maximum(a, x, out=a)
        else:
            a.copy_(x)
            slot.last_on_host = False
        slot.host_w += 1.0
    if nan == "error" and red not in SUM_KINDS:
        bad.add_(x * 0.0)


def update_number(
    slot: Slot,
    x: float,
    n_tensor: torch.Tensor | None,
    n_float: float,
    nan: str,
    device: torch.device | None,
) -> None:
    """Fold one Python number into ``slot``, with host arithmetic.

    The caller folds the pending steps of ``slot.plan`` in first when order matters
    (a ``last`` slot): they come before this value.
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
            a, w, _ = slot.device_row(device)
            a.add_(n_tensor, alpha=x)
            w.add_(n_tensor)
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


def update_cat(
    name: str, slot: Slot, x: torch.Tensor, nan: str, device: torch.device | None
) -> None:
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


def update_torchmetric(metric: Any, value: object) -> None:
    """Forward one logged value to a torchmetrics metric's own ``update``."""
    if isinstance(value, tuple):
        metric.update(*value)
    elif isinstance(value, Mapping):
        metric.update(**value)
    else:
        metric.update(value)
