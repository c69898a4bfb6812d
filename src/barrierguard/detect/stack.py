"""One walk of the stack per sync: the user's line, the framework mechanism and the phase.

:func:`observe` returns a :class:`Sync`: the interned location, the innermost mechanism of
``frameworks.MECHANISMS`` (with the Lightning hook in flight) and the innermost phase marker's
phase. Each source file is classified once (a frame costs one lookup by file name); a sync met
again is found from anchors and routes without a walk.

Example:
    >>> import sys
    >>> sync = observe(sys._getframe(), "item")
    >>> (sync.loc.kind, sync.loc.origin, sync.mechanism, sync.phase)
    ('item', 'user', None, None)
"""

from __future__ import annotations

import dis
import inspect
import sys
from dataclasses import InitVar, dataclass, field
from types import CodeType, FrameType

from barrierguard.detect import frameworks
from barrierguard.detect.frames import FRAMEWORK, OWN, USER, Location, classify_file, place

__all__ = ["Sync", "annotate", "forget", "observe"]


@dataclass(slots=True, eq=False)
class Sync:
    """One sync as the engines hand it to the recorders.

    Attributes:
        loc: Where it happened (interned: the same object for a hot site).
        mechanism: The table's mechanism, ``"name (hook)"`` in a Lightning hook, or ``None``.
        phase: The phase the stack shows (the innermost marker's), or ``None``.
    """

    loc: Location
    mechanism: str | None = None
    phase: str | None = None


# Every Sync by its parts: one object however found (a recorder tells a repeat by identity).
_syncs: dict[tuple[Location, str | None, str | None], Sync] = {}


def _sync(loc: Location, mechanism: str | None, phase: str | None) -> Sync:
    key = (loc, mechanism, phase)
    sync = _syncs.get(key)
    if sync is None:
        sync = Sync(loc, mechanism, phase)
        if len(_syncs) < 100_000:
            _syncs[key] = sync
    return sync


# What a source file is, as flags (the walk tests a frame's flags first).
_OWN = 1  # barrierguard's machinery: not a place of the sync
_USER = 2  # the user's code: the location ends here
_FRAMEWORK = 4  # a framework's code (its name in the entry)
_REAL = 8  # a frame that can be the one that synchronized (not torch's core nor stdlib)
_TABLE = 16  # a file with functions in the framework tables
_MARKS = 32  # ... among them a phase marker or a hook caller
_CATEGORY_FLAGS = {OWN: _OWN, USER: _USER, FRAMEWORK: _FRAMEWORK}
# What a function of the framework tables is.
_MECHANISM = 1
_DIRECT = 2  # ... a mechanism that counts only syncs made in the function itself
_MARKER = 4  # a phase marker
_CALLER = 8  # a Lightning hook caller (it holds the hook's name)

# A table function: (its flags, the mechanism's name, the phase marker).
_Function = tuple[int, "str | None", frameworks.Marker]
# A file by name (its hash is cached; an id() would allocate): (flags, framework name, its
# table functions by name or None, the entry of its other functions).
_File = tuple[int, str, "dict[str, _Function] | None", "_Function | None"]
_files: dict[str, _File] = {}

# A resumable frame's f_back is whoever resumed it last.
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
# Depth at which the search for a mechanism and a phase gives up (not the location's).
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
    flags = _CATEGORY_FLAGS.get(category, 0) | (_REAL if real else 0)
    flags |= _TABLE if functions is not None else 0
    table: dict[str, _Function] | None = None
    other: _Function | None = None
    if functions is not None:
        table = {k: _function(v) for k, v in functions.items()}
        other = table.pop("*", None)
        if any(fn[0] & (_MARKER | _CALLER) for fn in (*table.values(), other or _NONE)):
            flags |= _MARKS
    entry: _File = (flags, name, table, other)
    if len(_files) < 100_000:
        _files[filename] = entry
    return entry


# (len(sys.modules), the answer) of the last look: asked again after an import.
_phases_seen: tuple[int, bool] = (-1, False)

# Whether forget() has anything to drop: set wherever a frame or the look above is kept,
# cleared by a forget() that found nothing (a boundary after no walk skips the call).
holding = False
# The held frames' (id, depth for sys._getframe in forget's origin) at the last live forget(),
# cleared wherever holding is set: while it stands, a boundary that finds each frame there has
# nothing to drop (Guard._advance tests it inline, without a call).
settled: tuple[tuple[int, int], ...] | None = None
_ORIGIN_DEPTH = 8  # how far out of forget() its origin may be


