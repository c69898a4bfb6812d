"""One walk of the stack per sync: the user's line, the framework mechanism and the phase.

Every engine hands a detected sync to :func:`observe`, which walks outward from
the frame that synchronized once and returns a :class:`Sync`: the interned
:class:`~barrierguard.detect.frames.Location` (the user's line, the kind, the
framework line), the innermost mechanism of the framework table
(``frameworks.MECHANISMS``, with the Lightning hook in flight) and the phase of
the innermost phase marker (``frameworks.PHASES``). The recorders count it;
fixes and causes are looked up when a report is made, never per sync.

What the walk reads of a frame is fixed by its file and its function's name, so
each source file is classified once (:func:`_learn`), and a frame costs one
dictionary lookup by file name (two in a file that the framework tables name). The walk stops at the innermost phase marker
(or, with no framework that has phases imported, once the user's frame and a
mechanism are found); the location of a call path seen before is one lookup in
the location cache.

Example:
    >>> import sys
    >>> sync = observe(sys._getframe(), "item")
    >>> (sync.loc.kind, sync.loc.origin, sync.mechanism, sync.phase)
    ('item', 'user', None, None)
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType

from barrierguard.detect import frameworks
from barrierguard.detect.frames import FRAMEWORK, OWN, USER, Location, classify_file, place

__all__ = ["Sync", "annotate", "forget", "observe"]


class Sync:
    """One sync as the engines hand it to the recorders.

    Attributes:
        loc: Where it happened (interned: the same object for a hot site).
        mechanism: The framework table's mechanism, ``"name (hook)"`` while a
            Lightning hook is in flight, or ``None``.
        phase: The phase the stack shows (the innermost marker's), or ``None``.
    """

    __slots__ = ("loc", "mechanism", "phase")

    def __init__(self, loc: Location, mechanism: str | None = None, phase: str | None = None):
        self.loc = loc
        self.mechanism = mechanism
        self.phase = phase

    def __repr__(self) -> str:
        return f"Sync({self.loc!r}, mechanism={self.mechanism!r}, phase={self.phase!r})"


# What a source file is, as flags (the walk tests a frame's flags first).
_OWN = 1  # barrierguard's machinery: not a place of the sync
_USER = 2  # the user's code: the location ends here
_FRAMEWORK = 4  # a framework's code (its name in the entry)
_REAL = 8  # a frame that can be the one that synchronized (not torch's core nor stdlib)
_TABLE = 16  # a file with functions in the framework tables
_MARKS = 32  # ... among them a phase marker or a hook caller
# What a function of the framework tables is.
_MECHANISM = 1
_DIRECT = 2  # ... a mechanism that counts only syncs made in the function itself
_MARKER = 4  # a phase marker
_CALLER = 8  # a Lightning hook caller (it holds the hook's name)

# A table function: (its flags, the mechanism's name, the phase marker).
_Function = tuple[int, "str | None", frameworks.Marker]
# A file: (flags, framework name, its table functions by name or None, the
# entry of its other functions). Keyed by the file name, whose hash Python
# caches: a frame costs one lookup (an id() of the code would allocate an int).
_File = tuple[int, str, "dict[str, _Function] | None", "_Function | None"]
_files: dict[str, _File] = {}

# Code flags of a function whose frame is suspended and resumed (generator,
# coroutine, async generator): its f_back is whoever resumed it last.
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

# Depth at which the search for a mechanism and a phase gives up (the location
# is always found: it ends at the first user frame).
_STOP_DEPTH = 120


def _function(entry: frameworks.Function) -> _Function:
    mechanism, direct, marker, caller = entry
    flags = (
        (_MECHANISM if mechanism is not None else 0)
        | (_DIRECT if direct else 0)
        | (_MARKER if marker is not None else 0)
        | (_CALLER if caller else 0)
    )
    return flags, mechanism, marker


def _learn(filename: str) -> _File:
    category, name = classify_file(filename)
    real, functions = frameworks.file_entry(filename)
    flags = (
        (_OWN if category == OWN else 0)
        | (_USER if category == USER else 0)
        | (_FRAMEWORK if category == FRAMEWORK else 0)
        | (_REAL if real else 0)
        | (_TABLE if functions is not None else 0)
    )
    table: dict[str, _Function] | None = None
    other: _Function | None = None
    if functions is not None:
        table = {k: _function(v) for k, v in functions.items() if k != "*"}
        if "*" in functions:
            other = _function(functions["*"])
        every = [*table.values(), *([other] if other is not None else [])]
        if any(fn[0] & (_MARKER | _CALLER) for fn in every):
            flags |= _MARKS
    entry: _File = (flags, name, table, other)
    if len(_files) < 100_000:
        _files[filename] = entry
    return entry


def _phases_possible() -> bool:
    """Whether a framework with phase markers is imported (else none can be on the stack)."""
    # isdisjoint runs in C: any() over a generator costs a microsecond a sync.
    return not sys.modules.keys().isdisjoint(frameworks.PHASE_PACKAGES)


_Found = tuple["FrameType | None", "FrameType | None", str, "FrameType | None"]
_NONE: _Function = (0, None, None)


class _Anchors:
    """Two frames that earlier walks passed, and what lies outward of each.

    A frame object is one activation for as long as it lives, and the frames
    outward of a live one do not change: a walk that meets the same object
    (``is``) knows the rest without walking it. ``located``: a frame past
    which, the search being over, only the location was missing (the frame
    after a phase marker, inside a framework's loop), with the user's frame
    and the first framework frame from it on (when the walk noted it: a walk
    that had met one already only looked for the user's frame). ``searched``: a frame from which
    no function of the framework tables lies on the way to the root (a plain
    loop). Each is one slot, replaced when a walk misses it, and dropped at
    every step boundary and when an engine uninstalls (:func:`forget`), so
    that no finished frame is held for long. ``last``: the frame of the last
    sync, with the instruction it was at and the sync found there: a loop
    that reads a value in its own body meets the same frame at the same
    instruction every step, and gets the sync without a walk.
    """

    located: tuple[FrameType, FrameType, FrameType | None, str, bool] | None = None
    searched: FrameType | None = None
    # The last observed frame, its instruction, the kind and detail asked for,
    # and the sync found (one tuple: a thread reads it whole).
    last: tuple[FrameType, int, str | None, str, Sync] | None = None


_anchors = _Anchors()


def forget() -> None:
    """Drop the frames the walk keeps as anchors (step boundaries, uninstall)."""
    _anchors.located = None
    _anchors.searched = None
    _anchors.last = None


def _walk(frame: FrameType | None, locate: bool) -> tuple[_Found, str | None, str | None]:
    """The one walk: ``((innermost, framework, its name, user), mechanism, phase)``.

    Two loops over the same frames: the first, to the user's frame, reads
    everything; the second, outward of it, only what marks a mechanism, a hook
    caller or a phase (most frames there are none: one lookup each). Either
    ends early at its anchor (:class:`_Anchors`) when it meets it.
    """
    get = _files.get
    phases = _phases_possible()
    located = _anchors.located
    found: str | None = None
    caller: FrameType | None = None
    phase: str | None = None
    search = True
    first_real = True
    innermost: FrameType | None = None
    framework: FrameType | None = None
    framework_name = ""
    user: FrameType | None = None
    # The anchor to be (the first frame once the search is over) and the first
    # framework frame from it on.
    pending: FrameType | None = None
    pending_framework: FrameType | None = None
    pending_name = ""
    complete = True  # whether the anchor to be knows its first framework frame
    depth = 0
    f = frame
    while f is not None and (locate or first_real):
        if not search and locate and innermost is not None:
            if located is not None and f is located[0] and (framework or located[4]):
                user = located[1]
                if framework is None and located[2] is not None:
                    framework, framework_name = located[2], located[3]
                break
            if pending is None:
                pending = f
            if framework is not None:
                # Only the user's frame is missing: the tightest loop (it does
                # not note framework frames, so the anchor will not either).
                complete = False
                f = _to_user(f, located[0] if located is not None else None)
                if f is None:
                    break
                if located is not None and f is located[0]:
                    continue
        code = f.f_code
        entry = get(code.co_filename) or _learn(code.co_filename)
        flags = entry[0]
        if search:
            # Once a mechanism is found, only a marker or a hook caller matters.
            if flags & _TABLE and (found is None or flags & _MARKS):
                fn = _table_function(entry, code.co_name)
                if fn[0] & _MECHANISM and found is None and (first_real or not fn[0] & _DIRECT):
                    found = fn[1]
                    search = phases
                if search and fn[0] & _CALLER and caller is None:
                    caller = f
                if search and fn[0] & _MARKER:
                    phase = _phase(fn[2], f)
                    search = phase is None
            depth += 1
            search = search and depth < _STOP_DEPTH
        if flags & _REAL:
            first_real = False
        if locate and not flags & _OWN:
            if innermost is None:
                innermost = f
            if flags & _USER:
                user = f
                locate = False
                if pending is not None:
                    _anchors.located = (pending, f, pending_framework, pending_name, complete)
            elif flags & _FRAMEWORK:
                if framework is None:
                    framework, framework_name = f, entry[1]
                if pending is not None and pending_framework is None:
                    pending_framework, pending_name = f, entry[1]
        f = f.f_back
    if search and f is not None:
        # Outward of the first real frame (the user's, at the latest) a direct
        # mechanism never applies, and the location is known.
        searched = _anchors.searched
        start = f
        plain = True  # no table function met: start becomes the anchor
        for _ in range(_STOP_DEPTH - depth):
            if f is None or f is searched:
                break
            code = f.f_code
            entry = get(code.co_filename) or _learn(code.co_filename)
            flags = entry[0]
            if flags & _TABLE:
                plain = False
                if found is None or flags & _MARKS:
                    fn = _table_function(entry, code.co_name)
                    if fn[0] & _MECHANISM and found is None and not fn[0] & _DIRECT:
                        found = fn[1]
                        if not phases:
                            break
                    if fn[0] & _CALLER and caller is None:
                        caller = f
                    if fn[0] & _MARKER:
                        phase = _phase(fn[2], f)
                        if phase is not None:
                            break
            f = f.f_back
        if plain and f is None:
            _anchors.searched = start
    mechanism = found
    if found is not None and caller is not None:
        hook = caller.f_locals.get("hook_name")
        if isinstance(hook, str):
            mechanism = f"{found} ({hook})"
    return (innermost, framework, framework_name, user), mechanism, phase


def _to_user(frame: FrameType, anchor: FrameType | None) -> FrameType | None:
    """The first user frame from ``frame`` outward, or ``anchor`` if met first."""
    get = _files.get
    f: FrameType | None = frame
    while f is not None and f is not anchor:
        filename = f.f_code.co_filename
        if (get(filename) or _learn(filename))[0] & _USER:
            return f
        f = f.f_back
    return f


def _table_function(entry: _File, name: str) -> _Function:
    table = entry[2]
    return (table.get(name) if table is not None else None) or entry[3] or _NONE


def _phase(marker: frameworks.Marker, frame: FrameType) -> str | None:
    return marker if isinstance(marker, str) or marker is None else marker(frame)


def observe(frame: FrameType | None, kind: str | None = None, detail: str = "") -> Sync | None:
    """Walk outward from ``frame`` once: where the sync is, its mechanism, its phase.

    Args:
        frame: The innermost frame of the sync (barrierguard's own frames are
            skipped).
        kind: The kind when the caller already knows it (an intercepted call);
            otherwise it is read from the executing instruction.
        detail: Extra detail for a known kind (a copy's direction).

    Returns:
        The sync, or ``None`` when the stack holds no frame but barrierguard's.
    """
    last = _anchors.last
    if (
        last is not None
        and frame is last[0]
        and frame is not None
        and frame.f_lasti == last[1]
        and kind == last[2]
        and detail == last[3]
    ):
        # The same live frame at the same instruction: the frames outward of
        # it are the ones the walk saw, so the sync is the one it found.
        return last[4]
    (innermost, framework, name, user), mechanism, phase = _walk(frame, True)
    if innermost is None:
        return None
    loc = place(innermost, framework, name, user, kind, detail)
    sync = Sync(loc, mechanism, phase)
    if frame is innermost and not frame.f_code.co_flags & _RESUMABLE:
        # Only a frame of the sync's own place is kept: one of barrierguard's
        # (a wrapper) is new at every call and would never be met again. A
        # generator's or coroutine's frame is resumed from any caller: the
        # frames outward of it change, it is never kept.
        _anchors.last = (frame, frame.f_lasti, kind, detail, sync)
    return sync


def annotate(frame: FrameType | None) -> tuple[str | None, str | None]:
    """The framework mechanism and the phase the stack shows, from ``frame`` outward.

    The part of :func:`observe` that is not the location.

    Returns:
        ``(mechanism, phase)``: the innermost table mechanism on the stack as
        ``"name (hook)"`` when a Lightning hook is in flight, else ``"name"``,
        or ``None``; and the innermost phase marker's phase, or ``None``.

    Example:
        >>> import sys
        >>> annotate(sys._getframe())
        (None, None)
    """
    _, mechanism, phase = _walk(frame, False)
    return mechanism, phase
