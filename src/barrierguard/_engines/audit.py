"""The audit engine: on a CPU, tell which lines would synchronize on a GPU.

A CPU run of a device-agnostic script has every tensor on the CPU. The audit
follows which of them would live on the training device in a GPU run (their
*provenance*) and records each operation that would make the host wait for such
a tensor: ``item``, ``bool``, a device-to-host copy, a data-dependent shape.

Provenance (see docs/audit.md):

* device tensors: tensors moved to the training device (``.to(device)``,
  ``.cuda()``, ``copy_`` into a device tensor), factory results with an
  explicit ``device=`` that names the training device, ``nn.Parameter`` s (unless
  moved to the host), gradients handed to a custom ``backward``, and every
  tensor an operation computes from a device tensor;
* host tensors: everything else - the data pipeline, numpy, bookkeeping like
  ``torch.zeros(n)`` filled with Python numbers.

On a CPU the training device *is* ``"cpu"``, so a device argument is read at
the call site: a literal ``"cpu"`` (``.cpu()``, ``.to("cpu")``,
``torch.device("cpu")``) names the host, anything else (``.to(device)``) the
training device.

One lean ``TorchFunctionMode`` sees the calls; it is pushed on the guard's
thread only, and popped for the inside of ``optimizer.step()`` (the dominant
cost in a small step), whose syncs the audit therefore does not see.
"""

from __future__ import annotations

import ast
import functools
import linecache
import sys
import threading
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from barrierguard import _env, _hub
from barrierguard._engines._patch import Patches
from barrierguard._engines.cuda import PAGEABLE_BLOCKING_BYTES
from barrierguard._frames import OWN, USER, _classifier, classify_file, locate

__all__ = ["AuditEngine", "Provenance"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

# Notes the report carries when the audit had to assume something.
NOTE_PINNED_D2H = (
    "audit: {n} non_blocking device-to-host copy_ call(s) into host tensors were assumed to "
    "target pinned memory (no barrier); into pageable memory they would block"
)
NOTE_PAGEABLE_H2D = (
    "audit: {n} non_blocking host-to-device copies over {mib} MiB were counted as blocking "
    "(kind copy), as their source is pageable here; from pinned memory "
    "(DataLoader(pin_memory=True), tensor.pin_memory()) they would not block"
)
NOTE_SMALL_H2D = (
    "audit: {n} non_blocking host-to-device copies of {mib} MiB or less were counted as "
    "asynchronous, as the driver stages small pageable copies"
)


class Provenance:
    """Which tensors would live on the training device: an id-keyed weak table.

    Entries hold a weak reference and are checked on lookup (``ref() is t``),
    so an id reused by a new tensor never inherits a stale verdict; dead
    entries are purged when the table has doubled since the last purge.
    """

    def __init__(self) -> None:
        self.table: dict[int, tuple[weakref.ReferenceType[Any], bool]] = {}
        self._purge_at = 1024

    def get(self, t: Any) -> bool | None:
        e = self.table.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        return None

    def set(self, t: Any, device: bool) -> None:
        table = self.table
        table[id(t)] = (weakref.ref(t), device)
        if len(table) > self._purge_at:
            self.purge()

    def purge(self) -> None:
        self.table = {k: e for k, e in self.table.items() if e[0]() is not None}
        self._purge_at = max(1024, 2 * len(self.table))

    def clear(self) -> None:
        self.table = {}
        self._purge_at = 1024


_HOST_NAMES = frozenset({"cpu"})
_intent_cache: dict[tuple[CodeType, int], bool] = {}


def _is_cpu_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":", 1)[0] in _HOST_NAMES
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name == "device" and _is_cpu_literal(node.args[0])
    return False


def _host_call(node: ast.AST) -> bool:
    """Whether a call names the host: ``x.cpu()``, or a literal cpu device argument."""
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Call):
            continue
        func = sub.func
        if isinstance(func, ast.Attribute) and func.attr == "cpu":
            return True
        args = list(sub.args) + [k.value for k in sub.keywords if k.arg in ("device", None)]
        if any(_is_cpu_literal(a) for a in args):
            return True
    return False


def _segment(code: CodeType, lasti: int, lineno: int) -> str:
    from barrierguard._frames import _source_segment

    seg = _source_segment(code, lasti)
    if seg is not None:
        return seg
    return linecache.getline(code.co_filename, lineno).strip().rstrip(":")


