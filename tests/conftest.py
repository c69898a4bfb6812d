"""Shared fixtures: every test leaves torch, warnings and hooks as it found them."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import barrierguard
from barrierguard.detect import hub

pytest_plugins = ["_fake_cuda", "pytester"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        need = (
            2
            if item.get_closest_marker("multigpu")
            else 1
            if item.get_closest_marker("cuda")
            else 0
        )
        if gpus < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {gpus}"))


def _is_ours(entry: Any) -> bool:
    _action, message, category, _module, _lineno = entry
    text = getattr(message, "pattern", "") or ""
    return "synchronizing" in text or category is barrierguard.SyncWarning


def _global_state() -> dict[str, Any]:
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
        "optimizer_post_hooks": len(optim_mod._global_optimizer_post_hooks),
        "optimizer_pre_hooks": len(optim_mod._global_optimizer_pre_hooks),
        "function_modes": torch._C._len_torch_function_stack(),
        "trace": sys.gettrace(),
        "profile": sys.getprofile(),
        "running_recorders": hub.running_recorders(),
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


@pytest.fixture(autouse=True)
def check_global_state() -> Iterator[None]:
    """Fail any test after which barrierguard left a global touched."""
    before = _global_state()
    yield
    after = _global_state()
    leaked = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    # A leaked guard would keep the others leaked too: stop it so later tests run clean.
    for guard in hub.running_recorders():
        guard.stop()
    assert not leaked, f"global state leaked: {sorted(leaked)}"
