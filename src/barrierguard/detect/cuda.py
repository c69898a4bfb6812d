"""The CUDA engine: sync-debug mode in warn mode, plus what that mode misses.

Each sync-debug warning becomes a located record. Intercepted, as the mode misses them:
``torch.cuda.synchronize()``, ``Event.synchronize()``, ``non_blocking=True`` copies of large
pageable host tensors, and ``torch.distributed``'s host barriers. A ``non_blocking`` copy to
pinned host memory is reported as ``async_d2h``: no barrier, but a race if read too soon.
"""

from __future__ import annotations

import functools
import operator
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import torch

from barrierguard.detect import distributed, hub, stack
from barrierguard.detect.compile_logs import not_a_dynamo_frame
from barrierguard.detect.patch import Patches, drop_filter
from barrierguard.detect.stack import Sync, _anchors, _replay, _Route, observe

__all__ = ["PAGEABLE_BLOCKING_BYTES", "CudaEngine"]

SYNC_MESSAGE = "called a synchronizing CUDA operation"
_PROTOTYPE_MESSAGE = "Synchronization debug mode is a prototype feature"

# Above this size a non_blocking pageable host-to-device copy waits (docs/benchmarks.md).
PAGEABLE_BLOCKING_BYTES = 2 * 1024 * 1024


# A thread's last read counted in a tally: (sync, tally, hub.epoch then, its route or None for
# the loop's own frame, the sync frame's f_lasti, len(sys.modules) or -1 once phases can exist).
_Hot = tuple[Sync, hub.Tally, int, "_Route | None", int, int]


class _Thread:
    """One thread's state: the outermost timed call's start, the hot tally, and the start of
    the last copy whose sync drained the queue (a further sync in it costs no stall)."""

    __slots__ = ("__weakref__", "drained", "hot", "t0")

    def __init__(self) -> None:
        self.t0: float | None = None
        self.hot: _Hot | None = None
        self.drained: float | None = None


class _State(threading.local):
    """Per thread, its :class:`_Thread`: a wrapper reads the thread-local once, then slots."""

    def __init__(self) -> None:
        self.s = _Thread()
        _threads.add(self.s)


# Every live thread's state, so that uninstall drops every tally (and the frames its route holds).
_threads: weakref.WeakSet[_Thread] = weakref.WeakSet()
_tls = _State()
_distributed_tls = distributed._tls


def _get_mode() -> int:
    """The current sync-debug mode (a seam: tests on CPU replace it)."""
    return int(torch.cuda.get_sync_debug_mode())


def _set_mode(mode: int | str) -> None:
    """Set the sync-debug mode (a seam: tests on CPU replace it)."""
    torch.cuda.set_sync_debug_mode(mode)


_clock = time.perf_counter
# t0 after a timed call's first sync: the queue is drained from then on.
_DRAINED = float("-inf")

# Calls that may synchronize, timed from their entry (only the outermost on a thread).
_SCALAR_READS = frozenset({"item", "__bool__", "__int__", "__float__", "__index__"})
# Methods of self alone get a wrapper of fixed arity, cheaper than *args, **kwargs.
_NO_ARGS = _SCALAR_READS | {"tolist"}
_DATA_SHAPED = ("nonzero", "argwhere", "masked_select", "unique")
TIMED_TENSOR_METHODS = (*_DATA_SHAPED, "cpu", "numpy", "__complex__", "__format__", "__repr__")
TIMED_TORCH_FUNCTIONS = _DATA_SHAPED
# By the kind of sync they make: calls that seldom sync and run often, timed only once a run
# has shown an untimed sync of that kind. Optimizers call torch.tensor(1.0) every step, models
# call where(c, x, y) and repeat_interleave(n) per layer. Indexing is never timed: a Python
# __getitem__ on torch.Tensor makes CPython see every tensor as a sequence, for good (its
# sq_item slot stays set after the attribute is deleted), and torch.tensor([a, b]) of 0-d
# tensors then raises.
TIMED_ON_DEMAND: dict[str, tuple[tuple[Any, str], ...]] = {
    "copy": ((torch, "tensor"),),
    "nonzero": ((torch, "where"),),
    "compare": ((torch, "allclose"), (torch, "equal")),
    "repeat_interleave": ((torch, "repeat_interleave"), (torch.Tensor, "repeat_interleave")),
}