def _names_host(frame: FrameType) -> bool:
    """Whether the call ``frame`` is executing names the host device literally."""
    code, lasti = frame.f_code, frame.f_lasti
    key = (code, lasti)
    hit = _intent_cache.get(key)
    if hit is not None:
        return hit
    text = _segment(code, lasti, frame.f_lineno)
    try:
        tree: ast.AST = ast.parse("(" + text + "\n)", mode="eval")
    except SyntaxError:
        try:
            tree = ast.parse(text, mode="exec")
        except SyntaxError:
            tree = ast.Module(body=[], type_ignores=[])
    result = _host_call(tree)
    if len(_intent_cache) < 100_000:
        _intent_cache[key] = result
    return result


def _call_site() -> FrameType | None:
    """The user's frame of the current call (the innermost frame outside torch)."""
    cache = _classifier._cache
    f: FrameType | None = sys._getframe(2)
    innermost: FrameType | None = None
    while f is not None:
        filename = f.f_code.co_filename
        category = (cache.get(filename) or classify_file(filename))[0]
        if category != OWN:
            if category == USER:
                return f
            if innermost is None:
                innermost = f
        f = f.f_back
    return innermost


def _device_type(device: Any) -> str | None:
    if type(device) is torch.device:
        return device.type
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return device.split(":", 1)[0]
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"
    return None


