"""MetricBuffer's state: a :class:`Slot` per metric, a :class:`Block` of float64 device rows per
set of names, and the folds. Nothing here reads a device value."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeGuard

import torch

from barrierguard._errors import BarrierGuardError

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


def is_number(value: object) -> TypeGuard[numbers.Real]:
    """Whether ``value`` is a real Python number (``type`` first: an ABC check is slower)."""
    return type(value) in (float, int) or isinstance(value, numbers.Real)


def parse_spec(where: str, name: str, spec: object) -> tuple[str, bool]:
    """The reduction of ``spec`` and whether it is weighted by ``n``; raises naming ``where``."""
    red, mode = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, "unweighted")
    if isinstance(red, str) and red in REDUCTIONS and mode in ("weighted", "unweighted"):
        if mode == "weighted" and red not in WEIGHTABLE:
            raise BarrierGuardError(
                f"{where}={{{name!r}: {spec!r}}} is not a valid reduction: only "
                f"{quote_all(WEIGHTABLE)} can be weighted by n, a weight means nothing "
                f"for {red!r}"
            )
        return red, mode == "weighted"
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


F64: Final = torch.float64  # the dtype of every running state
BLOCK_STEPS: Final = 1024
"""Rows of a block: the steps a set of names copies in before they are folded in."""

_DEVICE: Final = torch.Tensor.get_device  # an int, and a TypeError for a non-tensor
_DTYPE: Final = operator.attrgetter("dtype")

Weight = float | torch.Tensor  # a fold's weight: a number, or a device vector of one a row


class Slot:
    """State of one metric: a float64 device ``row`` ``[a, w, bad]`` and its host twin.

    ``a``: the weighted sum (mean/sum), min/max or last value; ``w``: the total weight; ``bad``:
    non-finite values seen (``nan="error"``). ``block`` holds rows not folded in yet; ``values``
    are a ``cat`` metric's.
    """

    def __init__(self, reduction: str, weighted: bool) -> None:
        self.reduction, self.weighted = reduction, weighted
        self.initial_a = {"min": math.inf, "max": -math.inf, "last": math.nan}.get(reduction, 0.0)
        self.block: Block | None = None
        self.clear()

    def clear(self) -> None:
        self.host_a = self.initial_a
        self.host_w = self.host_bad = 0.0
        self.host_last, self.last_on_host = math.nan, False
        self.values: list[torch.Tensor] = []
        self.row: torch.Tensor | None = None  # made again on first use

    def device_row(self, device: torch.device) -> torch.Tensor:
        """The row ``[a, w, bad]``, made on ``device`` on first use (a fill, not a copy)."""
        if self.row is None:
            self.row = torch.zeros(3, dtype=F64, device=device)
            self.row[0].fill_(self.initial_a)
        return self.row

    @property
    def spec(self) -> ReductionSpec:
        return (self.reduction, "weighted") if self.weighted else self.reduction


class Block:
    """The float64 rows of a set of tensor names (column ``j``: ``tensors[j]``), a row a step.

    A weighted block has a last column for a tensor weight ``n`` (Python weights go to
    ``weights``). ``devices``, ``dtypes`` and ``groups`` are the last checked step's.
    """

    def __init__(
        self, slots: Mapping[str, Slot], tensors: tuple[str, ...], device: torch.device, nan: str
    ) -> None:
        self.width, self.device, self.nan = len(tensors), device, nan
        self.slots = [slots[name] for name in tensors]
        self.weighted = any(slot.weighted for slot in self.slots)
        # A step's values picked at C speed (itemgetter of one name gives no tuple).
        self.take: Callable[[Mapping[str, Any]], tuple[Any, ...]] = (
            operator.itemgetter(*tensors) if len(tensors) > 1 else lambda x: (x[tensors[0]],)
        )
        self.data = torch.zeros((BLOCK_STEPS, self.width + self.weighted), dtype=F64, device=device)
        # Each row's 0-d views, without and with the weight column, made on first use.
        self.rows: list[list[torch.Tensor] | None] = [None] * BLOCK_STEPS
        self.wrows: list[list[torch.Tensor] | None] = [None] * BLOCK_STEPS
        self.devices: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.groups: list[list[int]] | None = None
        self.grad = False
        self.steps = 0
        self.weights: list[float] = []
        self.tensor_weights = False

    def sign(self, values: Sequence[torch.Tensor]) -> None:
        """Remember the devices, dtypes and grad of checked ``values``; group them by dtype."""
        self.grad = any(v.requires_grad for v in values)
        self.devices = list(map(_DEVICE, values))
        self.dtypes = list(map(_DTYPE, values))
        # One kernel per dtype: torch would copy a mixed list one tensor at a time.
        groups = [
            [i for i, d in enumerate(self.dtypes) if d == k] for k in dict.fromkeys(self.dtypes)
        ]
        self.groups = groups if len(groups) > 1 else None

    def put(self, values: tuple[Any, ...], n: object) -> bool:
        """Copy a step that matches the last checked one into the next row; else ``False``.

        A non-tensor fails the device read; a tensor not 0-d, or newly requiring grad, fails the
        copy (autograd refuses to write a graph into the rows' ``unbind`` views).
        """
        if self.tensor_weights and isinstance(n, torch.Tensor):
            values = (*values, n)
        elif self.tensor_weights or not (n is None or type(n) is int or type(n) is float):
            return False
        try:
            if [*map(_DEVICE, values)] != self.devices or [*map(_DTYPE, values)] != self.dtypes:
                return False
            self.copy(values)
        except (TypeError, RuntimeError):  # TypeError: a value that is not a tensor
            return False
        self.advance(1.0 if n is None else n)  # type: ignore[arg-type]
        return True

    def copy(self, values: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        """Copy ``values`` into the next row: one kernel per dtype, no autograd graph."""
        steps = self.steps
        dst = (self.wrows if self.tensor_weights else self.rows)[steps]
        if dst is None:
            views = self.wrows[steps] = list(self.data[steps].unbind(0))
            self.rows[steps] = views[: self.width]
            dst = views if self.tensor_weights else views[: self.width]
        if self.grad and torch.is_grad_enabled():  # a value requires grad: copy it graph-free
            torch._C._set_grad_enabled(False)  # a microsecond less than no_grad()
            try:
                return self.copy(values)
            finally:
                torch._C._set_grad_enabled(True)
        if self.groups is None:
            torch._foreach_copy_(dst, values)
        else:
            for index in self.groups:
                torch._foreach_copy_([dst[i] for i in index], [values[i] for i in index])

    def advance(self, n: float) -> None:
        """Count the row just copied, with its Python weight ``n``; fold a full block in."""
        if self.weighted and not self.tensor_weights:
            self.weights.append(n)
        self.steps += 1
        if self.steps == 1:
            for slot in self.slots:
                slot.block = self
        elif self.steps == BLOCK_STEPS:
            self.fold()

    def clear(self) -> None:  # drops the rows not folded in yet
        self.steps = 0
        self.weights = []
        self.tensor_weights = False
        for slot in self.slots:
            slot.block = None

    def fold(self) -> None:
        """Fold the rows into the slots (device kernels only); the block is then empty."""
        if not (steps := self.steps):
            return
        data = self.data[:steps]
        weight: Weight = 1.0
        if self.tensor_weights:
            weight = data[:, -1]
        elif self.weighted:
            ws = self.weights
            if all(v == ws[0] for v in ws):
                weight = ws[0]  # a kernel argument
            else:  # one pinned staging tensor, copied without blocking the host
                staged = torch.tensor(ws, dtype=F64, pin_memory=self.device.type == "cuda")
                weight = staged.to(self.device, non_blocking=True)
        self.clear()
        finite = torch.isfinite(data) if self.nan != "propagate" else None
        with torch.no_grad():
            for j, slot in enumerate(self.slots):
                ok = None if finite is None else finite[:, j]
                if self.nan == "error":
                    assert ok is not None
                    slot.device_row(self.device)[2].add_(ok.logical_not().sum())
                    ok = None  # the values themselves are folded in as they are
                _fold_column(slot, data[:, j], ok, weight if slot.weighted else 1.0, self.device)


def _add(dst: torch.Tensor, v: torch.Tensor, weight: Weight) -> None:
    """``dst += sum(weight * v)``: a dot product, or a sum with the number as ``alpha``."""
    if isinstance(weight, torch.Tensor):
        dst.add_(v @ weight)
    else:
        dst.add_(v.sum(), alpha=weight)


def _fold_column(
    slot: Slot, col: torch.Tensor, ok: torch.Tensor | None, weight: Weight, device: torch.device
) -> None:
    """Fold one column of rows into ``slot``; ``ok`` masks non-finite values out (``ignore``)."""
    a, w, _ = slot.device_row(device)
    steps, red = col.shape[0], slot.reduction
    if red in SUM_KINDS:
        if red != "count":
            _add(a, col if ok is None else torch.where(ok, col, 0.0), weight)  # fixed shape
        if ok is not None:
            _add(w, ok.to(F64), weight)
        elif isinstance(weight, torch.Tensor):
            w.add_(weight.sum())
        else:
            slot.host_w += weight * steps
        return
    if ok is None:
        slot.host_w += steps
    else:
        w.add_(ok.sum())
    if red in ("min", "max"):
        part = col if ok is None else torch.where(ok, col, math.inf if red == "min" else -math.inf)
        if red == "min":
            torch.minimum(a, part.amin(), out=a)
        else:
            torch.maximum(a, part.amax(), out=a)
    else:  # last: the latest (finite) value, or the previous one if none
        previous: torch.Tensor | float = slot.host_last if slot.last_on_host else a
        if ok is None:
            a.copy_(col[-1])
        else:
            latest = torch.where(ok, torch.arange(steps, device=col.device), -1).amax()
            picked = col.gather(0, latest.clamp(min=0).reshape(1)).reshape(())
            a.copy_(torch.where(latest >= 0, picked, previous))
        slot.last_on_host = False


def update_number(
    slot: Slot, x: float, n_tensor: torch.Tensor | None, n_float: float, nan: str, device: Any
) -> None:
    """Fold one Python number into ``slot`` on the host; its block's rows come first."""
    red = slot.reduction
    if red == "cat":
        # Kept on the host until compute(): a device copy here would block.
        slot.values.append(torch.tensor([x], dtype=F64))
        slot.host_bad += nan == "error" and not math.isfinite(x)
        return
    if not math.isfinite(x):
        if nan == "ignore":
            return
        slot.host_bad += nan == "error"
    if red in SUM_KINDS:
        if slot.weighted and n_tensor is not None:
            # A device weight: the product lives on the device; x is a kernel argument.
            a, w, _ = slot.device_row(device)
            with torch.no_grad():
                a.add_(n_tensor, alpha=x)
                w.add_(n_tensor)
            return
        weight = n_float if slot.weighted else 1.0
        slot.host_a += weight * x
        slot.host_w += weight
        return
    if red in ("min", "max"):
        pick = min if red == "min" else max
        slot.host_a = math.nan if math.isnan(x) or math.isnan(slot.host_a) else pick(slot.host_a, x)
    else:
        slot.host_last = x
        slot.last_on_host = True
    slot.host_w += 1.0


def update_cat(name: str, slot: Slot, x: torch.Tensor, nan: str, device: torch.device) -> None:
    """Keep a device clone of one ``cat`` value; raise if its trailing shape is another."""
    value = x.detach()
    value = value.reshape(1) if value.dim() == 0 else value
    if slot.values and slot.values[0].shape[1:] != value.shape[1:]:
        raise BarrierGuardError(
            f"MetricBuffer.update({name}={describe(x)}) cannot be concatenated with "
            f"earlier values: expected trailing shape {tuple(slot.values[0].shape[1:])}"
        )
    slot.values.append(value.clone())
    if nan == "error":
        slot.device_row(device)[2].add_(torch.isfinite(value).logical_not().sum())
