"""The CPU audit engine: which lines would synchronize if the tensors lived on a GPU.

A lean function mode (``audit_provenance``) follows which tensors would live on the
device (docs/audit.md); calls that can sync have a rule (``audit_rules``). The mode steps
off the stack in ``optimizer.step()`` without a closure, ``zero_grad()`` and
``clip_grad_norm_``: many small calls that only update marked tensors. :class:`WarningRelay`
re-issues torch's warnings at the frame they would name without the mode.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode

from barrierguard.detect import distributed, hub, stack
from barrierguard.detect.audit_provenance import (
    NAME,
    NOTE,
    NOTE_SUSPENDED,
    AuditMode,
    Parameter,
    Tensor,
    _compiling,
    sync_frame,
)
from barrierguard.detect.audit_rules import build_rules, install_patches, tagged_ops
from barrierguard.detect.frames import OWN, classify_file
from barrierguard.detect.patch import Patches, drop_filter

__all__ = ["NOTE", "AuditEngine", "tagged_ops"]

_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_stack_pop = torch._C._pop_torch_function_stack
_stack_push = torch._C._push_on_torch_function_stack


class AuditEngine:
    """The audit: a lean function mode plus a few patches; see the module docstring."""

    name = NAME

    def __init__(self) -> None:
        self._patches = Patches()
        self._mode: AuditMode | None = None
        self._hooks: list[Any] = []
        self._thread = 0
        self._suspended = False
        self._depth = 0
        self._relay = WarningRelay()

    def install(self) -> None:
        from torch.optim import optimizer as optim

        self._thread = threading.get_ident()
        try:
            mode = AuditMode(build_rules())
            self._patch_calls(mode)
            self._relay.install()
            self._hooks.append(optim.register_optimizer_step_pre_hook(self._pause))
            self._hooks.append(optim.register_optimizer_step_post_hook(self._resume))
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
                # Stopped from another thread, the mode stays inert on the starting
                # thread's stack until that thread next enters or leaves a guard.
                if threading.get_ident() == self._thread:
                    _remove_from_stack(mode)
                else:
                    hub.defer(self._thread, functools.partial(_remove_from_stack, mode))
                mode.marks.clear()
        finally:
            while self._hooks:
                self._hooks.pop().remove()
            self._patches.undo()
            self._relay.uninstall()
            self._suspended = False
            stack.forget()

    def release(self, thread_ident: int) -> None:
        """The last guard of ``thread_ident`` stopped while others run: leave its stack."""
        mode = self._mode
        if mode is not None and thread_ident == self._thread == threading.get_ident():
            mode.active = False
            _remove_from_stack(mode)

    def _pause(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # A closure runs forward and backward inside step(): keep watching then.
        if len(args) > 1 or kwargs.get("closure") is not None:
            return
        mode = self._mode
        if mode is None or threading.get_ident() != self._thread:
            return
        if self._suspended:
            # The last step raised before its post hook: resume at this one's.
            hub.note(NAME, NOTE_SUSPENDED)
            return
        if _step_off(mode, self._thread):
            self._suspended = True
            self._depth = _stack_len()

    def _resume(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mode = self._mode
        if mode is None or not self._suspended or threading.get_ident() != self._thread:
            return
        if _stack_len() == self._depth:
            _stack_push(mode)
            self._suspended = False

    def _patch_calls(self, mode: AuditMode) -> None:
        thread = self._thread
        cuda_available = torch.cuda.is_available

        @contextlib.contextmanager
        def aside() -> Iterator[None]:
            off = _step_off(mode, thread)
            try:
                yield
            finally:
                if off:
                    _stack_push(mode)

        def synchronize_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
            # Without CUDA the real call raises: recorded only, so scripts that time still run.
            @functools.wraps(orig)
            def synchronize(*args: Any, **kwargs: Any) -> Any:
                out = orig(*args, **kwargs) if cuda_available() else None
                mode.record("synchronize", "device")
                return out

            return synchronize

        owners: tuple[Any, ...] = (torch.cuda, getattr(torch, "accelerator", None))
        for owner in owners:
            if hasattr(owner, "synchronize"):
                self._patches.set(owner, "synchronize", synchronize_wrapper(owner.synchronize))

        # A Parameter seen being made takes its data's side (unseen ones count as device).
        orig_new = Parameter.__dict__["__new__"].__func__

        @functools.wraps(orig_new)
        def parameter_new(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
            param = orig_new(cls, data, requires_grad)
            try:
                if mode.active and isinstance(param, Tensor):
                    mode.mark(param, isinstance(data, Tensor) and mode.is_dev(data))
            except Exception as exc:
                hub.fault(NAME, exc)
            return param

        self._patches.set(Parameter, "__new__", staticmethod(parameter_new))

        # backward() runs with the mode off the stack: a custom Function's backward gets it back.
        BackwardCFunction = torch.autograd.function.BackwardCFunction
        orig_apply: Callable[..., Any] = BackwardCFunction.apply

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

        # zero_grad() only drops or zeroes gradients: calls the mode need not see.
        orig_zero = torch.optim.Optimizer.zero_grad

        @functools.wraps(orig_zero)
        def zero_grad(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            with aside():
                return orig_zero(optimizer, *args, **kwargs)

        self._patches.set(torch.optim.Optimizer, "zero_grad", zero_grad)
        self._patch_clip(mode, thread)

        # An exception in optimizer.step() skips the post hook; its profiler range still closes.
        record_function = torch.autograd.profiler.record_function
        orig_exit = record_function.__exit__

        @functools.wraps(orig_exit)
        def range_exit(rf: Any, exc_type: Any, exc: Any, tb: Any) -> Any:
            if (
                exc_type is not None
                and self._suspended
                and threading.get_ident() == thread
                and str(getattr(rf, "name", "")).startswith("Optimizer.step#")
            ):
                self._resume(None, (), {})
            return orig_exit(rf, exc_type, exc, tb)

        self._patches.set(record_function, "__exit__", range_exit)

        # A collective on device tensors runs on NCCL's stream: not a barrier.
        distributed.install(
            self._patches,
            host=lambda tensor: not mode.is_dev(tensor),
            record=lambda detail, stall: mode.record("collective", detail),
            hush=aside,
        )
        install_patches(self._patches, mode, aside)

    def _patch_clip(self, mode: AuditMode, thread: int) -> None:
        """``clip_grad_norm_`` steps aside when it cannot sync (gradients on one side, no
        ``error_if_nonfinite``): the total norm takes the gradients' side."""
        utils = torch.nn.utils
        module = sys.modules.get("torch.nn.utils.clip_grad")
        clip: Callable[..., Any] = utils.clip_grad_norm_
        if getattr(module, "clip_grad_norm_", None) is not clip:
            return  # not the layout this wrapper knows

        @functools.wraps(clip)
        def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            if (
                not mode.active
                or _compiling()
                or kwargs.get("error_if_nonfinite", len(args) > 2 and args[2])
                or not _step_off(mode, thread)
            ):
                return clip(parameters, *args, **kwargs)
            try:
                params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
                sides = {mode.is_dev(p) for p in params if p.grad is not None}
                if len(sides) == 1:
                    total = clip(params, *args, **kwargs)
            finally:
                _stack_push(mode)
            if len(sides) != 1:
                # No gradient, or gradients on both sides: what the mode sees matters.
                return clip(params, *args, **kwargs)
            try:
                mode.mark_out(total, sides.pop())
            except Exception as exc:
                hub.fault(NAME, exc)
            return total

        self._patches.set(module, "clip_grad_norm_", clip_grad_norm_)
        self._patches.set(utils, "clip_grad_norm_", clip_grad_norm_)


