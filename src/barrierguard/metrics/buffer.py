"""MetricBuffer: log metrics every step without a host-device barrier.

``running_loss += loss.item()`` waits for the device at every step. A
:class:`MetricBuffer` keeps running reductions in float64 tensors on the device
instead, folds Python numbers into host-side floats, and reads everything back
with one device-to-host transfer in :meth:`MetricBuffer.compute`.

This module owns the public class, the slots and blocks it holds, and the
per-step control flow of :meth:`MetricBuffer.update`; the arithmetic is in
the sibling modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.fold import (
    fold_block,
    update_cat,
    update_number,
    update_torchmetric,
)
from barrierguard.metrics.readback import read_back
from barrierguard.metrics.slots import BLOCK_STEPS, Block, Slot
from barrierguard.metrics.spec import (
    NAN_POLICIES,
    REDUCTIONS,
    WEIGHTABLE,
    ReductionSpec,
    check_name,
    check_torchmetric,
    describe,
    is_number,
    not_real,
    not_single_value,
    other_device,
    parse_spec,
    quote_all,
    same_device,
)
from barrierguard.metrics.state import check_version, restore_metrics, restore_slots, snapshot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["BLOCK_STEPS", "NAN_POLICIES", "REDUCTIONS", "WEIGHTABLE", "MetricBuffer"]


class MetricBuffer:
    """Running metrics kept on the device, read back with one transfer.

    Follows torchmetrics' ``update``/``compute``/``reset``. Each metric has a
    reduction fixed at construction (or on first use, see ``default``):

    * ``"mean"``: mean of the logged values; ``("mean", "weighted")`` weights each
      value by the ``n`` passed to :meth:`update` (``n`` defaults to 1).
    * ``"sum"``: sum of values (``("sum", "weighted")``: sum of ``value * n``).
    * ``"count"``: number of values logged (``("count", "weighted")``: sum of ``n``).
    * ``"min"``, ``"max"``: running extremes; ``"last"``: the latest value.
    * ``"cat"``: keeps every value (tensors of any shape, concatenated on dim 0).

    Running reductions keep float64 state of constant size, however many steps
    are logged. :meth:`update` never synchronizes and keeps nothing of the
    caller's: for a repeated set of names it checks each tensor's metadata and
    copies the step's values into the next row of a preallocated float64 block
    on the device with one kernel (``torch._foreach_copy_``); every
    :data:`~barrierguard.metrics.slots.BLOCK_STEPS` steps, and before
    :meth:`compute`, :meth:`state_dict` and :meth:`load_state_dict`, the rows
    are folded into the state with a few reductions. Python numbers are folded
    in with host arithmetic. Tensors that require grad are copied without
    their graph. A logged tensor may be changed in place right after
    :meth:`update` returns.

    Args:
        reductions: Metric name to reduction spec, e.g.
            ``{"loss": ("mean", "weighted"), "grad_norm": "max"}``.
        metrics: torchmetrics ``Metric`` objects logged alongside; ``update``
            forwards to ``metric.update``, ``compute`` calls ``metric.compute()``
            (which may transfer or synchronize by itself).
        nan: What to do with NaN and +/-inf values: ``"propagate"`` (plain
            arithmetic), ``"ignore"`` (skipped, with fixed-shape ``torch.where``
            masking) or ``"error"`` (a device-side flag, raised at ``compute()``).
        default: Reduction given to metric names first seen in :meth:`update`;
            ``None`` makes an unknown name an error.
        device: Device of the state; by default the device of the first tensor
            logged. All tensors logged must be on it.
        sync_dist: Reduce across ranks in :meth:`compute` when
            ``torch.distributed`` is initialised.
        process_group: Process group for that reduction (default: the world).

    Raises:
        BarrierGuardError: A reduction, ``nan`` policy, ``default`` or metric name
            is not valid.

    Example:
        >>> import torch
        >>> from barrierguard import MetricBuffer
        >>> buf = MetricBuffer({"loss": ("mean", "weighted"), "grad_norm": "max"})
        >>> for step in range(3):
        ...     loss = torch.tensor(float(step))
        ...     buf.update(loss=loss, grad_norm=loss * 2, n=10)
        >>> buf.compute()
        {'grad_norm': 4.0, 'loss': 1.0}
    """

    def __init__(
        self,
        reductions: Mapping[str, ReductionSpec] | None = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        nan: str = "propagate",
        default: ReductionSpec | None = "mean",
        device: torch.device | str | None = None,
        sync_dist: bool = True,
        process_group: ProcessGroup | None = None,
    ) -> None:
        if nan not in NAN_POLICIES:
            raise BarrierGuardError(
                f"MetricBuffer(nan={nan!r}) is not a valid nan policy: expected one of "
                f"{quote_all(NAN_POLICIES)}"
            )
        self._nan = nan
        self._default: tuple[str, bool] | None = (
            None if default is None else parse_spec("MetricBuffer(default", "*", default)
        )
        self._device: torch.device | None = None if device is None else torch.device(device)
        self._sync_dist = sync_dist
        self._group = process_group
        self._slots: dict[str, Slot] = {}
        # A block per set of names in call order, and the block of the last update().
        self._blocks: dict[tuple[str, ...], Block] = {}
        self._patterns: dict[tuple[tuple[str, ...], tuple[str, ...]], Block] = {}
        self._last: Block | None = None
        for name, spec in (reductions or {}).items():
            check_name(name, "reductions")
            self._slots[name] = Slot(*parse_spec("MetricBuffer(reductions", name, spec))
        self._metrics: dict[str, Any] = {}
        for name, metric in (metrics or {}).items():
            check_name(name, "metrics")
            if name in self._slots:
                raise BarrierGuardError(
                    f"MetricBuffer(metrics={{{name!r}: ...}}) names a metric already in "
                    f"reductions: expected each name in only one of reductions and metrics"
                )
            check_torchmetric(name, metric)
            self._metrics[name] = metric

    # -- public API --------------------------------------------------------------------

    @property
    def device(self) -> torch.device | None:
        """Device of the state tensors, or ``None`` before the first tensor is logged."""
        return self._device

    @property
    def nan(self) -> str:
        """The NaN/inf policy given at construction."""
        return self._nan

    @property
    def reductions(self) -> dict[str, ReductionSpec]:
        """Reduction spec of every registered (non-torchmetrics) metric."""
        return {name: slot.spec for name, slot in self._slots.items()}

    def update(
        self,
        values: Mapping[str, Any] | None = None,
        /,
        *,
        n: float | torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """Log one step's values, without synchronizing with the device.

        For a set of names logged before, this checks metadata and launches one
        copy kernel (a few more every :data:`~barrierguard.metrics.slots.BLOCK_STEPS`
        steps, to fold the rows in). Raising for NaN (``nan="error"``) waits for
        :meth:`compute`.

        Args:
            values: Metric values by name, for names that are not identifiers.
            n: Weight of this step for weighted reductions (e.g. the batch size):
                a Python number or a one-element tensor on the buffer's device.
                Ignored by unweighted reductions. Defaults to 1.
            **kwargs: Metric values by name: one-element tensors or Python numbers
                (any tensor for ``cat``); for a torchmetrics metric, a tuple of
                positional arguments, a dict of keyword arguments or a single
                tensor for its ``update``.

        Raises:
            BarrierGuardError: An unknown name when ``default=None``; a tensor with
                more than one element for a running reduction, a complex tensor or
                a tensor on another device than the buffer's; a value that is not a
                number or tensor.

        Example:
            >>> import torch
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"loss": ("mean", "weighted")})
            >>> buf.update(loss=torch.tensor(2.0), n=3)
            >>> buf.update({"loss": 4.0}, n=1)
            >>> buf.compute()["loss"]
            2.5
        """
        items = kwargs if values is None else {**values, **kwargs} if kwargs else values
        # The hot path: a set of names logged before, with a Python weight.
        block = self._blocks.get(tuple(items))
        if (
            block is not None
            and (n is None or type(n) is int or type(n) is float)
            and self._log(block, items, 1.0 if n is None else float(n), None)
        ):
            return
        n_tensor, n_float = self._weight(n)
        if block is not None and self._log(block, items, n_float, n_tensor):
            return
        self._update_slow(items, n_tensor, n_float)

    def compute(self) -> dict[str, Any]:
        """Reduce every metric, with one device-to-host transfer for all of them.

        The blocks' rows are folded in first (device work, no transfer).
        All running states are packed into one float64 tensor on the device and
        read back at once. With ``torch.distributed`` initialised (and
        ``sync_dist=True``) that tensor is first gathered from every rank with one
        collective: means are weighted over all samples of all ranks, sums and
        counts add up, min/max are global, ``last`` is the value of the highest
        rank that logged one. ``cat`` values stay on the device and stay local to
        each rank. torchmetrics metrics are computed by their own ``compute()``.

        Returns:
            Metric name to a Python float (running reductions; ``nan`` for a mean,
            min, max or last with no values), a tensor (``cat``) or whatever the
            torchmetrics metric returns.

        Raises:
            BarrierGuardError: Under ``nan="error"``, a metric saw NaN or inf; the
                ranks registered different metrics.

        Example:
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"lr": "last", "steps": "count"})
            >>> buf.update(lr=0.1, steps=1)
            >>> buf.update(lr=0.05, steps=1)
            >>> buf.compute()
            {'lr': 0.05, 'steps': 2.0}
        """
        self._fold_all()
        results = read_back(
            self._slots,
            nan=self._nan,
            device=self._device,
            distributed=self._distributed(),
            group=self._group,
        )
        for name, metric in self._metrics.items():
            results[name] = metric.compute()
        return results

    def reset(self) -> None:
        """Forget every logged value; registered metrics and the device stay.

        Example:
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"loss": "sum"})
            >>> buf.update(loss=2.0)
            >>> buf.reset()
            >>> buf.compute()
            {'loss': 0.0}
        """
        for block in self._patterns.values():
            block.clear()  # its rows are dropped, never folded in
        for slot in self._slots.values():
            slot.clear()
        for metric in self._metrics.values():
            metric.reset()

    def state_dict(self) -> dict[str, Any]:
        """Snapshot of the state; device tensors are cloned on the device, never read.

        Returns:
            A dict that :meth:`load_state_dict` takes back (and ``torch.save`` can
            store). torchmetrics metrics are saved with their own ``state_dict()``
            plus their metric states.

        Example:
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"loss": "mean"})
            >>> buf.update(loss=3.0)
            >>> other = MetricBuffer({"loss": "mean"})
            >>> other.load_state_dict(buf.state_dict())
            >>> other.compute()
            {'loss': 3.0}
        """
        self._fold_all()
        return snapshot(self._slots, self._metrics, self._nan, self._device)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` snapshot.

        Tensors are moved to this buffer's device when it has one (a host-device
        copy, outside the training loop); otherwise the buffer takes their device.

        Args:
            state_dict: A dict from :meth:`state_dict`.

        Raises:
            BarrierGuardError: The snapshot comes from another version, or declares a
                different reduction for a metric this buffer declares.

        Example:
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"best": "min"})
            >>> buf.update(best=0.5)
            >>> restored = MetricBuffer({"best": "min"})
            >>> restored.load_state_dict(buf.state_dict())
            >>> restored.compute()
            {'best': 0.5}
        """
        check_version(state_dict)
        self._fold_all()  # slots the snapshot does not name keep their values
        restore_slots(state_dict["slots"], self._slots, self._adopt)
        restore_metrics(state_dict.get("metrics", {}), self._metrics)

    def __repr__(self) -> str:
        specs = ", ".join(f"{k!r}: {v!r}" for k, v in self.reductions.items())
        extra = f", metrics={sorted(self._metrics)}" if self._metrics else ""
        return f"MetricBuffer({{{specs}}}{extra}, nan={self._nan!r}, device={self._device})"

    # -- internals: registration, the device, the blocks ---------------------------------

    def _register(self, name: str) -> Slot:
        if self._default is None:
            raise BarrierGuardError(
                f"MetricBuffer.update({name}=...) names an unknown metric: expected one of "
                f"{quote_all(tuple(self._slots) + tuple(self._metrics))}, or construct the "
                f"buffer with a default reduction (default='mean')"
            )
        check_name(name, "reductions")
        slot = self._slots[name] = Slot(*self._default)
        return slot

    def _claim_device(self, name: str, tensor: torch.Tensor) -> torch.device:
        device = tensor.device
        if self._device is None or (
            self._device.index is None and device.type == self._device.type
        ):
            self._device = device
        elif not same_device(device, self._device):
            raise other_device(name, tensor, self._device)
        return self._device

    def _adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device is None:
            self._device = tensor.device
            return tensor
        return tensor.to(self._device)

    def _weight(self, n: object) -> tuple[torch.Tensor | None, float]:
        """The step's weight ``n``, checked: a device tensor, or a Python number."""
        if n is None:
            return None, 1.0
        if isinstance(n, torch.Tensor):
            if n.numel() != 1:
                raise BarrierGuardError(
                    f"MetricBuffer.update(n={describe(n)}) is not a valid weight: "
                    f"expected a Python number or a tensor with one element"
                )
            self._claim_device("n", n)
            return n.detach().reshape(()), 1.0
        if is_number(n):
            return None, float(n)  # type: ignore[arg-type]
        raise BarrierGuardError(
            f"MetricBuffer.update(n={n!r}) is not a valid weight: expected a "
            f"Python number or a tensor with one element"
        )

    def _log(
        self,
        block: Block,
        items: Mapping[str, Any],
        n_float: float,
        n_tensor: torch.Tensor | None,
    ) -> bool:
        """Copy one step into the next row of ``block``; ``False``, doing nothing, for a misfit.

        A misfit (a value of another type than the block's, on another device,
        with more than one element, complex) is left to :meth:`_update_slow`,
        which explains it or makes a new block.
        """
        values = block.take(items)
        device = block.device
        grad = False
        src: list[torch.Tensor] | None = None
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor) or v.device != device or v.is_complex():
                return False
            if v.dim():
                if v.numel() != 1:
                    return False
                src = src or list(values)
                src[i] = v.reshape(())
            grad = grad or v.requires_grad
        for name in block.numbers:
            x = items[name]
            if type(x) is not float and type(x) is not int and not is_number(x):
                return False
        if n_tensor is not None and block.weighted and n_tensor.device != device:
            return False
        src = src or list(values)
        if block.weighted:
            if block.steps and block.tensor_weights != (n_tensor is not None):
                fold_block(block, self._nan)  # one kind of weight per fold
            block.tensor_weights = n_tensor is not None
        if self._last is not block:
            self._settle(block)
        dst = block.row()
        if block.weighted:
            if n_tensor is not None:
                src.append(n_tensor)
            else:
                dst = dst[:-1]
                block.weights.append(n_float)
        groups = block.groups.get(len(src))
        if groups is None:
            groups = block.groups[len(src)] = _by_dtype(src)
        with torch.no_grad() if grad else contextlib.nullcontext():
            if len(groups) == 1:
                torch._foreach_copy_(dst, src)
            else:  # one kernel per dtype: mixed dtypes would make torch copy one by one
                for index in groups:
                    torch._foreach_copy_([dst[i] for i in index], [src[i] for i in index])
        if not block.steps:
            for slot in block.slots:
                slot.block = block
        block.steps += 1
        for name, slot in zip(block.numbers, block.number_slots, strict=True):
            update_number(slot, float(items[name]), n_tensor, n_float, self._nan, device)
        if block.steps == BLOCK_STEPS:
            fold_block(block, self._nan)
        return True

    def _settle(self, block: Block) -> None:
        """Fold in other blocks with rows of ``block``'s metrics: they come first (``last``)."""
        for slot in (*block.slots, *block.number_slots):
            other = slot.block
            if other is not None and other is not block:
                fold_block(other, self._nan)
        self._last = block

    def _update_slow(
        self, items: Mapping[str, Any], n_tensor: torch.Tensor | None, n_float: float
    ) -> None:
        """A step no block takes as it is: check it, and give its tensors a block."""
        running: dict[str, Any] = {}
        for name, value in items.items():
            metric = self._metrics.get(name)
            if metric is not None:
                update_torchmetric(metric, value)
                continue
            slot = self._slots.get(name) or self._register(name)
            if isinstance(value, torch.Tensor):
                device = self._claim_device(name, value)
                if slot.reduction == "cat":
                    update_cat(name, slot, value, self._nan, device)
                    continue
                if value.numel() != 1:
                    raise not_single_value(name, value, slot.reduction)
                if value.is_complex():
                    raise not_real(name)
            elif not is_number(value):
                raise BarrierGuardError(
                    f"MetricBuffer.update({name}={value!r}) is not a valid value: "
                    f"expected a tensor or a Python number"
                )
            running[name] = value
        tensors = tuple(name for name, v in running.items() if isinstance(v, torch.Tensor))
        if tensors and self._device is not None:
            key = tuple(running)
            numbers = tuple(name for name in key if name not in tensors)
            # A block per pattern of tensors and numbers: a name that changes kind
            # from call to call switches blocks, it does not rebuild one.
            block = self._patterns.get((key, tensors))
            if block is None:
                block = Block(self._slots, tensors, numbers, self._device)
                self._patterns[key, tensors] = block
            if len(running) == len(items):
                self._blocks[key] = block  # the hot path takes the next step
            logged = self._log(block, running, n_float, n_tensor)
            assert logged, "a checked step fits its block"
            return
        self._last = None
        for name, value in running.items():
            slot = self._slots[name]
            if slot.block is not None:
                fold_block(slot.block, self._nan)  # its rows come before this value
            update_number(slot, float(value), n_tensor, n_float, self._nan, self._device)

    def _distributed(self) -> bool:
        return (
            self._sync_dist
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )

    def _fold_all(self) -> None:
        for block in self._patterns.values():
            fold_block(block, self._nan)


def _by_dtype(values: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of ``values``, grouped by dtype: one copy kernel per group."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(v.dtype, []).append(i)
    return list(groups.values())
