"""Warnings raised inside a torch op under the audit, put back where they belong.

A warning that torch raises under the mode (``TORCH_WARN`` in C++, or Python's
``warn`` with a ``stacklevel``) is located at a frame of the mode, so it would
name ``barrierguard/detect/audit_*.py``: ``-W`` rules and ``filterwarnings(module=...)``
keyed on the user's module stop matching, and the once-per-location registry is
barrierguard's. Catching warnings around every call would cost each torch call
(and ``catch_warnings`` resets every registry), so the :class:`WarningRelay`
shows every warning located in the audit's modules (one filter) and re-issues
each at the frame it would name without barrierguard, with its category and
message, under the user's module, registry and filters. Nothing is paid until a
warning is raised.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

from barrierguard.detect.frames import OWN, classify_file
from barrierguard.detect.patch import drop_filter

__all__ = ["WarningRelay"]

# The audit's modules: a warning located in one was raised under its mode.
_MODULES = r"barrierguard\.detect\.audit"
_DISPATCH = ("overrides.py", "handle_torch_function")


def home_frame(frame: FrameType | None) -> FrameType | None:
    """The frame a warning located at ``frame`` (the mode's) would name without barrierguard.

    Outward past barrierguard's frames, and past torch's ``handle_torch_function``
    with the call that entered it (a torch function that dispatched to the mode
    runs again inside it).
    """
    while frame is not None and classify_file(frame.f_code.co_filename)[0] == OWN:
        frame = frame.f_back
    if frame is not None:
        code = frame.f_code
        if code.co_name == _DISPATCH[1] and code.co_filename.endswith(_DISPATCH[0]):
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
        warnings.filterwarnings("always", module=_MODULES)
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
            self._home = []

    def _show(self, msg: Any) -> None:
        saved = self._saved_show
        frame: FrameType | None = None
        try:
            if _is_audit_file(msg.filename):
                frame = _located(sys._getframe(1), msg.filename, msg.lineno)
                frame = home_frame(frame) if frame is not None else None
        except Exception:  # never lose a warning to our bookkeeping
            frame = None
        if frame is None:
            if saved is not None:
                saved(msg)
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


def _is_audit_file(filename: str) -> bool:
    return os.path.basename(filename).startswith("audit") and classify_file(filename)[0] == OWN


def _located(frame: FrameType | None, filename: str, lineno: int) -> FrameType | None:
    """The live frame at ``filename:lineno`` (where the warning was located)."""
    while frame is not None:
        if frame.f_code.co_filename == filename and frame.f_lineno == lineno:
            return frame
        frame = frame.f_back
    return None
