"""The vocabulary of :class:`~barrierguard.MetricBuffer` and the checks on it.

Owns the reduction names, the NaN policies and the reduction spec format, the
single place that validates a spec, the checks on metric names and torchmetrics
objects, what counts as a Python number, and the wording helpers that the error
messages of every other module of the buffer share.
"""

from __future__ import annotations

import numbers
import sys
from typing import Final

import torch

from barrierguard._errors import BarrierGuardError

__all__ = [
    "NAN_POLICIES",
    "REDUCTIONS",
    "SUM_KINDS",
    "WEIGHTABLE",
    "ReductionSpec",
    "check_name",
    "check_torchmetric",
    "describe",
    "is_number",
    "not_real",
    "not_single_value",
    "other_device",
    "parse_spec",
    "quote_all",
    "same_device",
]

REDUCTIONS: Final = ("mean", "sum", "min", "max", "last", "count", "cat")
WEIGHTABLE: Final = ("mean", "sum", "count")
NAN_POLICIES: Final = ("propagate", "ignore", "error")
SUM_KINDS: Final = frozenset(WEIGHTABLE)
"""Reductions whose state is a (weighted) sum and a total weight."""

ReductionSpec = str | tuple[str, str]
"""``"mean"`` or ``("mean", "weighted")``: a reduction name, optionally weighted by ``n``."""


def quote_all(names: tuple[str, ...]) -> str:
    """``'a', 'b'``: names as they read in a message."""
    return ", ".join(repr(n) for n in names)


def describe(value: object) -> str:
    """A value as a message shows it: a tensor by shape and device, never by content."""
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)} on {value.device}>"
    return repr(value)


def not_single_value(name: str, value: torch.Tensor, reduction: str) -> BarrierGuardError:
    """The error for a tensor of more than one element logged to a running reduction."""
    return BarrierGuardError(
        f"MetricBuffer.update({name}={describe(value)}) is not a single value for "
        f"reduction {reduction!r}: expected a tensor with one element or a "
        f"Python number (use reduction 'cat' to keep whole tensors)"
    )


def not_real(name: str) -> BarrierGuardError:
    """The error for a complex tensor logged to a running reduction."""
    return BarrierGuardError(
        f"MetricBuffer.update({name}=<complex tensor>) is not a real value: "
        f"expected a real (float, int or bool) tensor"
    )


def other_device(name: str, value: torch.Tensor, device: torch.device | None) -> BarrierGuardError:
    """The error for a tensor logged on another device than the buffer's state."""
    return BarrierGuardError(
        f"MetricBuffer.update({name}={describe(value)}) is on another device than "
        f"the buffer: expected a tensor on {device} (the device of the "
        f"buffer's state), or a Python number"
    )


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether tensors on ``a`` may join state on ``b``."""
    # "cuda" (no index) given by the user matches whichever CUDA device the tensors use.
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def is_number(value: object) -> bool:
    """Whether ``value`` is a real Python number (folded in on the host, never a tensor)."""
    return type(value) in (float, int) or (
        isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor)
    )


def parse_spec(where: str, name: str, spec: object) -> tuple[str, bool]:
    """Check one reduction spec; the single place where specs are validated.

    Returns:
        The reduction name and whether it is weighted by ``n``.

    Raises:
        BarrierGuardError: ``spec`` is not a valid reduction; the message names
            ``where``, ``name`` and ``spec``.
    """
    accepted = (
        f"expected one of {quote_all(REDUCTIONS)}, or (reduction, 'weighted') for "
        f"{quote_all(WEIGHTABLE)}"
    )
    if isinstance(spec, str):
        if spec in REDUCTIONS:
            return spec, False
    elif (
        isinstance(spec, tuple)
        and len(spec) == 2
        and spec[0] in REDUCTIONS
        and spec[1] in ("weighted", "unweighted")
    ):
        if spec[1] == "weighted" and spec[0] not in WEIGHTABLE:
            raise BarrierGuardError(
                f"{where}={{{name!r}: {spec!r}}} is not a valid reduction: only "
                f"{quote_all(WEIGHTABLE)} can be weighted by n, a weight means nothing "
                f"for {spec[0]!r}"
            )
        return str(spec[0]), spec[1] == "weighted"
    raise BarrierGuardError(f"{where}={{{name!r}: {spec!r}}} is not a valid reduction: {accepted}")


def check_name(name: object, arg: str) -> None:
    """Raise unless ``name`` can name a metric given in ``MetricBuffer(arg=...)``."""
    if not isinstance(name, str) or not name or name == "n":
        raise BarrierGuardError(
            f"MetricBuffer({arg}={{{name!r}: ...}}) is not a valid metric name: expected "
            f"a non-empty string other than 'n' (update() takes n as the weight)"
        )


def check_torchmetric(name: str, metric: object) -> None:
    """Raise unless ``metric`` is a torchmetrics ``Metric``."""
    # A Metric instance means torchmetrics is already imported; importing it here
    # would cost seconds and change the warnings filters as a side effect.
    module = sys.modules.get("torchmetrics")
    if module is None or not isinstance(metric, module.Metric):
        raise BarrierGuardError(
            f"MetricBuffer(metrics={{{name!r}: {metric!r}}}) is not a torchmetrics "
            f"Metric: expected an instance of torchmetrics.Metric"
        )
