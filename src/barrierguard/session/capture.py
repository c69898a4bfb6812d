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

The probed call runs compiled functions as plain Python
(``torch.compiler.set_stance("force_eager")``): the probe never replays or
records inductor's CUDA graphs (``mode="reduce-overhead"``) inside its own
capture, and never compiles there. Those graphs keep the last step's outputs
alive, and with them the autograd graph of that step, whose gradient
accumulators belong to the default stream: a backward captured on a side
stream would have to join it. Where torch can, those nodes follow the
capture's stream while the probe captures
(``torch.autograd.graph.set_override_stale_capture_stream``); elsewhere, when
the forward was captured and inductor kept no op out of its CUDA graphs, the
backward is inductor's verdict (it captured the compiled backward itself),
and the probe's reason says so.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import linecache
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import FrameType, FunctionType
from typing import Any

from barrierguard.detect.frames import OWN, USER, classify_file
from barrierguard.report.records import CaptureProbe
from barrierguard.session.compiled import frames_compiled

__all__ = ["CallProbe", "blocking_line", "inductor_cuda_graphs", "probe"]


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


def _end_generator_capture(stream: Any) -> None:
    """Leave the CUDA generators as they were after a capture that could not end.

    ``capture_end`` raises at ``cudaStreamEndCapture`` before its epilogue,
    which would tell the generators that the capture is over: they stay marked
    as capturing, and every later random op of the training fails ("Offset
    increment outside graph capture encountered unexpectedly"). An empty
    capture, begun and ended, runs the prologue and the epilogue once more.
    """
    import torch

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            graph.capture_begin(capture_error_mode="thread_local")
            graph.capture_end()
    finally:
        with contextlib.suppress(Exception):
            graph.reset()


# A capture on a side stream that autograd had to join to the default stream:
# an AccumulateGrad node of an earlier iteration (kept alive by a tensor of
# that iteration, such as the last loss) runs on the default stream. The CUDA
# error, and the errors of torch versions that name the case themselves.
_STREAM_MISMATCH = (
    "legacy stream depend on",
    "stale non-capturing stream",
    "set_override_stale_capture_stream",
)


def _stream_mismatch(exc: BaseException) -> bool:
    text = str(exc)
    return any(m in text for m in _STREAM_MISMATCH)


@contextlib.contextmanager
def _stale_streams_follow_capture() -> Iterator[bool]:
    """Autograd nodes of earlier iterations follow the capture's stream, where torch can.

    ``torch.autograd.graph.set_override_stale_capture_stream(True)`` (newer
    torch): during a capture, a node whose stream is a stale non-capturing one
    (an AccumulateGrad made on the default stream by an earlier iteration) uses
    the capturing stream instead, so the backward is captured like the rest.
    The flag is process-wide and touches nothing outside a capture; its value
    before is back at the exit. Yields whether it is on.
    """
    import torch

    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    before: bool | None = None
    if setter is not None and getter is not None:
        try:
            before = bool(getter())
            setter(True)
        except Exception:  # a torch that has the name but not the switch
            before = None
    if setter is None or before is None:
        yield False
        return
    try:
        with warnings.catch_warnings():
            # "During CUDA graph capture, autograd node ... had a stale non-capturing stream"
            warnings.filterwarnings("ignore", message=r"(?s).*stale non-capturing stream")
            yield True
    finally:
        with contextlib.suppress(Exception):
            setter(before)


def inductor_cuda_graphs() -> int:
    """How many CUDA graphs inductor's CUDA-graph trees hold on the current device.

    0 when inductor was never imported, no tree exists on this thread and
    device, or this torch keeps them otherwise. Reads only: creates no tree.

    Example:
        >>> inductor_cuda_graphs() >= 0
        True
    """
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return 0
    try:
        import torch

        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return 0
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        container = containers.get(torch.cuda.current_device())
        manager = getattr(container, "tree_manager", None)
        nodes = [n for roots in (getattr(manager, "roots", None) or {}).values() for n in roots]
        count = 0
        while nodes:
            node = nodes.pop()
            count += 1
            nodes.extend(c for children in node.children.values() for c in children)
        return count
    except Exception:  # another torch's layout: say none rather than guess
        return 0


