"""The CPU audit engine: which lines would synchronize if the tensors lived on a GPU.

On a machine without a GPU nothing synchronizes, so nothing can be observed;
the audit reasons instead. It follows *provenance*: which tensors would live on
the training device in a GPU run of the same script, and flags the operations
that read such a tensor on the host (``item``, ``bool``, printing, ...), need a
host-side size (mask indexing, ``nonzero``, ``unique``, ...), or copy between
host and device.

Design, chosen for cost (a training step must stay within 1.5x of bare):

* One lean :class:`~torch.overrides.TorchFunctionMode` sees every torch call in
  the thread that started the guard. Most calls take the fast path: run the op,
  and if an input is a device tensor, mark the outputs as device tensors.
  Calls that can synchronize have a rule (a dict lookup by function).
* Marks live in a dict keyed by ``id(tensor)``, each with a weak reference whose
  callback drops the entry when the tensor dies: nothing is stored on the
  tensor, so pickling, ``deepcopy`` and ``torch.save`` see no difference.
* During ``optimizer.step()`` without a closure the mode steps off the stack
  (a pre/post hook pair): optimizers make a hundred small calls per step that
  only update tensors already marked, and that cost dominated small steps.

Which tensors are device tensors (see docs/audit.md):

* results of ``.to(device)``, ``.cuda()`` and ``copy_`` into device tensors,
  of factories called with ``device=`` naming the training device, and of any
  op with a device tensor among its inputs;
* module parameters (also those created before the guard started: a
  ``Parameter`` the audit has not seen created counts as a device tensor);
* tensors handed around inside a backward pass (the autograd engine makes them
  in C++, out of the mode's sight).

A device-agnostic script run on CPU has ``device == "cpu"``: a ``"cpu"`` device
counts as the host only where the call says so literally (``.cpu()``,
``.to("cpu")``, ``device="cpu"``, ``torch.device("cpu")``); a device held in a
variable (``.to(device)``, ``device=x.device``) is the training device.
"""

from __future__ import annotations

import dis
import functools
import linecache
import re
import sys
import threading
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from barrierguard import _hub
from barrierguard._engines._patch import Patches
from barrierguard._engines.cuda import PAGEABLE_BLOCKING_BYTES, _nonblocking
from barrierguard._frames import OWN, TORCH, _classifier, _source_segment, classify_file, locate

__all__ = ["NOTE", "AuditEngine", "tagged_ops"]

NAME = "audit"

NOTE = (
    "audit engine: no GPU here, so no synchronization was observed; a line is reported "
    "when it would synchronize on a GPU with the tensors that would live there (moved with "
    ".to(device)/.cuda(), made with device=, module parameters, and all results computed "
    "from them); tensors made before the guard started, other than parameters, count as "
    "host tensors (docs/audit.md)"
)
NOTE_PINNED_H2D = (
    "audit: a non_blocking host-to-device copy over 2 MiB is reported as blocking, since "
    "host memory here is pageable; if the GPU run pins it (DataLoader(pin_memory=True), "
    "tensor.pin_memory()), that copy does not block"
)
NOTE_PINNED_D2H = (
    "audit: a non_blocking copy_ from a device tensor into a host tensor is assumed to "
    "target pinned memory (no barrier); if that host tensor is pageable on the GPU "
    "machine, the copy blocks"
)
NOTE_SUSPENDED = (
    "audit: an exception inside optimizer.step() left provenance tracking paused until the "
    "next optimizer step; tensors computed in between count as host tensors"
)

_CPU_LITERAL = re.compile(r"""(['"])cpu(:\d+)?\1""")
_MASK_DTYPES = (torch.bool, torch.uint8)

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_current_node = torch._C._current_autograd_node
_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_stack_pop = torch._C._pop_torch_function_stack
_stack_push = torch._C._push_on_torch_function_stack

Rule = Callable[["_AuditMode", Any, tuple[Any, ...], dict[str, Any]], Any]


def _is_param(t: Tensor) -> bool:
    # Parameter's metaclass makes isinstance() a Python call: plain tensors
    # (the hot case) skip it.
    cls = type(t)
    return cls is Parameter or (cls is not Tensor and isinstance(t, Parameter))


def _is_mask(index: Any) -> bool:
    return isinstance(index, Tensor) and index.dtype in _MASK_DTYPES


def _masks(index: Any) -> list[Tensor]:
    if _is_mask(index):
        return [index]
    if isinstance(index, (tuple, list)):
        return [i for i in index if _is_mask(i)]
    return []


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


