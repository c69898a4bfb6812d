"""The capture probe: try to capture one call of a step with ``torch.cuda.graph``.

What is captured: one call of the function given, with its arguments, on a
side stream, after the guard's warm-up (so that lazy state, such as an
optimizer's momentum buffers, already exists). Capturing records kernels and
runs none of them, and the probe never replays the graph, so the device
state (parameters, optimizer state, buffers, activations) is what it was
before; what the probe puts back by hand is what capturing does change on the
host: the ``.grad`` of the parameters it knows (the graph's pool would have
given them new, never written tensors), the CPU and CUDA RNG states, and the
current stream. Python state that the function changes itself (a counter of
its own) it cannot put back: probe a function without host side effects, or
one whose side effects are harmless once more.

The first call that cannot be captured (a sync such as ``.item()``, a copy
from pageable host memory, ``torch.cuda.synchronize()``, an optimizer built
without ``capturable=True``) raises inside the capture; its traceback names
the user's line.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import linecache
import sys
import traceback
from collections.abc import Callable, Iterable
from types import FrameType, FunctionType
from typing import Any

from barrierguard.detect.frames import OWN, USER, classify_file
from barrierguard.report.records import CaptureProbe

__all__ = ["CallProbe", "blocking_line", "probe"]


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def blocking_line(exc: BaseException) -> tuple[str, int, str]:
    """The user's innermost line in ``exc``'s traceback: ``(file, line, function)``.

    The innermost frame that is not barrierguard's own when no frame is the
    user's; ``("", 0, "")`` without a traceback.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    fallback: tuple[str, int, str] = ("", 0, "")
    for fs in reversed(frames):
        category = classify_file(fs.filename)[0]
        if category == USER:
            return fs.filename, fs.lineno or 0, fs.name
        if category != OWN and not fallback[0]:
            fallback = (fs.filename, fs.lineno or 0, fs.name)
    return fallback


def _release_failed_capture(graph: Any) -> None:
    """Give the graph's memory pool back after a capture that could not end.

    ``capture_end`` raises at ``cudaStreamEndCapture`` before it tells the
    caching allocator that the capture is over, and ``reset`` releases only
    the pool of a graph that was captured: without this, the allocator would
    keep the pool (its memory) and its capture bookkeeping for the rest of the
    run. ``torch.cuda.use_mem_pool`` ends a pool the same way.
    """
    import torch

    try:
        device, pool = torch.cuda.current_device(), graph.pool()
        torch._C._cuda_endAllocateToPool(device, pool)
        torch._C._cuda_releasePool(device, pool)
    except Exception:  # this torch already ended it, or names it otherwise
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def probe(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    params: Iterable[Any] = (),
) -> CaptureProbe:
    """Capture one call of ``fn(*args, **kwargs)``; never replay it.

    Args:
        fn: The step (or part of it) to capture.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        params: Tensors whose ``.grad`` the probe restores afterwards.

    Returns:
        ``status`` ``"capturable"``, ``"blocked"`` (with the first line that
        stopped the capture), or ``"not run"`` (no CUDA device).
    """
    import torch

    captured = (
        f"one call of {_name(fn)} under torch.cuda.graph on a side stream "
        "(recorded, never replayed)"
    )
    if not torch.cuda.is_available():
        return CaptureProbe(
            status="not run",
            reason="no CUDA device here: the capture probe needs one",
            captured=captured,
        )
    saved_grads = [(p, p.grad) for p in params]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all()
    error: BaseException | None = None
    end_error: BaseException | None = None
    graph = torch.cuda.CUDAGraph()
    # No synchronize (torch.cuda.graph makes one to free memory first): the side
    # stream waits for the work queued so far on the device, and the capture
    # only records; the host never waits.
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                fn(*args, **(kwargs or {}))
            except Exception as exc:
                error = exc
            finally:
                try:
                    graph.capture_end()
                except Exception as exc:
                    end_error = exc
        torch.cuda.current_stream().wait_stream(side)
    finally:
        # Each restore on its own: one that fails must not skip the others.
        if end_error is not None:
            _release_failed_capture(graph)
        with contextlib.suppress(Exception):
            graph.reset()
        del graph
        for p, g in saved_grads:
            p.grad = g
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state_all(cuda_rng)
    blocker = error or end_error
    if blocker is None:
        return CaptureProbe(status="capturable", captured=captured)
    file, line, function = blocking_line(blocker)
    reason = _first_line(blocker)
    # The error's traceback holds the step's frames, and with them what it
    # allocated in the capture: let go of it now, not at the next gc.
    error = end_error = blocker = None
    return CaptureProbe(
        status="blocked",
        reason=reason,
        file=file,
        line=line,
        function=function,
        code=linecache.getline(file, line).strip() if file else "",
        captured=captured,
    )


def _function_of(frame: FrameType) -> Callable[..., Any] | None:
    """The function object running in ``frame`` (a closure: the one with its cells)."""
    code = frame.f_code
    free = code.co_freevars
    for obj in gc.get_referrers(code):
        if not isinstance(obj, FunctionType) or obj.__code__ is not code:
            continue
        cells = obj.__closure__ or ()
        try:
            pairs = zip(free, cells, strict=False)
            if all(frame.f_locals.get(n) is c.cell_contents for n, c in pairs):
                return obj
        except ValueError:  # an empty cell
            continue
    return None


def _arguments(frame: FrameType) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``frame``'s function was called with, as it received them."""
    code = frame.f_code
    names = code.co_varnames
    local = frame.f_locals
    n, k = code.co_argcount, code.co_kwonlyargcount
    args = tuple(local[name] for name in names[:n])
    kwargs = {name: local[name] for name in names[n : n + k]}
    i = n + k
    if code.co_flags & inspect.CO_VARARGS:
        args += tuple(local[names[i]])
        i += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[i]])
    return args, kwargs


class CallProbe:
    """Probes the first call of a function named ``name`` once ``ready()`` says so.

    A profile function (``sys.setprofile``) watches the calls until the probe
    ran, then removes itself: it costs a little on every Python call until
    then, and is never installed over another profiler.

    Example:
        >>> done = []
        >>> cp = CallProbe("step", lambda: True, lambda fn, a, kw: done.append(fn(*a, **kw)))
        >>> def step(x):
        ...     return x + 1
        >>> cp.arm(); _ = step(1); cp.disarm()
        >>> done
        [2]
    """

    def __init__(
        self,
        name: str,
        ready: Callable[[], bool],
        run: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], object],
    ) -> None:
        self.name = name
        self.ready = ready
        self.run = run
        self.done = False
        self.note = ""
        self._armed = False

    def arm(self) -> None:
        if self.done or self._armed:
            return
        if sys.getprofile() is not None:
            self.note = (
                f"capture probe of {self.name!r} not armed: another profiler is running "
                "(sys.setprofile)"
            )
            return
        sys.setprofile(self._on_event)
        self._armed = True

    def disarm(self) -> None:
        if self._armed:
            sys.setprofile(None)
            self._armed = False

    def _on_event(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or frame.f_code.co_name != self.name or not self.ready():
            return
        code = frame.f_code
        if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE):
            return
        self.disarm()
        self.done = True
        fn = _function_of(frame)
        if fn is None:
            self.note = f"capture probe: the function object of {self.name!r} was not found"
            return
        args, kwargs = _arguments(frame)
        self.run(fn, args, kwargs)