def _inductor_skips() -> int:
    """CUDA-graph skips and partitions kept out of CUDA graphs that inductor counted."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        # More than one partition: ops were kept out of the CUDA graphs.
        return int(inductor["cudagraph_skips"]) + int(inductor["cudagraph_partitions"])
    except Exception:
        return 0


@contextlib.contextmanager
def _eager_stance(on: bool) -> Iterator[None]:
    """Compiled functions run as plain Python inside (when ``on`` and this torch can).

    ``torch.compiler.set_stance("force_eager")``: dynamo's caches stay as they
    are, and the stance before is back at the exit, also after an exception.
    """
    stance = None
    if on:
        try:
            import torch

            stance = torch.compiler.set_stance("force_eager")  # sets it at once
        except Exception:  # a torch without stances
            stance = None
    if stance is None:
        yield
        return
    with stance:
        yield


def _backward_by_inductor(
    blocker: BaseException, graphs: int, skips: Sequence[str], captured: str
) -> CaptureProbe:
    """The verdict when the probe's backward had to join the default stream.

    ``graphs``: inductor's CUDA graphs alive in the process (they hold the last
    step's autograd graph); ``skips``: the CUDA-graph skips known (the guard's
    records, at their lines, or inductor's counters). Capturable when the
    forward was captured, inductor's graphs run and none was skipped; else
    ``not run``, with why.

    Example:
        >>> e = RuntimeError("operation would make the legacy stream depend on a capturing blocking stream")
        >>> _backward_by_inductor(e, 2, [], "x").status
        'capturable'
        >>> _backward_by_inductor(e, 0, [], "x").status
        'not run'
    """
    file, line, _ = blocking_line(blocker)
    at = f" at {os.path.basename(file)}:{line}" if file else ""
    if graphs and not skips:
        return CaptureProbe(
            status="capturable",
            reason=(
                f"backward by inductor's verdict: the forward was captured here; the backward{at} "
                f"was not (it had to join the default stream: inductor's {graphs} CUDA graph"
                f"{'s' if graphs != 1 else ''} keep the last step's outputs, and with them its "
                "autograd graph, alive); inductor captured the compiled backward itself and "
                "kept no op out of its CUDA graphs. Not checked: autograd hooks and the "
                "backward of code outside torch.compile"
            ),
            captured=captured,
        )
    why = (
        "(inductor's CUDA graphs keep the last step's autograd graph alive), and inductor "
        f"kept ops out of its CUDA graphs ({'; '.join(skips[:2])}), so its verdict does not "
        "cover the backward"
        if graphs and skips
        else "because an AccumulateGrad node of an earlier iteration is still alive (a tensor "
        "of that iteration, such as the last loss, holds its graph); run the probe where no "
        "earlier graph is alive, e.g. with del loss before the call"
    )
    return CaptureProbe(
        status="not run",
        reason=(
            f"inconclusive: the backward{at} joined the default stream {why} "
            f"({_first_line(blocker)})"
        ),
        captured=captured,
    )


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces, as inductor does around a capture.

    A matmul in the capture takes a workspace for the side stream from the
    graph's pool; cached by cuBLAS, it would keep that pool (tens of MB) alive
    after the graph is gone. The training's own workspaces go too: cuBLAS
    takes new ones at its next matmul, from the caching allocator.
    """
    import torch

    with contextlib.suppress(Exception):
        torch._C._cuda_clearCublasWorkspaces()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def probe(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    params: Iterable[Any] = (),
    skips: Sequence[str] = (),
) -> CaptureProbe:
    """Capture one call of ``fn(*args, **kwargs)``; never replay it.

    Args:
        fn: The step (or part of it) to capture.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        params: Tensors whose ``.grad`` the probe restores afterwards.
        skips: The CUDA-graph skips seen so far (``"reason at file:line"``),
            which keep inductor's verdict on the backward from counting.

    Returns:
        ``status`` ``"capturable"``, ``"blocked"`` (with the first line that
        stopped the capture), or ``"not run"`` (no CUDA device, or an
        inconclusive capture, with why).
    """
    import torch

    if not torch.cuda.is_available():
        return CaptureProbe(
            status="not run",
            reason="no CUDA device here: the capture probe needs one",
            captured=(
                f"one call of {_name(fn)} under torch.cuda.graph on a side stream "
                "(recorded, never replayed)"
            ),
        )
    # Compiled code runs as plain Python in the probed call: it must not replay
    # (or record) inductor's CUDA graphs inside the probe's capture, nor compile
    # there (a guard that fails on the probe's call would recompile under
    # capture, and add to the compiled code the training uses).
    eager = "torch._dynamo" in sys.modules
    graphs = inductor_cuda_graphs()
    captured = (
        f"one call of {_name(fn)}"
        + (
            ", its compiled functions run as plain Python (force_eager)"
            if eager and (graphs or frames_compiled())
            else ""
        )
        + " under torch.cuda.graph on a side stream (recorded, never replayed)"
    )
    saved_grads = [(p, p.grad) for p in params]
    for p, _ in saved_grads:
        p.grad = None  # the captured backward makes its own, in the graph's pool
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
        with torch.cuda.stream(side), _stale_streams_follow_capture() as follow:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                with _eager_stance(eager):
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
                _end_generator_capture(side)
        _clear_cublas_workspaces()
        with contextlib.suppress(Exception):
            graph.reset()
        del graph
        for p, g in saved_grads:
            p.grad = g
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state_all(cuda_rng)
    if follow:
        captured += "; autograd nodes of earlier iterations follow its stream"
    blocker = error or end_error
    # The error's traceback holds the step's frames, and with them what it
    # allocated in the capture: let go of it as soon as it is read.
    error = end_error = None
    if blocker is None:
        return CaptureProbe(status="capturable", captured=captured)
    if _stream_mismatch(blocker):
        # Not the step's own doing: the probe's side stream met autograd state
        # of an earlier iteration. Rather than blame a line, take inductor's
        # verdict on the backward where it holds, or say why not.
        counted = _inductor_skips()
        known = list(skips) or ([f"{counted} counted by inductor"] if counted else [])
        result = _backward_by_inductor(blocker, graphs, known, captured)
        blocker = None
        return result
    file, line, function = blocking_line(blocker)
    reason = _first_line(blocker)
    blocker = None
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
