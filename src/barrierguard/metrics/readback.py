"""Reading the state back: :meth:`MetricBuffer.compute` and the ``state_dict`` format.

:func:`read_back` packs every slot into one float64 tensor (host parts as
kernel arguments), gathers it across ranks with one collective, reads it with
one transfer and combines the per-rank ``[a, w, bad]`` triples (``cat`` values
stay on the rank). :func:`snapshot` and :func:`restore` are ``state_dict`` and
``load_state_dict``: device tensors are cloned on their device, never read.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.slots import F64, Slot
from barrierguard.metrics.spec import SUM_KINDS, ReductionSpec, check_name, parse_spec, quote_all

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["STATE_VERSION", "check_version", "read_back", "restore", "snapshot"]

STATE_VERSION: Final = 1


def read_back(
    slots: Mapping[str, Slot],
    *,
    nan: str,
    device: torch.device | None,
    distributed: bool,
    group: ProcessGroup | None,
) -> dict[str, Any]:
    """The result of every slot, by sorted name, with one device-to-host transfer.

    Pending steps must have been folded in already. With ``distributed``, the
    packed state is first gathered from every rank of ``group``.

    Raises:
        BarrierGuardError: Under ``nan="error"``, a metric saw NaN or inf; or the
            ranks registered different metrics.
    """
    names = sorted(slots)
    results: dict[str, Any] = {}
    if not names:
        return results
    per_rank = _gather(slots, names, device, distributed, group)
    bad_names: list[str] = []
    for i, name in enumerate(names):
        triples = [rank[1 + 3 * i : 4 + 3 * i] for rank in per_rank]
        value, bad = _combine(slots[name], triples, nan)
        if bad:
            bad_names.append(name)
        results[name] = value
    if bad_names:
        raise BarrierGuardError(
            f"MetricBuffer(nan='error'): metric(s) {quote_all(tuple(bad_names))} "
            f"received NaN or inf values; use nan='ignore' to skip them or "
            f"nan='propagate' to keep them"
        )
    for name in names:
        slot = slots[name]
        if slot.reduction == "cat":
            results[name] = _cat_result(slot, device)
    return results


def _layout_hash(slots: Mapping[str, Slot], names: list[str]) -> float:
    text = ";".join(f"{n}:{slots[n].reduction}:{slots[n].weighted}" for n in names)
    return float(zlib.crc32(text.encode()))


def _pack_slot(slot: Slot, device: torch.device) -> list[torch.Tensor]:
    """``[a, w, bad]`` on ``device``, host parts added as kernel arguments (no copy)."""

    def full(value: float) -> torch.Tensor:
        return torch.full((), value, dtype=F64, device=device)

    red = slot.reduction
    host_a = slot.host_a
    if slot.row is None:
        a_val = slot.host_last if red == "last" else host_a
        return [full(a_val), full(slot.host_w), full(slot.host_bad)]
    row = slot.row if slot.row.device == device else slot.row.to(device)
    a_dev = row[0]
    if red in SUM_KINDS:
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


def _gather(
    slots: Mapping[str, Slot],
    names: list[str],
    state_device: torch.device | None,
    distributed: bool,
    group: ProcessGroup | None,
) -> list[list[float]]:
    """Pack all running states, gather them across ranks, and read them back once."""
    device = state_device or torch.device("cpu")
    parts = [torch.full((), _layout_hash(slots, names), dtype=F64, device=device)]
    for name in names:
        parts.extend(_pack_slot(slots[name], device))
    packed = torch.stack(parts)
    if not distributed:
        return [packed.tolist()]  # the single device-to-host transfer
    dist = torch.distributed
    backend = str(dist.get_backend(group))
    if "nccl" in backend and packed.device.type != "cuda":
        # NCCL only moves CUDA tensors: Python-only metrics on a NCCL job pay one copy.
        packed = packed.to(torch.device("cuda", torch.cuda.current_device()))
    elif "nccl" not in backend and packed.device.type == "cuda":
        # Gloo gathers CPU tensors; this copy is the one transfer.
        packed = packed.cpu()
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=group)  # the one collective
    per_rank: list[list[float]] = torch.stack(gathered).tolist()
    local = per_rank[0][0] if per_rank else 0.0
    if any(rank[0] != local for rank in per_rank):
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
    bad_total = sum(t[2] for t in triples)
    bad = nan == "error" and (bad_total != 0.0)  # NaN != 0 too
    value: float
    if red in SUM_KINDS:
        total_a = sum(t[0] for t in triples)
        if nan == "error" and not math.isfinite(total_a):
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


def _cat_result(slot: Slot, device: torch.device | None) -> torch.Tensor:
    if not slot.values:
        return torch.empty(0, dtype=F64, device=device)
    devices = {v.device for v in slot.values}
    if len(devices) > 1 and device is not None:
        # Python numbers were kept on the host; they join the device values here.
        return torch.cat([v.to(device) for v in slot.values])
    return torch.cat(slot.values)


def snapshot(
    slots: Mapping[str, Slot], metrics: Mapping[str, Any], nan: str, device: torch.device | None
) -> dict[str, Any]:
    """The state dict of a buffer whose blocks are folded in."""
    saved_slots = {
        name: {
            "reduction": slot.reduction,
            "weighted": slot.weighted,
            "row": None if slot.row is None else slot.row.clone(),
            "host": [slot.host_a, slot.host_w, slot.host_bad],
            "host_last": slot.host_last,
            "last_on_host": slot.last_on_host,
            "values": [v.clone() for v in slot.values],
        }
        for name, slot in slots.items()
    }
    saved_metrics = {
        # torchmetrics states are not persistent by default, so they are saved explicitly.
        name: {
            "state_dict": metric.state_dict(),
            "metric_state": {
                k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v])
                for k, v in metric.metric_state.items()
            },
            "update_count": int(metric.update_count),
        }
        for name, metric in metrics.items()
    }
    return {
        "version": STATE_VERSION,
        "nan": nan,
        "device": None if device is None else str(device),
        "slots": saved_slots,
        "metrics": saved_metrics,
    }


def check_version(state_dict: Mapping[str, Any]) -> None:
    """Raise unless ``state_dict`` has the layout :func:`snapshot` writes."""
    version = state_dict.get("version")
    if version != STATE_VERSION:
        raise BarrierGuardError(
            f"MetricBuffer.load_state_dict(version={version!r}) is not a known state "
            f"version: expected {STATE_VERSION}"
        )


def restore(
    state_dict: Mapping[str, Any],
    slots: dict[str, Slot],
    metrics: Mapping[str, Any],
    adopt: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Put a snapshot back into ``slots`` (registering names they lack) and ``metrics``.

    The caller folds its blocks in first. ``adopt`` moves a tensor to the
    buffer's device, or gives the buffer the tensor's device.

    Raises:
        BarrierGuardError: A saved slot declares another reduction than the slot
            of the same name, or a saved torchmetrics name is not in ``metrics``.
    """
    for name, saved in state_dict["slots"].items():
        spec: ReductionSpec = (
            (saved["reduction"], "weighted") if saved["weighted"] else saved["reduction"]
        )
        parsed = parse_spec("MetricBuffer.load_state_dict(slots", name, spec)
        slot = slots.get(name)
        if slot is None:
            check_name(name, "reductions")
            slot = slots[name] = Slot(*parsed)
        elif (slot.reduction, slot.weighted) != parsed:
            raise BarrierGuardError(
                f"MetricBuffer.load_state_dict(slots={{{name!r}: {spec!r}}}) does not "
                f"match this buffer: expected reduction {slot.spec!r} for {name!r}"
            )
        row = saved["row"]
        slot.row = None if row is None else adopt(row).to(F64).clone()
        slot.block = None
        slot.host_a, slot.host_w, slot.host_bad = (float(v) for v in saved["host"])
        slot.host_last = float(saved["host_last"])
        slot.last_on_host = bool(saved["last_on_host"])
        slot.values = [adopt(v).clone() for v in saved["values"]]
    for name, saved in state_dict.get("metrics", {}).items():
        metric = metrics.get(name)
        if metric is None:
            raise BarrierGuardError(
                f"MetricBuffer.load_state_dict(metrics={{{name!r}: ...}}) names a "
                f"torchmetrics metric this buffer lacks: expected one of "
                f"{quote_all(tuple(metrics))}"
            )
        metric.load_state_dict(saved["state_dict"], strict=False)
        for key, value in saved["metric_state"].items():
            setattr(metric, key, value)
        # torchmetrics warns in compute() when it believes update() never ran.
        metric._update_count = saved["update_count"]
        metric._computed = None
