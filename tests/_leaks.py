"""A snapshot of everything global that barrierguard touches (compared before/after tests)."""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from typing import Any

import torch

import barrierguard
from barrierguard.detect import hub

__all__ = ["EXITS", "RAISED", "global_state", "guard_step_hooks"]

# The ways out of watched code, and what each raises ("hook_exception": a
# framework hook that fails, such as an optimizer step hook).
EXITS = ("return", "exception", "keyboard_interrupt", "system_exit", "hook_exception")
RAISED: dict[str, type[BaseException]] = {
    "exception": ValueError,
    "keyboard_interrupt": KeyboardInterrupt,
    "system_exit": SystemExit,
    "hook_exception": ZeroDivisionError,
}


def _is_ours(entry: Any) -> bool:
    _action, message, category, _module, _lineno = entry
    text = getattr(message, "pattern", "") or ""
    return "synchronizing" in text or category is barrierguard.SyncWarning


def _alive() -> set[int | None]:
    return {t.ident for t in threading.enumerate()}


def guard_step_hooks() -> int:
    """How many of torch's global optimizer-step hooks are a guard's."""
    from torch.optim import optimizer as optim_mod

    from barrierguard.session.guard import Guard

    hooks = optim_mod._global_optimizer_post_hooks.values()
    return sum(getattr(h, "__func__", None) is Guard._advance for h in hooks)


def global_state() -> dict[str, Any]:
    from torch.optim import optimizer as optim_mod

    state: dict[str, Any] = {
        # Third-party imports may add filters of their own; ours must not stay.
        "our_filters": [f for f in warnings.filters if _is_ours(f)],
        "showwarning": warnings.showwarning,
        "_showwarnmsg": getattr(warnings, "_showwarnmsg", None),
        "tensor_patches": {
            k: torch.Tensor.__dict__.get(k)
            for k in ("to", "cuda", "cpu", "copy_", "item", "__bool__", "__repr__")
        },
        "cuda.synchronize": torch.cuda.synchronize,
        "Parameter.__new__": torch.nn.Parameter.__dict__.get("__new__"),
        "Optimizer.zero_grad": torch.optim.Optimizer.__dict__.get("zero_grad"),
        "BackwardCFunction.apply": torch.autograd.function.BackwardCFunction.__dict__.get("apply"),
        "Event.synchronize": torch.cuda.Event.__dict__.get("synchronize"),
        "record_function.__exit__": torch.autograd.profiler.record_function.__dict__.get(
            "__exit__"
        ),
        "optimizer_post_hooks": len(optim_mod._global_optimizer_post_hooks),
        "optimizer_pre_hooks": len(optim_mod._global_optimizer_pre_hooks),
        "function_modes": torch._C._len_torch_function_stack(),
        "trace": sys.gettrace(),
        "profile": sys.getprofile(),
        "running_recorders": hub.running_recorders(),
        # Cleanups an engine stopped from another thread left to a thread.
        "left_to_threads": {
            k: len(v) for k, v in getattr(hub, "_left", {}).items() if v and k in _alive()
        },
        "warnings_filters_count": sum(1 for f in warnings.filters if _is_ours(f)),
        "torch.cuda.synchronize": torch.cuda.synchronize,
        "getArtifactLogger": torch._logging.getArtifactLogger,
        # torch's artifact loggers that still carry a handler of barrierguard's.
        "artifact_loggers": sorted(
            name
            for name, lg in logging.Logger.manager.loggerDict.items()
            if isinstance(lg, logging.Logger)
            and any(type(h).__module__.startswith("barrierguard") for h in lg.handlers)
        ),
    }
    if torch.distributed.is_available():
        from torch.distributed import distributed_c10d

        from barrierguard.detect import distributed

        names = (*distributed.ALWAYS_BLOCKING, *distributed.TENSOR_CALLS, *distributed.WORK_CALLS)
        state["torch.distributed"] = {n: getattr(torch.distributed, n, None) for n in names}
        state["distributed_c10d"] = {n: getattr(distributed_c10d, n, None) for n in names}
        state["Work.wait"] = distributed_c10d.Work.__dict__.get("wait")
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        state["accelerator.synchronize"] = getattr(accel, "synchronize", None)
    if torch.cuda.is_available():
        state["sync_debug_mode"] = torch.cuda.get_sync_debug_mode()
    return state
