"""Reading the state back: one transfer (and one collective) in ``compute()``, the ``state_dict``.

Device tensors are packed, gathered and read once, or cloned on their device.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import torch

from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.slots import F64, Slot
from barrierguard.metrics.spec import SUM_KINDS, check_name, parse_spec, quote_all

if TYPE_CHECKING:
    from typing import Literal

    from torch.distributed import ProcessGroup

    Group = ProcessGroup | None | Literal[False]

__all__ = ["STATE_VERSION", "read_back", "restore", "snapshot"]

STATE_VERSION: Final = 1


def read_back(
    slots: Mapping[str, Slot], nan: str, device: torch.device | None, group: Group
) -> dict[str, Any]:
    """The result of every slot (blocks folded in), by name, with one transfer.

    ``group``: ``False`` in one process, else the ranks to gather from (``None``: all).

    Raises:
        BarrierGuardError: Under ``nan="error"``, a metric saw NaN or inf; or the
            ranks registered different metrics.
    """
    names = sorted(slots)
    if not names:
        return {}
    per_rank = _gather(slots, names, device or torch.device("cpu"), group)
    results: dict[str, Any] = {}
    bad: list[str] = []
    for i, name in enumerate(names):
        value, saw_bad = _combine(slots[name], [r[1 + 3 * i : 4 + 3 * i] for r in per_rank], nan)
        results[name] = value
        bad += [name] if saw_bad else []
    if bad:
        raise BarrierGuardError(
            f"MetricBuffer(nan='error'): metric(s) {quote_all(tuple(bad))} received NaN or "
            f"inf values; use nan='ignore' to skip them or nan='propagate' to keep them"
        )
    for name in names:
        values = slots[name].values
        if slots[name].reduction == "cat":
            # Python numbers were kept on the host; they join the device values here.
            results[name] = (
                torch.cat([v if device is None else v.to(device) for v in values])
                if values
                else torch.empty(0, dtype=F64, device=device)
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
    saved_metrics = {  # torchmetrics states are not persistent by default: saved explicitly
        name: {
            "state_dict": metric.state_dict(),
            "metric_state": {
                k: v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v]
                for k, v in metric.metric_state.items()
            },
            "update_count": int(metric.update_count),
        }
        for name, metric in metrics.items()
    }
    device_name = None if device is None else str(device)
    return dict(
        version=STATE_VERSION, nan=nan, device=device_name, slots=saved_slots, metrics=saved_metrics
    )


def restore(
    state_dict: Mapping[str, Any],
    slots: dict[str, Slot],
    metrics: Mapping[str, Any],
    adopt: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Put a snapshot back into ``slots`` (registering the names they lack) and ``metrics``.

    ``adopt`` moves a tensor to the buffer's device, or gives the buffer its device.

    Raises:
        BarrierGuardError: Another version; a saved slot of another reduction than
            this buffer's; a saved torchmetrics name that is not in ``metrics``.
    """
    if (version := state_dict.get("version")) != STATE_VERSION:
        raise BarrierGuardError(
            f"MetricBuffer.load_state_dict(version={version!r}) is not a known state "
            f"version: expected {STATE_VERSION}"
        )
    for name, saved in state_dict["slots"].items():
        spec = (saved["reduction"], "weighted") if saved["weighted"] else saved["reduction"]
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
        slot.host_last, slot.last_on_host = float(saved["host_last"]), bool(saved["last_on_host"])
        slot.values = [adopt(v).clone() for v in saved["values"]]
    for name, saved in state_dict.get("metrics", {}).items():
        if (metric := metrics.get(name)) is None:
            raise BarrierGuardError(
                f"MetricBuffer.load_state_dict(metrics={{{name!r}: ...}}) names a torchmetrics "
                f"metric this buffer lacks: expected one of {quote_all(tuple(metrics))}"
            )
        metric.load_state_dict(saved["state_dict"], strict=False)
        for key, value in saved["metric_state"].items():
            setattr(metric, key, value)
        # torchmetrics warns in compute() when it believes update() never ran.
        metric._update_count, metric._computed = saved["update_count"], None