def _phases_possible() -> bool:
    """Whether a framework with phase markers is imported (else none can be on the stack)."""
    global _phases_seen, holding, settled
    modules = sys.modules
    seen = _phases_seen
    if seen[0] != len(modules):
        holding, settled = True, None
        # isdisjoint runs in C (any() over a generator cost a microsecond a sync).
        seen = _phases_seen = (
            len(modules),
            not modules.keys().isdisjoint(frameworks.PHASE_PACKAGES),
        )
    return seen[1]


_Found = tuple["FrameType | None", "FrameType | None", str, "FrameType | None"]
_NONE: _Function = (0, None, None)


class _Anchors:
    """Frames that earlier walks passed: a walk that meets one (``is``) knows what lies outward.
    Dropped at step boundaries and uninstall (:func:`forget`): no finished frame is held long."""

    # A frame past which only the location was missing (inside a framework's loop), the user's
    # frame, the first framework frame, its name, whether the walk noted it, and the distances
    # to the user's frame and to the framework frame.
    located: tuple[FrameType, FrameType, FrameType | None, str, bool, int, int] | None = None
    # A frame with no table function between it and the root (a plain loop).
    searched: FrameType | None = None
    # The last observed frame, its instruction, kind and detail, and its sync (one tuple).
    last: tuple[FrameType, int, str | None, str, Sync] | None = None
    # The last replayed route's key (code, instruction, kind, detail) and its routes.
    hot: tuple[CodeType, int, str | None, str, list[_Route]] | None = None
    # The last route replayed for a read, with its code and instruction: CudaEngine._read
    # tries it first (in user code too: a function a step calls is a new frame each step).
    read: tuple[CodeType, int, _Route] | None = None


_anchors = _Anchors()


@dataclass(slots=True, eq=False)
class _Route:
    """What a walk's answer came from, by depth outward of the sync's frame: the same code and
    instruction give the same sync while the probed frames are where they were and ``outer``
    (the frame past the user's, when the phase search ran out) lives."""

    code: CodeType  # the sync's frame's: held, so that its id in the key stays its own
    kept: bool  # whether the sync's frame is the user's own (kept as the last)
    probes: tuple[tuple[int, CodeType, int], ...]
    outer: tuple[int, FrameType] | None
    markers: tuple[tuple[int, frameworks.Marker], ...]
    phase: str | None
    phases: bool
    caller: int
    mechanism: str | None
    found: InitVar[Sync]
    loc: Location = field(init=False)
    sync: Sync | None = field(init=False)

    def __post_init__(self, found: Sync) -> None:
        self.loc = found.loc
        static = self.caller < 0 and all(isinstance(m, str) for _, m in self.markers)
        self.sync = found if static else None


# User frames a route's held frame may lie past, each then probed by its code (a probe more
# at every replay): one covers a read in a function that the loop's step function calls.
_WITNESS_SKIP = 1
# Routes by the sync's (code id, instruction, kind, detail); a few per key.
_routes: dict[tuple[int, int, str | None, str], list[_Route]] = {}
_ROUTES_PER_KEY = 4
_NO_ROUTES: list[_Route] = []  # never filled
# Routes that hold a frame (``outer``): dropped with the anchors.
_held: list[tuple[tuple[int, int, str | None, str], _Route]] = []
# The depth (forget's sys._getframe(depth)) of each held frame, by id, at the last boundary.
_depths: dict[int, int] = {}
# Counts the changes to _held outside forget (a route learnt or dropped).
_held_version = 0
# What the last boundary kept, by id: searched, located's and last's frames, _held_version.
_kept: tuple[int, int, int, int] | None = None


