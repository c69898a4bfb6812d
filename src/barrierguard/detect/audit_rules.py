"""The audit's rules: one function per kind of call that can synchronize.

A rule runs the op, then judges it with the provenance of its inputs
(``audit_provenance.AuditMode``) and records a sync where a GPU run would
make one. :func:`build_rules` maps torch functions to their rules; ops that
PyTorch itself tags as data-dependent (:func:`tagged_ops`) get a rule without
a release of barrierguard.
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

from barrierguard.detect.audit_provenance import (
    NAME,
    NOTE_PINNED_D2H,
    AuditMode,
    Rule,
    Tensor,
    _masks,
    sync_frame,
)
from barrierguard.detect.audit_provenance import fault as _fault
from barrierguard.detect.cuda import _nonblocking
from barrierguard.detect.frameworks import package_path
from barrierguard.detect.hub import emit
from barrierguard.detect.patch import Patches
from barrierguard.detect.stack import observe

__all__ = ["build_rules", "install_patches", "tagged_ops"]


@functools.cache
def tagged_ops() -> dict[str, str]:
    """Names of aten ops tagged ``dynamic_output_shape`` or ``data_dependent_output``.

    Read once per process from torch's own op registry (about 0.4 s), so ops a
    newer torch tags are audited without a release of barrierguard.

    Returns:
        ``{aten name: tag name}``; empty when this torch has no such tags.
    """
    tags = {
        getattr(torch.Tag, t)
        for t in ("dynamic_output_shape", "data_dependent_output")
        if hasattr(torch.Tag, t)
    }
    found: dict[str, str] = {}
    if not tags:
        return found
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


def _reader(
    kind: str,
    detail: str = "",
    when: Callable[[], bool] | None = None,
    hit: Callable[[], None] | None = None,
) -> Rule:
    """A rule that records ``kind`` when the call's tensor is a device tensor
    (and ``when()``, if given, says the call counts); ``hit()`` is told."""

    def rule(mode: AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if when is not None and not when():
            return out
        try:
            t = args[0] if args else None
            if not isinstance(t, Tensor):
                return out
            m = mode.marks.get(id(t))
            if not (m.dev if m is not None else mode.is_dev(t)):
                return out
            if hit is not None:
                hit()
            # The caller of the mode's __torch_function__, which called this
            # rule: sys._getframe makes no frame object for the frames it skips.
            sync = observe(sync_frame(sys._getframe(2)), kind, detail)
        except Exception as exc:
            _fault(exc)
            return out
        if sync is not None:
            emit(NAME, sync)
        return out

    return rule


def _dynamic(kind: str, which: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Rule:
    """A rule for an op that syncs when ``which(args, kwargs)`` is a device tensor."""

    def rule(mode: AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        try:
            mode.propagate(args, kwargs, out)
            probe = which(args, kwargs)
            if isinstance(probe, (tuple, list)):
                hit = any(isinstance(p, Tensor) and mode.is_dev(p) for p in probe)
            else:
                hit = isinstance(probe, Tensor) and mode.is_dev(probe)
        except Exception as exc:
            _fault(exc)
            return out
        if hit:
            mode.record(kind)
        return out

    return rule


def _first(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("input")


def _all(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return (*args, *kwargs.values())


def _where_one(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if len(args) == 1 and not kwargs else None


def _one_hot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    return _first(args, kwargs) if classes == -1 else None


def _repeats_fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # torch.repeat_interleave(input, repeats, ...) or torch.repeat_interleave(repeats)
    if kwargs.get("output_size") is not None:
        return None
    if len(args) >= 2:
        return args[1]
    return kwargs.get("repeats", args[0] if args else None)


def _repeats_method(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs.get("output_size") is not None:
        return None
    return args[1] if len(args) >= 2 else kwargs.get("repeats")


def _to_rule(method: str) -> Rule:
    def rule(mode: AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        try:
            src = args[0]
            if not isinstance(src, Tensor):
                return out
            target: bool | None
            if method == "cpu":
                target = False
            elif method == "cuda":
                target = True
            else:
                target = _to_target(mode, args, kwargs)
            nonblocking = _nonblocking(args[1:], kwargs) or (
                bool(target) and _gpu_nonblocking_caller(sys._getframe(1))
            )
        except Exception as exc:
            _fault(exc)
            return out
        return mode.moved(src, out, target, nonblocking)

    return rule


# Framework functions that copy with non_blocking=True when the target is a GPU
# but not when it is the CPU (Lightning's _BLOCKING_DEVICE_TYPES): the audit
# judges the copy the GPU run would make. Paths as the framework table names
# them (the standalone lightning_fabric package reads as lightning/fabric).
_GPU_NONBLOCKING = frozenset({"lightning/fabric/utilities/apply_func.py:batch_to"})


# Per source file, the functions of _GPU_NONBLOCKING in it (mostly none): a
# frame costs one lookup by file name, whose hash Python caches.
_gpu_functions: dict[str, frozenset[str]] = {}


def _gpu_nonblocking_functions(filename: str) -> frozenset[str]:
    path = package_path(filename)
    names = frozenset(
        entry.rsplit(":", 1)[1] for entry in _GPU_NONBLOCKING if entry.rsplit(":", 1)[0] == path
    )
    if len(_gpu_functions) < 100_000:
        _gpu_functions[filename] = names
    return names


def _gpu_nonblocking_caller(frame: FrameType | None, depth: int = 4) -> bool:
    get = _gpu_functions.get
    while frame is not None and depth > 0:
        code = frame.f_code
        filename = code.co_filename
        names = get(filename)
        if names is None:
            names = _gpu_nonblocking_functions(filename)
        if names and code.co_name in names:
            return True
        frame = frame.f_back
        depth -= 1
    return False


def _to_target(mode: AuditMode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool | None:
    device = kwargs.get("device")
    if device is None:
        other = kwargs.get("other")
        if isinstance(other, Tensor):
            return mode.is_dev(other)
        for a in args[1:]:
            if isinstance(a, Tensor):
                return mode.is_dev(a)
            if isinstance(a, (str, torch.device)) or (
                isinstance(a, int) and not isinstance(a, bool)
            ):
                device = a
                break
    return mode.training(device)


def _copy_rule(mode: AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = func(*args, **kwargs)
    verdict: tuple[str, str] | None = None
    try:
        dst = args[0]
        src = args[1] if len(args) > 1 else kwargs.get("src")
        if isinstance(dst, Tensor) and isinstance(src, Tensor):
            ddev, sdev = mode.is_dev(dst), mode.is_dev(src)
            nonblocking = _nonblocking(args[2:], kwargs)
            if ddev and not sdev:
                verdict = mode.h2d(src, nonblocking)
            elif sdev and not ddev:
                if nonblocking:
                    mode.engine.note(NOTE_PINNED_D2H)
                else:
                    verdict = ("copy", "d2h")
    except Exception as exc:
        _fault(exc)
        return out
    if verdict is not None:
        mode.record(*verdict)
    return out


def _tensor_rule(mode: AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.tensor``/``as_tensor``/``Tensor.new_tensor``: host data onto the device."""
    out = func(*args, **kwargs)
    try:
        if func is Tensor.new_tensor:
            target = mode.training(kwargs.get("device"))
            if target is None:
                target = isinstance(args[0], Tensor) and mode.is_dev(args[0])
            data = args[1] if len(args) > 1 else kwargs.get("data")
        else:
            target = mode.training(kwargs.get("device"))
            data = args[0] if args else kwargs.get("data")
        from_device = isinstance(data, Tensor) and mode.is_dev(data)
        if target is None and from_device:
            mode.mark_out(out, True)
        if not target:
            return out
        mode.mark_out(out, True)
    except Exception as exc:
        _fault(exc)
        return out
    # An empty tensor copies nothing: on a GPU, torch.tensor([], device=...)
    # does not wait (a KV cache starts that way in every forward).
    if not from_device and not (isinstance(out, Tensor) and out.numel() == 0):
        mode.record("copy", "h2d")
    return out


