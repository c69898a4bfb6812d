"""MetricBuffer: log metrics every step without a host-device barrier.

``running_loss += loss.item()`` waits for the device at every step. A
:class:`MetricBuffer` keeps running reductions in float64 tensors on the device
instead, folds Python numbers into host-side floats, and reads everything back
with one device-to-host transfer in :meth:`MetricBuffer.compute`.

This module owns the public class and the state it holds: the slots, the device,
the plans of the fast path with their pending steps, and the per-step control
flow of :meth:`MetricBuffer.update`. The arithmetic is in the sibling modules.
It stays some 530 lines, about 215 of them the public docstrings: moving the
fast path's planning out would put an attribute lookup on every ``update``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.fold import (
    flush,
    update_cat,
    update_number,
    update_tensor,
    update_torchmetric,
)
from barrierguard.metrics.readback import read_back
from barrierguard.metrics.slots import (
    FLUSH_EVERY,
    HOLD_BYTES,
    Plan,
    Slot,
    admit,
    holdable,
)
from barrierguard.metrics.spec import (
    NAN_POLICIES,
    REDUCTIONS,
    WEIGHTABLE,
    ReductionSpec,
    check_name,
    check_torchmetric,
    describe,
    is_number,
    other_device,
    parse_spec,
    quote_all,
    same_device,
)
from barrierguard.metrics.state import check_version, restore_metrics, restore_slots, snapshot

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# The vocabulary keeps its documented home here (barrierguard.metrics.buffer.FLUSH_EVERY).
__all__ = ["FLUSH_EVERY", "HOLD_BYTES", "NAN_POLICIES", "REDUCTIONS", "WEIGHTABLE", "MetricBuffer"]

_TENSOR: Final = torch.Tensor
_UNPLANNED: Final = object()
_MAX_PLAN_REBUILDS: Final = 3


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
    are logged. :meth:`update` never synchronizes and, for a repeated set of
    names, launches no kernel: it keeps references to the step's tensors, and
    every :data:`FLUSH_EVERY` steps (or before :meth:`compute`,
    :meth:`state_dict` and :meth:`load_state_dict`) the pending steps are folded
    into the state with one ``torch.stack`` and a few reductions. Python numbers
    are folded in with host arithmetic. A logged tensor must therefore keep its
    value until it is folded in: one changed in place earlier raises
    :class:`BarrierGuardError` at the fold. Tensors that require grad are
    detached. Two kinds are copied, one element with one kernel: leaves that
    require grad, such as parameters, and views into a storage larger than
    :data:`HOLD_BYTES` (``logits[0, 0]`` would
    otherwise keep ``logits`` alive). After the first step of a set of names,
    ``update`` reads only each tensor's version counter, ``requires_grad`` and
    storage size; the fold's stack checks the rest (one element, real, on the
    buffer's device) and raises for a value that does not fit.

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
        # Fast paths by names in call order; None: use the slow path for that set.
        self._plans: dict[tuple[str, ...], Plan | None] = {}
        self._plan_builds: dict[tuple[str, ...], int] = {}
        # Plans with pending steps, by id.
        self._pending: dict[int, Plan] = {}
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

        For a set of names logged before, this only checks metadata and queues
        references to the tensors; the device work happens once per
        :data:`FLUSH_EVERY` steps. Raising for NaN (``nan="error"``) waits for
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
                a tensor on another device than the buffer's (for a set of names
                logged before, raised by the call that folds its step in); a value
                that is not a number or tensor; a tensor logged earlier was changed
                in place before this call folded it in.

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
        # The hot path: a set of names logged before, tensors only, a Python weight.
        plan = self._plans.get(tuple(items))
        if (
            plan is not None
            and plan.steady
            and (n is None or type(n) is int or type(n) is float)
            and plan.queue(items, 1.0 if n is None else float(n))
        ):
            if plan.steps == 1:
                self._pending[id(plan)] = plan
            if plan.steps >= FLUSH_EVERY:
                self._flush(plan)
            return
        n_tensor: torch.Tensor | None = None
        n_float = 1.0
        if type(n) is int or type(n) is float:
            n_float = float(n)
        elif n is not None:
            if isinstance(n, torch.Tensor):
                if n.numel() != 1:
                    raise BarrierGuardError(
                        f"MetricBuffer.update(n={describe(n)}) is not a valid weight: "
                        f"expected a Python number or a tensor with one element"
                    )
                self._claim_device("n", n)
                n_tensor = n.reshape(())
            elif is_number(n):
                n_float = float(n)
            else:
                raise BarrierGuardError(
                    f"MetricBuffer.update(n={n!r}) is not a valid weight: expected a "
                    f"Python number or a tensor with one element"
                )
        if self._defer(items, n_tensor, n_float):
            return
        # no_grad: a value that requires grad must not pull the state into the graph.
        with torch.no_grad():
            for name in items:
                # The slow path updates rows in place: fold earlier steps in first, so
                # that order-dependent reductions (last) see the values in call order.
                slot = self._slots.get(name)
                if slot is not None and slot.plan is not None and slot.plan.steps:
                    self._flush(slot.plan)
            for name, value in items.items():
                metric = self._metrics.get(name)
                if metric is not None:
                    update_torchmetric(metric, value)
                    continue
                slot = self._slots.get(name)
                if slot is None:
                    slot = self._register(name)
                if isinstance(value, torch.Tensor):
                    self._claim_device(name, value)
                    if slot.reduction == "cat":
                        update_cat(name, slot, value, self._nan, self._device)
                    else:
                        update_tensor(name, slot, value, n_tensor, n_float, self._nan, self._device)
                elif is_number(value):
                    update_number(slot, float(value), n_tensor, n_float, self._nan, self._device)
                else:
                    raise BarrierGuardError(
                        f"MetricBuffer.update({name}={value!r}) is not a valid value: "
                        f"expected a tensor or a Python number"
                    )

    def compute(self) -> dict[str, Any]:
        """Reduce every metric, with one device-to-host transfer for all of them.

        Pending steps are folded in first (device work, no transfer).
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
                ranks registered different metrics; or a pending tensor was changed
                in place after it was logged.

        Example:
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"lr": "last", "steps": "count"})
            >>> buf.update(lr=0.1, steps=1)
            >>> buf.update(lr=0.05, steps=1)
            >>> buf.compute()
            {'lr': 0.05, 'steps': 2.0}
        """
        self._flush_all()
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
        for plan in self._pending.values():
            plan.clear()  # pending values are dropped, never folded in
        self._pending.clear()
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
        self._flush_all()
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
        self._flush_all()  # slots the snapshot does not name keep their values
        restore_slots(state_dict["slots"], self._slots, self._adopt)
        self._plans.clear()  # their blocks no longer hold the rows
        restore_metrics(state_dict.get("metrics", {}), self._metrics)

    def __repr__(self) -> str:
        specs = ", ".join(f"{k!r}: {v!r}" for k, v in self.reductions.items())
        extra = f", metrics={sorted(self._metrics)}" if self._metrics else ""
        return f"MetricBuffer({{{specs}}}{extra}, nan={self._nan!r}, device={self._device})"

    # -- internals: registration, the device, the fast path and its flushes ------------

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

    def _claim_device(self, name: str, tensor: torch.Tensor) -> None:
        device = tensor.device
        if self._device is None or (
            self._device.index is None and device.type == self._device.type
        ):
            self._device = device
        elif not same_device(device, self._device):
            raise other_device(name, tensor, self._device)

    def _adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device is None:
            self._device = tensor.device
            return tensor
        return tensor.to(self._device)

    def _plan_for(self, items: Mapping[str, Any]) -> Plan | None:
        key = tuple(items)
        if key in self._plans:
            return self._plans[key]
        device = self._device
        if device is None or (device.index is None and device.type not in ("cpu", "meta")):
            return None  # the slow path claims the device; the next call builds the plan
        plan: Plan | None = None
        builds = self._plan_builds.get(key, 0)
        tensors = tuple(name for name, v in items.items() if isinstance(v, torch.Tensor))
        numbers = tuple(name for name, v in items.items() if is_number(v))
        eligible = (
            builds < _MAX_PLAN_REBUILDS  # sets of names that keep stealing rows: slow path
            and tensors
            and len(tensors) + len(numbers) == len(items)
            and not any(name in self._metrics for name in items)
        )
        if eligible:
            slots = {name: self._slots.get(name) or self._register(name) for name in items}
            if all(slot.reduction != "cat" for slot in slots.values()):
                # Rows move into the new block: plans that held them as views are stale.
                # Their pending steps are folded in first.
                owners = (slots[name].plan for name in tensors)
                stale = {id(owner): owner for owner in owners if owner is not None}
                for other in stale.values():
                    self._flush(other)
                for other_key, other_plan in list(self._plans.items()):
                    if other_plan is not None and id(other_plan) in stale:
                        del self._plans[other_key]
                plan = Plan({name: slots[name] for name in tensors}, numbers, device)
                self._plan_builds[key] = builds + 1
        self._plans[key] = plan
        return plan

    def _defer(
        self, items: Mapping[str, Any], n_tensor: torch.Tensor | None, n_float: float
    ) -> bool:
        """The fast path: queue one step without any device work.

        Only metadata is read here. The steps of a set of names read all of it
        (type, number of elements, device, dtype, requires_grad, storage size)
        until one passes; later steps read only the type, ``requires_grad`` and
        storage size (see :func:`~barrierguard.metrics.slots.holdable`), and
        the fold's one stack checks the rest for all pending steps at once.
        :meth:`update` queues the later steps of a plan of tensors with a
        Python weight itself (:meth:`Plan.queue
        <barrierguard.metrics.slots.Plan.queue>`). Anything unusual returns
        ``False`` before any state changes, leaving every check (and error) to
        the slow path.
        """
        if not items:
            return True
        plan = self._plans.get(tuple(items), _UNPLANNED)
        if plan is _UNPLANNED:
            plan = self._plan_for(items)
        if not isinstance(plan, Plan):
            return False
        first = not plan.checked  # until one step has passed every check
        for name in plan.numbers:
            x = items[name]
            if type(x) is not float and type(x) is not int and not is_number(x):
                return False
        device = plan.device
        # The step's tensor weight, if its plan has weighted metrics to give it to.
        n_held = n_tensor if plan.sizes[0] else None
        if n_held is not None and n_held.device != device:
            return False
        # The step is built apart and queued whole: a value that does not fit leaves
        # the plan as it was.
        step: list[torch.Tensor] = []
        try:
            for name in plan.order:
                v = items[name]
                if first or type(v) is not _TENSOR:
                    v = admit(v, device)  # every check; None: not a fit for the plan
                    if v is None:
                        return False
                else:
                    v = holdable(v)
                step.append(v)
            if n_held is not None:
                n_held = n_tensor = holdable(n_held)
        except RuntimeError:  # no storage: the slow path folds it now
            return False
        plan.pending.extend(step)
        plan.versions.extend(v._version for v in step)
        if plan.sizes[0]:
            if n_held is not None:
                plan.weights.append(n_held)
                plan.wversions.append(n_held._version)
            plan.add_weight(n_float if n_held is None else None)
        plan.steps += 1
        if plan.steps == 1:
            self._pending[id(plan)] = plan
        if first:
            plan.check({v.dtype for v in step})
        for name in plan.numbers:
            slot = self._slots[name]
            if slot.reduction == "last" and slot.plan is not None and slot.plan.steps:
                self._flush(slot.plan)  # its pending tensors come before this value
            update_number(slot, float(items[name]), n_tensor, n_float, self._nan, self._device)
        if plan.steps >= FLUSH_EVERY:
            self._flush(plan)
        return True

    def _distributed(self) -> bool:
        return (
            self._sync_dist
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )

    def _flush_all(self) -> None:
        for plan in list(self._pending.values()):
            self._flush(plan)

    def _flush(self, plan: Plan) -> None:
        """Fold the pending steps of ``plan`` in (see :func:`~barrierguard.metrics.fold.flush`)."""
        if plan.steps:
            self._pending.pop(id(plan), None)
            flush(plan, self._nan)