def forget(live: bool = False, origin: FrameType | None = None) -> None:
    """Drop the frames the walk keeps; with ``live`` (a step boundary), not those on the stack.
    With ``origin`` (a frame out of this call), :data:`settled` counts its depths from it."""
    global _phases_seen, _depths, _kept, holding, settled
    # Cleared before the look: a frame another thread keeps meanwhile sets it again.
    holding, settled = False, None
    _phases_seen = (-1, False)
    located, searched, last = _anchors.located, _anchors.searched, _anchors.last
    if last is not None and _returned(last[0]):
        # The last read's frame, often a function the step calls, has returned: dropped
        # without a look (a walk for a frame not on the stack goes to its root).
        _anchors.last = last = None
    read = _anchors.read
    if not (_held or located or searched or last or (read and read[2].outer)):
        return  # a read's route without a frame holds nothing
    holding = True
    if live and _kept == (
        id(searched),
        id(located and located[0]),
        id(last and last[0]),
        _held_version,
    ):
        # Nothing held changed: the kept frames live if each is where it was.
        getframe = sys._getframe
        try:
            for held, depth in _depths.items():
                if id(getframe(depth)) != held:
                    break
            else:
                settled = _settle(origin)
                return
        except ValueError:
            pass
    _kept = None
    on_stack: set[int] = set()
    if live:
        # The held frames that are on the stack: the walk ends once all are met.
        wanted = {id(route.outer[1]) for _, route in _held}  # type: ignore[index]
        for frame in (searched, located and located[0], last and last[0]):
            if frame is not None:
                wanted.add(id(frame))
        # First where each was at the last boundary (a probe makes no frame object).
        getframe = sys._getframe
        for held, depth in _depths.items():
            if held in wanted:
                try:
                    if id(getframe(depth)) == held:
                        on_stack.add(held)
                except ValueError:
                    pass
        depths = {held: _depths[held] for held in on_stack}
        if len(on_stack) < len(wanted):
            f: FrameType | None = getframe(1)
            depth = 1
            while f is not None and len(on_stack) < len(wanted):
                if id(f) in wanted:
                    on_stack.add(id(f))
                    depths[id(f)] = depth
                f = f.f_back
                depth += 1
        _depths = depths
    else:
        _depths = {}
    if located is None or id(located[0]) not in on_stack:
        _anchors.located = None
    if id(searched) not in on_stack:
        _anchors.searched = None
    if last is None or id(last[0]) not in on_stack:
        _anchors.last = None
    if read is not None and read[2].outer is not None and id(read[2].outer[1]) not in on_stack:
        _anchors.read = None  # its route holds a frame that finished
    still = [(key, route) for key, route in _held if id(route.outer[1]) in on_stack]  # type: ignore[index]
    for key, route in _held:
        routes = _routes.get(key)
        if routes is not None and route in routes and id(route.outer[1]) not in on_stack:  # type: ignore[index]
            routes.remove(route)
    _held[:] = still
    if live:
        located, last = _anchors.located, _anchors.last
        _kept = (
            id(_anchors.searched),
            id(located and located[0]),
            id(last and last[0]),
            _held_version,
        )
        settled = _settle(origin)


# The opcodes a frame that returned stopped at (one that raised stopped elsewhere: looked for).
_RETURNS = frozenset(
    op for name, op in dis.opmap.items() if name.endswith(("RETURN_VALUE", "RETURN_CONST"))
)


def _returned(frame: FrameType) -> bool:
    """Whether ``frame`` (not a generator's: a generator's may resume) has returned."""
    try:
        return frame.f_code.co_code[frame.f_lasti] in _RETURNS
    except IndexError:
        return False


def _settle(origin: FrameType | None) -> tuple[tuple[int, int], ...] | None:
    """:data:`_depths` counted from ``origin`` (``None`` where there is none, or it is not near
    forget's caller). The held frames are all on one stack: while the innermost is where it
    was, so is each frame out of it, unless it is a generator's or a coroutine's (resumed, its
    callers change), so only it is given then."""
    if origin is None:
        return None
    f: FrameType | None = sys._getframe(2)  # forget's caller: its sys._getframe(1)
    for out in range(1, _ORIGIN_DEPTH):
        if f is None:
            return None
        if f is origin:
            held = tuple((held, depth - out) for held, depth in _depths.items())
            if len(held) > 1:
                inner = min(held, key=_depth_of)
                # sys._getframe(1) in forget is sys._getframe(2) here.
                if not sys._getframe(inner[1] + out + 1).f_code.co_flags & _RESUMABLE:
                    return (inner,)
            return held
        f = f.f_back
    return None


def _depth_of(held: tuple[int, int]) -> int:
    return held[1]


