"""What torch.compile says about the watched code: its graph breaks and CUDA-graph skips.

A :class:`CompileListener` reads dynamo's ``graph_breaks`` and inductor's ``cudagraphs``
artifact logs while a guard runs, as :class:`CompileEvent` at the user's line; what
``TORCH_LOGS`` would print is still printed.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from dataclasses import dataclass
from types import CodeType

from barrierguard.detect.frames import USER, classify_file
from barrierguard.detect.patch import Patches

__all__ = [
    "CompileEvent",
    "CompileListener",
    "not_a_dynamo_frame",
    "parse_cudagraph_skip",
    "parse_graph_break",
]

ARTIFACTS = ("graph_breaks", "cudagraphs")

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$', re.M)
_AT = re.compile(r"in user code at (?P<file>.+):(?P<line>\d+)\s*$", re.M)
_GB = re.compile(r"/(gb\d{4})\.html")
# Lines of dynamo's message that say how the break was handled, not why.
_WRAPPERS = (
    "Encountered graph break",
    "Graph break encountered",
    "Failed to handle graph break",
    "Graph break under ",
)
# The dynamo config flags a graph break's hint may name.
_FLAGS = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")


@dataclass(frozen=True)
class CompileEvent:
    """One ``"graph_break"`` or ``"cudagraph_skip"`` (``what``), at the user's line.

    ``reason`` is the headline, ``detail`` its explanation and hints, ``gb`` the graph-break
    page (``"gb0124"``), ``flag`` the config flag a hint names, ``user`` whether the line is
    the user's (else the innermost frame dynamo named).
    """

    what: str
    file: str
    line: int
    function: str
    reason: str
    detail: str = ""
    gb: str = ""
    flag: str = ""
    user: bool = True


def _user_frame(text: str) -> tuple[str, int, str] | None:
    """The innermost frame of ``text``'s traceback that is the user's own code."""
    best: tuple[str, int, str] | None = None
    for m in _FRAME.finditer(text):
        file = m.group("file")
        if classify_file(file)[0] == USER:
            best = (file, int(m.group("line")), m.group("func").strip())
    return best


def parse_graph_break(text: str, exc: BaseException | None = None) -> CompileEvent | None:
    """A graph break from the text of a ``graph_breaks`` log record.

    Example:
        >>> e = parse_graph_break(
        ...     "Graph break in user code at /w/train.py:12\\n"
        ...     "Graph Break Reason: Data-dependent branching\\n"
        ...     "  Explanation: Detected data-dependent branching.\\n"
        ...     " For more details ... https://x/gb/gb0170.html\\n")
        >>> (e.line, e.reason, e.gb)
        (12, 'Data-dependent branching', 'gb0170')
    """
    head, _, stack = text.partition("\nUser code traceback:\n")
    if "Graph Break Reason:" in head:
        body = head.split("Graph Break Reason:", 1)[1]
    elif exc is not None:
        body = str(exc)
    else:
        body = head.split("\n", 1)[-1]
    reason = ""
    detail: list[str] = []
    for ln in map(str.strip, body.splitlines()):
        if not ln or ln.startswith(_WRAPPERS):
            continue
        if not reason:
            reason = ln
        elif ln.startswith(("Explanation:", "Hint:")):
            detail.append(ln)
    where = _user_frame(stack or head)
    user = where is not None
    if where is None:
        at = _AT.search(head.split("\n", 1)[0] + "\n")
        if at is None:
            return None
        where = (at.group("file"), int(at.group("line")), "")
        user = classify_file(where[0])[0] == USER
    gb = _GB.search(text)
    return CompileEvent(
        "graph_break",
        *where,
        reason=reason or "graph break",
        detail=" ".join(detail),
        gb=gb.group(1) if gb else "",
        flag=next((flag for flag in _FLAGS if flag in body), ""),
        user=user,
    )


def parse_cudagraph_skip(text: str) -> CompileEvent | None:
    """A CUDA-graph skip from the text of a ``cudagraphs`` log record, or ``None``.

    Example:
        >>> e = parse_cudagraph_skip(
        ...     "skipping cudagraphs due to cpu device (arg0_1). Found from : \\n"
        ...     '   File "/w/train.py", line 30, in loss_fn\\n    w = torch.tensor([1.0])\\n')
        >>> (e.line, e.reason)
        (30, 'cpu device (arg0_1)')
    """
    if "skipping cudagraphs" not in text:
        return None
    first = text.split("\n", 1)[0]
    reason = first.split("skipping cudagraphs due to", 1)[-1].strip()
    reason = reason.split(". Found from", 1)[0].strip() or first.strip()
    where = _user_frame(text)
    return CompileEvent("cudagraph_skip", *(where or ("", 0, "")), reason, user=where is not None)


_PARTITION_OP = re.compile(r"^\s*op\d+: reason=(?P<reason>.+?)(?:, ir=|$)")


def not_a_dynamo_frame(code: CodeType) -> None:
    """Keep dynamo from compiling ``code`` as a frame of its own, so that our hooks see the
    calls a graph break leaves to eager mode as eager code (no-op on a torch without it)."""
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameAction.SKIP
        eval_frame.set_code_exec_strategy(code, eval_frame._FrameExecStrategy(skip, skip))
    except (ImportError, AttributeError, TypeError, RuntimeError):
        pass


_listening_lock = threading.Lock()
_listening: list[CompileListener] = []
_patch = Patches()  # torch._logging.getArtifactLogger, while a listener runs


class CompileListener(logging.Handler):
    """Collects graph breaks and CUDA-graph skips between :meth:`start` and :meth:`stop`, as
    the handler of torch's loggers (``logging`` calls :meth:`emit` under its lock)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[CompileEvent] = []
        self.faults: list[str] = []
        self.notes: list[str] = []
        # logger name -> (level, propagate, effective level) before we touched it
        self._saved: dict[str, tuple[int, bool, int]] = {}
        self._listening = False
        # Inductor (torch 2.9+) logs each op it cannot put in a CUDA graph, then its stack
        # one frame per record: the op's reason, and its event at the innermost user frame.
        self._reason: str | None = None
        self._placed: CompileEvent | None = None

    def start(self) -> None:
        """Attach to every artifact logger there is, and to those made from now on."""
        for name in list(logging.Logger.manager.loggerDict):
            if name.rsplit(".__", 1)[-1] in ARTIFACTS:
                self._attach(logging.getLogger(name))
        try:
            import torch._logging as tl

            original = tl.getArtifactLogger  # type: ignore[attr-defined]
        except (ImportError, AttributeError):
            self.notes.append(
                "torch._logging.getArtifactLogger is missing in this torch: graph breaks "
                "and CUDA-graph skips were not read"
            )
            return

        # One patch for all listeners, removed by the last: stops in any order restore it.
        with _listening_lock:
            if not _listening:

                def get_artifact_logger(module_qname: str, artifact_name: str) -> logging.Logger:
                    logger: logging.Logger = original(module_qname, artifact_name)
                    if artifact_name in ARTIFACTS:
                        for listener in list(_listening):
                            try:
                                listener._attach(logger)
                            except Exception as exc:
                                listener.faults.append(f"{type(exc).__name__}: {exc}")
                    return logger

                _patch.set(tl, "getArtifactLogger", get_artifact_logger)
            _listening.append(self)
        self._listening = True

    def stop(self) -> None:
        """Detach from every logger and restore its level and propagation."""
        if self._listening:
            self._listening = False
            with _listening_lock:
                _listening.remove(self)
                if not _listening:
                    _patch.undo()
        for name, (level, propagate, _) in self._saved.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate
        self._saved.clear()

    def _attach(self, logger: logging.Logger) -> None:
        if logger.name in self._saved:
            return
        level = logger.getEffectiveLevel()
        # Already enabled (TORCH_LOGS=graph_breaks), it prints as before; else it is
        # lowered for our handler only, and emit() passes on what it printed before.
        enabled = level <= logging.DEBUG
        self._saved[logger.name] = (logger.level, logger.propagate, 10**6 if enabled else level)
        if not enabled:
            logger.setLevel(logging.DEBUG)
            logger.propagate = False
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        """Read ``record``; hand on what the logger would have propagated."""
        try:
            self._take(record)
        except Exception as exc:  # never lose a compile to our parsing
            self.faults.append(f"{type(exc).__name__}: {exc}")
        saved = self._saved.get(record.name)
        parent = logging.getLogger(record.name).parent
        if saved is not None and saved[1] and record.levelno >= saved[2] and parent is not None:
            parent.callHandlers(record)

    def _take(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.name.rsplit(".__", 1)[-1] == "graph_breaks":
            event = parse_graph_break(text, record.exc_info[1] if record.exc_info else None)
        else:
            event = parse_cudagraph_skip(text)
            # An op outside inductor's partitions costs only with its CUDA graphs on.
            config = sys.modules.get("torch._inductor.config")
            if event is None and getattr(getattr(config, "triton", None), "cudagraphs", False):
                self._partition(text)
                return
        if event is not None:
            self.events.append(event)
            self._placed = None

    def _partition(self, text: str) -> None:
        """Place the pending op of a CUDA-graph partition at a frame of ``text``."""
        m = _PARTITION_OP.match(text)
        if m is not None:
            self._reason, self._placed = m.group("reason").strip(), None
            return
        if self._reason is None:
            return
        if "Partition " in text or "graph partitions" in text:
            self._reason = None  # the op's stack ended without a line of the user's
            return
        where = _user_frame(text)
        if where is None:
            return
        if self._placed is not None:
            self.events.pop()  # the same op, placed at an inner frame
        self._placed = CompileEvent(
            "cudagraph_skip", *where, f"not in a CUDA graph: {self._reason}"
        )
        self.events.append(self._placed)
