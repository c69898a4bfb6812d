"""The snapshot format of :meth:`MetricBuffer.state_dict`, and restoring from it.

Owns the layout and version of the dict that ``state_dict`` returns (every
slot's device row and host parts, ``cat`` values, torchmetrics states), and
putting a snapshot back into slots and torchmetrics objects. Device tensors are
cloned on their device, never read back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.slots import F64, Slot
from barrierguard.metrics.spec import ReductionSpec, check_name, parse_spec, quote_all

__all__ = ["STATE_VERSION", "check_version", "restore_metrics", "restore_slots", "snapshot"]

STATE_VERSION: Final = 1


def snapshot(
    slots: Mapping[str, Slot],
    metrics: Mapping[str, Any],
    nan: str,
    device: torch.device | None,
) -> dict[str, Any]:
    """The state dict of a buffer whose blocks are folded in."""
    saved_slots: dict[str, Any] = {}
    for name, slot in slots.items():
        saved_slots[name] = {
            "reduction": slot.reduction,
            "weighted": slot.weighted,
            "row": None if slot.row is None else slot.row.clone(),
            "host": [slot.host_a, slot.host_w, slot.host_bad],
            "host_last": slot.host_last,
            "last_on_host": slot.last_on_host,
            "values": [v.clone() for v in slot.values],
        }
    saved_metrics: dict[str, Any] = {}
    for name, metric in metrics.items():
        # torchmetrics states are not persistent by default, so save them explicitly.
        saved_metrics[name] = {
            "state_dict": metric.state_dict(),
            "metric_state": {
                k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v])
                for k, v in metric.metric_state.items()
            },
            "update_count": int(metric.update_count),
        }
    return {
        "version": STATE_VERSION,
        "nan": nan,
        "device": None if device is None else str(device),
        "slots": saved_slots,
        "metrics": saved_metrics,
    }


def check_version(state_dict: Mapping[str, Any]) -> None:
    """Raise unless ``state_dict`` has the layout this module writes."""
    version = state_dict.get("version")
    if version != STATE_VERSION:
        raise BarrierGuardError(
            f"MetricBuffer.load_state_dict(version={version!r}) is not a known state "
            f"version: expected {STATE_VERSION}"
        )


def restore_slots(
    saved_slots: Mapping[str, Any],
    slots: dict[str, Slot],
    adopt: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Put saved slots into ``slots``, registering the names it lacks.

    The caller folds its blocks in first and drops them afterwards.
    ``adopt`` moves a tensor to the buffer's device (or gives the buffer its device).

    Raises:
        BarrierGuardError: A saved slot declares another reduction than the slot
            of the same name, or is not valid.
    """
    for name, saved in saved_slots.items():
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
        if row is not None:
            row = adopt(row).to(F64).clone()
        slot.set_row(row)
        slot.block = None
        slot.host_a, slot.host_w, slot.host_bad = (float(v) for v in saved["host"])
        slot.host_last = float(saved["host_last"])
        slot.last_on_host = bool(saved["last_on_host"])
        slot.values = [adopt(v).clone() for v in saved["values"]]


def restore_metrics(saved_metrics: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
    """Put saved torchmetrics states back into the metrics of the same names.

    Raises:
        BarrierGuardError: A saved name is not one of ``metrics``.
    """
    for name, saved in saved_metrics.items():
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
