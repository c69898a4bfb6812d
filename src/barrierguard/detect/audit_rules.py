"""The audit's rules: one per kind of call that can synchronize.

A rule runs the op, judges it by its inputs' provenance (``AuditMode``) and records a
sync where a GPU run would make one. Ops torch tags as data-dependent get a rule too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

import torch

from barrierguard.detect import hub
from barrierguard.detect.audit_provenance import (
    NAME,
    NOTE_PINNED_D2H,
    AuditMode,
    Rule,
    Tensor,
    sync_frame,
)
from barrierguard.detect.cuda import _nonblocking
from barrierguard.detect.frameworks import package_path
from barrierguard.detect.patch import Patches
from barrierguard.detect.stack import observe

__all__ = ["build_rules", "install_patches", "tagged_ops"]

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Verdict = tuple[str, str] | None  # a sync's kind and detail, or none
Judge = Callable[[AuditMode, Any, Args, Kwargs, Any], Verdict]
Probe = Callable[[Args, Kwargs], Any]


@functools.cache
def tagged_ops() -> dict[str, str]:
    """``{aten op name: tag}`` of the ops tagged ``dynamic_output_shape`` or
    ``data_dependent_output`` (read once from torch's registry, about 0.4 s)."""
    wanted = ("dynamic_output_shape", "data_dependent_output")
    tags = {getattr(torch.Tag, t) for t in wanted if hasattr(torch.Tag, t)}
    found: dict[str, str] = {}
    names = {s.name[6:] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")}
    for name in sorted(names):
        try:
            packet = getattr(torch.ops.aten, name)
            for overload in packet.overloads():
                hit = [t for t in getattr(packet, overload).tags if t in tags]
                if hit:
                    found[name] = str(hit[0]).rsplit(".", 1)[-1]
                    break
        except Exception:  # an op that cannot be inspected is simply not audited
            continue
    return found


def _judged(judge: Judge) -> Rule:
    """A rule that runs the op, then records what ``judge(mode, func, args, kwargs, out)`` finds."""

    def rule(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs) -> Any:
        out = func(*args, **kwargs)
        try:
            verdict = judge(mode, func, args, kwargs, out)
        except Exception as exc:
            hub.fault(NAME, exc)
            return out
        if verdict is not None:
            # The caller of __torch_function__ (no frame object is made for those skipped).
            mode.record(*verdict, depth=3)
        return out

    return rule


def _reader(kind: str) -> Rule:
    """A rule that records ``kind`` when the call's tensor is a device tensor (every
    ``.item()``: written out to read the mark first and make no extra call)."""

    def rule(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs) -> Any:
        out = func(*args, **kwargs)
        try:
            t = args[0] if args else None
            if not isinstance(t, Tensor):
                return out
            m = mode.marks.get(id(t))
            if not (m.dev if m is not None else mode.is_dev(t)):
                return out
            # The caller of __torch_function__ (no frame object is made for those skipped).
            sync = observe(sync_frame(sys._getframe(2)), kind, "")
        except Exception as exc:
            hub.fault(NAME, exc)
            return out
        if sync is not None:
            hub.emit(NAME, sync)
        return out

    return rule


def _dynamic(kind: str, which: Probe) -> Rule:
    """A rule for an op that syncs when ``which(args, kwargs)`` holds a device tensor."""

    def judge(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs, out: Any) -> Verdict:
        mode.propagate(args, kwargs, out)
        probe = which(args, kwargs)
        probes = probe if isinstance(probe, (tuple, list)) else (probe,)
        return (kind, "") if any(isinstance(p, Tensor) and mode.is_dev(p) for p in probes) else None

    return _judged(judge)


def _first(args: Args, kwargs: Kwargs) -> Any:
    return args[0] if args else kwargs.get("input")


def _all(args: Args, kwargs: Kwargs) -> Any:
    return (*args, *kwargs.values())


def _where_one(args: Args, kwargs: Kwargs) -> Any:
    return args[0] if len(args) == 1 and not kwargs else None


def _one_hot(args: Args, kwargs: Kwargs) -> Any:
    classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    return _first(args, kwargs) if classes == -1 else None


def _repeats(args: Args, kwargs: Kwargs) -> Any:
    # (input, repeats, ...), or (repeats,) alone; the method always names its repeats.
    if kwargs.get("output_size") is not None:
        return None
    if len(args) >= 2:
        return args[1]
    return kwargs.get("repeats", args[0] if args else None)


def _move(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs) -> Any:
    """The rule of ``.to()``, ``.cpu()`` and ``.cuda()``."""
    out = func(*args, **kwargs)
    try:
        src = args[0]
        if not isinstance(src, Tensor):
            return out
        target = _to_target(mode, args, kwargs) if func is Tensor.to else func is Tensor.cuda
        nonblocking = _nonblocking(args[1:], kwargs) or (
            bool(target) and _gpu_nonblocking_caller(sys._getframe(1))
        )
    except Exception as exc:
        hub.fault(NAME, exc)
        return out
    return mode.moved(src, out, target, nonblocking)


# Framework functions that copy with non_blocking=True to a GPU but not to the CPU
# (Lightning's _BLOCKING_DEVICE_TYPES): judged as the GPU run's copy.
_GPU_NONBLOCKING = {"lightning/fabric/utilities/apply_func.py": frozenset({"batch_to"})}


@functools.lru_cache(maxsize=4096)
def _gpu_functions(filename: str) -> frozenset[str]:
    return _GPU_NONBLOCKING.get(package_path(filename) or "", frozenset())


def _gpu_nonblocking_caller(frame: FrameType | None, depth: int = 4) -> bool:
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in _gpu_functions(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _to_target(mode: AuditMode, args: Args, kwargs: Kwargs) -> bool | None:
    device = kwargs.get("device")
    if device is None:
        other = kwargs.get("other")
        if isinstance(other, Tensor):
            return mode.is_dev(other)
        for a in args[1:]:
            if isinstance(a, Tensor):
                return mode.is_dev(a)
            if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                device = a
                break
    return mode.training(device)


def _copy(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs, out: Any) -> Verdict:
    dst = args[0]
    src = args[1] if len(args) > 1 else kwargs.get("src")
    if not (isinstance(dst, Tensor) and isinstance(src, Tensor)):
        return None
    ddev, sdev = mode.is_dev(dst), mode.is_dev(src)
    if ddev == sdev:
        return None
    nonblocking = _nonblocking(args[2:], kwargs)
    if ddev:
        return mode.h2d(src, nonblocking)
    if nonblocking:
        hub.note(NAME, NOTE_PINNED_D2H)
        return None
    return ("copy", "d2h")


def _tensor(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs, out: Any) -> Verdict:
    """``torch.tensor``/``as_tensor``/``Tensor.new_tensor``: host data onto the device."""
    target = mode.training(kwargs.get("device"))
    if func is Tensor.new_tensor:
        if target is None:
            target = isinstance(args[0], Tensor) and mode.is_dev(args[0])
        data = args[1] if len(args) > 1 else kwargs.get("data")
    else:
        data = args[0] if args else kwargs.get("data")
    from_device = isinstance(data, Tensor) and mode.is_dev(data)
    if target or (target is None and from_device):
        mode.mark_out(out, True)
    # An empty tensor copies nothing (a KV cache starts that way in every forward).
    if not target or from_device or (isinstance(out, Tensor) and out.numel() == 0):
        return None
    return ("copy", "h2d")


def _host_index(index: Any) -> bool:
    """Whether ``index`` holds a list or range (or numpy array) of integers, which torch
    copies to the indexed tensor's device with a blocking copy: ``x[[0, 2]]``."""
    return any(
        (isinstance(part, range) and len(part) > 0)
        or (isinstance(part, list) and part and all(isinstance(i, int) for i in part))
        or (type(part).__name__ == "ndarray" and part.size)
        for part in (index if isinstance(index, tuple) else (index,))
    )


def _index_verdict(mode: AuditMode, args: Args) -> Verdict:
    index = args[1]
    parts = index if isinstance(index, (tuple, list)) else (index,)
    masks = (i for i in parts if isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8))
    if any(mode.is_dev(m) for m in masks):
        return ("index", "")
    if isinstance(args[0], Tensor) and _host_index(index) and mode.is_dev(args[0]):
        return ("index", "list")
    return None


def _getitem(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs, out: Any) -> Verdict:
    mode.propagate(args, kwargs, out)
    verdict = _index_verdict(mode, args) if len(args) > 1 else None
    if verdict == ("index", "") and isinstance(out, Tensor) and out.grad_fn is not None:
        mode.watch_backward(out.grad_fn)
    return verdict


def _setitem(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs, out: Any) -> Verdict:
    if len(args) < 3:
        return None
    dst, value = args[0], args[2]
    verdict = _index_verdict(mode, args)
    if verdict is not None or not (isinstance(dst, Tensor) and isinstance(value, Tensor)):
        return verdict
    return ("copy", "d2h") if mode.is_dev(value) and not mode.is_dev(dst) else None


_READS: dict[str, str] = {
    "item": "item",
    "tolist": "tolist",
    "numpy": "numpy",
    "__array__": "numpy",
    "__bool__": "bool",
    "__contains__": "bool",
    "__int__": "int",
    "__index__": "int",
    "__float__": "float",
    "__complex__": "complex",
    "__repr__": "print",
    "__str__": "print",
    "__format__": "format",
}

# Ops with a kind of their own (tagged ops not listed are "dynamic_shape"), and for
# those audited whatever this torch tags, the input whose side decides.
_NAMED_OPS: dict[str, tuple[str, Probe | None]] = {
    "nonzero": ("nonzero", _first),
    "argwhere": ("nonzero", _first),
    "masked_select": ("masked_select", _all),
    "unique": ("unique", _first),
    "unique_consecutive": ("unique", _first),
    "_unique": ("unique", None),
    "_unique2": ("unique", None),
    "unique_dim": ("unique", None),
    "unique_dim_consecutive": ("unique", None),
    "allclose": ("compare", _all),
    "equal": ("compare", _all),
}
# Tagged ops whose torch-level entry points have a rule of their own (or read).
_HANDLED = frozenset({"item", "_local_scalar_dense", "repeat_interleave", "one_hot", "index"})


def _functions(name: str) -> list[Any]:
    found = [getattr(space, name, None) for space in (torch, Tensor, torch.nn.functional)]
    if name.startswith("linalg_"):
        found.append(getattr(torch.linalg, name[len("linalg_") :], None))
    return [fn for fn in found if fn is not None]


def build_rules() -> dict[Any, Rule]:
    """The function -> rule table (built when the engine installs, not at import)."""
    rules: dict[Any, Rule] = {}
    for name, kind in _READS.items():
        if name in vars(Tensor) or name in vars(torch._C.TensorBase):
            rules[getattr(Tensor, name)] = _reader(kind)
    for name, tag in tagged_ops().items():
        if name not in _HANDLED:
            which: Probe = _all if tag == "data_dependent_output" else _first
            rule = _dynamic(_NAMED_OPS.get(name, ("dynamic_shape", None))[0], which)
            rules.update(dict.fromkeys(_functions(name), rule))
    for name, (kind, probe) in _NAMED_OPS.items():
        if probe is not None:
            rules.update(dict.fromkeys(_functions(name), _dynamic(kind, probe)))
    rules[torch.where] = _dynamic("nonzero", _where_one)
    repeats = (torch.repeat_interleave, Tensor.repeat_interleave)
    rules.update(dict.fromkeys(repeats, _dynamic("repeat_interleave", _repeats)))
    rules[torch.nn.functional.one_hot] = _dynamic("one_hot", _one_hot)
    rules.update(dict.fromkeys((Tensor.to, Tensor.cpu, Tensor.cuda), _move))
    rules[Tensor.copy_] = _judged(_copy)
    made = (torch.tensor, torch.as_tensor, Tensor.new_tensor)
    rules.update(dict.fromkeys(made, _judged(_tensor)))
    rules[Tensor.__getitem__] = _judged(_getitem)
    rules[Tensor.__setitem__] = _judged(_setitem)
    return rules


class _Checkpoints:
    """The files ``torch.save`` wrote device tensors to (a ``torch.load`` without
    ``map_location`` puts them back on the device)."""

    def __init__(self) -> None:
        self.saving: list[Any] = []  # the files torch.save is writing, innermost last
        self.paths: set[str] = set()
        self.buffers: weakref.WeakSet[Any] = weakref.WeakSet()

    def _seen(self, f: Any) -> tuple[Any, set[str] | weakref.WeakSet[Any]]:
        """The key of file ``f`` (its absolute path, else the object), and its set."""
        if isinstance(f, (str, os.PathLike)):
            return os.path.abspath(os.fspath(f)), self.paths
        name = getattr(f, "name", None)
        if isinstance(name, str) and not name.startswith("<"):
            return os.path.abspath(name), self.paths
        return f, self.buffers

    def remember(self, f: Any) -> None:
        key, seen = self._seen(f)
        with contextlib.suppress(TypeError):  # an object without weak references
            seen.add(key)

    def holds_device_tensors(self, f: Any) -> bool:
        key, seen = self._seen(f)
        with contextlib.suppress(TypeError):  # an object that cannot be hashed
            return key in seen
        return False


def _mark_loaded(mode: AuditMode, obj: Any, dev: bool, depth: int = 0) -> bool:
    """Mark the tensors of what ``torch.load`` returned as on ``dev``'s side; any there?"""
    if isinstance(obj, Tensor):
        mode.mark(obj, dev)
        return True
    if isinstance(obj, torch.nn.Module):
        tensors = (*obj.parameters(), *obj.buffers())
        for t in tensors:
            mode.mark(t, dev)
        return bool(tensors)
    if isinstance(obj, dict):
        obj = list(obj.values())
    if not isinstance(obj, (list, tuple)) or depth >= 20:
        return False
    return any([_mark_loaded(mode, item, dev, depth + 1) for item in obj])  # a list: marks all


def install_patches(
    patches: Patches, mode: AuditMode, aside: Callable[[], AbstractContextManager[None]]
) -> None:
    """Audit ``torch.save`` and ``torch.load``.

    Args:
        patches: Where the patches go (undone when the engine uninstalls).
        mode: The running mode; it gets a rule for ``Tensor.untyped_storage``.
        aside: A context with the mode off the stack (for ``torch.load``'s own calls).
    """
    state = _Checkpoints()

    def storage(mode: AuditMode, func: Any, args: Args, kwargs: Kwargs, out: Any) -> Verdict:
        # torch.save reads each tensor's storage once: a device tensor's is a copy.
        if not (state.saving and isinstance(args[0], Tensor) and mode.is_dev(args[0])):
            return None
        state.remember(state.saving[-1])
        return ("copy", "d2h")

    mode.rules[Tensor.untyped_storage] = _judged(storage)
    orig_save, orig_load = torch.save, torch.load

    @functools.wraps(orig_save)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        state.saving.append(f)
        try:
            return orig_save(obj, f, *args, **kwargs)
        finally:
            state.saving.pop()

    @functools.wraps(orig_load)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if not mode.active:
            return orig_load(f, *args, **kwargs)
        with aside():
            out = orig_load(f, *args, **kwargs)
        try:
            # Whether it loads onto the device: where saved from, or where mapped to.
            where = kwargs.get("map_location", args[0] if args else None)
            if where is None:
                dev = state.holds_device_tensors(f)
            elif isinstance(where, dict):
                dev = any(mode.training(v) for v in where.values())
            else:  # a function decides per storage: not known here, stay quiet
                dev = not callable(where) and bool(mode.training(where))
            hit = _mark_loaded(mode, out, dev) and dev
        except Exception as exc:
            hub.fault(NAME, exc)
            return out
        if hit:
            mode.record("copy", "h2d")
        return out

    patches.set(torch, "save", save)
    patches.set(torch, "load", load)
