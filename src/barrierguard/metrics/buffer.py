"""MetricBuffer: running metrics kept on the device, read back with one transfer in compute()."""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.slots import (
    BLOCK_STEPS,
    F64,
    NAN_POLICIES,
    REDUCTIONS,
    SUM_KINDS,
    WEIGHTABLE,
    Block,
    ReductionSpec,
    Slot,
    check_name,
    describe,
    is_number,
    parse_spec,
    quote_all,
    update_cat,
    update_number,
)

if TYPE_CHECKING:
    from typing import Literal

    from torch.distributed import ProcessGroup

    Group = ProcessGroup | None | Literal[False]

__all__ = ["BLOCK_STEPS", "NAN_POLICIES", "REDUCTIONS", "WEIGHTABLE", "MetricBuffer"]

STATE_VERSION: Final = 1


class MetricBuffer:
    """Running metrics kept on the device, read back with one transfer.

    Follows torchmetrics' ``update``/``compute``/``reset``. Reductions: ``"mean"``, ``"sum"``,
    ``"count"`` (weighted by ``n`` as ``("mean", "weighted")`` etc.), ``"min"``, ``"max"``,
    ``"last"`` and ``"cat"`` (every value, of any shape, concatenated on dim 0). Running
    reductions keep float64 state of constant size; :meth:`update` never synchronizes and keeps
    no reference to the caller's tensors.

    Args:
        reductions: Metric name to reduction spec, e.g.
            ``{"loss": ("mean", "weighted"), "grad_norm": "max"}``.
        metrics: torchmetrics ``Metric`` objects logged alongside (their ``compute()`` may
            synchronize by itself).
        nan: NaN and +/-inf values are kept (``"propagate"``), masked out (``"ignore"``) or
            raised at ``compute()`` (``"error"``).
        default: Reduction of names first seen in :meth:`update`; ``None`` makes them an error.
        device: Device of the state and of every logged tensor; by default the first tensor's.
        sync_dist: Reduce across ranks in :meth:`compute` when ``torch.distributed`` is
            initialised.
        process_group: Process group for that reduction (default: the world).

    Raises:
        BarrierGuardError: A reduction, ``nan`` policy, ``default`` or metric name is not valid.

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
        self._blocks: dict[tuple[str, ...], Block] = {}  # by the names of a step's tensors
        self._last: Block | None = None  # the block of the last step
        self._hot: Block | None = None  # the block the next step may take unchecked
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
            # Not imported here: importing torchmetrics costs seconds and changes warning filters.
            module = sys.modules.get("torchmetrics")
            if module is None or not isinstance(metric, module.Metric):
                raise BarrierGuardError(
                    f"MetricBuffer(metrics={{{name!r}: {metric!r}}}) is not a torchmetrics "
                    f"Metric: expected an instance of torchmetrics.Metric"
                )
            self._metrics[name] = metric

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

        A step with the last step's names, devices and dtypes is one copy kernel. NaN under
        ``nan="error"`` is raised by :meth:`compute`.

        Args:
            values: Metric values by name, for names that are not identifiers.
            n: Weight of this step for weighted reductions (e.g. the batch size): a Python
                number or a one-element tensor on the buffer's device; defaults to 1.
            **kwargs: Metric values by name: one-element tensors or Python numbers (any tensor
                for ``cat``); for a torchmetrics metric, a tuple of positional arguments, a
                dict of keyword arguments or a single tensor for its ``update``.

        Raises:
            BarrierGuardError: An unknown name when ``default=None``; a value that is not a
                number or a one-element real tensor on the buffer's device.

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
        block = self._hot
        if block is not None and len(items) == block.width:
            # The hot path: the last step's names, devices and dtypes, one copy kernel.
            try:
                step = block.take(items)
            except KeyError:
                step = None
            if step is not None and block.put(step, n):
                return
        self._update_checked(items, *self._weight(n))

    def compute(self) -> dict[str, Any]:
        """Reduce every metric, with one device-to-host transfer for all of them.

        With ``torch.distributed`` initialised and ``sync_dist=True``, over all ranks with one
        collective (``last``: the highest rank that logged one); ``cat`` values stay local.

        Returns:
            Metric name to a Python float (``nan`` for a mean, min, max or last with no values),
            a device tensor (``cat``) or the torchmetrics result.

        Raises:
            BarrierGuardError: Under ``nan="error"``, a metric saw NaN or inf; the ranks
                registered different metrics.

        Example:
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"lr": "last", "steps": "count"})
            >>> buf.update(lr=0.1, steps=1)
            >>> buf.update(lr=0.05, steps=1)
            >>> buf.compute()
            {'lr': 0.05, 'steps': 2.0}
        """
        self._fold_all()
        dist = torch.distributed
        ranks = self._sync_dist and dist.is_available() and dist.is_initialized()
        results = _read_back(self._slots, self._nan, self._device, ranks and self._group)
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
        self._hot = self._last = None
        for block in self._blocks.values():
            block.clear()  # its rows are dropped, never folded in
        for slot in self._slots.values():
            slot.clear()
        for metric in self._metrics.values():
            metric.reset()

    def state_dict(self) -> dict[str, Any]:
        """Snapshot of the state; device tensors are cloned on the device, never read.

        Returns:
            A dict for :meth:`load_state_dict` (and ``torch.save``), torchmetrics states included.

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
        return {
            "version": STATE_VERSION,
            "nan": self._nan,
            "device": None if self._device is None else str(self._device),
            "slots": {
                name: {
                    "reduction": slot.reduction,
                    "weighted": slot.weighted,
                    "row": None if slot.row is None else slot.row.clone(),
                    "host": [slot.host_a, slot.host_w, slot.host_bad],
                    "host_last": slot.host_last,
                    "last_on_host": slot.last_on_host,
                    "values": [v.clone() for v in slot.values],
                }
                for name, slot in self._slots.items()
            },
            # torchmetrics states are not persistent by default: saved explicitly.
            "metrics": {
                name: {
                    "state_dict": metric.state_dict(),
                    "metric_state": {
                        k: v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v]
                        for k, v in metric.metric_state.items()
                    },
                    "update_count": int(metric.update_count),
                }
                for name, metric in self._metrics.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` snapshot, onto this buffer's device if it has one.

        Raises:
            BarrierGuardError: The snapshot comes from another version, or declares a different
                reduction for a metric this buffer declares.

        Example:
            >>> from barrierguard import MetricBuffer
            >>> buf = MetricBuffer({"best": "min"})
            >>> buf.update(best=0.5)
            >>> restored = MetricBuffer({"best": "min"})
            >>> restored.load_state_dict(buf.state_dict())
            >>> restored.compute()
            {'best': 0.5}
        """
        if (version := state_dict.get("version")) != STATE_VERSION:
            raise BarrierGuardError(
                f"MetricBuffer.load_state_dict(version={version!r}) is not a known state "
                f"version: expected {STATE_VERSION}"
            )
        self._fold_all()  # slots the snapshot does not name keep their values
        self._hot = self._last = None
        for name, saved in state_dict["slots"].items():
            spec = (saved["reduction"], "weighted") if saved["weighted"] else saved["reduction"]
            parsed = parse_spec("MetricBuffer.load_state_dict(slots", name, spec)
            if (slot := self._slots.get(name)) is None:
                check_name(name, "reductions")
                slot = self._slots[name] = Slot(*parsed)
            elif (slot.reduction, slot.weighted) != parsed:
                raise BarrierGuardError(
                    f"MetricBuffer.load_state_dict(slots={{{name!r}: {spec!r}}}) does not "
                    f"match this buffer: expected reduction {slot.spec!r} for {name!r}"
                )
            row = saved["row"]
            slot.row = None if row is None else self._adopt(row).to(F64).clone()
            slot.host_a, slot.host_w, slot.host_bad = (float(v) for v in saved["host"])
            slot.host_last = float(saved["host_last"])
            slot.last_on_host = bool(saved["last_on_host"])
            slot.values = [self._adopt(v).clone() for v in saved["values"]]
        for name, saved in state_dict.get("metrics", {}).items():
            if (metric := self._metrics.get(name)) is None:
                raise BarrierGuardError(
                    f"MetricBuffer.load_state_dict(metrics={{{name!r}: ...}}) names a "
                    f"torchmetrics metric this buffer lacks: expected one of "
                    f"{quote_all(tuple(self._metrics))}"
                )
            metric.load_state_dict(saved["state_dict"], strict=False)
            for key, value in saved["metric_state"].items():
                setattr(metric, key, value)
            # torchmetrics warns in compute() when it believes update() never ran.
            metric._update_count, metric._computed = saved["update_count"], None

    def __repr__(self) -> str:
        specs = ", ".join(f"{k!r}: {v!r}" for k, v in self.reductions.items())
        extra = f", metrics={sorted(self._metrics)}" if self._metrics else ""
        return f"MetricBuffer({{{specs}}}{extra}, nan={self._nan!r}, device={self._device})"

    def _claim_device(self, name: str, tensor: torch.Tensor) -> torch.device:
        device, mine = tensor.device, self._device
        # "cuda" (no index) given by the user matches whichever CUDA device is used.
        if mine is None or (mine.index is None and device.type == mine.type):
            self._device = mine = device
        elif device.type != mine.type or device.index not in (None, mine.index):
            raise BarrierGuardError(
                f"MetricBuffer.update({name}={describe(tensor)}) is on another device than "
                f"the buffer: expected a tensor on {mine} (the device of the buffer's "
                f"state), or a Python number"
            )
        return mine

    def _adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._device is None:
            self._device = tensor.device
            return tensor
        return tensor.to(self._device)

    def _weight(self, n: object) -> tuple[torch.Tensor | None, float]:
        """The checked weight ``n``: a device tensor, or a Python number."""
        if n is None or is_number(n):
            return None, 1.0 if n is None else float(n)
        if not isinstance(n, torch.Tensor) or n.numel() != 1:
            raise BarrierGuardError(
                f"MetricBuffer.update(n={describe(n)}) is not a valid weight: expected a "
                f"Python number or a tensor with one element"
            )
        self._claim_device("n", n)
        return n.detach().reshape(()), 1.0

    def _update_checked(
        self, items: Mapping[str, Any], n_tensor: torch.Tensor | None, n_float: float
    ) -> None:
        """Check every value of a step, then log it: into a block, or on the host."""
        floats: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        for name, value in items.items():
            if (metric := self._metrics.get(name)) is not None:
                if isinstance(value, tuple):  # positional arguments; a mapping: keywords
                    metric.update(*value)
                else:
                    metric.update(**value) if isinstance(value, Mapping) else metric.update(value)
                continue
            if (slot := self._slots.get(name)) is None:
                if self._default is None:
                    raise BarrierGuardError(
                        f"MetricBuffer.update({name}=...) names an unknown metric: expected one "
                        f"of {quote_all((*self._slots, *self._metrics))}, or construct the "
                        f"buffer with a default reduction (default='mean')"
                    )
                check_name(name, "reductions")
                slot = self._slots[name] = Slot(*self._default)
            if isinstance(value, torch.Tensor):
                device = self._claim_device(name, value)
                if slot.reduction == "cat":
                    update_cat(name, slot, value, self._nan, device)
                    continue
                if value.numel() != 1:
                    raise BarrierGuardError(
                        f"MetricBuffer.update({name}={describe(value)}) is not a single value "
                        f"for reduction {slot.reduction!r}: expected a tensor with one element "
                        f"or a Python number (use reduction 'cat' to keep whole tensors)"
                    )
                if value.is_complex():
                    raise BarrierGuardError(
                        f"MetricBuffer.update({name}=<complex tensor>) is not a real value: "
                        f"expected a real (float, int or bool) tensor"
                    )
                tensors[name] = value
            elif is_number(value):
                floats[name] = value
            else:
                raise BarrierGuardError(
                    f"MetricBuffer.update({name}={value!r}) is not a valid value: "
                    f"expected a tensor or a Python number"
                )
        for name, value in floats.items():  # only once every value is checked
            slot = self._slots[name]
            if slot.block is not None:
                slot.block.fold()  # its rows come before this value (``last``)
            update_number(slot, float(value), n_tensor, n_float, self._nan, self._device)
        if not tensors:
            self._hot = self._last = None
            return
        assert self._device is not None
        key = tuple(tensors)
        if (block := self._blocks.get(key)) is None:
            block = self._blocks[key] = Block(self._slots, key, self._device, self._nan)
        if block.weighted:
            if block.steps and block.tensor_weights != (n_tensor is not None):
                block.fold()  # one kind of weight per fold
            block.tensor_weights = n_tensor is not None
        if self._last is not block:
            # Fold in other blocks with rows of these metrics: they come first (``last``).
            for slot in block.slots:
                if slot.block is not None and slot.block is not block:
                    slot.block.fold()
            self._last = block
        values = [v.reshape(()) for v in block.take(tensors)]
        if block.tensor_weights:
            assert n_tensor is not None
            values.append(n_tensor)
        block.sign(values)
        block.copy(values)
        block.advance(n_float)
        whole = len(tensors) == len(items) and not any(v.dim() for v in tensors.values())
        self._hot = block if whole else None

    def _fold_all(self) -> None:
        for block in self._blocks.values():
            block.fold()


def _read_back(
    slots: Mapping[str, Slot], nan: str, device: torch.device | None, group: Group
) -> dict[str, Any]:
    """Every slot's result, with one transfer (``group``: ``False`` in one process)."""
    if not (names := sorted(slots)):
        return {}
    per_rank = _gather(slots, names, device or torch.device("cpu"), group)
    results: dict[str, Any] = {}
    bad: list[str] = []
    for i, name in enumerate(names):
        slot = slots[name]
        results[name], saw_bad = _combine(slot, [r[1 + 3 * i : 4 + 3 * i] for r in per_rank], nan)
        bad += [name] if saw_bad else []
        if slot.reduction == "cat":  # Python numbers were kept on the host: they join here
            values = [v.to(device) for v in slot.values]
            results[name] = (
                torch.cat(values) if values else torch.empty(0, dtype=F64, device=device)
            )
    if bad:
        raise BarrierGuardError(
            f"MetricBuffer(nan='error'): metric(s) {quote_all(tuple(bad))} received NaN or "
            f"inf values; use nan='ignore' to skip them or nan='propagate' to keep them"
        )
    return results


def _pack_slot(slot: Slot, device: torch.device) -> list[torch.Tensor]:
    """``[a, w, bad]`` on ``device``, host parts added as kernel arguments (no copy)."""
    red, host_a = slot.reduction, slot.host_a
    # A metric logged only as Python numbers has no row: a fresh one (fills, no copy).
    row = Slot(red, False).device_row(device) if slot.row is None else slot.row.to(device)
    a = row[0]
    if red in SUM_KINDS:
        a = a + host_a
    elif red in ("min", "max"):
        if math.isnan(host_a):
            a = a + math.nan
        else:
            a = torch.clamp(a, max=host_a) if red == "min" else torch.clamp(a, min=host_a)
    elif red == "last" and slot.last_on_host:
        a = torch.full((), slot.host_last, dtype=F64, device=device)
    return [a, row[1] + slot.host_w, row[2] + slot.host_bad]


def _gather(
    slots: Mapping[str, Slot], names: list[str], device: torch.device, group: Group
) -> list[list[float]]:
    """Pack all running states (and a layout checksum), gather them, read them back once."""
    layout = ";".join(f"{n}:{slots[n].reduction}:{slots[n].weighted}" for n in names)
    parts = [torch.full((), float(zlib.crc32(layout.encode())), dtype=F64, device=device)]
    for name in names:
        parts.extend(_pack_slot(slots[name], device))
    packed = torch.stack(parts)
    if group is False:
        return [packed.tolist()]  # the single device-to-host transfer
    dist = torch.distributed
    if "nccl" not in str(dist.get_backend(group)):
        packed = packed.cpu()  # Gloo gathers CPU tensors; for a CUDA state, the one transfer
    elif packed.device.type != "cuda":
        # NCCL only moves CUDA tensors: Python-only metrics on a NCCL job pay one copy.
        packed = packed.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)  # the one collective
    per_rank: list[list[float]] = torch.stack(gathered).tolist()
    if any(rank[0] != per_rank[0][0] for rank in per_rank):
        raise BarrierGuardError(
            f"MetricBuffer.compute() found different metrics on different ranks: "
            f"expected every rank to register the same names and reductions "
            f"(this rank: {names}); declare them all in MetricBuffer(reductions=...)"
        )
    return per_rank


def _combine(slot: Slot, triples: list[list[float]], nan: str) -> tuple[float, bool]:
    """Combine per-rank ``[a, w, bad]`` triples into a value and a "saw bad" flag."""
    red = slot.reduction
    total_w = math.fsum(t[1] for t in triples)
    bad = nan == "error" and sum(t[2] for t in triples) != 0.0  # NaN != 0 too
    seen = [t[0] for t in triples if t[1] > 0.0]  # ranks that logged a value
    if red in SUM_KINDS:
        total_a = sum(t[0] for t in triples)
        bad = bad or (nan == "error" and not math.isfinite(total_a))
        if red == "mean":
            return (total_a / total_w if total_w != 0.0 else math.nan), bad
        return (total_a if red == "sum" else total_w), bad
    if red in ("min", "max"):
        if not seen or any(math.isnan(v) for v in seen):
            return math.nan, bad
        return (min(seen) if red == "min" else max(seen)), bad
    if red == "last":
        return (seen[-1] if seen else math.nan), bad  # the highest rank that logged one
    return math.nan, bad  # cat: only its bad counter travels; its values stay apart
