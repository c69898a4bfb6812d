"""Provenance for the audit: which tensors would live on the training device (docs/audit.md).

:class:`AuditMode`, the audit's function mode, marks the outputs of ops on device tensors
and hands calls that can synchronize to their rule in ``audit_rules``.
"""

from __future__ import annotations

import contextlib
import linecache
import re
import sys
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from barrierguard.detect import hub
from barrierguard.detect.compile_logs import not_a_dynamo_frame
from barrierguard.detect.cuda import PAGEABLE_BLOCKING_BYTES
from barrierguard.detect.frames import (
    OWN,
    TORCH,
    _classifier,
    _instruction,
    _source_segment,
    classify_file,
)
from barrierguard.detect.stack import observe

__all__ = ["NAME", "AuditMode", "Rule", "sync_frame"]

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

Tensor = torch.Tensor
Parameter = torch.nn.Parameter
_current_node = torch._C._current_autograd_node

Rule = Callable[["AuditMode", Any, tuple[Any, ...], dict[str, Any]], Any]

# Dynamo runs the mode's Python while it traces: the mode steps aside (its stack walks
# would break the graph) and sees the calls when the compiled code runs.
_compiling = torch.compiler.is_compiling


def _is_param(t: Tensor) -> bool:
    # Parameter's metaclass makes isinstance() a Python call: plain tensors skip it.
    cls = type(t)
    return cls is Parameter or (cls is not Tensor and isinstance(t, Parameter))


class _Mark(weakref.ref):  # type: ignore[type-arg]
    """A tensor's side, and the weak reference whose callback forgets it (one object:
    every op on device tensors makes one)."""

    __slots__ = ("dev", "key")

    dev: bool
    key: int


_NO_KWARGS: dict[str, Any] = {}