@dataclass(slots=True, eq=False)
class _Trace:
    """What a walk notes for a route: the depth and frame of each source of its answer."""

    innermost: int = -1
    framework: int = -1
    user: int = -1
    mechanism: tuple[int, FrameType] | None = None
    caller: tuple[int, FrameType] | None = None
    markers: list[tuple[int, FrameType, frameworks.Marker]] = field(default_factory=list)
    # -1: decided; else the depth where the search ran out (None: no route).
    complete: int | None = -1


def _walk(
    frame: FrameType | None, locate: bool, trace: _Trace | None = None
) -> tuple[_Found, str | None, str | None]:
    """The one walk: ``((innermost, framework, its name, user), mechanism, phase)``. The first
    loop, to the user's frame, reads everything; the second only mechanisms, hook callers and
    phases. Either ends at its anchor (:class:`_Anchors`)."""
    global holding, settled
    holding, settled = True, None  # it may keep frames (forget)
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
    # The anchor to be (the first frame once the search is over), its depth, its framework frame.
    pending: FrameType | None = None
    pending_depth = 0
    pending_framework: FrameType | None = None
    pending_name = ""
    framework_at = -1
    complete = True  # whether the anchor to be knows its first framework frame
    depth = 0  # of f, outward of frame
    f = frame
    while f is not None and (locate or first_real):
        if not search and locate and innermost is not None:
            if located is not None and f is located[0] and (framework or located[4]):
                user = located[1]
                if trace is not None:
                    trace.user = depth + located[5]
                if framework is None and located[2] is not None:
                    framework, framework_name = located[2], located[3]
                    if trace is not None:
                        trace.framework = depth + located[6]
                break
            if pending is None:
                pending, pending_depth = f, depth
            if framework is not None:
                # Only the user's frame is missing: the tightest loop, noting no framework.
                complete = False
                f, steps = _to_user(f, located[0] if located is not None else None)
                depth += steps
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
                    if trace is not None:
                        trace.mechanism = (depth, f)
                if search and fn[0] & _CALLER and caller is None:
                    caller = f
                    if trace is not None:
                        trace.caller = (depth, f)
                if search and fn[0] & _MARKER:
                    phase = _phase(fn[2], f)
                    search = phase is None
                    if trace is not None:
                        trace.markers.append((depth, f, fn[2]))
            if depth + 1 >= _STOP_DEPTH and search:
                search = False
                if trace is not None:
                    trace.complete = None  # ran out before the user's frame
        if flags & _REAL:
            first_real = False
        if locate and not flags & _OWN:
            if innermost is None:
                innermost = f
                if trace is not None:
                    trace.innermost = depth
            if flags & _USER:
                user = f
                locate = False
                if trace is not None:
                    trace.user = depth
                if pending is not None:
                    _anchors.located = (
                        pending,
                        f,
                        pending_framework,
                        pending_name,
                        complete,
                        depth - pending_depth,
                        framework_at - pending_depth if pending_framework is not None else -1,
                    )
            elif flags & _FRAMEWORK:
                if framework is None:
                    framework, framework_name = f, entry[1]
                    if trace is not None:
                        trace.framework = depth
                if pending is not None and pending_framework is None:
                    pending_framework, pending_name, framework_at = f, entry[1], depth
        f = f.f_back
        depth += 1
    if search and f is not None:
        # Outward of the first real frame no direct mechanism applies; the location is known.
        searched = _anchors.searched
        start = f
        plain = True  # no table function met: start becomes the anchor
        while depth < _STOP_DEPTH:
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
                        if trace is not None:
                            trace.mechanism = (depth, f)
                        if not phases:
                            search = False
                            break
                    if fn[0] & _CALLER and caller is None:
                        caller = f
                        if trace is not None:
                            trace.caller = (depth, f)
                    if fn[0] & _MARKER:
                        phase = _phase(fn[2], f)
                        if trace is not None:
                            trace.markers.append((depth, f, fn[2]))
                        if phase is not None:
                            search = False
                            break
            f = f.f_back
            depth += 1
        if plain and f is None:
            _anchors.searched = start
    if trace is not None and search and trace.complete is not None:
        # Ran out outward of the user's frame: the frame after it stands for the rest.
        trace.complete = trace.user + 1 if trace.user >= 0 else None
    mechanism = found
    if found is not None and caller is not None:
        hook = caller.f_locals.get("hook_name")
        if isinstance(hook, str):
            mechanism = f"{found} ({hook})"
    return (innermost, framework, framework_name, user), mechanism, phase


