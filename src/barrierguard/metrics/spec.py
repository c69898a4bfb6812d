"""The vocabulary of :class:`~barrierguard.MetricBuffer` (reductions, NaN policies, specs,
names, Python numbers) and the one place that checks it.
"""

from __future__ import annotations

import numbers
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
    "describe",
    "is_number",
    "parse_spec",
    "quote_all",
]

REDUCTIONS: Final = ("mean", "sum", "min", "max", "last", "count", "cat")
WEIGHTABLE: Final = ("mean", "sum", "count")
NAN_POLICIES: Final = ("propagate", "ignore", "error")
SUM_KINDS: Final = frozenset(WEIGHTABLE)  # state: a (weighted) sum and a total weight
ReductionSpec = str | tuple[str, str]  # "mean", or ("mean", "weighted"): weighted by n


def quote_all(names: tuple[str, ...]) -> str:
    """``'a', 'b'``: names as they read in a message."""
    return ", ".join(repr(n) for n in names)


def describe(value: object) -> str:
    """A value as a message shows it: a tensor by shape and device, never by content."""
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)} on {value.device}>"
    return repr(value)


def is_number(value: object) -> bool:
    """Whether ``value`` is a real Python number (folded in on the host, never a tensor)."""
    return type(value) in (float, int) or (
        isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor)
    )


def parse_spec(where: str, name: str, spec: object) -> tuple[str, bool]:
    """The reduction of ``spec`` and whether it is weighted by ``n``.

    Raises:
        BarrierGuardError: ``spec`` is not a valid reduction; the message names
            ``where``, ``name`` and ``spec``.
    """
    if isinstance(spec, str) and spec in REDUCTIONS:
        return spec, False
    if (
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
    raise BarrierGuardError(
        f"{where}={{{name!r}: {spec!r}}} is not a valid reduction: expected one of "
        f"{quote_all(REDUCTIONS)}, or (reduction, 'weighted') for {quote_all(WEIGHTABLE)}"
    )


def check_name(name: object, arg: str) -> None:
    """Raise unless ``name`` can name a metric given in ``MetricBuffer(arg=...)``."""
    if not isinstance(name, str) or not name or name == "n":
        raise BarrierGuardError(
            f"MetricBuffer({arg}={{{name!r}: ...}}) is not a valid metric name: expected "
            f"a non-empty string other than 'n' (update() takes n as the weight)"
        )
