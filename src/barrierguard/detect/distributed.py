"""The ``torch.distributed`` calls that block the host, recorded at the user's line.

CUDA sync-debug mode does not see them. Recorded as ``collective`` (docs/distributed.md):
barriers and ``*_object`` calls always; a collective on host tensors (gloo) without
``async_op=True``, else its ``wait()``. Syncs inside a recorded call are part of it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from barrierguard.detect import hub
from barrierguard.detect.kinds import BARRIER_CALLS, OBJECT_CALLS
from barrierguard.detect.patch import Patches

__all__ = ["ALWAYS_BLOCKING", "TENSOR_CALLS", "WORK_CALLS", "install", "quiet"]

# Calls that block the host whatever their tensors.
ALWAYS_BLOCKING = (*BARRIER_CALLS, *OBJECT_CALLS)
# Collectives and point-to-point calls: a host barrier on host tensors only.
TENSOR_CALLS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "send",
    "recv",
)
# Calls that return works without waiting: their wait() is where the host blocks.
WORK_CALLS = ("isend", "irecv", "batch_isend_irecv")


class _State(threading.local):
    """Per thread: how many wrapped calls it is inside, and whether one is recorded."""

    depth = 0
    quiet = False


_tls = _State()
# How many threads are inside a recorded call: while none is, no sync reads the
# thread-local. Counted before a thread turns quiet, uncounted after it turns back.
_quiet_threads = 0
_quiet_lock = threading.Lock()
_clock = time.perf_counter
# Folded to True by dynamo while it traces (torch 2.1 has neither).
_compiling: Callable[[], bool] = (
    getattr(torch.compiler, "is_dynamo_compiling", None)
    or getattr(torch.compiler, "is_compiling", None)
    or (lambda: False)
)


def quiet() -> bool:
    """Whether this thread is inside a recorded distributed call (its syncs are part of it)."""
    return _quiet_threads > 0 and _tls.quiet


def _count_quiet(change: int) -> None:
    global _quiet_threads
    with _quiet_lock:
        _quiet_threads += change
    hub.invalidate()  # a read inside the call is part of it: no engine's tally counts it


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a call: arguments, lists of them, and ``P2POp.tensor``."""
    found: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        for item in a if isinstance(a, (list, tuple)) else (a,):
            inner = item if isinstance(item, torch.Tensor) else getattr(item, "tensor", None)
            if isinstance(inner, torch.Tensor):
                found.append(inner)
    return found


def _position(fn: Callable[..., Any], name: str) -> int | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, pos: int | None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if pos is not None and pos < len(args) else None


def _backend(dist: Any, group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # an uninitialized or foreign group: name the side instead
        return "cpu"


def install(
    patches: Patches,
    *,
    host: Callable[[torch.Tensor], bool],
    record: Callable[[str, float], None],
    hush: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Wrap the blocking calls of ``torch.distributed`` with reversible ``patches``.

    Args:
        patches: Where the patches go (the engine undoes them on uninstall).
        host: Whether a tensor is a host tensor (gloo runs its collective on the host).
        record: Records one blocking call, ``record(detail, stall seconds)``, from
            the wrapper (the user's frame is its caller's caller).
        hush: A context around a recorded call: the engine records nothing inside.
    """
    if not torch.distributed.is_available():
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    # Works of host calls started with async_op=True, and what their wait() is.
    works: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def inside(recorded: bool) -> Iterator[None]:
        was = _tls.quiet
        turns = recorded and not was  # this thread turns quiet here
        if turns:
            _count_quiet(1)
        _tls.depth += 1
        _tls.quiet = was or recorded
        try:
            with hush() if recorded else contextlib.nullcontext():
                yield
        finally:
            _tls.depth -= 1
            _tls.quiet = was
            if turns:
                _count_quiet(-1)

    def wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        always = name in ALWAYS_BLOCKING
        works_only = name in WORK_CALLS
        async_pos = _position(orig, "async_op")
        group_pos = _position(orig, "group")

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _tls.depth > 0 or _compiling():
                return orig(*args, **kwargs)
            is_async = bool(_argument(args, kwargs, "async_op", async_pos))
            tensors = () if always else _tensors(args, kwargs)
            on_host = always or (bool(tensors) and all(host(t) for t in tensors))
            blocks = on_host and not is_async and not works_only
            t0 = _clock()
            with inside(blocks):
                out = orig(*args, **kwargs)
            stall = _clock() - t0
            if not blocks and (not on_host or out is None):
                return out
            group = None if always else _argument(args, kwargs, "group", group_pos)
            backend = None if always else _backend(dist, group)
            if blocks:
                record(name if backend is None else f"{name} ({backend})", stall)
                return out
            what = name if backend is None else f"{name}, {backend}"
            for work in out if isinstance(out, list) else (out,):
                with contextlib.suppress(TypeError):
                    works[work] = f"wait ({what})"
            return out

        return wrapper

    for name in (*ALWAYS_BLOCKING, *TENSOR_CALLS, *WORK_CALLS):
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        wrapped = wrap(name, orig)
        patches.set(c10d, name, wrapped)
        if getattr(dist, name, None) is orig:
            patches.set(dist, name, wrapped)
    work_class = getattr(c10d, "Work", None)
    if work_class is None or not callable(getattr(work_class, "wait", None)):
        return
    orig_wait = work_class.wait

    @functools.wraps(orig_wait)
    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            detail = works.pop(work, None)
        except TypeError:
            detail = None
        if detail is None or _tls.depth > 0:
            return orig_wait(work, *args, **kwargs)
        t0 = _clock()
        with inside(True):
            out = orig_wait(work, *args, **kwargs)
        record(detail, _clock() - t0)
        return out

    patches.set(work_class, "wait", wait)
