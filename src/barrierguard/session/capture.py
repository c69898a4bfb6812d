"""The capture probe: one call of a step captured with ``torch.cuda.graph``, never replayed.

Captured on a side stream, which records kernels and runs none; the host state it changes
(``.grad``, RNG states, the current stream) is put back. Compiled functions run as plain
Python (``force_eager``); a backward that must join an earlier step's autograd graph takes
inductor's verdict where it kept no op out of its graphs (docs/compile.md).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import FrameType, FunctionType
from typing import Any

from barrierguard.detect.frames import OWN, USER, classify_file
from barrierguard.report.records import CaptureProbe
from barrierguard.session.compile_watch import dynamo_count, frames_compiled
from barrierguard.session.site_stats import code_at

__all__ = ["CallProbe", "blocking_line", "inductor_cuda_graphs", "probe"]


def blocking_line(exc: BaseException) -> tuple[str, int, str]:
    """The user's innermost line in ``exc``'s traceback (else the innermost not our own)."""
    fallback: tuple[str, int, str] = ("", 0, "")
    for fs in reversed(traceback.extract_tb(exc.__traceback__)):
        category = classify_file(fs.filename)[0]
        if category == USER:
            return fs.filename, fs.lineno or 0, fs.name
        if category != OWN and not fallback[0]:
            fallback = (fs.filename, fs.lineno or 0, fs.name)
    return fallback


def _release_failed_capture(graph: Any, stream: Any) -> None:
    """Undo what a capture that could not end leaves behind in the allocator and generators."""
    import torch

    # capture_end raised before ending the allocator's pool, which reset() does not
    # release: end it as torch.cuda.use_mem_pool does.
    with contextlib.suppress(Exception):  # this torch already ended it, or names it otherwise
        device, pool = torch.cuda.current_device(), graph.pool()
        torch._C._cuda_endAllocateToPool(device, pool)
        torch._C._cuda_releasePool(device, pool)
    # Nor did it tell the CUDA generators, so every later random op would fail ("Offset
    # increment outside graph capture"): an empty capture ends both once more.
    with contextlib.suppress(Exception):
        empty = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
                empty.capture_begin(capture_error_mode="thread_local")
                empty.capture_end()
        finally:
            with contextlib.suppress(Exception):
                empty.reset()


def _stream_mismatch(exc: BaseException) -> bool:
    """Whether autograd had to join the capture to the default stream (an old AccumulateGrad)."""
    text = str(exc)
    return any(
        m in text
        for m in (
            "legacy stream depend on",
            "stale non-capturing stream",
            "set_override_stale_capture_stream",
        )
    )


@contextlib.contextmanager
def _stale_streams_follow_capture() -> Iterator[bool]:
    """Autograd nodes of earlier iterations follow the capture's stream, where torch can
    (a process-wide switch that acts only during a capture); yields whether it is on."""
    import torch

    setter: Any = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    getter: Any = getattr(torch._C, "_override_stale_capture_stream", None)
    try:
        before: bool | None = bool(getter())
        setter(True)
    except Exception:  # a torch without the switch, or with the name but not the switch
        before = None
    if before is None:
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
    """How many CUDA graphs inductor's trees hold on the current device (creates none)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return 0
    try:
        import torch

        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return 0
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        manager = getattr(containers.get(torch.cuda.current_device()), "tree_manager", None)
        nodes = [n for roots in (getattr(manager, "roots", None) or {}).values() for n in roots]
        count = 0
        while nodes:
            count += 1
            nodes.extend(c for children in nodes.pop().children.values() for c in children)
        return count
    except Exception:  # another torch's layout: say none rather than guess
        return 0


def _eager_stance(on: bool) -> Any:
    """A context where compiled functions run as plain Python, when ``on`` and this torch can."""
    if on:
        with contextlib.suppress(Exception):  # a torch without stances
            import torch

            return torch.compiler.set_stance("force_eager")  # sets it at once
    return contextlib.nullcontext()