class _AuditMode(TorchFunctionMode):
    """The mode: propagate provenance on every call, apply a rule where one exists."""

    def __init__(self, engine: AuditEngine, rules: dict[Any, Rule]) -> None:
        super().__init__()
        self.engine = engine
        self.rules = rules
        self.active = True
        self.marks: dict[int, tuple[bool, weakref.ref[Tensor]]] = {}
        self.where_cache: dict[tuple[CodeType, int], bool] = {}

    # -- provenance ----------------------------------------------------------
    def is_dev(self, t: Tensor) -> bool:
        """Whether ``t`` would live on the training device in a GPU run."""
        m = self.marks.get(id(t))
        if m is not None:
            return m[0]
        # Unseen: a real device tensor, a parameter made before the guard, or
        # a tensor the autograd engine made for a backward pass.
        return not t.is_cpu or _is_param(t) or _current_node() is not None

    def mark(self, t: Tensor, dev: bool) -> None:
        key = id(t)
        marks = self.marks
        old = marks.get(key)
        if old is not None:
            if old[0] != dev:
                marks[key] = (dev, old[1])
            return
        pop = marks.pop
        marks[key] = (dev, weakref.ref(t, lambda _r: pop(key, None)))

    def mark_out(self, out: Any, dev: bool) -> None:
        if isinstance(out, Tensor):
            self.mark(out, dev)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, Tensor):
                    self.mark(o, dev)

    def any_dev(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        marks = self.marks
        for a in args:
            if isinstance(a, Tensor):
                m = marks.get(id(a))
                if m[0] if m is not None else self.is_dev(a):
                    return True
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, Tensor) and self.is_dev(b):
                        return True
        if kwargs:
            return self.any_dev(tuple(kwargs.values()), {})
        return False

    def propagate(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if out is None:
            return
        if kwargs and "device" in kwargs:
            self.factory(kwargs, out)
            return
        if self.any_dev(args, kwargs):
            self.mark_out(out, True)

    def factory(self, kwargs: dict[str, Any], out: Any) -> None:
        dev = self.training(kwargs["device"])
        if dev is None:
            return
        if dev:
            self.mark_out(out, True)
        elif isinstance(out, Tensor) and id(out) in self.marks:
            self.mark(out, False)

    def training(self, device: Any) -> bool | None:
        """Whether ``device`` is the training device (None: no device named)."""
        if device is None:
            return None
        if isinstance(device, torch.device):
            typ = device.type
        elif isinstance(device, str):
            typ = device.split(":", 1)[0]
        elif isinstance(device, int) and not isinstance(device, bool):
            return True
        else:
            return None
        if typ != "cpu":
            return True
        return not self.literal_cpu()

    def literal_cpu(self) -> bool:
        """Whether the call that asked for the "cpu" device names it literally."""
        cache = _classifier._cache
        f: FrameType | None = sys._getframe(1)
        while f is not None:
            name = f.f_code.co_filename
            category = (cache.get(name) or classify_file(name))[0]
            if category != OWN and category != TORCH:
                break
            f = f.f_back
        if f is None:
            return False
        key = (f.f_code, f.f_lasti)
        hit = self.where_cache.get(key)
        if hit is None:
            hit = bool(_CPU_LITERAL.search(_call_text(f)))
            self.where_cache[key] = hit
        return hit

    # -- the mode ------------------------------------------------------------
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        try:
            rule = self.rules.get(func)
        except TypeError:  # an unhashable callable: no rule can name it
            rule = None
        if not self.active:
            return func(*args, **kwargs)
        if rule is not None:
            return rule(self, func, args, kwargs)
        out = func(*args, **kwargs)
        try:
            self.propagate(args, kwargs, out)
        except Exception as exc:  # never lose the user's op to our bookkeeping
            _fault(exc)
        return out

    # -- helpers for the rules --------------------------------------------------
    def record(self, kind: str, detail: str = "") -> None:
        try:
            loc = locate(sys._getframe(1), kind, detail)
        except Exception as exc:
            _fault(exc)
            return
        if loc is not None:
            _hub.emit(NAME, loc)

    def h2d(self, src: Tensor, nonblocking: bool) -> tuple[str, str] | None:
        if not nonblocking:
            return ("copy", "h2d")
        if src.nbytes > PAGEABLE_BLOCKING_BYTES and not src.is_pinned():
            self.engine.note(NOTE_PINNED_H2D)
            return ("copy", "h2d pageable non_blocking")
        return None

    def moved(self, src: Tensor, out: Any, target: bool | None, nonblocking: bool) -> Any:
        """Judge a ``.to()``/``.cpu()``/``.cuda()`` and return the (maybe retargeted) result."""
        sdev = self.is_dev(src)
        tdev = sdev if target is None else target
        verdict: tuple[str, str] | None = None
        if tdev and not sdev:
            verdict = self.h2d(src, nonblocking)
        elif sdev and not tdev:
            verdict = ("async_d2h", "non_blocking") if nonblocking else ("copy", "d2h")
        if isinstance(out, Tensor):
            if out is src and sdev != tdev:
                out = self.retarget(src, tdev)
            elif out is not src and tdev:
                self.mark(out, True)
        if verdict is not None:
            self.record(*verdict)
        return out

    def retarget(self, src: Tensor, dev: bool) -> Tensor:
        """A move that is a no-op on CPU: give the caller a tensor of its own.

        On a GPU, ``x.cpu()`` is a new host tensor while ``x`` stays on the
        device; on CPU it is ``x`` itself. An alias (a view of all of ``x``)
        keeps both verdicts apart without copying. A parameter, or a leaf that
        requires grad, keeps its identity (``module.to()`` and optimizers rely
        on it) and changes sides instead.
        """
        if _is_param(src) or (src.requires_grad and src.is_leaf):
            self.mark(src, dev)
            return src
        try:
            alias = src.view_as(src)
        except Exception:  # layouts without views (sparse, nested): change sides
            self.mark(src, dev)
            return src
        self.mark(alias, dev)
        return alias


def _call_text(frame: FrameType) -> str:
    code, lasti = frame.f_code, frame.f_lasti
    raw = code.co_code
    try:
        while lasti >= 2 and dis.opname[raw[lasti]] == "CACHE":
            lasti -= 2
    except IndexError:
        pass
    text = _source_segment(code, lasti)
    if text is None:
        text = linecache.getline(code.co_filename, frame.f_lineno)
    return text


def _fault(exc: BaseException) -> None:
    for guard in _hub.running_guards():
        if guard._engine_name == NAME:
            guard._fault(exc)


# -- the rules: one function per kind of call -------------------------------------
def _reader(kind: str) -> Rule:
    def rule(mode: _AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        try:
            hit = bool(args) and isinstance(args[0], Tensor) and mode.is_dev(args[0])
        except Exception as exc:
            _fault(exc)
            return out
        if hit:
            mode.record(kind)
        return out

    return rule


def _dynamic(kind: str, which: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Rule:
    """A rule for an op that syncs when ``which(args, kwargs)`` is a device tensor."""

    def rule(mode: _AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
    def rule(mode: _AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
            nonblocking = _nonblocking(args[1:], kwargs)
        except Exception as exc:
            _fault(exc)
            return out
        return mode.moved(src, out, target, nonblocking)

    return rule


def _to_target(mode: _AuditMode, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool | None:
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


def _copy_rule(mode: _AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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


def _tensor_rule(mode: _AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
    if not from_device:
        mode.record("copy", "h2d")
    return out


def _getitem_rule(
    mode: _AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    out = func(*args, **kwargs)
    try:
        mode.propagate(args, kwargs, out)
        hit = any(mode.is_dev(m) for m in _masks(args[1])) if len(args) > 1 else False
        if hit and isinstance(out, Tensor) and out.grad_fn is not None:
            mode.engine.watch_backward(out.grad_fn)
    except Exception as exc:
        _fault(exc)
        return out
    if hit:
        mode.record("index")
    return out


def _setitem_rule(
    mode: _AuditMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    out = func(*args, **kwargs)
    verdict: tuple[str, str] | None = None
    try:
        if len(args) >= 3:
            dst, index, value = args[0], args[1], args[2]
            if any(mode.is_dev(m) for m in _masks(index)):
                verdict = ("index", "")
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


class AuditEngine:
    """The audit: a lean function mode plus a few patches; see the module docstring."""

    name = NAME

    def __init__(self) -> None:
        self._patches = Patches()
        self._mode: _AuditMode | None = None
        self._hooks: list[Any] = []
        self._thread = 0
        self._suspended = False
        self._depth = 0

    # -- install / uninstall --------------------------------------------------
    def install(self) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._thread = threading.get_ident()
        self._suspended = False
        try:
            mode = _AuditMode(self, build_rules())
            self._patch_calls(mode)
            self._hooks.append(register_optimizer_step_pre_hook(self._pause))
            self._hooks.append(register_optimizer_step_post_hook(self._resume))
            self._mode = mode
            _stack_push(mode)
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.active = False
                # The stack is per thread: stopped from another thread, the
                # mode stays on the starting thread's stack, inert.
                if threading.get_ident() == self._thread and not self._suspended:
                    _remove_from_stack(mode)
                mode.marks.clear()
        finally:
            while self._hooks:
                self._hooks.pop().remove()
            self._patches.undo()
            self._suspended = False

    # -- notes to the running guards ------------------------------------------------
    def note(self, text: str) -> None:
        for guard in _hub.running_guards():
            if guard._engine_name == NAME and text not in guard._notes:
                with guard._lock:
                    guard._notes.append(text)

    # -- optimizer steps: the mode steps aside ------------------------------------
    def _pause(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A closure runs forward and backward inside step(): keep watching then.
        if len(args) > 1 or kwargs.get("closure") is not None:
            return
        mode = self._mode
        if mode is None or threading.get_ident() != self._thread:
            return
        if self._suspended:
            # The last step raised before its post hook: resume at this one's.
            self.note(NOTE_SUSPENDED)
            return
        n = _stack_len()
        if n and _stack_at(n - 1) is mode:
            _stack_pop()
            self._suspended = True
            self._depth = n - 1

    def _resume(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mode = self._mode
        if mode is None or not self._suspended or threading.get_ident() != self._thread:
            return
        if _stack_len() == self._depth:
            _stack_push(mode)
            self._suspended = False

    def paused(self) -> bool:
        """Whether the mode is off the stack for an optimizer step."""
        return self._suspended

    # -- backward passes -----------------------------------------------------------
    def watch_backward(self, node: Any) -> None:
        """Report the backward of ``node`` (mask indexing's backward needs a size)."""
        record = self._record

        def prehook(grad_outputs: Any) -> None:
            record("backward", "")

        node.register_prehook(prehook)

    def _record(self, kind: str, detail: str) -> None:
        mode = self._mode
        if mode is None or not mode.active:
            return
        try:
            loc = locate(sys._getframe(1), kind, detail)
        except Exception as exc:
            _fault(exc)
            return
        if loc is not None:
            _hub.emit(NAME, loc)

    # -- patches: what the mode cannot see --------------------------------------------
    def _patch_calls(self, mode: _AuditMode) -> None:
        record = self._record
        cuda_available = torch.cuda.is_available

        def synchronize_wrapper(orig: Callable[..., Any], detail: str) -> Callable[..., Any]:
            # On a CPU-only build the real call raises: the audit records it and
            # returns, so device-agnostic scripts that time with it still run.
            @functools.wraps(orig)
            def synchronize(*args: Any, **kwargs: Any) -> Any:
                out = orig(*args, **kwargs) if cuda_available() else None
                record("synchronize", detail)
                return out

            return synchronize

        self._patches.set(
            torch.cuda, "synchronize", synchronize_wrapper(torch.cuda.synchronize, "device")
        )
        accel = getattr(torch, "accelerator", None)
        if accel is not None and hasattr(accel, "synchronize"):
            self._patches.set(
                accel, "synchronize", synchronize_wrapper(accel.synchronize, "device")
            )

        # A Parameter the audit sees being made takes its data's side; one it
        # never saw made (the model was built before the guard) counts as device.
        orig_new = Parameter.__dict__["__new__"].__func__

        @functools.wraps(orig_new)
        def parameter_new(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
            param = orig_new(cls, data, requires_grad)
            try:
                if mode.active and isinstance(param, Tensor):
                    dev = isinstance(data, Tensor) and mode.is_dev(data)
                    mode.mark(param, dev)
            except Exception as exc:
                _fault(exc)
            return param

        self._patches.set(Parameter, "__new__", staticmethod(parameter_new))

        # backward() is itself a torch function: the autograd engine runs
        # while the mode is off the stack. A custom Function's Python backward
        # gets the mode back, so what it computes and reads is audited.
        from torch.autograd.function import BackwardCFunction

        orig_apply: Callable[..., Any] = BackwardCFunction.apply
        thread = self._thread

        @functools.wraps(orig_apply)
        def apply(node: Any, *args: Any) -> Any:
            if not mode.active or threading.get_ident() != thread or _on_stack(mode):
                return orig_apply(node, *args)
            _stack_push(mode)
            try:
                return orig_apply(node, *args)
            finally:
                _remove_from_stack(mode)

        self._patches.set(BackwardCFunction, "apply", apply)

        # zero_grad() only drops or zeroes gradients: a dozen attribute calls
        # per step that the mode need not see (a gradient read later is
        # marked through its parameter).
        orig_zero = torch.optim.Optimizer.zero_grad

        @functools.wraps(orig_zero)
        def zero_grad(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            n = _stack_len()
            if n == 0 or _stack_at(n - 1) is not mode or threading.get_ident() != thread:
                return orig_zero(optimizer, *args, **kwargs)
            _stack_pop()
            try:
                return orig_zero(optimizer, *args, **kwargs)
            finally:
                _stack_push(mode)

        self._patches.set(torch.optim.Optimizer, "zero_grad", zero_grad)


def _on_stack(mode: TorchFunctionMode) -> bool:
    return any(_stack_at(i) is mode for i in range(_stack_len()))


def _remove_from_stack(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's function-mode stack, wherever it sits."""
    above: list[Any] = []
    try:
        while _stack_len():
            top = _stack_pop()
            if top is mode:
                break
            above.append(top)
    finally:
        for m in reversed(above):
            _stack_push(m)