# Dynamo folds is_dynamo_compiling() to True while tracing: wrappers stay out of graphs.
_compiling = distributed._compiling
_HOST_NUMBERS = frozenset({int, float, bool, complex})


def _timed(orig: Callable[..., Any], compiling: Callable[[], bool]) -> Callable[..., Any]:
    """``orig``, noting on this thread when the outermost timed call began."""
    tls = _tls
    clock = _clock

    @functools.wraps(orig)
    def timed(*args: Any, **kwargs: Any) -> Any:
        # A Python number first (torch.tensor(1.0)) reads no device value.
        if (args and type(args[0]) in _HOST_NUMBERS) or compiling():
            return orig(*args, **kwargs)
        state = tls.s
        if state.t0 is not None:
            return orig(*args, **kwargs)
        state.t0 = clock()
        try:
            return orig(*args, **kwargs)
        finally:
            state.t0 = None

    not_a_dynamo_frame(timed.__code__)  # type: ignore[attr-defined]
    return timed


_on_device: Callable[[Any], bool] = operator.attrgetter("is_cuda")
"""Whether a tensor lives on a CUDA device (only then can reading it wait)."""


def _no_mode(mode: int = 0) -> int:
    return 0  # a build without CUDA: no mode to read or set


# The mode by its number, without the public functions' checks (seams for tests).
_raw_get: Callable[[], int] = getattr(torch._C, "_cuda_get_sync_debug_mode", _no_mode)
_raw_set: Callable[[int], object] = getattr(torch._C, "_cuda_set_sync_debug_mode", _no_mode)
_WARN = 1  # the sync-debug mode's number for "warn"
# A read of a plain CUDA tensor synchronizes for certain (a subclass may run Python).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _timed_no_args(
    orig: Callable[..., Any],
    compiling: Callable[[], bool],
    read: Callable[[FrameType, float], None] | None = None,
) -> Callable[..., Any]:
    """Like :func:`_timed`, for ``tensor.method()``; with ``read`` (a scalar read), a plain CUDA
    tensor's read is recorded here, with sync-debug mode off for that one call."""
    tls = _tls
    clock = _clock
    on_device = _on_device
    plain = _PLAIN
    getframe = sys._getframe
    anchors = _anchors
    hub_module = hub
    modules = sys.modules

    @functools.wraps(orig)
    def timed(self: Any) -> Any:
        # A host tensor never waits (optimizers read CPU step counters every step).
        if not on_device(self) or compiling():
            return orig(self)
        state = tls.s
        if state.t0 is not None:
            return orig(self)
        if read is not None and type(self) in plain and _raw_get() == _WARN:
            t0 = clock()
            _raw_set(0)
            try:
                out = orig(self)
            except BaseException:
                # One value that failed on the device reached it; a misfit did not.
                if self.numel() == 1:
                    read(getframe(1), clock() - t0)
                raise
            finally:
                _raw_set(_WARN)
            stall = clock() - t0
            frame = getframe(1)
            # Met again while its tally stands (hub.Tally): counted here, nothing called.
            # stack._replay's probe test is written out: a call per read is the cost.
            hot = state.hot
            if hot is not None:
                sync, tally, epoch, route, lasti, imported = hot
                if epoch != hub_module.epoch:
                    hit = False
                elif (last := anchors.last) is not None and frame is last[0]:
                    hit = last[4] is sync and frame.f_lasti == last[1]
                else:
                    hit = False
                    if (
                        route is not None
                        and route.code is frame.f_code
                        and lasti == frame.f_lasti
                        and not 0 <= imported != len(modules)  # no import since
                    ):
                        hit = True
                        try:
                            for depth, code, at in route.probes:
                                f = getframe(depth + 1)
                                if f.f_code is not code or (at >= 0 and f.f_lasti != at):
                                    hit = False
                                    break
                            outer = route.outer
                            if outer is not None and getframe(outer[0] + 1) is not outer[1]:
                                hit = False
                        except ValueError:
                            hit = False
                if hit:
                    tally.n += 1
                    tally.stall += stall
                    return out
            read(frame, stall)
            return out
        state.t0 = clock()
        try:
            return orig(self)
        finally:
            state.t0 = None

    not_a_dynamo_frame(timed.__code__)  # type: ignore[attr-defined]
    return timed