def _host_index(index: Any) -> bool:
    """Whether ``index`` holds a Python list or range (or a numpy array) of integers.

    Torch turns such an index into a host tensor and copies it to the indexed
    tensor's device with a blocking copy: ``x[[0, 2]]``, ``x[range(n), y]``.

    Example:
        >>> _host_index([0, 2]), _host_index((range(3), 1)), _host_index((0, 1))
        (True, True, False)
    """
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, range):
            if len(part):
                return True
        elif isinstance(part, list):
            if part and all(isinstance(i, int) for i in part):
                return True
        elif type(part).__name__ == "ndarray" and part.size:
            return True
    return False


def _index_verdict(mode: AuditMode, args: tuple[Any, ...]) -> tuple[str, str] | None:
    index = args[1]
    if any(mode.is_dev(m) for m in _masks(index)):
        return ("index", "")
    if isinstance(args[0], Tensor) and _host_index(index) and mode.is_dev(args[0]):
        return ("index", "list")
    return None


def _getitem_rule(mode: AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = func(*args, **kwargs)
    try:
        mode.propagate(args, kwargs, out)
        verdict = _index_verdict(mode, args) if len(args) > 1 else None
        if verdict == ("index", "") and isinstance(out, Tensor) and out.grad_fn is not None:
            mode.engine.watch_backward(out.grad_fn)
    except Exception as exc:
        _fault(exc)
        return out
    if verdict is not None:
        mode.record(*verdict)
    return out


def _setitem_rule(mode: AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = func(*args, **kwargs)
    verdict: tuple[str, str] | None = None
    try:
        if len(args) >= 3:
            dst, value = args[0], args[2]
            verdict = _index_verdict(mode, args)
            if verdict is not None:
                pass
            elif (
                isinstance(dst, Tensor)
                and isinstance(value, Tensor)
                and mode.is_dev(value)
                and not mode.is_dev(dst)
            ):
                verdict = ("copy", "d2h")
    except Exception as exc:
        _fault(exc)
        return out
    if verdict is not None:
        mode.record(*verdict)
    return out


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

# Kinds for tagged ops by name; tagged ops not listed here are "dynamic_shape".
_TAGGED_KINDS: dict[str, str] = {
    "nonzero": "nonzero",
    "argwhere": "nonzero",
    "masked_select": "masked_select",
    "unique_consecutive": "unique",
    "_unique": "unique",
    "_unique2": "unique",
    "unique_dim": "unique",
    "unique_dim_consecutive": "unique",
    "allclose": "compare",
    "equal": "compare",
}

# Tagged ops whose torch-level entry points have a rule of their own (or read).
_HANDLED = frozenset({"item", "_local_scalar_dense", "repeat_interleave", "one_hot", "index"})


def _functions(name: str) -> list[Any]:
    found = []
    for space in (torch, Tensor, torch.nn.functional):
        fn = getattr(space, name, None)
        if fn is not None:
            found.append(fn)
    if name.startswith("linalg_"):
        fn = getattr(torch.linalg, name[len("linalg_") :], None)
        if fn is not None:
            found.append(fn)
    return found


def build_rules() -> dict[Any, Rule]:
    """The function -> rule table (built when the engine installs, not at import)."""
    rules: dict[Any, Rule] = {}
    for name, kind in _READS.items():
        if name in vars(Tensor) or name in vars(torch._C.TensorBase):
            rules[getattr(Tensor, name)] = _reader(kind)
    for name, tag in tagged_ops().items():
        if name in _HANDLED:
            continue
        kind = _TAGGED_KINDS.get(name, "dynamic_shape")
        which = _all if tag == "data_dependent_output" else _first
        for fn in _functions(name):
            rules[fn] = _dynamic(kind, which)
    for fn in _functions("unique"):
        rules[fn] = _dynamic("unique", _first)
    for fn in _functions("unique_consecutive"):
        rules[fn] = _dynamic("unique", _first)
    for name, kind, which in (
        ("nonzero", "nonzero", _first),
        ("argwhere", "nonzero", _first),
        ("masked_select", "masked_select", _all),
        ("allclose", "compare", _all),
        ("equal", "compare", _all),
    ):
        for fn in _functions(name):
            rules[fn] = _dynamic(kind, which)
    rules[torch.where] = _dynamic("nonzero", _where_one)
    rules[torch.repeat_interleave] = _dynamic("repeat_interleave", _repeats_fn)
    rules[Tensor.repeat_interleave] = _dynamic("repeat_interleave", _repeats_method)
    rules[torch.nn.functional.one_hot] = _dynamic("one_hot", _one_hot)
    for method in ("to", "cpu", "cuda"):
        rules[getattr(Tensor, method)] = _to_rule(method)
    rules[Tensor.copy_] = _copy_rule
    for fn in (torch.tensor, torch.as_tensor, Tensor.new_tensor):
        rules[fn] = _tensor_rule
    rules[Tensor.__getitem__] = _getitem_rule
    rules[Tensor.__setitem__] = _setitem_rule
    return rules


# -- checkpoints and cuDNN RNNs: calls the mode does not see whole ----------------
Record = Callable[[str | None, str], None]


class _Checkpoints:
    """What ``torch.save`` wrote from the device, for ``torch.load`` to read back.

    A GPU run's ``torch.save`` copies every device tensor to the host (one
    blocking copy each); a ``torch.load`` without ``map_location`` puts them
    back where they were saved, onto the device.
    """

    def __init__(self) -> None:
        self.saving = 0
        self.device_tensors = 0
        self.paths: set[str] = set()
        self.buffers: weakref.WeakSet[Any] = weakref.WeakSet()

    def saw_device_tensor(self) -> None:
        self.device_tensors += 1

    def remember(self, f: Any) -> None:
        key = _file_key(f)
        if isinstance(key, str):
            self.paths.add(key)
        elif key is not None:
            with contextlib.suppress(TypeError):
                self.buffers.add(key)

    def holds_device_tensors(self, f: Any) -> bool:
        key = _file_key(f)
        if isinstance(key, str):
            return key in self.paths
        try:
            return key is not None and key in self.buffers
        except TypeError:
            return False


def _file_key(f: Any) -> Any:
    """A file's path, absolute, or the file object itself (a ``BytesIO``)."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fspath(f))
    name = getattr(f, "name", None)
    if isinstance(name, str) and not name.startswith("<"):
        return os.path.abspath(name)
    return f


def _mark_loaded(mode: AuditMode, obj: Any, dev: bool, depth: int = 0) -> bool:
    """Mark every tensor in what ``torch.load`` returned as on the device (``dev``)
    or the host; whether there was one."""
    if depth > 20:
        return False
    if isinstance(obj, Tensor):
        mode.mark(obj, dev)
        return True
    if isinstance(obj, torch.nn.Module):
        found = False
        for t in (*obj.parameters(), *obj.buffers()):
            mode.mark(t, dev)
            found = True
        return found
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        found = False
        for item in obj:
            found = _mark_loaded(mode, item, dev, depth + 1) or found
        return found
    return False


def _load_target(mode: AuditMode, state: _Checkpoints, f: Any, where: Any) -> bool:
    """Whether ``torch.load(f, map_location=where)`` would load onto the device."""
    if where is None:
        return state.holds_device_tensors(f)
    if isinstance(where, dict):
        return any(mode.training(v) for v in where.values())
    if callable(where):
        return False  # a function decides per storage: not known here, stay quiet
    return bool(mode.training(where))


def install_patches(
    patches: Patches,
    mode: AuditMode,
    record: Record,
    aside: Callable[[], AbstractContextManager[None]],
) -> None:
    """Audit ``torch.save`` and ``torch.load``.

    Args:
        patches: Where the patches go (undone when the engine uninstalls).
        mode: The running mode; a rule for ``Tensor.untyped_storage`` is added
            to its table (``torch.save`` reads each tensor's storage once).
        record: Records a sync at the caller's line: ``record(kind, detail)``,
            the kind read from the user's call when ``None``.
        aside: A context in which the mode is off the stack (``torch.load``'s
            own calls say nothing about the GPU run).
    """
    state = _Checkpoints()

    mode.rules[Tensor.untyped_storage] = _reader(
        "copy", "d2h", when=lambda: state.saving > 0, hit=state.saw_device_tensor
    )
    orig_save = torch.save
    orig_load = torch.load

    @functools.wraps(orig_save)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        before = state.device_tensors
        state.saving += 1
        try:
            return orig_save(obj, f, *args, **kwargs)
        finally:
            state.saving -= 1
            if state.device_tensors > before:
                try:
                    state.remember(f)
                except Exception as exc:
                    _fault(exc)

    @functools.wraps(orig_load)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if not mode.active:
            return orig_load(f, *args, **kwargs)
        # torch.load's own calls (device= of the saved location) say nothing
        # about the GPU run: the mode steps aside, and the result is marked.
        with aside():
            out = orig_load(f, *args, **kwargs)
        try:
            where = kwargs.get("map_location", args[0] if args else None)
            dev = _load_target(mode, state, f, where)
            hit = _mark_loaded(mode, out, dev) and dev
        except Exception as exc:
            _fault(exc)
            return out
        if hit:
            record("copy", "h2d")
        return out

    patches.set(torch, "save", save)
    patches.set(torch, "load", load)