def _nonblocking(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    flag = kwargs.get("non_blocking")
    if flag is not None:
        return bool(flag)
    return any(a is True for a in args)


def _has_bool_index(index: Any) -> bool:
    if isinstance(index, _Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, tuple):
        return any(isinstance(i, _Tensor) and i.dtype in (torch.bool, torch.uint8) for i in index)
    return False


class _AuditMode(TorchFunctionMode):
    """The lean mode: a dict lookup for the few special calls, propagation otherwise."""

    def __init__(self, engine: AuditEngine) -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        engine = self.engine
        special = engine.special.get(func)
        if special is not None:
            return special(func, args, kwargs or {})
        if kwargs:
            out = func(*args, **kwargs)
            device = kwargs.get("device")
            if device is not None:
                if engine.training(device):
                    engine.mark(out, True)
                return out
            values = kwargs.values()
            if any(out is a for a in args) or any(out is v for v in values):
                return out  # in place (nn.init.uniform_(tensor=w)): stays where it was
            if engine.any_device(args) or engine.any_device(values):
                engine.mark(out, True)
            return out
        out = func(*args)
        if not args or out is args[0]:
            # A factory without a device makes host tensors; an in-place op
            # keeps its tensor where it was (and a parameter unseen until
            # model.to(device) moves it).
            return out
        if not isinstance(out, _Tensor):
            if isinstance(out, (tuple, list)) and engine.any_device(args):
                engine.mark(out, True)
            return out
        # The hot path, inlined: is any tensor argument a device tensor?
        table = engine.prov.table
        for a in args:
            if isinstance(a, _Tensor):
                e = table.get(id(a))
                if e is not None and e[0]() is a:
                    if not e[1]:
                        continue
                elif not (issubclass(type(a), _Parameter) or engine.cuda_tensor(a)):
                    continue
                engine.prov.set(out, True)
                return out
            elif isinstance(a, (list, tuple)) and engine.any_device(a):
                engine.prov.set(out, True)
                return out
        return out


class AuditEngine:
    """Predicts a GPU run's synchronizations from a CPU run; see the module docstring."""

    name = "audit"

    def __init__(self) -> None:
        self.prov = Provenance()
        self._patches = Patches()
        self._mode: _AuditMode | None = None
        self._hooks: list[Any] = []
        self._thread: int | None = None
        self._suspended = False
        self._cuda = False
        self._last_host: tuple[int, CodeType, int] | None = None
        self._mask_grad = False
        self.counts: dict[str, int] = {}
        self.special: dict[Any, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {}
        self._tags: dict[Any, bool] = {}

    # -- provenance ---------------------------------------------------------
    def is_device(self, t: Any) -> bool:
        known = self.prov.get(t)
        if known is not None:
            return known
        # Not isinstance: Parameter's metaclass makes that a Python-level check.
        if issubclass(type(t), _Parameter):
            return True
        return self._cuda and t.device.type != "cpu"

    def cuda_tensor(self, t: Any) -> bool:
        return self._cuda and t.device.type != "cpu"

    def any_device(self, values: Any) -> bool:
        for a in values:
            if isinstance(a, _Tensor):
                if self.is_device(a):
                    return True
            elif isinstance(a, (list, tuple)) and a and isinstance(a[0], _Tensor):
                for b in a:
                    if isinstance(b, _Tensor) and self.is_device(b):
                        return True
        return False

    def mark(self, out: Any, device: bool) -> None:
        if isinstance(out, _Tensor):
            self.prov.set(out, device)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, _Tensor):
                    self.prov.set(o, device)

    def training(self, device: Any) -> bool:
        """Whether an explicit device argument names the training device."""
        kind = _device_type(device)
        if kind is None:
            return False
        if kind != "cpu":
            return True
        frame = _call_site()
        return frame is None or not _names_host(frame)

    def _read(self, t: Any) -> bool:
        """Whether reading ``t`` on the host would wait for the device."""
        if not self.is_device(t):
            return False
        last = self._last_host
        if last is not None and last[0] == id(t):
            # x.cpu().numpy(): on a CPU .cpu() returns x itself; the copy was
            # already recorded on this line, the numpy() reads host memory.
            frame = _call_site()
            if frame is not None and (frame.f_code, frame.f_lineno) == last[1:]:
                return False
        return True

    # -- recording ------------------------------------------------------------
    def record(self, kind: str, detail: str = "") -> None:
        try:
            loc = locate(sys._getframe(1), kind, detail)
        except Exception as exc:  # a fault of ours is reported, never raised
            for guard in _hub.running_guards():
                guard._fault(exc)
            return
        if loc is not None:
            _hub.emit(self.name, loc)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def notes(self) -> list[str]:
        mib = PAGEABLE_BLOCKING_BYTES // (1024 * 1024)
        out = []
        for key, text in (
            ("pinned_d2h", NOTE_PINNED_D2H),
            ("pageable_h2d", NOTE_PAGEABLE_H2D),
            ("small_h2d", NOTE_SMALL_H2D),
        ):
            n = self.counts.get(key, 0)
            if n:
                out.append(text.format(n=n, mib=mib))
        return out

    # -- the special calls -----------------------------------------------------
    def _build_special(self) -> None:
        T = torch.Tensor
        s = self.special
        fn: Any  # torch's functions and methods, each with its own stub type

        def reader(kind: str) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]:
            def handle(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                out = func(*args, **kwargs)
                if args and isinstance(args[0], _Tensor) and self._read(args[0]):
                    self.record(kind)
                return out

            return handle

        def any_reader(kind: str, when: Callable[..., bool] | None = None) -> Any:
            def handle(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                out = func(*args, **kwargs)
                device = self.any_device(args) or self.any_device(kwargs.values())
                if device:
                    self.mark(out, True)
                    if when is None or when(args, kwargs):
                        self.record(kind)
                return out

            return handle

        for name, kind in (
            ("item", "item"),
            ("tolist", "tolist"),
            ("numpy", "numpy"),
            ("__array__", "numpy"),
            ("__bool__", "bool"),
            ("__contains__", "bool"),
            ("__int__", "int"),
            ("__index__", "int"),
            ("__float__", "float"),
            ("__complex__", "complex"),
            ("__repr__", "print"),
            ("__format__", "format"),
        ):
            if name in dir(T):
                s[getattr(T, name)] = reader(kind)
        s[torch.is_nonzero] = reader("bool")
        for fn in (torch.nonzero, T.nonzero, torch.argwhere, T.argwhere):
            s[fn] = any_reader("nonzero")
        s[torch.where] = any_reader("nonzero", lambda a, k: len(a) + len(k) == 1)
        for fn in (torch.masked_select, T.masked_select):
            s[fn] = any_reader("masked_select")
        for fn in (torch.unique, T.unique, torch.unique_consecutive, T.unique_consecutive):
            s[fn] = any_reader("unique")

        def repeat_sync(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
            if k.get("output_size") is not None:
                return False
            reps = k.get("repeats", a[1] if len(a) > 1 else a[0] if a else None)
            return isinstance(reps, _Tensor)

        for fn in (torch.repeat_interleave, T.repeat_interleave):
            s[fn] = any_reader("repeat_interleave", repeat_sync)

        def one_hot_sync(a: tuple[Any, ...], k: dict[str, Any]) -> bool:
            n = k.get("num_classes", a[1] if len(a) > 1 else -1)
            return n is None or n == -1

        s[F.one_hot] = any_reader("one_hot", one_hot_sync)
        for fn in (torch.allclose, T.allclose, torch.equal, T.equal):
            s[fn] = any_reader("compare")
        for fn in (torch.bincount, T.bincount):
            s[fn] = any_reader("dynamic_shape")
        s[T.__getitem__] = self._getitem
        s[T.__setitem__] = self._setitem
        s[T.to] = self._to
        s[T.cpu] = self._cpu
        s[T.cuda] = self._cuda_call
        s[T.copy_] = self._copy
        s[T.backward] = self._backward
        s[torch.autograd.backward] = self._backward
        s[torch.tensor] = self._factory_copy
        s[torch.as_tensor] = self._factory_copy

    def _getitem(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if self.any_device(args):
            self.mark(out, True)
            if len(args) > 1 and _has_bool_index(args[1]):
                self.record("index")
                if args[0].requires_grad and torch.is_grad_enabled():
                    # Its gradient scatters through the mask: on a GPU the
                    # backward pass waits for the index count as well.
                    self._mask_grad = True
        return out

    def _setitem(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if len(args) < 3:
            return out
        target, index, value = args[0], args[1], args[2]
        if self.is_device(target):
            if _has_bool_index(index) and self.any_device((index,)):
                self.record("index")
        elif isinstance(value, _Tensor) and self.is_device(value):
            self.record("copy", "d2h")
        return out

    def _backward(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        pending, self._mask_grad = self._mask_grad, False
        out = func(*args, **kwargs)
        if pending and self.any_device(args[:1]):
            self.record("backward")
        return out

    def _factory_copy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if device is not None and self.training(device):
            src_device = bool(args) and isinstance(args[0], _Tensor) and self.is_device(args[0])
            self.mark(out, True)
            if not src_device:
                self.record("copy", "h2d")
        elif args and isinstance(args[0], _Tensor) and self.is_device(args[0]):
            # torch.tensor(device_tensor) without a device copies on the device.
            self.mark(out, True)
        return out

    def _move(self, src: Any, out: Any, to_device: bool, nonblocking: bool) -> Any:
        """Record a move of ``src`` to the device or to the host; return the result.

        On a CPU the move returns ``src`` itself. The result then becomes a new
        view of it (same memory, same values, as a GPU run also returns a new
        tensor), so that the device copy and the host original keep their own
        provenance. Parameters and tensors that require grad stay themselves:
        a view of a leaf would not be a leaf.
        """
        src_device = self.is_device(src)
        if to_device:
            if not src_device or (issubclass(type(src), _Parameter) and self.prov.get(src) is None):
                # Host data, or a parameter the audit has not seen moved yet:
                # model.to(device) copies it from where it was built.
                self._h2d(src, nonblocking)
                if out is src and not src_device:
                    out = _new_view(src)
            self.mark(out, True)
            return out
        if not src_device:
            if out is not src:
                self.mark(out, False)
            return out
        if nonblocking:
            self.record("async_d2h", "non_blocking")
        else:
            self.record("copy", "d2h")
        if out is src:
            if issubclass(type(src), _Parameter):
                self.prov.set(src, False)  # module.to("cpu"): it lives on the host now
                return out
            out = _new_view(src)
            if out is src:
                frame = _call_site()
                if frame is not None:
                    self._last_host = (id(out), frame.f_code, frame.f_lineno)
                return out
        self.mark(out, False)
        return out

    def _h2d(self, src: Any, nonblocking: bool) -> None:
        if not nonblocking:
            self.record("copy", "h2d")
        elif src.nbytes > PAGEABLE_BLOCKING_BYTES and not src.is_pinned():
            self.count("pageable_h2d")
            self.record("copy", "h2d pageable non_blocking")
        else:
            self.count("small_h2d")

    def _to(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        src = args[0]
        rest = args[1:]
        device = kwargs.get("device")
        other = None
        if device is None:
            for a in rest:
                if isinstance(a, _Tensor):
                    other = a
                    break
                if isinstance(a, (str, torch.device)) or (
                    isinstance(a, int) and not isinstance(a, bool)
                ):
                    device = a
                    break
        nb = _nonblocking(rest, kwargs)
        if other is not None:
            return self._move(src, out, self.is_device(other), nb)
        if device is not None:
            return self._move(src, out, self.training(device), nb)
        if out is not src and self.is_device(src):
            self.mark(out, True)  # a dtype conversion stays where it is
        return out

    def _cpu(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._move(args[0], func(*args, **kwargs), False, False)

    def _cuda_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._move(args[0], func(*args, **kwargs), True, _nonblocking(args[1:], kwargs))

    def _copy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dst = args[0]
        src = args[1] if len(args) > 1 else kwargs.get("src")
        dst_device = self.is_device(dst)
        out = func(*args, **kwargs)
        if not isinstance(src, _Tensor):
            return out
        src_device = self.is_device(src)
        nb = _nonblocking(args[2:], kwargs)
        if dst_device and not src_device:
            self._h2d(src, nb)
        elif src_device and not dst_device:
            if nb:
                self.count("pinned_d2h")
            else:
                self.record("copy", "d2h")
        return out

    # -- install / uninstall ------------------------------------------------------
    def install(self) -> None:
        self._cuda = _env.cuda_available()
        self._thread = threading.get_ident()
        self.counts = {}
        try:
            if not self.special:
                self._build_special()
            self._patch()
            self._mode = _AuditMode(self)
            torch._C._push_on_torch_function_stack(self._mode)
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self._hooks.append(register_optimizer_step_pre_hook(self._suspend))
            self._hooks.append(register_optimizer_step_post_hook(self._resume))
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        try:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            if self._mode is not None and not self._suspended:
                _remove_mode(self._mode)
        finally:
            self._mode = None
            self._suspended = False
            self._patches.undo()
            self.prov.clear()
            self._last_host = None
            self._mask_grad = False

    def _suspend(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # The optimizer's own ops are most of a small step's calls; they make
        # no new tensor the loop reads, so the mode steps aside for them.
        if threading.get_ident() != self._thread or self._suspended:
            return
        self._suspended = self._pop_if_on_top()

    def _pop_if_on_top(self) -> bool:
        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is self._mode:
            torch._C._pop_torch_function_stack()
            return True
        return False

    def _resume(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._suspended and threading.get_ident() == self._thread and self._mode is not None:
            torch._C._push_on_torch_function_stack(self._mode)
            self._suspended = False

    def _patch(self) -> None:
        record = self.record
        cuda_ok = self._cuda

        def sync_wrapper(orig: Callable[..., Any], available: bool) -> Callable[..., Any]:
            @functools.wraps(orig)
            def synchronize(*args: Any, **kwargs: Any) -> Any:
                # Without a device there is nothing to wait for: record the
                # call a device-agnostic script makes, and return.
                out = orig(*args, **kwargs) if available else None
                record("synchronize", "device")
                return out

            return synchronize

        self._patches.set(torch.cuda, "synchronize", sync_wrapper(torch.cuda.synchronize, cuda_ok))
        accel = getattr(torch, "accelerator", None)
        if accel is not None and hasattr(accel, "synchronize"):
            has_accel = bool(getattr(accel, "is_available", lambda: cuda_ok)())
            self._patches.set(accel, "synchronize", sync_wrapper(accel.synchronize, has_accel))
        from torch.autograd.function import BackwardCFunction

        orig_apply: Callable[..., Any] = BackwardCFunction.apply
        prov = self.prov
        engine = self

        @functools.wraps(orig_apply)
        def apply(ctx: Any, *grads: Any) -> Any:
            # A custom backward runs on the device's gradients in a GPU run.
            for g in grads:
                if isinstance(g, _Tensor):
                    prov.set(g, True)
            # backward() runs inside the mode's own handler, where the mode is
            # popped: it watches the custom backward's Python code again.
            mode = engine._mode
            if mode is None or engine._suspended or _on_stack(mode):
                return orig_apply(ctx, *grads)
            torch._C._push_on_torch_function_stack(mode)
            try:
                return orig_apply(ctx, *grads)
            finally:
                _remove_mode(mode)

        self._patches.set(BackwardCFunction, "apply", apply)

        orig_zero_grad = torch.optim.Optimizer.zero_grad

        @functools.wraps(orig_zero_grad)
        def zero_grad(opt: Any, *args: Any, **kwargs: Any) -> Any:
            # Only drops or zeroes gradients: nothing the audit needs to see.
            suspended = engine._pop_if_on_top()
            try:
                return orig_zero_grad(opt, *args, **kwargs)
            finally:
                if suspended and engine._mode is not None:
                    torch._C._push_on_torch_function_stack(engine._mode)

        self._patches.set(torch.optim.Optimizer, "zero_grad", zero_grad)


def _new_view(t: Any) -> Any:
    """A new tensor object on the same memory, or ``t`` where that is not safe."""
    if t.requires_grad or issubclass(type(t), _Parameter) or t.layout != torch.strided:
        return t
    try:
        return t.view_as(t)
    except RuntimeError:
        return t


def _on_stack(mode: Any) -> bool:
    stack = torch._C._get_function_stack_at
    return any(stack(i) is mode for i in range(torch._C._len_torch_function_stack()))


def _remove_mode(mode: Any) -> None:
    """Pop ``mode`` from this thread's stack, keeping any mode pushed above it."""
    above: list[Any] = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    # Not found (stopped from another thread): everything goes back as it was.
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