def _backward_by_inductor(
    blocker: BaseException, graphs: int, skips: Sequence[str], captured: str
) -> CaptureProbe:
    """Capturable when the backward had to join the default stream but inductor's graphs
    run and kept every op; else ``not run``, with why."""
    file, line, _ = blocking_line(blocker)
    at = f" at {os.path.basename(file)}:{line}" if file else ""
    if graphs and not skips:
        reason = (
            f"backward by inductor's verdict: the forward was captured here; the backward{at} "
            f"was not (it had to join the default stream: inductor's {graphs} CUDA graph"
            f"{'s' if graphs != 1 else ''} keep the last step's outputs, and with them its "
            "autograd graph, alive); inductor captured the compiled backward itself and "
            "kept no op out of its CUDA graphs. Not checked: autograd hooks and the "
            "backward of code outside torch.compile"
        )
        return CaptureProbe(status="capturable", reason=reason, captured=captured)
    why = (
        "(inductor's CUDA graphs keep the last step's autograd graph alive), and inductor "
        f"kept ops out of its CUDA graphs ({'; '.join(skips[:2])}), so its verdict does not "
        "cover the backward"
        if graphs and skips
        else "because an AccumulateGrad node of an earlier iteration is still alive (a tensor "
        "of that iteration, such as the last loss, holds its graph); run the probe where no "
        "earlier graph is alive, e.g. with del loss before the call"
    )
    reason = (
        f"inconclusive: the backward{at} joined the default stream {why} ({_first_line(blocker)})"
    )
    return CaptureProbe(status="not run", reason=reason, captured=captured)


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

    ``params``: tensors whose ``.grad`` is put back; ``skips``: the CUDA-graph skips seen
    so far (``"reason at file:line"``), which keep inductor's verdict on the backward out.
    """
    import torch

    name = str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))
    cuda = torch.cuda.is_available()
    # Compiled code runs as plain Python: no inductor CUDA graph and no compile in the capture.
    eager = "torch._dynamo" in sys.modules
    graphs = inductor_cuda_graphs() if cuda else 0
    plain = cuda and eager and (graphs or frames_compiled())
    captured = (
        f"one call of {name}"
        + (", its compiled functions run as plain Python (force_eager)" if plain else "")
        + " under torch.cuda.graph on a side stream (recorded, never replayed)"
    )
    if not cuda:
        reason = "no CUDA device here: the capture probe needs one"
        return CaptureProbe(status="not run", reason=reason, captured=captured)
    saved_grads = [(p, p.grad) for p in params]
    for p, _ in saved_grads:
        p.grad = None  # the captured backward makes its own, in the graph's pool
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all()
    error: BaseException | None = None
    end_error: BaseException | None = None
    graph = torch.cuda.CUDAGraph()
    # Unlike torch.cuda.graph, no synchronize: the side stream waits on the device.
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
            _release_failed_capture(graph, side)
        # cuBLAS's workspace for the side stream keeps the graph's pool (tens of MB)
        # alive: drop them, as inductor does (the training's come back at its next matmul).
        with contextlib.suppress(Exception):
            torch._C._cuda_clearCublasWorkspaces()
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
    # Its traceback holds the step's frames and what they allocated: let go once read.
    error = end_error = None
    if blocker is None:
        return CaptureProbe(status="capturable", captured=captured)
    if _stream_mismatch(blocker):
        # An earlier iteration's autograd state, not the step: inductor's verdict where it
        # holds (partitions kept out of CUDA graphs count as skips), or why not.
        counted = dynamo_count("inductor", "cudagraph_skips", "cudagraph_partitions")
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
        code=code_at(file, line) if file else "",
        captured=captured,
    )


def _function_of(frame: FrameType) -> Callable[..., Any] | None:
    """The function object running in ``frame`` (a closure: the one with its cells)."""
    code = frame.f_code
    for obj in gc.get_referrers(code):
        if not isinstance(obj, FunctionType) or obj.__code__ is not code:
            continue
        try:
            pairs = zip(code.co_freevars, obj.__closure__ or (), strict=False)
            if all(frame.f_locals.get(n) is c.cell_contents for n, c in pairs):
                return obj
        except ValueError:  # an empty cell
            continue
    return None


def _arguments(frame: FrameType) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``frame``'s function was called with, as it received them."""
    names, varargs, varkw, local = inspect.getargvalues(frame)
    n = frame.f_code.co_argcount
    args = (*(local[a] for a in names[:n]), *(local[varargs] if varargs else ()))
    return args, {a: local[a] for a in names[n:]} | (local[varkw] if varkw else {})


class CallProbe:
    """Probes the first call of a function named ``name`` once ``ready()`` says so, watching
    calls until then with a profile function (never installed over another profiler)."""

    def __init__(
        self,
        name: str,
        ready: Callable[[], bool],
        run: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], object],
    ) -> None:
        self.name, self.ready, self.run = name, ready, run
        self.done = self._armed = False
        self.note = ""

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
        code = frame.f_code
        if event != "call" or code.co_name != self.name or not self.ready():
            return
        if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE):
            return
        self.disarm()
        self.done = True
        fn = _function_of(frame)
        if fn is None:
            self.note = f"capture probe: the function object of {self.name!r} was not found"
            return
        self.run(fn, *_arguments(frame))