def _to_user(frame: FrameType, anchor: FrameType | None) -> tuple[FrameType | None, int]:
    """The first user frame from ``frame`` outward (or ``anchor`` if met first), and its distance."""
    get = _files.get
    f: FrameType | None = frame
    steps = 0
    while f is not None and f is not anchor:
        filename = f.f_code.co_filename
        if (get(filename) or _learn(filename))[0] & _USER:
            return f, steps
        f = f.f_back
        steps += 1
    return f, steps


def _table_function(entry: _File, name: str) -> _Function:
    table = entry[2]
    return (table.get(name) if table is not None else None) or entry[3] or _NONE


def _phase(marker: frameworks.Marker, frame: FrameType) -> str | None:
    return marker if isinstance(marker, str) or marker is None else marker(frame)


def _learn_route(
    key: tuple[int, int, str | None, str],
    base: int,
    frame: FrameType,
    trace: _Trace,
    found: _Found,
    sync: Sync,
) -> None:
    """Keep the route of a walk from ``frame`` (``sys._getframe(base)`` here) to ``sync``."""
    global _held_version
    mechanism = sync.mechanism
    innermost, framework, _, user = found
    if trace.complete is None or user is None or trace.user < 0:
        return
    getframe = sys._getframe
    try:
        if getframe(base) is not frame:
            return  # not where the caller said: no depth to trust
        outer: tuple[int, FrameType] | None = None
        probes: dict[int, tuple[int, CodeType, int]] = {}
        if trace.complete >= 0:
            past = trace.complete
            witness = getframe(base + past)
            # The user's own frames hold no table function: the route holds the frame past
            # them (up to _WITNESS_SKIP: a loop's, not that of a function the loop calls each
            # step, which a boundary drops), and probes their code.
            while witness.f_back is not None and len(probes) < _WITNESS_SKIP:
                code = witness.f_code
                if not (_files.get(code.co_filename) or _learn(code.co_filename))[0] & _USER:
                    break
                probes[past] = (past, code, -1)
                past += 1
                witness = witness.f_back
            outer = (past, witness)
    except ValueError:
        return
    for depth, f in (
        (trace.innermost, innermost),
        (trace.framework, framework),
        (trace.user, user),
    ):
        if depth > 0 and f is not None:
            probes[depth] = (depth, f.f_code, f.f_lasti)  # over a code-only probe there
    if trace.user > 1:
        caller_of_sync = frame.f_back
        if caller_of_sync is not None:
            probes.setdefault(1, (1, caller_of_sync.f_code, caller_of_sync.f_lasti))
    for at in (trace.mechanism, trace.caller, *trace.markers):
        if at is not None and at[0] > 0:
            probes.setdefault(at[0], (at[0], at[1].f_code, -1))
    base_mechanism = mechanism.split(" (", 1)[0] if mechanism is not None else None
    route = _Route(
        frame.f_code,
        trace.innermost == 0 and trace.user == 0,
        tuple(sorted(probes.values())),
        outer,
        tuple((depth, marker) for depth, _, marker in trace.markers),
        sync.phase,
        _phases_possible(),
        trace.caller[0] if trace.caller is not None and base_mechanism is not None else -1,
        base_mechanism,
        sync,
    )
    routes = _routes.get(key)
    if routes is None:
        if len(_routes) >= 100_000:
            return
        routes = _routes[key] = []
    if len(routes) >= _ROUTES_PER_KEY:
        dropped = routes.pop()
        if dropped.outer is not None:
            _held[:] = [(k, r) for k, r in _held if r is not dropped]
            _held_version += 1
    routes.insert(0, route)  # the newest first: a loop replays the route it just took
    if outer is not None:
        _held.append((key, route))
        _held_version += 1


