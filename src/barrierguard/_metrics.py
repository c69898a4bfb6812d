"""MetricBuffer: log metrics every step without a host-device barrier.

``running_loss += loss.item()`` waits for the device at every step. A
:class:`MetricBuffer` keeps running reductions in float64 tensors on the device
instead, folds Python numbers into host-side floats, and reads everything back
with one device-to-host transfer in :meth:`MetricBuffer.compute`.
"""

from __future__ import annotations

import math
import numbers
import sys
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from barrierguard._errors import BarrierGuardError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["MetricBuffer"]

REDUCTIONS: Final = ("mean", "sum", "min", "max", "last", "count", "cat")
WEIGHTABLE: Final = ("mean", "sum", "count")
NAN_POLICIES: Final = ("propagate", "ignore", "error")
_SUM_KINDS: Final = frozenset(WEIGHTABLE)
_F64: Final = torch.float64
_STATE_VERSION: Final = 1
FLUSH_EVERY: Final = 64
"""Steps of device values a set of names keeps pending before they are folded in."""
_COMPLEX: Final = frozenset({torch.complex32, torch.complex64, torch.complex128})

ReductionSpec = str | tuple[str, str]
"""``"mean"`` or ``("mean", "weighted")``: a reduction name, optionally weighted by ``n``."""


def _quote_all(names: tuple[str, ...]) -> str:
    return ", ".join(repr(n) for n in names)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)} on {value.device}>"
    return repr(value)


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" (no index) given by the user matches whichever CUDA device the tensors use.
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _is_number(value: object) -> bool:
    return type(value) in (float, int) or (
        isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor)
    )


class _Slot:
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
        # The _Plan whose block holds ``row`` as a view, if any.
        self.plan: _Plan | None = None
        self.reset_host()

    def reset_host(self) -> None:
        self.host_a = self.initial_a()
        self.host_w = 0.0
        self.host_bad = 0.0
        self.host_last = math.nan
        self.last_on_host = False

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
        row = torch.full((3,), 0.0, dtype=_F64, device=device)
        row[0].fill_(self.initial_a())
        self.set_row(row)
        return row

    def set_row(self, row: torch.Tensor | None) -> None:
        self.row = row
        if row is None:
            self.a = self.w = self.bad = None
        else:
            self.a, self.w, self.bad = row[0], row[1], row[2]

    @property
    def spec(self) -> ReductionSpec:
        return (self.reduction, "weighted") if self.weighted else self.reduction


_GROUP_ORDER: Final = ("weighted", "unweighted", "min", "max", "last")
_UNPLANNED: Final = object()
_MAX_PLAN_REBUILDS: Final = 3


class _Plan:
    """Deferred fast path for one repeated set of names.

    The rows of its tensor-valued metrics are columns of one ``(3, k)`` block,
    ordered by group (weighted sums, unweighted sums, min, max, last). An update
    only appends references to its tensors to ``pending`` (and its weight to
    ``runs``/``weights``); :meth:`MetricBuffer._flush` folds up to
    :data:`FLUSH_EVERY` steps into the block at once. Names whose value was a
    Python number when the plan was built go to the host-side state directly.
    """

    __slots__ = (
        "a",
        "bad",
        "device",
        "groups",
        "host_unit",
        "host_weighted",
        "lasts",
        "numbers",
        "order",
        "pending",
        "runs",
        "sizes",
        "steps",
        "versions",
        "w_unit",
        "weights",
        "wversions",
    )

    def __init__(
        self, slots: Mapping[str, _Slot], numbers: tuple[str, ...], device: torch.device
    ) -> None:
        def group(slot: _Slot) -> str:
            if slot.reduction in _SUM_KINDS:
                return "weighted" if slot.weighted else "unweighted"
            return slot.reduction

        names = sorted(slots, key=lambda name: _GROUP_ORDER.index(group(slots[name])))
        self.order = tuple(names)
        self.numbers = numbers
        self.device = device
        self.sizes = [sum(group(slots[n]) == g for n in names) for g in _GROUP_ORDER]
        block = torch.empty((3, len(names)), dtype=_F64, device=device)
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

    def column(self, index: int) -> str:
        """Name of the metric of flat pending index ``index``."""
        return self.order[index % len(self.order)]