class AuditMode(TorchFunctionMode):
    """The mode: propagate provenance on every call, apply a rule where one exists."""

    def __init__(self, rules: dict[Any, Rule]) -> None:
        super().__init__()
        not_a_dynamo_frame(type(self).__torch_function__.__code__)
        self.rules = rules
        self.active = True
        self.marks: dict[int, _Mark] = {}
        self.where_cache: dict[tuple[int, int], tuple[CodeType, bool]] = {}
        pop = self.marks.pop
        self._forget = lambda ref: pop(ref.key, None)

    def is_dev(self, t: Tensor) -> bool:
        """Whether ``t`` would live on the training device in a GPU run."""
        m = self.marks.get(id(t))
        if m is not None:
            return m.dev
        # Unseen: a real device tensor, a parameter made before the guard, or a
        # tensor the autograd engine made for a backward pass.
        return not t.is_cpu or _is_param(t) or _current_node() is not None

    def mark(self, t: Tensor, dev: bool) -> None:
        key = id(t)
        m = self.marks.get(key)
        if m is None:
            m = self.marks[key] = _Mark(t, self._forget)
            m.key = key
        m.dev = dev

    def mark_out(self, out: Any, dev: bool) -> None:
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, Tensor):
                self.mark(o, dev)

    def any_dev(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        get = self.marks.get
        for a in args:
            if isinstance(a, Tensor):
                m = get(id(a))
                if m.dev if m is not None else self.is_dev(a):
                    return True
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, Tensor) and self.is_dev(b):
                        return True
        if kwargs:
            return self.any_dev(tuple(kwargs.values()), _NO_KWARGS)
        return False

    def propagate(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Mark ``out`` as a device tensor if an input is one, or ``device=`` says so."""
        if out is None:
            return
        if not kwargs or "device" not in kwargs:
            if self.any_dev(args, kwargs):
                self.mark_out(out, True)
            return
        dev = self.training(kwargs["device"])
        if dev:
            self.mark_out(out, True)
        elif dev is not None and isinstance(out, Tensor) and id(out) in self.marks:
            self.mark(out, False)

    def training(self, device: Any) -> bool | None:
        """Whether ``device`` is the training device (None: no device named)."""
        if isinstance(device, torch.device):
            typ = device.type
        elif isinstance(device, str):
            typ = device.split(":", 1)[0]
        else:
            return True if isinstance(device, int) and not isinstance(device, bool) else None
        return typ != "cpu" or not self.literal_cpu()

    def literal_cpu(self) -> bool:
        """Whether the call that asked for the "cpu" device names it literally."""
        cache = _classifier._cache
        f: FrameType | None = sys._getframe(1)
        first = True
        while f is not None:
            name = f.f_code.co_filename
            category = (cache.get(name) or classify_file(name))[0]
            if category != OWN and category != TORCH:
                break
            if category == TORCH and first:
                first = False
                # dynamo wraps a Python number as a CPU scalar tensor: a host tensor.
                if f.f_code.co_name == "_as_tensor_fullprec":
                    return True
            f = f.f_back
        if f is None:
            return False
        # Keyed by the code's id (hashing a code hashes its constants); the entry keeps it alive.
        code = f.f_code
        key = (id(code), f.f_lasti)
        hit = self.where_cache.get(key)
        if hit is not None and hit[0] is code:
            return hit[1]
        literal = bool(_CPU_LITERAL.search(_call_text(f)))
        self.where_cache[key] = (code, literal)
        return literal

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Inert once stopped from another thread, and while dynamo traces.
        if not self.active or _compiling():
            return func(*args, **kwargs) if kwargs else func(*args)
        try:
            rule = self.rules.get(func)
        except TypeError:  # an unhashable callable: no rule can name it
            rule = None
        if rule is not None:
            # _NO_KWARGS is never written to: a dict per call costs every op.
            return rule(self, func, args, kwargs or _NO_KWARGS)
        if kwargs:
            out = func(*args, **kwargs)
            try:
                self.propagate(args, kwargs, out)
            except Exception as exc:  # never lose the user's op to our bookkeeping
                hub.fault(NAME, exc)
            return out
        # propagate() inlined: most ops take no keyword and one or two marked tensors,
        # and return one tensor (f(*args) builds no dict).
        out = func(*args)
        if out is None:
            return out
        try:
            get = self.marks.get
            for a in args:
                if type(a) is Tensor:
                    m = get(id(a))
                    if m.dev if m is not None else self.is_dev(a):
                        break
                elif isinstance(a, (Tensor, list, tuple)) and self.any_dev((a,), _NO_KWARGS):
                    break
            else:
                return out
            if type(out) is Tensor:
                key = id(out)
                m = get(key)
                if m is None:
                    m = self.marks[key] = _Mark(out, self._forget)
                    m.key = key
                m.dev = True
            else:
                self.mark_out(out, True)
        except Exception as exc:  # never lose the user's op to our bookkeeping
            hub.fault(NAME, exc)
        return out

    def record(self, kind: str, detail: str = "", depth: int = 1) -> None:
        """Record a sync of ``kind`` at the first frame not ours, from ``depth`` frames out."""
        if not self.active:  # stopped, or released by the thread that installed it
            return
        try:
            sync = observe(sync_frame(sys._getframe(depth)), kind, detail)
        except Exception as exc:
            hub.fault(NAME, exc)
            return
        if sync is not None:
            hub.emit(NAME, sync)

    def h2d(self, src: Tensor, nonblocking: bool) -> tuple[str, str] | None:
        if not nonblocking:
            return ("copy", "h2d")
        if src.nbytes > PAGEABLE_BLOCKING_BYTES and not src.is_pinned():
            hub.note(NAME, NOTE_PINNED_H2D)
            return ("copy", "h2d pageable non_blocking")
        return None

    def watch_backward(self, node: Any) -> None:
        """Report the backward of ``node`` (mask indexing's backward needs a size)."""
        node.register_prehook(lambda grad_outputs: self.record("backward"))

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
        """For a move that is a no-op on CPU, a tensor of the caller's own: an alias (a view
        of all of ``src``), or ``src`` itself for a parameter or a leaf that requires grad
        (``module.to()`` and optimizers rely on their identity) or a layout without views."""
        alias = src
        if not (_is_param(src) or (src.requires_grad and src.is_leaf)):
            with contextlib.suppress(Exception):  # layouts without views (sparse, nested)
                alias = src.view_as(src)
        self.mark(alias, dev)
        return alias


def _call_text(frame: FrameType) -> str:
    """The source of the call ``frame`` is executing, else its whole line."""
    code = frame.f_code
    text = _source_segment(code, _instruction(code, frame.f_lasti)[1])
    return linecache.getline(code.co_filename, frame.f_lineno) if text is None else text


def sync_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame from ``frame`` outward that is not barrierguard's own."""
    cache = _classifier._cache
    while frame is not None:
        name = frame.f_code.co_filename
        if (cache.get(name) or classify_file(name))[0] != OWN:
            return frame
        frame = frame.f_back
    return None
