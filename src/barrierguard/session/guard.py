"""The guard: one watching session, its steps, its records and its policy.

One module, as :class:`Guard`'s parts share one lock and one hot path.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from barrierguard import _env
from barrierguard._errors import BarrierGuardError, MemoryGrowthError, SyncError, SyncWarning
from barrierguard.detect import hub, stack
from barrierguard.detect.frames import Location
from barrierguard.detect.kinds import KINDS
from barrierguard.detect.stack import Sync
from barrierguard.report.records import CaptureProbe, MemoryReport, Report, Timeline, Violation
from barrierguard.session import allowing, lifecycle
from barrierguard.session import rank_reports as ranks
from barrierguard.session.compile_watch import CompileWatch, join
from barrierguard.session.loop_end import AFTER_LOOP, OpenStep, unwatch_loaders, watch_loaders
from barrierguard.session.options import Options
from barrierguard.session.site_stats import SiteStats, message, site_record
from barrierguard.session.steps import OptimizerSteps

if TYPE_CHECKING:
    from barrierguard.session.capture import CallProbe
    from barrierguard.session.memory import MemoryMonitor
    from barrierguard.session.timeline import StepTimeline

__all__ = ["APART_PHASES", "Guard"]

log = logging.getLogger("barrierguard")

F = TypeVar("F", bound=Callable[..., Any])

_MAX_VIOLATIONS = 1000
# Per-step counters are made this many steps ahead (see Guard._boundary).
_STEPS_AHEAD = 1024
# A tally's closed steps kept uncounted (see the roll in Guard._advance) before they are
# counted together.
_PAST_STEPS = 256
# This thread's open allowed() blocks, read on the quiet path (see _Quiet).
_allowing_tls = allowing._TLS
_get_ident = threading.get_ident
_getframe = sys._getframe


# Phases whose syncs are counted apart from the steps' counts and the policy (not training).
APART_PHASES = frozenset(
    {"validate", "test", "predict", "teardown", "checkpoint", AFTER_LOOP, "compile", "probe"}
)


def _make_engine(requested: str) -> hub.Engine:
    if requested != "audit" and _env.cuda_available():
        from barrierguard.detect.cuda import CudaEngine

        return CudaEngine()
    if requested == "cuda":
        raise BarrierGuardError(
            "watch(engine='cuda') needs a CUDA device, but torch.cuda.is_available() is "
            "False here; use engine='auto' (CUDA when available, else the CPU audit) or "
            "engine='audit'"
        )
    from barrierguard.detect.audit import AuditEngine

    return AuditEngine()


def _make_timeline() -> StepTimeline:
    """The step timer of a CUDA guard (a seam: tests on CPU pass fake events)."""
    from barrierguard.session.timeline import StepTimeline

    return StepTimeline()


class _Quiet(hub.Tally):
    """A settled site (``Guard._settle``) and its tally of repeats since ``Guard._fold``: the
    same sync object, step, adapter phase and thread, outside ``allowed()``."""

    __slots__ = (
        "guard_phase",
        "listed",
        "lists",
        "mechanism",
        "past",
        "phase",
        "stats",
        "step",
        "sync",
        "untimed",
        "violating",
    )

    def __init__(self, stats: SiteStats, violating: bool) -> None:
        super().__init__()
        self.stats = stats
        self.violating = violating  # a blocking site not allowed: counts against the policy
        self.lists = violating  # ... and not in a phase counted apart: a roll lists its syncs
        self.sync: Sync | None = None
        self.step = -1
        self.guard_phase: str | None = None
        self.mechanism: str | None = None
        self.phase: str | None = None
        self.untimed = 0  # of the n, those without a measured stall
        self.listed = False  # in Guard._grown: its tally was handed out (see the roll in _advance)
        # The closed steps' (step, n, stall, untimed), not yet counted (see the roll in _advance).
        self.past: list[tuple[int, int, float, int]] = []


# A listener's due step when there is none: past any run's last step.
_NEVER = sys.maxsize


class Guard:
    """A watching session: collects syncs between :meth:`start` and :meth:`stop`.

    Made by :func:`watch`: a context manager, a decorator, or driven with
    :meth:`start`/:meth:`stop`; starting it again adds to the same report.

    Every ``optimizer.step()`` ends a step (several optimizers: see docs/guide.md); loops
    without one call :meth:`step`, after which optimizer steps no longer count. Syncs before
    the first step and in the first ``warmup_steps`` steps are setup, never held against the
    policy; those after the last step, at sites no closed step saw, are ``"after-loop"``.

    Attributes:
        is_running: Whether the guard is collecting now, from :meth:`start` to :meth:`stop`.
        report_path: Where :meth:`stop` last saved the report (``watch(out=...)``), or ``None``.

    Example:
        >>> import barrierguard, torch
        >>> with barrierguard.watch(policy="record") as guard:
        ...     for _ in range(3):
        ...         x = torch.ones(4) * 2
        ...         guard.step()
        >>> guard.report.steps, guard.is_running
        (3, False)
    """

    def __init__(self, options: Options) -> None:
        self._options = options
        self._lock = threading.Lock()
        self._sites: dict[tuple[str, int, str, str, str, int], SiteStats] = {}
        # Settled sites by their interned location (_settle).
        self._quiet: dict[Location, _Quiet] = {}
        # The settled sites whose tallies were handed out since the last stale-making roll: the
        # only ones that can grow without record(), so a boundary rolls them on (see the roll in
        # _advance).
        self._grown: list[_Quiet] = []
        self._steps = 0
        self._step_syncs = 0
        self._per_step: list[int] = [0]
        self._step_stall: list[float] = [0.0]
        self._manual = False
        self._optimizer_steps = OptimizerSteps()
        # The optimizer whose next step makes one boundary, no questions asked.
        self._alone: int | None = None
        # (site, step, reason, thread name): made into Violations by report().
        self._violations: list[tuple[Location, int, str, str]] = []
        self._violation_count = 0
        self._thread_names: dict[int, str] = {}
        self._deferred: list[SyncError] = []
        # Syncs of sites no closed step saw yet, and errors not yet raised (loop_end).
        self._open = OpenStep()
        self._due: dict[tuple[str, int, str, str, str, int], SyncError] = {}
        self._loader_end = -1
        self._warned: set[tuple[str, int, str, str, str, int]] = set()
        self._faults: list[str] = []
        self._notes: list[str] = []
        self._engine_name = "none"
        # Whether the guard is collecting now, from start() to stop(): an attribute, not a
        # property, as a framework's callback reads it every step.
        self.is_running = False
        self._thread_ident: int | None = None
        # start() and stop() may race across threads; each thread's entries are apart.
        self._life = threading.RLock()
        self._entries = threading.local()
        self._hook_handle: Any = None
        self._started = 0.0
        self._elapsed = 0.0
        self._env: dict[str, str] = {}
        self._step_listeners: list[Callable[[int], int | None]] = []
        # The step each listener asked to be called at next; the earliest of them.
        self._listen_due: list[int] = []
        self._listen_at = 0
        # The first step whose boundary has more than a quiet step's work (_plan_work).
        self._work_at = 0
        self._memory: MemoryMonitor | None = None
        self._timeline: StepTimeline | None = None
        self._compile = CompileWatch()
        self._probing = False
        self._call_probe: CallProbe | None = None
        self._optimizers: dict[int, Any] = {}
        # A framework's optimizers, asked by a capture probe: with it, no optimizer hook runs.
        self._optimizer_source: Callable[[], Iterable[Any]] | None = None
        self._phase: str | None = None  # from framework adapters' events (set_phase)
        # Where stop() last saved the report (watch(out=...)), this rank's file.
        self.report_path: str | None = None

    @property
    def options(self) -> Options:
        """The validated options this guard runs with."""
        return self._options

    def start(self) -> Guard:
        """Install the engine's hooks and start collecting.

        Raises:
            BarrierGuardError: This guard is already running, or ``engine='cuda'`` without CUDA.
        """
        with self._life:
            if self.is_running:
                raise BarrierGuardError(
                    "this guard is already running - did you call start() twice? Create a "
                    "second guard with watch() instead"
                )
            hub.tidy()
            engine = _make_engine(self._options.engine)
            self._engine_name = name = engine.name
            if name == "audit":
                from barrierguard.detect.audit import NOTE

                self.note(NOTE)
            if not self._env:
                self._env = _env.environment(name)
            self._thread_ident = threading.get_ident()
            hub.attach(self, engine)
            try:
                if self._optimizer_source is None:
                    from torch.optim.optimizer import register_optimizer_step_post_hook

                    self._hook_handle = register_optimizer_step_post_hook(self._advance)
                if self._phase is None:
                    # A loader that ran out marks a loop's end only for syncs without a phase;
                    # a framework's adapter names every phase (set_phase), so its fit pays no
                    # wrapper on each batch. set_phase(None) watches them from then on.
                    watch_loaders(self._on_loader_end)
            except BaseException:
                if self._hook_handle is not None:
                    self._hook_handle.remove()
                    self._hook_handle = None
                hub.detach(self, name)
                raise
            self.is_running = True
            self._started = time.perf_counter()
            self._listen_due = [0] * len(self._step_listeners)  # each asks anew
            self._listen_at = self._work_at = 0
            self._start_memory()
            if name == "cuda":  # step timing reads CUDA events
                with self._faults_noted():
                    if self._timeline is None:
                        self._timeline = _make_timeline()
                        self.add_step_listener(self._timeline.on_step)
                    self._timeline.start(self._steps)
            with self._faults_noted():
                self._compile.start()
                self._arm_call_probe()
            return self

    def _arm_call_probe(self) -> None:
        name = self._options.capture_probe
        if not isinstance(name, str) or self._compile.probe is not None:
            return
        from barrierguard.session.capture import CallProbe

        warmup = max(1, self._options.warmup_steps)
        self._call_probe = CallProbe(
            name,
            lambda: self.is_running and not self._probing and self._steps >= warmup,
            lambda fn, args, kwargs: self.probe_capture(fn, *args, **kwargs),
        )
        self._call_probe.arm()

    def _start_memory(self) -> None:
        opts = self._options
        if not opts.memory:
            return
        with self._faults_noted():
            if self._memory is None:
                from barrierguard.session.memory import MemoryMonitor, default_probes

                cuda = _env.cuda_available()
                children = opts.memory_children
                self._memory = MemoryMonitor(
                    lambda notes: default_probes(notes, cuda=cuda, children=children),
                    policy=opts.policy,
                    threshold=opts.max_growth_per_step,
                    warmup=opts.warmup_steps,
                    every=opts.memory_every,
                )
                self.add_step_listener(self._memory.on_step)
            self._memory.thread_ident = self._thread_ident
            self._memory.start(self._steps)

    def stop(self) -> Report:
        """Remove every hook, restore every global, and return the report.

        With ``watch(out=...)`` the report is also saved to this rank's file
        (:attr:`report_path`); a failed write is logged and noted, never raised.

        Raises:
            SyncError: Under the ``"error"`` policy, a sync in another thread broke the policy.
            MemoryGrowthError: Under the ``"error"`` policy, memory kept growing beyond
                ``max_growth_per_step`` and was not raised yet.
        """
        return self._stop(act=True)

    def _stop(self, *, act: bool) -> Report:
        with self._life:
            if not self.is_running:
                return self.report
            self.is_running = False
            self._elapsed += time.perf_counter() - self._started
            memory_error: MemoryGrowthError | None = None
            try:
                if self._hook_handle is not None:
                    self._hook_handle.remove()
                    self._hook_handle = None
            finally:
                hub.detach(self, self._engine_name)
                unwatch_loaders(self._on_loader_end)
                self._end_loop(act)
                with self._faults_noted():
                    self._compile.stop()
                    self._disarm_call_probe()
                with self._faults_noted():
                    try:
                        if self._memory is not None:
                            self._memory.finish(self._steps, act=act)
                    except MemoryGrowthError as grown:
                        memory_error = grown
                if self._timeline is not None:
                    with self._faults_noted():
                        self._timeline.stop()
            report = self.report
            if self._options.out is not None:
                self._save(report, self._options.out)
            if self._deferred:
                err = self._deferred[0]
                self._deferred.clear()
                raise err
            if memory_error is not None:
                raise memory_error
            return report

    def _save(self, report: Report, path: str) -> None:
        # A report that cannot be written must not cost the run: logged, and noted.
        try:
            self.report_path = ranks.save(report, path)
        except OSError as exc:
            text = f"the report could not be written to {path!r}: {exc}"
            log.warning("barrierguard: %s", text)
            self.note(text)

    def _disarm_call_probe(self) -> None:
        probe = self._call_probe
        if probe is None:
            return
        probe.disarm()
        if probe.note:
            self.note(probe.note)
        elif not probe.done:
            self.note(
                f"capture probe: no call of {probe.name!r} after warm-up while watching, "
                "so nothing was captured"
            )

    def __enter__(self) -> Guard:
        lifecycle.enter(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lifecycle.leave(self, failed=exc_type is not None)

    def __call__(self, func: F) -> F:
        """Watch each call of ``func`` (a generator over its iterations, a coroutine to its end)."""
        return lifecycle.decorate(self, func)

    def step(self) -> None:
        """Mark the end of a training step; optimizer steps no longer mark steps after it."""
        self._manual = True
        self._alone = None
        self._advance()

    def add_step_listener(self, listener: Callable[[int], int | None]) -> None:
        """Call ``listener(step)`` at step boundaries (samplers hook in here).

        It returns the step it is next called at, or ``None`` for the next one.
        """
        self._listen_due.append(0)  # first: a boundary meanwhile finds its due step
        self._step_listeners.append(listener)
        self._listen_at = self._work_at = 0

    def _optimizer_boundaries(self, optimizer: Any) -> int:
        """How many boundaries a step of ``optimizer`` makes, when it is not the last
        boundary's optimizer stepping again (see :meth:`_advance`); it is held from now on."""
        key = id(optimizer)
        self._alone = None
        if self._probing:
            return 0  # a captured step runs no kernel: not a step of the training
        if key not in self._optimizers:
            self._optimizers[key] = optimizer  # held: its id stays its own
        if self._manual:
            return 0
        rule = self._optimizer_steps
        boundaries = rule.boundaries(key)
        if rule.alone(key):
            self._alone = key
        return boundaries

    def _advance(self, optimizer: Any = None, args: Any = None, kwargs: Any = None) -> None:
        """Count a step and make its boundary; also torch's optimizer-step hook (``optimizer``
        stepped), one call where the last boundary's optimizer steps again, none other since.
        :meth:`_boundary`'s tests and the carried tallies' roll are inline: a quiet step's
        boundary, or one that only rolls a read once a step on, is this one call."""
        if optimizer is not None and id(optimizer) != self._alone:
            boundaries = self._optimizer_boundaries(optimizer)
            if not boundaries:
                return
            for _ in range(boundaries - 1):
                self._advance()  # the rule counts more than one: the others first
        # Only the training thread advances steps: no lock, the counters made first.
        self._step_syncs = 0
        self._steps = step = self._steps + 1
        kept = stack.holding
        if kept:
            # Whether the frames held are where the last boundary found them (by depth from
            # this frame, its origin), none kept since: then it has nothing to drop.
            settled = stack.settled
            if settled is not None:
                try:
                    for held, depth in settled:
                        if id(_getframe(depth)) != held:
                            break
                    else:
                        kept = False
                except ValueError:
                    pass
        grown = self._grown
        if grown:
            # The roll: close this thread's tallies' step and move their sites on to ``step``,
            # so that a tally handed out stays good across the boundary (a read once a step
            # calls nothing) while one grew in the closed step: it may grow again. Else, or
            # with another thread's tally out, every tally is made stale and _grown emptied.
            # Only the sites in _grown are visited: a tally is handed out by record() alone,
            # which lists its site, and the list is emptied only with the tallies made stale.
            # A site left at an older step is folded by record() when next met. A closed
            # step's count is put aside in the site's ``past`` and counted with the others
            # later (_fold_one: at a report, or every _PAST_STEPS steps): a boundary touches
            # the tally alone, not the site's counters.
            me = _get_ident()
            grew, alone = False, True
            for quiet in grown:
                if quiet.stats.last_ident != me:
                    alone = False  # its tally is counted by its thread: stale at our boundary
                    continue
                n = quiet.n
                if n:
                    grew = True
                    if quiet.lists:
                        # Listed as they ran (the list keeps the first ones), counted later.
                        # _violate_quietly's test, inline: once the list is full, no call.
                        if len(self._violations) < _MAX_VIOLATIONS:
                            self._violate_quietly(quiet.stats, quiet.step, n)
                        else:
                            self._violation_count += n
                    past = quiet.past
                    past.append((quiet.step, n, quiet.stall, quiet.untimed))
                    quiet.n, quiet.stall, quiet.untimed = 0, 0.0, 0
                    if len(past) >= _PAST_STEPS:
                        self._fold_one(quiet)
                quiet.step = step
            if not (grew and alone):
                for quiet in grown:
                    quiet.listed = False
                grown.clear()
                hub.invalidate()
        if kept or step >= self._work_at:
            self._boundary(step, _getframe(), kept)

    def _boundary(self, step: int, origin: FrameType, kept: bool) -> None:
        """A step boundary's work once ``step`` is counted and its tallies rolled: frames, held
        syncs, listeners. :meth:`_advance` calls it only when one of its tests holds: work added
        here needs its test there too. ``kept``: frames are held that may have finished;
        ``origin``: the caller's frame, from which :data:`stack.settled` counts their depths."""
        if step == len(self._per_step):
            self._per_step += [0] * _STEPS_AHEAD
            self._step_stall += [0.0] * _STEPS_AHEAD
        # The walk's anchors hold frames: none that finished outlives a step.
        if kept:
            stack.forget(live=True, origin=origin)
        try:
            late = self._close_step() if self._open.held or self._due else None
            if step >= self._listen_at:
                self._listen(step)
        finally:
            with self._lock:  # record() may hold a sync meanwhile, on another thread
                self._plan_work()
        if late is not None:
            raise late

    def _plan_work(self) -> None:
        """Note the next step whose boundary has work (:attr:`_work_at`): a listener due, the
        per-step counters to extend, or now, while a sync is held or an error due. Called
        wherever one of them changes (a held sync: under the lock)."""
        if self._open.held or self._due:
            self._work_at = 0
        else:
            self._work_at = min(self._listen_at, len(self._per_step))

    def _listen(self, step: int) -> None:
        """Call the step listeners due at ``step``; note when the next one is due."""
        due = self._listen_due
        try:
            for i, listener in enumerate(self._step_listeners):
                if due[i] > step:
                    continue
                due[i] = step + 1  # also when it fails: called again next step
                try:
                    then = listener(step)
                except MemoryGrowthError:
                    raise  # the error policy's verdict, raised from the step boundary
                except Exception as exc:
                    self.fault(exc)
                    continue
                if then is not None and then > step:
                    due[i] = then
        finally:
            self._listen_at = min(due, default=_NEVER)

    def _on_loader_end(self) -> None:
        self._loader_end = self._steps

    def _close_step(self) -> SyncError | None:
        """Judge the closed step's held syncs (``loop_end``); return an error due now."""
        opts = self._options
        actions: list[Callable[[], None]] = []
        with self._lock:
            late = next(iter(self._due.values()), None)
            self._due.clear()
            for held in self._open.close():
                stats = held.stats
                key = stats.loc.key
                # Every held violation is counted; the policy acts once, on the first.
                for step, reason, thread in held.violations:
                    self._violate(stats.loc, step, reason, thread)
                self._violation_count += held.more_violations
                first = held.first_event()
                if first is None or (opts.policy == "record" and not first[3]):
                    continue
                step, reason, _thread, violation = first
                first_time = key not in self._warned
                self._warned.add(key)
                if opts.policy == "error" and violation:
                    self._due[key] = self._error(stats, step, reason)
                elif opts.policy != "record" and first_time:
                    actions.append(functools.partial(self._warn, stats, step, reason))
        for act in actions:
            act()
        return late

    def _end_loop(self, act: bool) -> None:
        """At stop: what is still held followed the loop's last step."""
        with self._lock:
            self._fold(every=True)  # the engines are detached: no tally moves now
            self._open.finish(self._steps, self._per_step, self._step_stall)
            due = next(iter(self._due.values()), None)
            self._due.clear()
        if act and due is not None and not self._deferred:
            self._deferred.append(due)

    def _before_call(self, func: Callable[..., Any], args: Any, kwargs: Any) -> None:
        """A decorated step is called: ``watch(capture_probe=True)``'s turn after warm-up."""
        if (
            self._options.capture_probe is True
            and self._compile.probe is None
            and self._steps >= max(1, self._options.warmup_steps)
        ):
            self.probe_capture(func, *args, **kwargs)

    def probe_capture(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CaptureProbe:
        """Try to capture one call of ``fn(*args, **kwargs)`` with ``torch.cuda.graph``.

        Recorded on a side stream, never replayed (docs/compile.md); its syncs are counted
        apart (phase ``"probe"``). Call it after warm-up, or let ``watch(capture_probe=True)``
        do it for a decorated step's first call after; the result is the report's
        ``compile.probe``.

        Returns:
            ``status`` ``"capturable"``, ``"blocked"`` (with the first line that stopped the
            capture), or ``"not run"`` (no CUDA device).

        Example:
            >>> import barrierguard
            >>> guard = barrierguard.watch(policy="record")
            >>> guard.probe_capture(lambda: None).status in ("capturable", "not run")
            True
        """
        from barrierguard.session.capture import probe

        optimizers = dict(self._optimizers)
        if self._optimizer_source is not None:
            try:
                optimizers.update((id(opt), opt) for opt in self._optimizer_source())
            except Exception as exc:  # the hooked ones still count
                self.fault(exc)
        params = [
            p
            for opt in optimizers.values()
            for group in getattr(opt, "param_groups", ())
            for p in group.get("params", ())
        ]
        saved, self._phase = self._phase, "probe"
        self._probing = True
        self._alone = None
        try:
            result = probe(fn, args, kwargs, params, self._compile.skips())
        except Exception as exc:  # the probe's own failure must not cost the run
            self.fault(exc)
            result = CaptureProbe(
                status="not run", reason=f"the probe failed: {type(exc).__name__}: {exc}"
            )
        finally:
            self._probing = False
            self._phase = saved
        self._compile.probe = result
        return result

    @property
    def phase(self) -> str | None:
        """The phase a framework adapter's events say the run is in (``None``: none said)."""
        return self._phase

    def set_phase(self, phase: str | None) -> None:
        """Tag the syncs from now on with ``phase`` (a framework adapter's events).

        A phase the stack shows wins over ``"train"``; syncs in :data:`APART_PHASES`
        are counted apart. While no phase is named (``None``), a ``DataLoader`` that runs out
        marks the loop's end; a guard started with a phase does not watch its loaders.

        Example:
            >>> import barrierguard
            >>> guard = barrierguard.watch(policy="record")
            >>> guard.set_phase("validate")
            >>> guard.phase
            'validate'
        """
        self._phase = phase
        hub.invalidate()
        if phase is None and self.is_running:
            watch_loaders(self._on_loader_end)  # once; stop() unwatches

    @property
    def steps(self) -> int:
        """Step boundaries seen so far."""
        return self._steps

    def steps_by_caller(self, optimizers: Callable[[], Iterable[Any]] | None = None) -> None:
        """Take step boundaries from :meth:`step` calls only, even before the first one.

        ``optimizers``: where a framework keeps its optimizers, asked only when a capture probe
        runs (it puts their parameters' gradients back). With it, the guard hooks no optimizer
        step: a framework's callback drives the steps, and the hook would only cost each step.
        """
        self._manual = True
        self._alone = None
        self._optimizer_source = optimizers

    def syncs_in_steps(self, start: int, end: int) -> list[int]:
        """The blocking syncs of each measured step from ``start`` to ``end`` (steps seen)."""
        self._fold()  # _per_step[k]: the syncs after k steps, in step k + 1
        return self._per_step[start : min(end, self._steps + 1)]

    def memory_slopes(self) -> dict[str, float]:
        """Memory growth per step by series so far (empty when memory is not sampled)."""
        memory = self._memory
        return dict(memory.report().slopes) if memory is not None else {}

    def abandon(self) -> Report:
        """Stop because the run is failing: restore every global, raise no policy error."""
        self._deferred.clear()
        return self._stop(act=False)

    def fault(self, exc: BaseException) -> None:
        """Note a fault of barrierguard's own (logged once, listed in the report), never raised."""
        text = f"internal error in barrierguard: {type(exc).__name__}: {exc}"
        with self._lock:
            first = not self._faults
            if len(self._faults) < 5:
                self._faults.append(text)
        if first:
            log.warning("%s (recording goes on; the report lists it)", text, exc_info=exc)

    @contextlib.contextmanager
    def _faults_noted(self) -> Iterator[None]:
        """Run the block; a fault of barrierguard's inside it is noted, never raised."""
        try:
            yield
        except Exception as exc:
            self.fault(exc)

    def note(self, text: str) -> None:
        """Add ``text`` to the report's notes, once."""
        with self._lock:
            if text not in self._notes:
                self._notes.append(text)

    def record(
        self, sync: Sync, ident: int, stall: float | None = None, again: bool = False
    ) -> Callable[[], None] | hub.Tally | None:
        """Count one ``sync`` from thread ``ident``; return the policy's action, or a tally.
        ``again``: a further sync inside a call already counted (``print(t)``)."""
        loc = sync.loc
        quiet = self._quiet.get(loc)
        if (
            quiet is not None
            and quiet.sync is sync
            # Another thread's first in a step is counted at once: a report folds its own
            # thread's tallies only.
            and (quiet.step == self._steps or ident == self._thread_ident)
            and quiet.guard_phase is self._phase
            and ident == quiet.stats.last_ident
            and not again
            and (not quiet.violating or not (allowing.open_blocks and _allowing_tls.scopes))
        ):
            if quiet.step != self._steps:
                # The guard's thread's first in a later step: no tally of it stands (a boundary
                # moves each one on, the roll in _advance, or makes it stale): its count so far
                # is its step's.
                self._fold_one(quiet)
                quiet.step = self._steps
            quiet.n += 1  # a repeat: folded into the counters later (the roll, _fold)
            if not quiet.listed:
                quiet.listed = True
                self._grown.append(quiet)
            if stall is None:
                quiet.untimed += 1
            else:
                quiet.stall += stall
            return quiet
        if quiet is not None:
            # A settled site counted another way (thread, sync or step): the tallies are stale.
            hub.invalidate()
        mechanism = sync.mechanism
        # The stack's phase wins but for plain "train", where the adapter's knows better.
        phase = self._phase
        found = sync.phase
        if found is not None and (phase is None or found != "train"):
            phase = found
        if quiet is not None and not again and ident == quiet.stats.last_ident:
            # Settled (see _settle): counted without the lock or the policy's checks.
            self._fold_one(quiet)
            self._count_quiet(quiet.stats, mechanism, phase, stall)
            quiet.sync, quiet.step, quiet.guard_phase = sync, self._steps, self._phase
            quiet.mechanism, quiet.phase = mechanism, phase
            quiet.lists = quiet.violating and phase not in APART_PHASES
            return None
        if again:
            with self._lock:
                stats = self._sites.get(loc.key)
                if stats is not None:
                    stats.events += 1
                    return None
        opts = self._options
        with self._lock:
            stats = self._sites.get(loc.key)
            if stats is None:
                stats = self._new_site(loc, mechanism)
            step = self._steps
            if ident != stats.last_ident:
                stats.last_ident = ident
                stats.threads[self._thread_name(ident)] = None
            if phase is None and self._loader_end == step > 0 and not stats.in_loop:
                phase = AFTER_LOOP  # after the epoch's data ran out
            if self._count_occurrence(stats, mechanism, phase):
                return None
            if stats.blocking:
                self._per_step[step] += 1
            if step <= opts.warmup_steps:
                stats.setup_count += 1
                if stall is not None:
                    stats.setup_stall += stall
                return None
            held = not stats.in_loop
            if held:
                self._open.hold(stats, stall)
                self._work_at = 0  # the next boundary judges it
            self._count_in_step(stats, step, stall)
            if not stats.blocking:
                if opts.policy == "record" or loc.key in self._warned:
                    self._settle(stats)
                    return None
                if held:
                    race = "not a barrier, but a race"
                    self._open.pend(stats, step, race, self._thread_name(ident), False)
                    return None
                self._warned.add(loc.key)
                return functools.partial(self._warn, stats, step, "not a barrier, but a race")
            if stats.allowed or allowing.admits(loc.key, loc.kind):
                if stats.allowed:
                    self._settle(stats)
                return None
            self._step_syncs += 1
            budget = opts.max_syncs_per_step or 0
            if self._step_syncs <= budget:
                return None
            if opts.max_syncs_per_step is None:
                reason = "not allowed"
            else:
                reason = f"{self._step_syncs} syncs in step {step}, budget {budget}"
            if held:
                self._open.pend(stats, step, reason, self._thread_name(ident), True)
                return None
            self._violate(loc, step, reason, self._thread_name(ident))
            if opts.policy == "record":
                self._settle(stats)
                return None
            first_time = loc.key not in self._warned
            self._warned.add(loc.key)
            if opts.policy == "warn":
                return functools.partial(self._warn, stats, step, reason) if first_time else None
            self._due.pop(loc.key, None)
            error = self._error(stats, step, reason)
            if ident != self._thread_ident:
                # A worker thread's error is raised by the guard's thread at stop().
                if not self._deferred:
                    self._deferred.append(error)
                return functools.partial(self._warn, stats, step, reason) if first_time else None
        return functools.partial(_raise, error)

    def _violate(self, loc: Location, step: int, reason: str, thread: str, n: int = 1) -> None:
        self._violation_count += n
        room = _MAX_VIOLATIONS - len(self._violations)
        if room > 0:
            self._violations += [(loc, step, reason, thread)] * min(n, room)

    def _violate_quietly(self, stats: SiteStats, step: int, n: int) -> None:
        """``n`` violations of a settled site in ``step`` (a site settles only where the reason
        is ``"not allowed"``: no budget); its thread's name is looked up only to list them."""
        if len(self._violations) < _MAX_VIOLATIONS:
            self._violate(stats.loc, step, "not allowed", self._thread_name(stats.last_ident), n)
        else:
            self._violation_count += n

    def _count_in_step(self, stats: SiteStats, step: int, stall: float | None) -> None:
        """Count one sync of ``stats``'s site in the measured step ``step``."""
        stats.step_count += 1
        if stall is not None:
            stats.stall += stall
            stats.stall_count += 1
            self._step_stall[step] += stall
        _add_step(stats.ranges, step)

    def _settle(self, stats: SiteStats) -> None:
        """Count ``stats``'s further syncs on the quiet path once the loop confirmed the site and
        it can no longer warn or raise (its violations are listed there too). Called with the
        lock held."""
        if stats.in_loop and self._options.max_syncs_per_step is None:
            self._quiet.setdefault(stats.loc, _Quiet(stats, stats.blocking and not stats.allowed))

    def _fold(self, every: bool = False) -> None:
        """Count this thread's tallies of settled sites (every thread's with ``every``)."""
        hub.invalidate()  # a new step or a report: the tallies start again
        me = _get_ident()
        for quiet in self._quiet.values():
            if (quiet.n or quiet.past) and (every or quiet.stats.last_ident == me):
                self._fold_one(quiet)

    def _fold_one(self, quiet: _Quiet) -> None:
        """Count ``quiet``'s tally, as more of its last sync: the closed steps put aside
        (the roll in :meth:`_advance`, which listed their violations), then its count in the
        open step."""
        entries, n = quiet.past, quiet.n
        if n:
            entries.append((quiet.step, n, quiet.stall, quiet.untimed))
            quiet.n, quiet.stall, quiet.untimed = 0, 0.0, 0
        elif not entries:
            return
        quiet.past = []
        stats = quiet.stats
        total = sum(entry[1] for entry in entries)
        if self._count_occurrence(stats, quiet.mechanism, quiet.phase, total):
            return
        stats.step_count += total
        blocking, ranges = stats.blocking, stats.ranges
        per_step, step_stall = self._per_step, self._step_stall
        for step, k, stall, untimed in entries:
            if blocking:
                per_step[step] += k
            _add_step(ranges, step)  # a step the roll moved to has had no count of its own
            if k > untimed:
                stats.stall += stall
                stats.stall_count += k - untimed
                step_stall[step] += stall
        if n and quiet.violating:  # the open step's count: no roll listed it
            if quiet.step == self._steps:
                self._step_syncs += n
            self._violate_quietly(stats, quiet.step, n)

    @staticmethod
    def _count_occurrence(
        stats: SiteStats, mechanism: str | None, phase: str | None, n: int = 1
    ) -> bool:
        """Count ``n`` occurrences of ``stats``'s site; return whether its phase is counted apart."""
        stats.count += n
        stats.events += n
        if mechanism is not None:
            stats.mechanisms[mechanism] = stats.mechanisms.get(mechanism, 0) + n
        if phase is None:
            return False
        stats.phases[phase] = stats.phases.get(phase, 0) + n
        return phase in APART_PHASES

    def _count_quiet(
        self, stats: SiteStats, mechanism: str | None, phase: str | None, stall: float | None
    ) -> None:
        """One sync of a settled site: the counters of :meth:`record`, nothing else."""
        if self._count_occurrence(stats, mechanism, phase):
            return
        step = self._steps
        blocking = stats.blocking
        if blocking:
            self._per_step[step] += 1
        self._count_in_step(stats, step, stall)
        if blocking and not stats.allowed and not allowing.admits(stats.loc.key, stats.loc.kind):
            self._step_syncs += 1
            self._violate_quietly(stats, step, 1)

    def _new_site(self, loc: Location, mechanism: str | None) -> SiteStats:
        known = KINDS.get(loc.kind)
        allowed = self._options.allowed(
            loc.file,
            loc.line,
            loc.kind,
            loc.origin,
            mechanism.split(" (", 1)[0] if mechanism else None,
        ) or allowing.inline_allowed(loc.file, loc.line, loc.kind)
        stats = SiteStats(loc, allowed=allowed, blocking=known.blocking if known else True)
        self._sites[loc.key] = stats
        return stats

    def _thread_name(self, ident: int) -> str:
        # A thread keeps the name it had when first seen (listing threads is slow).
        name = self._thread_names.get(ident)
        if name is None:
            named = (t.name for t in threading.enumerate() if t.ident == ident)
            name = self._thread_names[ident] = next(named, f"thread-{ident}")
        return name

    def _error(self, stats: SiteStats, step: int, reason: str) -> SyncError:
        measured = max(0, self._steps - self._options.warmup_steps)
        return SyncError(message(stats, step, reason), site_record(stats, measured).to_dict())

    def _warn(self, stats: SiteStats, step: int, reason: str) -> None:
        loc = stats.loc
        warnings.warn_explicit(
            message(stats, step, reason),
            SyncWarning,
            filename=loc.file,
            lineno=loc.line,
            module=os.path.splitext(os.path.basename(loc.file))[0],
            registry=None,
        )

    @property
    def report(self) -> Report:
        """A snapshot of what was found so far (also while running: taken on another thread,
        it leaves out the training thread's repeats of a settled site since their last count,
        a few hundred steps at most)."""
        with self._lock:
            self._fold()
            stats = list(self._sites.values())
            # A tally's violations are listed when it is folded: by step, then by site.
            listed = sorted(self._violations[:_MAX_VIOLATIONS], key=_violation_order)
            violations = tuple(
                Violation(loc.file, loc.line, loc.kind, loc.origin, step, reason, thread)
                for loc, step, reason, thread in listed
            )
            extra = self._violation_count - len(listed)
            notes = list(self._notes) + list(self._faults)
            steps = self._steps
            per_step = tuple(self._per_step[: steps + 1])
        if extra > 0:
            notes.append(f"{extra} further policy violations were counted but not listed")
        if steps == 0:
            notes.append(
                "no step boundary was seen (no optimizer.step() and no guard.step()): every "
                "sync counts as setup, and the policy never applied"
            )
        elif steps <= self._options.warmup_steps + 1:
            notes.append(
                f"{steps} step boundary(ies) and {self._options.warmup_steps} warm-up step(s): "
                "what ran before the last boundary is setup or warm-up, what ran after it "
                "follows the loop, so the policy judged no step; run at least "
                f"{self._options.warmup_steps + 2} steps for a verdict"
            )
        elapsed = self._elapsed + (time.perf_counter() - self._started if self.is_running else 0.0)
        memory: MemoryReport | None = None
        if self._memory is not None:
            try:
                memory = self._memory.report()
            except Exception as exc:
                self.fault(exc)
                notes.append(f"internal error in barrierguard: {type(exc).__name__}: {exc}")
        warmup = self._options.warmup_steps
        timeline: Timeline | None = None
        if self._timeline is not None:
            with self._faults_noted():
                from barrierguard.session.timeline import summarize

                tl = self._timeline
                timeline = summarize(
                    tl.steps,
                    tl.host_s,
                    tl.ahead,
                    tl.device_s,
                    self._step_stall[: steps + 1],
                    warmup,
                    sampling=tl.sampling,
                )
        sites = [site_record(s, max(0, steps - warmup)) for s in stats]
        compiled: Any = None
        with self._faults_noted():
            joined = join(sites, self._compile, running=self.is_running)
            if joined is not None:
                sites, compiled = list(joined[0]), joined[1]
        return Report(
            engine=self._engine_name,
            detection=self._engine_name != "none",
            policy=self._options.policy,
            steps=steps,
            warmup_steps=min(warmup, steps),
            measured_steps=max(0, steps - warmup),
            sites=tuple(sites),
            violations=violations,
            syncs_per_step=per_step,
            notes=tuple(notes),
            duration_s=elapsed,
            environment=dict(self._env),
            timeline=timeline,
            memory=memory,
            rank=ranks.current_rank(),
            compile=compiled,
        )


def _add_step(ranges: list[list[int]], step: int) -> None:
    """Put ``step`` in a site's ranges of steps, kept in order and merged. A step before the
    last range is rare: another thread's count, then a tally's closed steps."""
    if ranges and ranges[-1][0] <= step:
        last = ranges[-1]
        if last[1] < step - 1:
            ranges.append([step, step])
        elif last[1] < step:
            last[1] = step
        return
    i = bisect.bisect_right(ranges, [step, _NEVER])  # ranges[i - 1] starts at or before it
    if i and ranges[i - 1][1] >= step:
        return
    if i and ranges[i - 1][1] == step - 1:
        i -= 1
        ranges[i][1] = step
    else:
        ranges.insert(i, [step, step])
    if i + 1 < len(ranges) and ranges[i + 1][0] <= ranges[i][1] + 1:
        ranges[i][1] = max(ranges[i][1], ranges[i + 1][1])
        del ranges[i + 1]


def _violation_order(entry: tuple[Location, int, str, str]) -> tuple[int, str, int]:
    loc = entry[0]
    return entry[1], loc.file, loc.line


def _raise(error: SyncError) -> None:
    raise error