def _parse_spec(where: str, name: str, spec: object) -> tuple[str, bool]:
    """Check one reduction spec; the single place where specs are validated."""
    accepted = (
        f"expected one of {_quote_all(REDUCTIONS)}, or (reduction, 'weighted') for "
        f"{_quote_all(WEIGHTABLE)}"
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
                f"{_quote_all(WEIGHTABLE)} can be weighted by n, a weight means nothing "
                f"for {spec[0]!r}"
            )
        return str(spec[0]), spec[1] == "weighted"
    raise BarrierGuardError(f"{where}={{{name!r}: {spec!r}}} is not a valid reduction: {accepted}")


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
    :class:`BarrierGuardError` at the fold (tensors that require grad are
    detached; leaves that require grad, such as parameters, are copied).

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
                f"{_quote_all(NAN_POLICIES)}"
            )
        self._nan = nan
        self._default: tuple[str, bool] | None = (
            None if default is None else _parse_spec("MetricBuffer(default", "*", default)
        )
        self._device: torch.device | None = None if device is None else torch.device(device)
        self._sync_dist = sync_dist
        self._group = process_group
        self._slots: dict[str, _Slot] = {}
        # Fast paths by names in call order; None: use the slow path for that set.
        self._plans: dict[tuple[str, ...], _Plan | None] = {}
        self._plan_builds: dict[tuple[str, ...], int] = {}
        # Plans with pending steps, by id.
        self._pending: dict[int, _Plan] = {}
        for name, spec in (reductions or {}).items():
            self._check_name(name, "reductions")
            self._slots[name] = _Slot(*_parse_spec("MetricBuffer(reductions", name, spec))
        self._metrics: dict[str, Any] = {}
        for name, metric in (metrics or {}).items():
            self._check_name(name, "metrics")
            if name in self._slots:
                raise BarrierGuardError(
                    f"MetricBuffer(metrics={{{name!r}: ...}}) names a metric already in "
                    f"reductions: expected each name in only one of reductions and metrics"
                )
            self._check_torchmetric(name, metric)
            self._metrics[name] = metric

    # -- construction helpers ----------------------------------------------------------

    @staticmethod
    def _check_name(name: object, arg: str) -> None:
        if not isinstance(name, str) or not name or name == "n":
            raise BarrierGuardError(
                f"MetricBuffer({arg}={{{name!r}: ...}}) is not a valid metric name: expected "
                f"a non-empty string other than 'n' (update() takes n as the weight)"
            )

    @staticmethod
    def _check_torchmetric(name: str, metric: object) -> None:
        # A Metric instance means torchmetrics is already imported; importing it here
        # would cost seconds and change the warnings filters as a side effect.
        module = sys.modules.get("torchmetrics")
        if module is None or not isinstance(metric, module.Metric):
            raise BarrierGuardError(
                f"MetricBuffer(metrics={{{name!r}: {metric!r}}}) is not a torchmetrics "
                f"Metric: expected an instance of torchmetrics.Metric"
            )

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
                more than one element for a running reduction; a tensor on another
                device than the buffer's; a value that is not a number or tensor; a
                tensor logged earlier was changed in place before this call folded
                it in.

        Example:
            >>> import torch
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"loss": ("mean", "weighted")})
            >>> buf.update(loss=torch.tensor(2.0), n=3)
            >>> buf.update({"loss": 4.0}, n=1)
            >>> buf.compute()["loss"]
            2.5
        """
        items = kwargs if values is None else {**values, **kwargs}
        n_tensor: torch.Tensor | None = None
        n_float = 1.0
        if n is not None:
            if isinstance(n, torch.Tensor):
                if n.numel() != 1:
                    raise BarrierGuardError(
                        f"MetricBuffer.update(n={_describe(n)}) is not a valid weight: "
                        f"expected a Python number or a tensor with one element"
                    )
                self._claim_device("n", n)
                n_tensor = n.reshape(())
            elif _is_number(n):
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
                    self._update_torchmetric(metric, value)
                    continue
                slot = self._slots.get(name)
                if slot is None:
                    slot = self._register(name)
                if isinstance(value, torch.Tensor):
                    self._claim_device(name, value)
                    if slot.reduction == "cat":
                        self._update_cat(name, slot, value)
                    else:
                        self._update_tensor(name, slot, value, n_tensor, n_float)
                elif _is_number(value):
                    self._update_number(slot, float(value), n_tensor, n_float)
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
        names = sorted(self._slots)
        results: dict[str, Any] = {}
        if names:
            per_rank = self._gather(names)
            bad_names: list[str] = []
            for i, name in enumerate(names):
                slot = self._slots[name]
                triples = [rank[1 + 3 * i : 4 + 3 * i] for rank in per_rank]
                value, bad = self._combine(slot, triples)
                if bad:
                    bad_names.append(name)
                results[name] = value
            if bad_names:
                raise BarrierGuardError(
                    f"MetricBuffer(nan='error'): metric(s) {_quote_all(tuple(bad_names))} "
                    f"received NaN or inf values; use nan='ignore' to skip them or "
                    f"nan='propagate' to keep them"
                )
            for name in names:
                slot = self._slots[name]
                if slot.reduction == "cat":
                    results[name] = self._cat_result(slot)
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
            slot.reset_host()
            slot.values = []
            if slot.row is not None:
                # Fill in place (device kernels, no sync) so the views stay valid.
                slot.row.zero_()
                slot.row[0].fill_(slot.initial_a())
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
        slots: dict[str, Any] = {}
        for name, slot in self._slots.items():
            slots[name] = {
                "reduction": slot.reduction,
                "weighted": slot.weighted,
                "row": None if slot.row is None else slot.row.clone(),
                "host": [slot.host_a, slot.host_w, slot.host_bad],
                "host_last": slot.host_last,
                "last_on_host": slot.last_on_host,
                "values": [v.clone() for v in slot.values],
            }
        metrics: dict[str, Any] = {}
        for name, metric in self._metrics.items():
            # torchmetrics states are not persistent by default, so save them explicitly.
            metrics[name] = {
                "state_dict": metric.state_dict(),
                "metric_state": {
                    k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v])
                    for k, v in metric.metric_state.items()
                },
                "update_count": int(metric.update_count),
            }
        return {
            "version": _STATE_VERSION,
            "nan": self._nan,
            "device": None if self._device is None else str(self._device),
            "slots": slots,
            "metrics": metrics,
        }

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
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            raise BarrierGuardError(
                f"MetricBuffer.load_state_dict(version={version!r}) is not a known state "
                f"version: expected {_STATE_VERSION}"
            )
        self._flush_all()  # slots the snapshot does not name keep their values
        for name, saved in state_dict["slots"].items():
            spec: ReductionSpec = (
                (saved["reduction"], "weighted") if saved["weighted"] else saved["reduction"]
            )
            parsed = _parse_spec("MetricBuffer.load_state_dict(slots", name, spec)
            slot = self._slots.get(name)
            if slot is None:
                self._check_name(name, "reductions")
                slot = self._slots[name] = _Slot(*parsed)
            elif (slot.reduction, slot.weighted) != parsed:
                raise BarrierGuardError(
                    f"MetricBuffer.load_state_dict(slots={{{name!r}: {spec!r}}}) does not "
                    f"match this buffer: expected reduction {slot.spec!r} for {name!r}"
                )
            row = saved["row"]
            if row is not None:
                row = self._adopt(row).to(_F64).clone()
            slot.set_row(row)
            slot.plan = None
            slot.host_a, slot.host_w, slot.host_bad = (float(v) for v in saved["host"])
            slot.host_last = float(saved["host_last"])
            slot.last_on_host = bool(saved["last_on_host"])
            slot.values = [self._adopt(v).clone() for v in saved["values"]]
        self._plans.clear()  # their blocks no longer hold the rows
        for name, saved in state_dict.get("metrics", {}).items():
            metric = self._metrics.get(name)
            if metric is None:
                raise BarrierGuardError(
                    f"MetricBuffer.load_state_dict(metrics={{{name!r}: ...}}) names a "
                    f"torchmetrics metric this buffer lacks: expected one of "
                    f"{_quote_all(tuple(self._metrics))}"
                )
            metric.load_state_dict(saved["state_dict"], strict=False)
            for key, value in saved["metric_state"].items():
                setattr(metric, key, value)
            # torchmetrics warns in compute() when it believes update() never ran.
            metric._update_count = saved["update_count"]
            metric._computed = None

    def __repr__(self) -> str:
        specs = ", ".join(f"{k!r}: {v!r}" for k, v in self.reductions.items())
        extra = f", metrics={sorted(self._metrics)}" if self._metrics else ""
        return f"MetricBuffer({{{specs}}}{extra}, nan={self._nan!r}, device={self._device})"

    # -- update internals --------------------------------------------------------------

    def _register(self, name: str) -> _Slot:
        if self._default is None:
            raise BarrierGuardError(
                f"MetricBuffer.update({name}=...) names an unknown metric: expected one of "
                f"{_quote_all(tuple(self._slots) + tuple(self._metrics))}, or construct the "
                f"buffer with a default reduction (default='mean')"
            )
        self._check_name(name, "reductions")
        slot = self._slots[name] = _Slot(*self._default)
        return slot

    def _claim_device(self, name: str, tensor: torch.Tensor) -> None:
        device = tensor.device
        if self._device is None or (
            self._device.index is None and device.type == self._device.type
        ):
            self._device = device
        elif not _same_device(device, self._device):
            raise BarrierGuardError(
                f"MetricBuffer.update({name}={_describe(tensor)}) is on another device than "
                f"the buffer: expected a tensor on {self._device} (the device of the "
                f"buffer's state), or a Python number"
            )

    def _adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device is None:
            self._device = tensor.device
            return tensor
        return tensor.to(self._device)

    def _row(self, slot: _Slot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if slot.row is None:
            assert self._device is not None  # a tensor was claimed before any row
            slot.make_row(self._device)
        assert slot.a is not None and slot.w is not None and slot.bad is not None
        return slot.a, slot.w, slot.bad

    def _plan_for(self, items: Mapping[str, Any]) -> _Plan | None:
        key = tuple(items)
        if key in self._plans:
            return self._plans[key]
        device = self._device
        if device is None or (device.index is None and device.type not in ("cpu", "meta")):
            return None  # the slow path claims the device; the next call builds the plan
        plan: _Plan | None = None
        builds = self._plan_builds.get(key, 0)
        tensors = tuple(name for name, v in items.items() if isinstance(v, torch.Tensor))
        numbers = tuple(name for name, v in items.items() if _is_number(v))
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
                stale: dict[int, _Plan] = {}
                for name in tensors:
                    owner = slots[name].plan
                    if owner is not None:
                        stale[id(owner)] = owner
                for other in stale.values():
                    self._flush(other)
                for other_key, other_plan in list(self._plans.items()):
                    if other_plan is not None and id(other_plan) in stale:
                        del self._plans[other_key]
                plan = _Plan({name: slots[name] for name in tensors}, numbers, device)
                self._plan_builds[key] = builds + 1
        self._plans[key] = plan
        return plan

    def _defer(
        self, items: Mapping[str, Any], n_tensor: torch.Tensor | None, n_float: float
    ) -> bool:
        """The fast path: queue one step without any device work.

        Only metadata is read here (type, shape, device, dtype, requires_grad);
        anything unusual returns ``False`` before any state changes, leaving every
        check (and error) to the slow path.
        """
        if not items:
            return True
        found = self._plans.get(tuple(items), _UNPLANNED)
        plan = self._plan_for(items) if found is _UNPLANNED else found
        if not isinstance(plan, _Plan):
            return False
        for name in plan.numbers:
            x = items[name]
            if type(x) is not float and type(x) is not int and not _is_number(x):
                return False
        device = plan.device
        pending, versions = plan.pending, plan.versions
        mark = len(pending)
        for name in plan.order:
            v = items[name]
            if type(v) is not torch.Tensor or (
                v.dim() or v.requires_grad or v.device != device or v.dtype in _COMPLEX
            ):
                admitted = self._admit(v, device)
                if admitted is None:
                    del pending[mark:], versions[mark:]
                    return False
                v = admitted
            pending.append(v)
            versions.append(v._version)
        if plan.sizes[0]:
            weight: float | None = n_float
            if n_tensor is not None:
                if n_tensor.device != device:
                    del pending[mark:], versions[mark:]
                    return False
                if n_tensor.requires_grad:
                    n_tensor = n_tensor.detach()
                plan.weights.append(n_tensor)
                plan.wversions.append(n_tensor._version)
                weight = None
            runs = plan.runs
            if runs and runs[-1][0] == weight:
                runs[-1][1] += 1
            else:
                runs.append([weight, 1])
        plan.steps += 1
        if plan.steps == 1:
            self._pending[id(plan)] = plan
        for name in plan.numbers:
            self._update_number(self._slots[name], float(items[name]), n_tensor, n_float)
        if plan.steps >= FLUSH_EVERY:
            self._flush(plan)
        return True

    @staticmethod
    def _admit(value: object, device: torch.device) -> torch.Tensor | None:
        """``value`` as a 0-d tensor fit to queue on ``device``, or ``None`` for the slow path."""
        if not isinstance(value, torch.Tensor):
            return None
        if value.numel() != 1 or value.is_complex() or value.device != device:
            # Includes "cuda" vs "cuda:0": the slow path claims the device or explains.
            return None
        if value.requires_grad:
            # A leaf that requires grad is most likely a parameter that the optimizer
            # changes in place before the flush: keep a copy of its value. Any other
            # value keeps no graph alive once detached (a view, no kernel).
            value = value.detach().clone() if value.is_leaf else value.detach()
        if value.dim():
            value = value.reshape(())
        return value

    def _flush_all(self) -> None:
        for plan in list(self._pending.values()):
            self._flush(plan)

    def _flush(self, plan: _Plan) -> None:
        """Fold the pending steps of ``plan`` into its block: one stack, a few reductions.

        Raises:
            BarrierGuardError: A pending tensor was changed in place after it was
                logged (its version counter moved), so its logged value is lost.
        """
        steps = plan.steps
        if not steps:
            return
        values, versions = plan.pending, plan.versions
        weights, wversions, runs = plan.weights, plan.wversions, plan.runs
        plan.clear()
        self._pending.pop(id(plan), None)
        if [v._version for v in values] != versions:
            i = next(i for i, v in enumerate(values) if v._version != versions[i])
            raise BarrierGuardError(
                f"MetricBuffer.update({plan.column(i)}=<tensor>) was changed in place "
                f"after it was logged: expected logged tensors to keep their value "
                f"until they are folded in (log a copy, e.g. value.detach().clone())"
            )
        if [n._version for n in weights] != wversions:
            raise BarrierGuardError(
                "MetricBuffer.update(n=<tensor>) was changed in place after it was logged: "
                "expected logged tensors to keep their value until they are folded in "
                "(pass a copy)"
            )
        with torch.no_grad():
            self._fold(plan, values, weights, runs, steps)

    def _fold(
        self,
        plan: _Plan,
        values: list[torch.Tensor],
        weights: list[torch.Tensor],
        runs: list[list[Any]],
        steps: int,
    ) -> None:
        """The device work of a flush, over the ``(steps, metrics)`` block of values."""
        block = torch.stack(values).view(steps, len(plan.order))  # the one stack
        if block.dtype != _F64:
            block = block.to(_F64)
        s_w, s_u, s_min, s_max, s_last = plan.sizes
        o_min = s_w + s_u
        o_max = o_min + s_min
        o_last = o_max + s_max
        (a_w, w_w), (a_u, _), (a_min, _), (a_max, _), (a_last, _) = plan.groups
        finite: torch.Tensor | None = None
        counts: torch.Tensor | None = None
        src = block
        if self._nan == "ignore":
            # Non-finite values contribute nothing: fixed-shape masking, no branch on data.
            finite = torch.isfinite(block)
            counts = finite.to(_F64)
            src = torch.where(finite, block, 0.0)
        if s_w:
            n_block = torch.stack(weights).to(_F64) if weights else None
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
        if self._nan == "error":
            # Count the non-finite values of every column: min, max, last and count
            # could hide one otherwise (a mean or sum also ends non-finite).
            plan.bad.add_(torch.isfinite(block).logical_not().sum(0))

    def _update_tensor(
        self,
        name: str,
        slot: _Slot,
        x: torch.Tensor,
        n_tensor: torch.Tensor | None,
        n_float: float,
    ) -> None:
        if x.numel() != 1:
            raise BarrierGuardError(
                f"MetricBuffer.update({name}={_describe(x)}) is not a single value for "
                f"reduction {slot.reduction!r}: expected a tensor with one element or a "
                f"Python number (use reduction 'cat' to keep whole tensors)"
            )
        if x.is_complex():
            raise BarrierGuardError(
                f"MetricBuffer.update({name}=<complex tensor>) is not a real value: "
                f"expected a real (float, int or bool) tensor"
            )
        x = x.reshape(())
        a, w, bad = self._row(slot)
        red = slot.reduction
        weight_t = n_tensor if slot.weighted else None
        weight_f = n_float if slot.weighted else 1.0
        if self._nan == "ignore":
            # Fixed-shape masking: a non-finite value contributes nothing, with no branch
            # on its value (that would need it on the host).
            x = x.to(_F64)
            finite = torch.isfinite(x)
            if red in _SUM_KINDS:
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
        if red in _SUM_KINDS:
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
        if self._nan == "error" and red not in _SUM_KINDS:
            bad.add_(x * 0.0)

    def _update_number(
        self, slot: _Slot, x: float, n_tensor: torch.Tensor | None, n_float: float
    ) -> None:
        red = slot.reduction
        if red == "last" and slot.plan is not None and slot.plan.steps:
            self._flush(slot.plan)  # the pending tensors come before this value
        if red == "cat":
            # Kept on the host until compute(): a device copy here would block.
            slot.values.append(torch.tensor([x], dtype=_F64))
            if self._nan == "error" and not math.isfinite(x):
                slot.host_bad += 1.0
            return
        if not math.isfinite(x):
            if self._nan == "ignore":
                return
            if self._nan == "error":
                slot.host_bad += 1.0
        if red in _SUM_KINDS:
            if slot.weighted and n_tensor is not None:
                # A device weight: the product lives on the device; x is a kernel argument.
                a, w, _ = self._row(slot)
                a.add_(n_tensor, alpha=x)
                w.add_(n_tensor)
                return
            weight = n_float if slot.weighted else 1.0
            slot.host_a += weight * x
            slot.host_w += weight
            return
        if red == "min":
            slot.host_a = (
                math.nan if math.isnan(x) or math.isnan(slot.host_a) else min(slot.host_a, x)
            )
        elif red == "max":
            slot.host_a = (
                math.nan if math.isnan(x) or math.isnan(slot.host_a) else max(slot.host_a, x)
            )
        else:
            slot.host_last = x
            slot.last_on_host = True
        slot.host_w += 1.0

    def _update_cat(self, name: str, slot: _Slot, x: torch.Tensor) -> None:
        value = x.detach()
        if value.dim() == 0:
            value = value.reshape(1)
        if slot.values and slot.values[0].shape[1:] != value.shape[1:]:
            raise BarrierGuardError(
                f"MetricBuffer.update({name}={_describe(x)}) cannot be concatenated with "
                f"earlier values: expected trailing shape {tuple(slot.values[0].shape[1:])}"
            )
        # Cloned on the device so later in-place changes to the caller's tensor don't leak in.
        slot.values.append(value.clone())
        if self._nan == "error":
            _, _, bad = self._row(slot)
            bad.add_(torch.isfinite(value).logical_not().sum())

    @staticmethod
    def _update_torchmetric(metric: Any, value: object) -> None:
        if isinstance(value, tuple):
            metric.update(*value)
        elif isinstance(value, Mapping):
            metric.update(**value)
        else:
            metric.update(value)

    # -- compute internals -------------------------------------------------------------

    def _layout_hash(self, names: list[str]) -> float:
        text = ";".join(f"{n}:{self._slots[n].reduction}:{self._slots[n].weighted}" for n in names)
        return float(zlib.crc32(text.encode()))

    def _distributed(self) -> bool:
        return (
            self._sync_dist
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )

    def _pack_slot(self, slot: _Slot, device: torch.device) -> list[torch.Tensor]:
        """Three 0-d float64 tensors on ``device``: ``[a, w, bad]`` with host parts folded in.

        Host floats enter as kernel arguments (``torch.full``, ``+ scalar``), never as
        host-to-device copies.
        """

        def full(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=_F64, device=device)

        red = slot.reduction
        host_a = slot.host_a
        if slot.row is None:
            a_val = slot.host_last if red == "last" else host_a
            return [full(a_val), full(slot.host_w), full(slot.host_bad)]
        row = slot.row if slot.row.device == device else slot.row.to(device)
        a_dev = row[0]
        if red in _SUM_KINDS:
            a = a_dev + host_a
        elif red in ("min", "max"):
            if math.isnan(host_a):
                a = a_dev + math.nan
            elif red == "min":
                a = torch.clamp(a_dev, max=host_a)
            else:
                a = torch.clamp(a_dev, min=host_a)
        elif red == "last" and slot.last_on_host:
            a = full(slot.host_last)
        else:
            a = a_dev
        return [a, row[1] + slot.host_w, row[2] + slot.host_bad]

    def _gather(self, names: list[str]) -> list[list[float]]:
        """Pack all running states, gather them across ranks, and read them back once."""
        distributed = self._distributed()
        device = self._device or torch.device("cpu")
        parts = [torch.full((), self._layout_hash(names), dtype=_F64, device=device)]
        for name in names:
            parts.extend(self._pack_slot(self._slots[name], device))
        packed = torch.stack(parts)
        if not distributed:
            return [packed.tolist()]  # the single device-to-host transfer
        dist = torch.distributed
        backend = str(dist.get_backend(self._group))
        if "nccl" in backend and packed.device.type != "cuda":
            # NCCL only moves CUDA tensors: Python-only metrics on a NCCL job pay one copy.
            packed = packed.to(torch.device("cuda", torch.cuda.current_device()))
        elif "nccl" not in backend and packed.device.type == "cuda":
            # Gloo gathers CPU tensors; this copy is the one transfer.
            packed = packed.cpu()
        world = dist.get_world_size(self._group)
        gathered = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(gathered, packed, group=self._group)  # the one collective
        per_rank: list[list[float]] = torch.stack(gathered).tolist()
        local = per_rank[0][0] if per_rank else 0.0
        if any(rank[0] != local for rank in per_rank):
            raise BarrierGuardError(
                f"MetricBuffer.compute() found different metrics on different ranks: "
                f"expected every rank to register the same names and reductions "
                f"(this rank: {names}); declare them all in MetricBuffer(reductions=...)"
            )
        return per_rank

    def _combine(self, slot: _Slot, triples: list[list[float]]) -> tuple[float, bool]:
        """Combine per-rank ``[a, w, bad]`` triples into a value and a "saw bad" flag."""
        red = slot.reduction
        total_w = math.fsum(t[1] for t in triples)
        bad_total = sum(t[2] for t in triples)
        bad = self._nan == "error" and (bad_total != 0.0)  # NaN != 0 too
        value: float
        if red in _SUM_KINDS:
            total_a = sum(t[0] for t in triples)
            if self._nan == "error" and not math.isfinite(total_a):
                bad = True
            if red == "mean":
                value = total_a / total_w if total_w != 0.0 else math.nan
            elif red == "sum":
                value = total_a
            else:
                value = total_w
        elif red in ("min", "max"):
            seen = [t[0] for t in triples if t[1] > 0.0]
            if not seen or any(math.isnan(v) for v in seen):
                value = math.nan
            else:
                value = min(seen) if red == "min" else max(seen)
        elif red == "last":
            seen = [t[0] for t in triples if t[1] > 0.0]
            value = seen[-1] if seen else math.nan  # the highest rank that logged one
        else:  # cat: only its bad counter travels; the values are returned separately
            value = math.nan
        return value, bad

    def _cat_result(self, slot: _Slot) -> torch.Tensor:
        if not slot.values:
            return torch.empty(0, dtype=_F64, device=self._device)
        devices = {v.device for v in slot.values}
        if len(devices) > 1 and self._device is not None:
            # Python numbers were kept on the host; they join the device values here.
            return torch.cat([v.to(self._device) for v in slot.values])
        return torch.cat(slot.values)