# The copy wrappers' shared code, and how far out of its frame a sync inside a copy may be
# (a tensor subclass's Python runs in between).
_COPY_CODE: Any = None
_COPY_DEPTH = 4


def _copy_of(frame: FrameType | None) -> FrameType | None:
    """The copy wrapper's frame among ``frame`` and the few frames out of it, or ``None``."""
    for _ in range(_COPY_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _COPY_CODE:
            return frame
        frame = frame.f_back
    return None


def _nonblocking(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``to``/``cuda``/``copy_`` call asked for ``non_blocking``."""
    flag = kwargs.get("non_blocking")
    if flag is not None:
        return bool(flag)
    return any(a is True for a in args)


def _direction(src: str, dst: str) -> str:
    if src == dst:
        return ""
    return "h2d" if src == "cpu" else "d2h" if dst == "cpu" else "d2d"


def _target_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The device type a ``to``/``cuda`` call copies to, or ``None`` when it names none."""
    device = kwargs.get("device")
    for a in args if device is None else (device,):
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, str):
            return a.split(":", 1)[0]
        if isinstance(a, torch.device):
            return a.type
        if isinstance(a, int) and not isinstance(a, bool):
            return "cuda"
    return None


class CudaEngine:
    """Sync-debug mode plus intercepted calls; see the module docstring."""

    name = "cuda"

    def __init__(self) -> None:
        # On the instance too: CPython 3.11 specializes an instance attribute's lookup.
        self.name = type(self).name
        self._patches = Patches()
        self._saved_mode: int = 0
        self._filter: Any = None
        self._filter_list: list[Any] = []
        self._saved_show: Callable[..., Any] | None = None
        self._timed_kinds: set[str] = set()  # TIMED_ON_DEMAND's kinds timed so far

    def install(self) -> None:
        self._saved_mode = _get_mode()
        try:
            warnings.filterwarnings("always", message=SYNC_MESSAGE, category=UserWarning)
            self._filter = warnings.filters[0]
            # Its list: a catch_warnings() entered meanwhile restores this one at exit.
            self._filter_list = cast("list[Any]", warnings.filters)
            # _showwarnmsg sees warnings even inside catch_warnings(record=True).
            self._saved_show = warnings._showwarnmsg  # type: ignore[attr-defined]
            warnings._showwarnmsg = self._show  # type: ignore[attr-defined]
            with self._patches.deferred():  # torch.Tensor changed once (Patches.deferred)
                self._patch_calls()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_PROTOTYPE_MESSAGE)
                _set_mode("warn")
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        try:
            _set_mode(self._saved_mode)
        finally:
            self._patches.undo()
            self._timed_kinds.clear()
            for state in list(_threads):
                state.hot = None
            stack.forget()
            if self._saved_show is not None and warnings._showwarnmsg == self._show:  # type: ignore[attr-defined]
                warnings._showwarnmsg = self._saved_show  # type: ignore[attr-defined]
            self._saved_show = None
            if self._filter is not None:
                drop_filter(self._filter, self._filter_list)
                self._filter_list = []
                self._filter = None

    def _show(self, msg: Any) -> None:
        message, category = msg.message, msg.category
        if (
            category is UserWarning
            and message.args
            and str(message.args[0]).startswith(SYNC_MESSAGE)
        ):
            self._on_sync(sys._getframe(1))
            return
        assert self._saved_show is not None
        self._saved_show(msg)

    def _on_sync(self, frame: FrameType | None) -> None:
        if distributed.quiet():
            return  # inside a recorded torch.distributed call: part of that call
        state = _tls.s
        now = _clock()
        t0 = state.t0
        try:
            kind, detail = None, ""
            copy = _copy_of(frame)
            if copy is not None:  # inside a copy: its wrapper's frame holds the call
                kind = "copy"
                local = copy.f_locals
                method, (tensor, *args) = local["method"], local["args"]
                if method == "copy_" and args and isinstance(args[0], torch.Tensor):
                    detail = _direction(args[0].device.type, tensor.device.type)
                else:
                    dst = "cuda" if method == "cuda" else _target_type(args, local["kwargs"])
                    detail = _direction(tensor.device.type, dst or tensor.device.type)
                if t0 is None:  # the copy is the outermost timed call: timed from its t0
                    t0 = local["t0"]
                    if state.drained == t0:
                        t0 = _DRAINED
                    else:
                        state.drained = t0
            sync = observe(frame, kind, detail, 2)
        except Exception as exc:  # a fault of ours is reported, never raised
            hub.fault(self.name, exc)
            return
        finally:
            if state.t0 is not None:
                # The first sync drained the queue: later ones in the call cost no stall.
                state.t0 = _DRAINED
        stall = None if t0 is None else (0.0 if t0 is _DRAINED else now - t0)
        if sync is not None:
            kind = sync.loc.kind
            if t0 is None and kind in TIMED_ON_DEMAND and kind not in self._timed_kinds:
                self._timed_kinds.add(kind)  # its first sync untimed, the calls after it timed
                with self._patches.deferred():
                    for owner, name in TIMED_ON_DEMAND[kind]:
                        self._time(owner, (name,))
            # A further sync inside the same timed call (print(t)) is the same occurrence.
            hub.emit(self.name, sync, stall, again=t0 is _DRAINED)

    def _time(self, owner: Any, names: tuple[str, ...]) -> None:
        """Wrap ``owner``'s calls ``names`` (those it has) with :func:`_timed`."""
        for name in names:
            orig = getattr(owner, name, None)
            if orig is not None:
                self._patches.set(owner, name, _timed(orig, _compiling))

    def _read(self, frame: FrameType, stall: float) -> None:
        """A scalar read of a CUDA tensor, timed by its wrapper (see :func:`_timed_no_args`)."""
        # distributed.quiet(), inline, its thread-local read only while a call records.
        if distributed._quiet_threads and _distributed_tls.quiet:
            return
        route: _Route | None = None
        last = _anchors.last
        if last is not None and frame is last[0] and frame.f_lasti == last[1] and last[2] is None:
            sync: Sync | None = last[4]  # the loop's own frame at the same instruction
        else:
            try:
                read = _anchors.read
                sync = None
                if read is not None and read[0] is frame.f_code and read[1] == frame.f_lasti:
                    # From _replay, one call further in, frame is sys._getframe(3).
                    sync = _replay(read[2], 3)
                    if sync is not None:
                        route = read[2]
                        if route.kept:
                            stack.keep_last(frame, sync)
                if sync is None:
                    sync = observe(frame, None, "", 2)
                    read = _anchors.read
                    if read is not None and read[2].sync is sync:
                        route = read[2]
            except Exception as exc:  # a fault of ours is reported, never raised
                hub.fault(self.name, exc)
                return
        if sync is None:
            return
        epoch = hub.epoch
        tally = hub.emit(self.name, sync, stall)
        state = _tls.s
        state.hot = None
        if tally is None:
            return
        if route is None:
            state.hot = (sync, tally, epoch, None, -1, -1)
        elif route.sync is sync:  # a route whose answer never changes
            modules = -1 if route.phases else len(sys.modules)
            state.hot = (sync, tally, epoch, route, frame.f_lasti, modules)

    def _record(self, kind: str, detail: str, stall: float | None = None) -> None:
        """Locate the sync made by this call's caller and hand it on."""
        try:
            sync = observe(sys._getframe(1), kind, detail, 1)
        except Exception as exc:  # a fault of ours is reported, never raised
            hub.fault(self.name, exc)
            return
        if sync is not None:
            hub.emit(self.name, sync, stall)

    def _patch_calls(self) -> None:
        record = self._record

        def after(orig: Callable[..., Any], detail: str) -> Callable[..., Any]:
            @functools.wraps(orig)
            def synchronize(*args: Any, **kwargs: Any) -> Any:
                t0 = _clock()
                out = orig(*args, **kwargs)
                record("synchronize", detail, _clock() - t0)
                return out

            return synchronize

        cuda, accel = torch.cuda, getattr(torch, "accelerator", None)
        for owner, detail in ((cuda, "device"), (cuda.Event, "event"), (accel, "device")):
            orig = getattr(owner, "synchronize", None)
            if orig is not None:
                self._patches.set(owner, "synchronize", after(orig, detail))

        for method in ("to", "cuda", "copy_"):
            orig = getattr(torch.Tensor, method)
            self._patches.set(torch.Tensor, method, self._copy_wrapper(orig, method))
        self._host_reads_unwrapped(torch.Tensor.item)
        for name in sorted(_NO_ARGS):
            read = self._read if name in _SCALAR_READS else None
            timed = _timed_no_args(getattr(torch.Tensor, name), _compiling, read)
            self._patches.set(torch.Tensor, name, timed)
        self._time(torch.Tensor, TIMED_TENSOR_METHODS)
        self._time(torch, TIMED_TORCH_FUNCTIONS)
        # torch.distributed's host barriers (a collective on a CPU tensor runs on the host).
        distributed.install(
            self._patches,
            host=lambda tensor: tensor.device.type == "cpu",
            record=lambda detail, stall: record("collective", detail, stall),
        )

    def _host_reads_unwrapped(self, item: Callable[[Any], Any]) -> None:
        """Let optimizers read host step counters with the unwrapped ``item``: ``torch.optim``'s
        ``_get_value`` runs ``x.item()`` once or twice a step per parameter."""
        try:
            from torch.optim import optimizer as base
        except ImportError:  # a torch without it: the reads pass the wrapper
            return
        orig = getattr(base, "_get_value", None)
        if orig is None:
            return
        plain = torch.Tensor
        on_device = _on_device
        # is_dynamo_compiling: one call where is_compiling() makes two. Outside dynamo, a traced
        # tensor (fake or functional) is not a plain one: torch's own _get_value reads it.
        compiling = _compiling

        @functools.wraps(orig)
        def _get_value(x: Any) -> Any:
            if type(x) is plain and not on_device(x) and not compiling():
                return item(x)
            return orig(x)

        for name, module in list(sys.modules.items()):
            if name.startswith("torch.optim") and getattr(module, "_get_value", None) is orig:
                self._patches.set(module, "_get_value", _get_value)

    def _copy_wrapper(self, orig: Callable[..., Any], method: str) -> Callable[..., Any]:
        record = self._record
        compiling = _compiling
        clock = _clock
        tensor_type = torch.Tensor
        moves = method != "copy_"  # to() and cuda() return the tensor itself when it stays

        # The tensor is args[0]: (self, *args, **kwargs) would build a tuple (1/6 of the cost).
        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                return orig(*args, **kwargs)
            # A sync inside the copy reads method, args, kwargs and t0 from this frame (_copy_of).
            t0 = clock()
            out = orig(*args, **kwargs)  # without a tensor: raises, as torch's own does
            if moves and out is args[0]:
                return out  # nothing moved (a framework moves logged values every step)
            # _nonblocking(args[1:], kwargs) inline; a positional non_blocking is never first.
            if (kwargs and kwargs.get("non_blocking")) or (
                len(args) > 2 and any(a is True for a in args)
            ):
                if method == "copy_":
                    src = args[1] if len(args) > 1 else kwargs.get("src")
                    dst = args[0]
                else:
                    src, dst = args[0], out
                if src is not dst and isinstance(src, tensor_type) and isinstance(dst, tensor_type):
                    # is_cpu/is_cuda: flags, no device built. Only the outermost copy is
                    # judged (a subclass's copy runs copies).
                    if src.is_cpu and dst.is_cuda:
                        if (
                            src.nbytes > PAGEABLE_BLOCKING_BYTES
                            and not src.is_pinned()
                            and _copy_of(sys._getframe(1)) is None
                        ):
                            stall = clock() - t0 if _tls.s.t0 is None else None
                            record("copy", "h2d pageable non_blocking", stall)
                    elif (
                        src.is_cuda
                        and dst.is_cpu
                        and method != "copy_"
                        and _copy_of(sys._getframe(1)) is None
                    ):
                        # Not ready yet; copy_ into a pinned buffer is deliberate, left alone.
                        record("async_d2h", "non_blocking")
            return out

        global _COPY_CODE
        _COPY_CODE = wrapper.__code__  # type: ignore[attr-defined]
        return wrapper