def _step_off(mode: TorchFunctionMode, thread: int) -> bool:
    """Take ``mode`` off the stack if it is on top, in its thread: then push it back after."""
    n = _stack_len()
    if n == 0 or _stack_at(n - 1) is not mode or threading.get_ident() != thread:
        return False
    _stack_pop()
    return True


def _on_stack(mode: TorchFunctionMode) -> bool:
    return any(_stack_at(i) is mode for i in range(_stack_len()))


def _remove_from_stack(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's function-mode stack, wherever it sits."""
    if not _on_stack(mode):
        return
    above: list[Any] = []
    while (top := _stack_pop()) is not mode:
        above.append(top)
    for m in reversed(above):
        _stack_push(m)


def home_frame(frame: FrameType | None) -> FrameType | None:
    """The frame a warning located at the mode's ``frame`` would name without barrierguard:
    outward past ours, and past ``handle_torch_function`` with the call that entered it."""
    frame = sync_frame(frame)
    if frame is not None:
        code = frame.f_code
        if code.co_name == "handle_torch_function" and code.co_filename.endswith("overrides.py"):
            frame = frame.f_back
            frame = frame.f_back if frame is not None else None
    return frame


class WarningRelay:
    """Re-issues at the user's frame the warnings that the mode's frames took."""

    def __init__(self) -> None:
        self._filter: Any = None
        self._home: list[Any] = []
        self._saved_show: Callable[..., Any] | None = None

    def install(self) -> None:
        """Add the filter and the show hook (both undone by :meth:`uninstall`)."""
        # A warning located in the audit's modules was raised under its mode.
        warnings.filterwarnings("always", module=r"barrierguard\.detect\.audit")
        self._filter = warnings.filters[0]
        self._home = cast("list[Any]", warnings.filters)
        # _showwarnmsg is also called inside catch_warnings(record=True).
        self._saved_show = warnings._showwarnmsg  # type: ignore[attr-defined]
        warnings._showwarnmsg = self._show  # type: ignore[attr-defined]

    def uninstall(self) -> None:
        """Remove the filter and the hook; safe to call twice."""
        if self._saved_show is not None:
            if warnings._showwarnmsg == self._show:  # type: ignore[attr-defined]
                warnings._showwarnmsg = self._saved_show  # type: ignore[attr-defined]
            self._saved_show = None
        if self._filter is not None:
            drop_filter(self._filter, self._home)
            self._filter = None

    def _show(self, msg: Any) -> None:
        frame: FrameType | None = None
        name = msg.filename
        try:
            if os.path.basename(name).startswith("audit") and classify_file(name)[0] == OWN:
                frame = sys._getframe(1)
                where = (name, msg.lineno)
                while frame is not None and (frame.f_code.co_filename, frame.f_lineno) != where:
                    frame = frame.f_back
                frame = home_frame(frame)
        except Exception:  # never lose a warning to our bookkeeping
            frame = None
        if frame is None:
            if self._saved_show is not None:
                self._saved_show(msg)
            return
        g = frame.f_globals
        # The user's filters decide, and may raise it as an error: as without us.
        warnings.warn_explicit(
            msg.message,
            msg.category,
            frame.f_code.co_filename,
            frame.f_lineno,
            module=g.get("__name__"),
            registry=g.setdefault("__warningregistry__", {}),
            module_globals=g,
            source=msg.source,
        )
