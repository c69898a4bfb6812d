"""The vocabulary of synchronization kinds, and the fix for each."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CODES", "KINDS", "Kind", "code_for", "fix_for", "kind_for_call"]


@dataclass(frozen=True)
class Kind:
    """One kind of synchronization: its rule code, what causes it, and how to avoid it."""

    code: str
    what: str
    fix: str
    blocking: bool = True


_D2H = (
    "keep the tensor on the device, or copy with .to('cpu', non_blocking=True) into pinned "
    "memory and read it after an event"
)
_PIN = (
    "pin the source (DataLoader(pin_memory=True) or tensor.pin_memory()) and copy with "
    "non_blocking=True"
)
_ITEM_FIX = (
    "keep the value on the device and reduce once at epoch end "
    "(barrierguard.MetricBuffer: buf.update(loss=loss) per step, buf.compute() after the loop)"
)

KINDS: dict[str, Kind] = {
    "item": Kind("BG101", "tensor.item() reads one device value on the host", _ITEM_FIX),
    "tolist": Kind("BG102", "tensor.tolist() copies the tensor to the host", _ITEM_FIX),
    "numpy": Kind(
        "BG103",
        "tensor.numpy() needs the values on the host",
        "keep the tensor on the device; convert once after the loop",
    ),
    "copy": Kind("BG201", "a blocking copy between host and device", f"d2h: {_D2H}; h2d: {_PIN}"),
    "print": Kind(
        "BG111",
        "printing or repr() of a device tensor copies it to the host",
        "print less often, or log through barrierguard.MetricBuffer and print after the loop",
    ),
    "format": Kind(
        "BG112",
        "formatting a device tensor (f-string, str.format) copies it to the host",
        "format after the loop, or keep it in a barrierguard.MetricBuffer",
    ),
    "bool": Kind(
        "BG107",
        "Python control flow on a device value (if t:, while t:, and/or/not, assert t)",
        "decide on the device with torch.where or masked_fill, or check once per epoch",
    ),
    "int": Kind("BG104", "int(t) or t.__index__() reads a device value", "keep it a tensor"),
    "float": Kind("BG105", "float(t) reads a device value", "keep it a tensor"),
    "complex": Kind("BG106", "complex(t) reads a device value", "keep it a tensor"),
    "index": Kind(
        "BG301",
        "boolean-mask indexing or assignment needs the number of selected elements; "
        "a Python list or range as an index is copied to the device with a blocking copy",
        "use torch.where(mask, x, 0) or x.masked_fill(~mask, 0) to keep the shape fixed",
    ),
    "nonzero": Kind(
        "BG302",
        "nonzero/argwhere/one-argument where: the output size depends on device values",
        "pass the size when it is known (torch.nonzero_static(x, size=n)) or use "
        "fixed-shape ops (torch.where(c, x, y), masked_fill)",
    ),
    "masked_select": Kind(
        "BG303",
        "masked_select: the output size depends on device values",
        "multiply by the mask or use torch.where(mask, x, 0) and reduce",
    ),
    "unique": Kind(
        "BG304",
        "torch.unique: the output size depends on device values",
        "use torch.bincount(x, minlength=n) or a one-hot sum with a fixed size",
    ),
    "repeat_interleave": Kind(
        "BG305",
        "repeat_interleave with tensor repeats needs the output size",
        "pass output_size= (the sum of repeats, if the host knows it)",
    ),
    "one_hot": Kind(
        "BG306",
        "one_hot without num_classes reads the largest value",
        "pass num_classes=",
    ),
    "compare": Kind(
        "BG108",
        "torch.allclose/torch.equal return a Python bool",
        "compare on the device (torch.isclose(a, b).all()) and read the flag after the loop",
    ),
    "dynamic_shape": Kind(
        "BG307",
        "an op whose output shape or value depends on device data",
        "use a fixed-shape alternative, or move it out of the loop",
    ),
    "synchronize": Kind(
        "BG401",
        "an explicit synchronize drains the device queue",
        "remove it from the loop; to time, record torch.cuda.Event(enable_timing=True) "
        "and read elapsed_time after the loop",
    ),
    "backward": Kind(
        "BG501",
        "a synchronizing op inside the backward pass (replayed when backward() returns)",
        "find the forward op whose gradient needs host values (mask indexing, nonzero, "
        "unique) and replace it with a fixed-shape op",
    ),
    "async_d2h": Kind(
        "BG202",
        "a non_blocking copy to the host returns before the data has arrived",
        "not a barrier but a race: record a torch.cuda.Event after the copy and call "
        "event.synchronize() before reading it, or read it one step later",
        blocking=False,
    ),
    "collective": Kind(
        "BG402",
        "a torch.distributed call that blocks the host until every rank has arrived "
        "(barrier, an *_object call, a collective on CPU tensors, wait() on one)",
        "keep collectives on device tensors (NCCL runs them on the stream, the host goes "
        "on) and out of the per-step path; every rank waits for the slowest one here",
    ),
    "call": Kind(
        "BG901",
        "a call that synchronized; barrierguard could not name the operation",
        "look at the call on this line for a host read of a device value",
    ),
}

# The stable rule code of each kind, never reused for another (docs/rules.md).
#   BG1xx: a device value read on the host    BG2xx: a copy between host and device
#   BG3xx: an output size that needs device data    BG4xx: explicit waits, collectives
#   BG5xx: inside backward    BG9xx: not named
CODES: dict[str, str] = {name: kind.code for name, kind in KINDS.items()}
_KIND_OF_CODE = {code: kind for kind, code in CODES.items()}

# The torch.distributed calls that always block the host (detect/distributed.py).
BARRIER_CALLS = ("barrier", "monitored_barrier")
OBJECT_CALLS = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)

# Attribute or function names seen at the call site, by the kind they mean.
_CALL_NAMES: dict[str, str] = {
    name: kind
    for kind, names in (
        ("item", ("item",)),
        ("tolist", ("tolist",)),
        ("numpy", ("numpy",)),
        ("copy", ("cpu", "to", "cuda", "copy_", "tensor", "as_tensor", "pin_memory")),
        ("print", ("print", "repr", "str")),
        ("format", ("format",)),
        ("bool", ("bool", "any", "all")),
        ("int", ("int", "len", "range")),
        ("float", ("float",)),
        ("complex", ("complex",)),
        ("nonzero", ("nonzero", "argwhere", "where")),
        ("masked_select", ("masked_select",)),
        ("unique", ("unique", "unique_consecutive")),
        ("repeat_interleave", ("repeat_interleave",)),
        ("one_hot", ("one_hot",)),
        ("compare", ("allclose", "equal")),
        ("synchronize", ("synchronize",)),
        ("copy", ("save", "load", "load_state_dict")),
        ("backward", ("backward", "grad")),
        ("collective", (*BARRIER_CALLS, *OBJECT_CALLS)),
    )
    for name in names
}


def code_for(kind: str) -> str:
    """The rule code of ``kind`` (``BG901``, the unnamed call's, for a kind not in the table).

    Example:
        >>> code_for("item"), code_for("index"), code_for("frobnicate")
        ('BG101', 'BG301', 'BG901')
    """
    return CODES.get(kind, CODES["call"])


def kind_named(name: str) -> str | None:
    """The kind that ``name`` names: a kind, or a rule code (any case); else ``None``.

    Example:
        >>> kind_named("item"), kind_named("bg301"), kind_named("x")
        ('item', 'index', None)
    """
    return name if name in KINDS else _KIND_OF_CODE.get(name.upper())


def kind_for_call(name: str) -> str:
    """The kind of a synchronizing call named ``name`` at the call site.

    Example:
        >>> kind_for_call("item"), kind_for_call("unique"), kind_for_call("frobnicate")
        ('item', 'unique', 'call')
    """
    return _CALL_NAMES.get(name, "call")


# The fixes that a site's detail (its first word) makes more precise than its kind's.
_DETAIL_FIXES: dict[tuple[str, str], str] = {
    ("copy", "h2d"): f"{_PIN}; create constants on the device once, outside the loop",
    ("copy", "d2h"): _D2H,
    ("index", "list"): (
        "build the index on the device once (torch.arange(n, device=x.device), or a tensor "
        "made before the loop) and index with that tensor"
    ),
    **dict.fromkeys(
        (("collective", name) for name in BARRIER_CALLS),
        "take it out of the training loop: the gradient all-reduce already keeps the ranks "
        "in step; where ranks must wait for rank 0's work (a checkpoint, evaluation), do that "
        "work on every rank or after the loop, or give it a timeout outside the hot path",
    ),
    **dict.fromkeys(
        (("collective", name) for name in OBJECT_CALLS),
        "an *_object call pickles, copies through a tensor and blocks every rank: send "
        "fixed-size device tensors instead (dist.all_gather_into_tensor, dist.broadcast), or "
        "exchange the objects once, before or after the loop",
    ),
    ("collective", "wait"): (
        "wait later: start the collective with async_op=True a step early and wait() just "
        "before its result is read, or keep its tensors on the GPU (an NCCL work's wait() "
        "only orders the stream; the host goes on)"
    ),
}
# Any other collective with a detail ran on host tensors.
_HOST_TENSOR_FIX = (
    "a collective on CPU tensors runs on the host (gloo) and returns when every rank has "
    "arrived: move the tensors to the GPU so NCCL runs it on the stream, or reduce once per "
    "epoch (barrierguard.MetricBuffer gathers its metrics with one collective)"
)


def fix_for(kind: str, detail: str = "") -> str:
    """The one-line fix hint for ``kind`` (a copy's hint follows its direction, a
    collective's the call it names).

    Example:
        >>> fix_for("copy", "h2d").startswith("pin the source")
        True
        >>> fix_for("collective", "all_reduce (gloo)").startswith("a collective on CPU")
        True
    """
    fix = _DETAIL_FIXES.get((kind, detail.split(" ", 1)[0]))
    if fix is None and kind == "collective" and detail:
        fix = _HOST_TENSOR_FIX
    return fix or KINDS.get(kind, KINDS["call"]).fix