def _replay(route: _Route, base: int) -> Sync | None:
    """The route's sync if its frames are where they were (the sync's: ``sys._getframe(base)``)."""
    getframe = sys._getframe
    try:
        for depth, code, lasti in route.probes:
            f = getframe(base + depth)
            if f.f_code is not code or (lasti >= 0 and f.f_lasti != lasti):
                return None
        outer = route.outer
        if outer is not None and getframe(base + outer[0]) is not outer[1]:
            return None
        # A route learnt before a framework with phase markers was imported holds no marker's
        # probe: walk again once one is (_phases_possible(), inline).
        seen = _phases_seen
        if not route.phases and (seen[1] if seen[0] == len(sys.modules) else _phases_possible()):
            return None
        if route.sync is not None:
            return route.sync
        phase: str | None = None
        for depth, marker in route.markers:
            phase = _phase(marker, getframe(base + depth))
            if phase is not None:
                break
        if phase is None and route.phase is not None:
            return None  # the marker that decided says no more: walk again
        mechanism = route.mechanism
        if route.caller >= 0:
            hook = getframe(base + route.caller).f_locals.get("hook_name")
            if isinstance(hook, str):
                mechanism = f"{mechanism} ({hook})"
    except ValueError:
        return None
    return _sync(route.loc, mechanism, phase)


def observe(
    frame: FrameType | None, kind: str | None = None, detail: str = "", depth: int = -1
) -> Sync | None:
    """Walk outward from ``frame`` once: where the sync is, its mechanism, its phase.

    Args:
        frame: The innermost frame of the sync (barrierguard's own frames are skipped).
        kind: The kind when the caller knows it (an intercepted call); else read from the
            executing instruction.
        detail: Extra detail for a known kind (a copy's direction).
        depth: ``frame``'s depth as the caller's ``sys._getframe(depth)``, when known: a sync
            met again by the same route is then found by a few probes instead of a walk.

    Returns:
        The sync, or ``None`` when the stack holds no frame but barrierguard's.
    """
    global holding, settled
    if frame is None:
        return None
    last = _anchors.last
    if (
        last is not None
        and frame is last[0]
        and frame.f_lasti == last[1]
        and kind == last[2]
        and detail == last[3]
    ):
        return last[4]  # the same live frame at the same instruction: the same sync
    holding, settled = True, None  # routes and anchors may keep frames (forget)
    code = frame.f_code
    lasti = frame.f_lasti
    sync: Sync | None = None
    kept = False
    key: tuple[int, int, str | None, str] | None = None
    if depth >= 0:
        # The routes of the last key replayed, without making the key again.
        hot = _anchors.hot
        if (
            hot is not None
            and hot[0] is code
            and hot[1] == lasti
            and hot[2] == kind
            and hot[3] == detail
        ):
            routes = hot[4]
        else:
            key = (id(code), lasti, kind, detail)
            routes = _routes.get(key, _NO_ROUTES)
        # From _replay and _learn_route, frame is sys._getframe(depth + 2).
        for route in routes:
            sync = _replay(route, depth + 2)
            if sync is not None:
                kept = route.kept
                if hot is None or routes is not hot[4]:
                    _anchors.hot = (code, lasti, kind, detail, routes)
                if kind is None and not detail:
                    _anchors.read = (code, lasti, route)
                break
    if sync is None:
        trace = _Trace() if depth >= 0 else None
        found, mechanism, phase = _walk(frame, True, trace)
        innermost, framework, name, user = found
        if innermost is None:
            return None
        loc = place(innermost, framework, name, user, kind, detail)
        sync = _sync(loc, mechanism, phase)
        kept = frame is innermost and frame is user
        if trace is not None:
            if key is None:
                key = (id(code), lasti, kind, detail)
            _learn_route(key, depth + 2, frame, trace, found, sync)
    if kept:
        # Only the user's own frame (a wrapper's is new every call).
        keep_last(frame, sync, kind, detail)
    return sync


def keep_last(frame: FrameType, sync: Sync, kind: str | None = None, detail: str = "") -> None:
    """Keep ``frame``, the user's own, as the last sync's (never a resumable one: it is resumed
    from anywhere): a loop of syncs in that frame then meets it again without a probe."""
    global holding, settled
    if not frame.f_code.co_flags & _RESUMABLE:
        holding, settled = True, None  # a frame kept (forget)
        _anchors.last = (frame, frame.f_lasti, kind, detail, sync)


def annotate(frame: FrameType | None) -> tuple[str | None, str | None]:
    """The framework mechanism and the phase the stack shows, from ``frame`` outward.

    Returns:
        ``(mechanism, phase)``: the innermost table mechanism (``"name (hook)"`` in a Lightning
        hook) or ``None``, and the innermost phase marker's phase or ``None``.

    Example:
        >>> import sys
        >>> annotate(sys._getframe())
        (None, None)
    """
    _, mechanism, phase = _walk(frame, False)
    return mechanism, phase
