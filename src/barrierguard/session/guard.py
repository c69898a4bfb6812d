"""The guard: one watching session, its steps, its records and its policy.

It stays one module of some 590 lines because :class:`Guard` is one object
whose parts share one lock and one hot path: the lifecycle installs what the
recording path reads, and the policy acts inside the recording. Per-site
records and messages are in ``sites``, ``watch()`` in ``watch``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from barrierguard import _env
from barrierguard._errors import BarrierGuardError, MemoryGrowthError, SyncError, SyncWarning
from barrierguard.detect import hub, stack
from barrierguard.detect.frames import Location
from barrierguard.detect.kinds import KINDS
from barrierguard.detect.stack import Sync
from barrierguard.report.records import MemoryReport, Report, Timeline, Violation
from barrierguard.session import ranks
from barrierguard.session.options import Options
from barrierguard.session.sites import SiteStats, message, site_record

if TYPE_CHECKING:
    from barrierguard.session.memory import MemoryMonitor
    from barrierguard.session.timeline import StepTimeline

__all__ = ["APART_PHASES", "Guard"]

log = logging.getLogger("barrierguard")

F = TypeVar("F", bound=Callable[..., Any])

_MAX_VIOLATIONS = 1000


# Phases whose syncs are counted apart: outside the training steps' counts,
# their per-step series and the policy (a Lightning validation batch is not a
# training step, nor is the teardown after the last one).
APART_PHASES = frozenset({"validate", "test", "predict", "teardown", "checkpoint"})


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread.name
    return f"thread-{ident}"


def _pick_engine(requested: str) -> tuple[str, list[str]]:
    notes: list[str] = []
    if requested == "cuda":
        if not _env.cuda_available():
            raise BarrierGuardError(
                "watch(engine='cuda') needs a CUDA device, but torch.cuda.is_available() is "
                "False here; use engine='auto' (CUDA when available, else the CPU audit) or "
                "engine='audit'"
            )
        return "cuda", notes
    if requested == "auto" and _env.cuda_available():
        return "cuda", notes
    # "audit" anywhere, and "auto" without CUDA: the CPU audit reasons about
    # which lines would sync on a GPU.
    from barrierguard.detect.audit import NOTE

    notes.append(NOTE)
    return "audit", notes


def _make_timeline() -> StepTimeline:
    """The step timer of a CUDA guard (a seam: tests on CPU pass fake events)."""
    from barrierguard.session.timeline import StepTimeline

    return StepTimeline()


def _make_engine(name: str) -> hub.Engine:
    if name == "cuda":
        from barrierguard.detect.cuda import CudaEngine

        return CudaEngine()
    from barrierguard.detect.audit import AuditEngine

    return AuditEngine()


class Guard:
    """A watching session: collects syncs between :meth:`start` and :meth:`stop`.

    Create one with :func:`watch`. A guard is a context manager, a decorator,
    or driven by hand with :meth:`start`/:meth:`stop`; starting it again after a
    stop adds to the same report.

    Steps: every ``optimizer.step()`` ends a step (the first optimizer that
    steps leads, so a GAN's two optimizers make one step). Loops without an
    optimizer call :meth:`step`; once :meth:`step` has been called, optimizer
    steps no longer count. Everything before the first step, and the first
    ``warmup_steps`` steps, is setup: recorded, never held against the policy.

    Example:
        >>> import barrierguard, torch
        >>> with barrierguard.watch(policy="record") as guard:
        ...     for _ in range(3):
        ...         x = torch.ones(4) * 2
        ...         guard.step()
        >>> guard.report.steps
        3
    """

    def __init__(self, options: Options) -> None:
        self._options = options
        self._lock = threading.Lock()
        self._sites: dict[tuple[str, int, str, str, str, int], SiteStats] = {}
        self._steps = 0
        self._step_syncs = 0
        self._per_step: list[int] = [0]
        self._step_stall: list[float] = [0.0]
        self._manual = False
        self._lead: Any = None
        # (site, step, reason, thread name): made into Violations by report(),
        # off the hot path.
        self._violations: list[tuple[Location, int, str, str]] = []
        self._violation_count = 0
        self._thread_names: dict[int, str] = {}
        self._deferred: list[SyncError] = []
        self._warned: set[tuple[str, int, str, str, str, int]] = set()
        self._faults: list[str] = []
        self._notes: list[str] = []
        self._engine_name = "none"
        self._running = False
        self._thread_ident: int | None = None
        self._hook_handle: Any = None
        self._started = 0.0
        self._elapsed = 0.0
        self._env: dict[str, str] = {}
        self._step_listeners: list[Callable[[int], None]] = []
        self._memory: MemoryMonitor | None = None
        self._timeline: StepTimeline | None = None
        # Set by framework adapters (set_phase) from their events: the phase
        # each sync is tagged with.
        self._phase: str | None = None
        # Where stop() last saved the report (watch(out=...)), this rank's file.
        self.report_path: str | None = None

    # -- lifecycle ----------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """Whether the guard is collecting now."""
        return self._running

    @property
    def options(self) -> Options:
        """The validated options this guard runs with."""
        return self._options

    def start(self) -> Guard:
        """Install the engine's hooks and start collecting.

        Raises:
            BarrierGuardError: If this guard is already running, or the engine
                cannot run here (``engine='cuda'`` without CUDA).
        """
        if self._running:
            raise BarrierGuardError(
                "this guard is already running - did you call start() twice, or enter the "
                "same guard in a nested 'with'? Create a second guard with watch() instead"
            )
        name, notes = _pick_engine(self._options.engine)
        engine = _make_engine(name)
        self._engine_name = name
        for note in notes:
            if note not in self._notes:
                self._notes.append(note)
        if not self._env:
            self._env = _env.environment(name)
        self._thread_ident = threading.get_ident()
        hub.attach(self, engine)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._hook_handle = register_optimizer_step_post_hook(self._on_optimizer_step)
        except BaseException:
            hub.detach(self, name)
            raise
        self._running = True
        self._started = time.perf_counter()
        self._start_memory()
        self._start_timeline()
        return self

    def _start_timeline(self) -> None:
        # Step timing reads CUDA events: only where the CUDA engine runs.
        if self._engine_name != "cuda":
            return
        try:
            if self._timeline is None:
                self._timeline = _make_timeline()
                self.add_step_listener(self._timeline.on_step)
            self._timeline.start(self._steps)
        except Exception as exc:
            self.fault(exc)

    def _start_memory(self) -> None:
        opts = self._options
        if not opts.memory:
            return
        try:
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
        except Exception as exc:
            self.fault(exc)

    def stop(self) -> Report:
        """Remove every hook, restore every global, and return the report.

        With ``watch(out=...)`` the report is also saved, to this rank's file
        (:attr:`report_path`); a file that cannot be written is logged and
        noted in the report, never raised.

        Raises:
            SyncError: Under the ``"error"`` policy, when a sync in another
                thread broke the policy (raised here, in the guard's thread).
            MemoryGrowthError: Under the ``"error"`` policy, when memory kept
                growing beyond ``max_growth_per_step`` and was not raised yet.
        """
        return self._stop(act=True)

    def _stop(self, *, act: bool) -> Report:
        if not self._running:
            return self.report
        self._running = False
        self._elapsed += time.perf_counter() - self._started
        try:
            if self._hook_handle is not None:
                self._hook_handle.remove()
                self._hook_handle = None
        finally:
            hub.detach(self, self._engine_name)
            memory_error = self._stop_memory(act)
            if self._timeline is not None:
                try:
                    self._timeline.stop()
                except Exception as exc:
                    self.fault(exc)
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
        # A report that cannot be written must not cost the run (the training
        # around it may still have a checkpoint to save): logged, and noted.
        try:
            self.report_path = ranks.save(report, path)
        except OSError as exc:
            text = f"the report could not be written to {path!r}: {exc}"
            log.warning("barrierguard: %s", text)
            self.note(text)

    def _stop_memory(self, act: bool) -> MemoryGrowthError | None:
        if self._memory is None:
            return None
        try:
            self._memory.finish(self._steps, act=act)
        except MemoryGrowthError as err:
            return err
        except Exception as exc:
            self.fault(exc)
        return None

    def __enter__(self) -> Guard:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.stop()
            return
        # An exception is already on its way out: restore everything, and do
        # not hide it behind a deferred policy error.
        self._deferred.clear()
        self._stop(act=False)

    def __call__(self, func: F) -> F:
        """Use the guard as a decorator: each call of ``func`` runs watched."""

        @functools.wraps(func)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        watched.guard = self  # type: ignore[attr-defined]
        return watched  # type: ignore[return-value]

    # -- steps --------------------------------------------------------------
    def step(self) -> None:
        """Mark the end of a training step (for loops without an optimizer).

        Once called, optimizer steps no longer mark steps for this guard.
        """
        self._manual = True
        self._advance()

    def add_step_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(step)`` at every step boundary (samplers hook in here)."""
        self._step_listeners.append(listener)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._manual:
            return
        lead = self._lead
        if lead is None:
            self._lead = lead = id(optimizer)
        if id(optimizer) == lead:
            self._advance()

    def _advance(self) -> None:
        # Only the training thread advances steps, so no lock on this hot path:
        # the new step's counter exists before the step number that indexes it.
        self._per_step.append(0)
        self._step_stall.append(0.0)
        self._step_syncs = 0
        self._steps += 1
        stack.forget()  # the walk's anchors hold frames: none beyond a step
        step = self._steps
        for listener in self._step_listeners:
            try:
                listener(step)
            except MemoryGrowthError:
                raise  # the error policy's verdict, raised from the step boundary
            except Exception as exc:
                self.fault(exc)

    @property
    def phase(self) -> str | None:
        """The phase a framework adapter's events say the run is in (``None``: none said)."""
        return self._phase

    def set_phase(self, phase: str | None) -> None:
        """Tag the syncs from now on with ``phase`` (a framework adapter's events).

        A phase the stack shows (an evaluation loop, a checkpoint save) wins
        over ``"train"``; syncs in ``validate``, ``test``, ``predict``,
        ``checkpoint`` and ``teardown`` are counted apart from the steps.

        Example:
            >>> import barrierguard
            >>> guard = barrierguard.watch(policy="record")
            >>> guard.set_phase("validate")
            >>> guard.phase
            'validate'
        """
        self._phase = phase

    @property
    def steps(self) -> int:
        """Step boundaries seen so far."""
        return self._steps

    # -- recording (called from the hub, on any thread) --------------------
    def fault(self, exc: BaseException) -> None:
        """Note a fault of barrierguard's own (logged once, listed in the report), never raised."""
        text = f"internal error in barrierguard: {type(exc).__name__}: {exc}"
        with self._lock:
            first = not self._faults
            if len(self._faults) < 5:
                self._faults.append(text)
        if first:
            log.warning("%s (recording goes on; the report lists it)", text, exc_info=exc)

    def note(self, text: str) -> None:
        """Add ``text`` to the report's notes, once."""
        with self._lock:
            if text not in self._notes:
                self._notes.append(text)

    def record(
        self, sync: Sync, ident: int, stall: float | None = None, again: bool = False
    ) -> Callable[[], None] | None:
        """Count one ``sync`` from thread ``ident``; return the policy's action.

        ``again``: a further sync inside a call already counted (``print(t)``);
        it adds an event to that occurrence, not an occurrence.
        """
        loc = sync.loc
        if again:
            with self._lock:
                stats = self._sites.get(loc.key)
                if stats is not None:
                    stats.events += 1
                    return None
        opts = self._options
        mechanism = sync.mechanism
        # The stack's phase is the more specific one (an evaluation or a save
        # inside the training loop), except the plain training region, where an
        # adapter's phase from its events (setup, teardown hooks) knows better.
        phase = self._phase
        found = sync.phase
        if found is not None and (phase is None or found != "train"):
            phase = found
        with self._lock:
            stats = self._sites.get(loc.key)
            if stats is None:
                stats = self._new_site(loc, mechanism)
            stats.count += 1
            stats.events += 1
            step = self._steps
            if ident != stats.last_ident:
                stats.last_ident = ident
                stats.threads[self._thread_name(ident)] = None
            if mechanism is not None:
                stats.mechanisms[mechanism] = stats.mechanisms.get(mechanism, 0) + 1
            if phase is not None:
                stats.phases[phase] = stats.phases.get(phase, 0) + 1
                if phase in APART_PHASES:
                    return None
            if stats.blocking:
                self._per_step[step] += 1
            if step <= opts.warmup_steps:
                stats.setup_count += 1
                if stall is not None:
                    stats.setup_stall += stall
                return None
            stats.step_count += 1
            if stall is not None:
                stats.stall += stall
                stats.stall_count += 1
                self._step_stall[step] += stall
            ranges = stats.ranges
            if ranges and ranges[-1][1] >= step - 1:
                ranges[-1][1] = step
            else:
                ranges.append([step, step])
            if not stats.blocking:
                if opts.policy == "record" or loc.key in self._warned:
                    return None
                self._warned.add(loc.key)
                return functools.partial(self._warn, stats, step, "not a barrier, but a race")
            if stats.allowed:
                return None
            self._step_syncs += 1
            budget = opts.max_syncs_per_step or 0
            if self._step_syncs <= budget:
                return None
            if opts.max_syncs_per_step is None:
                reason = "not allowed"
            else:
                reason = f"{self._step_syncs} syncs in step {step}, budget {budget}"
            self._violation_count += 1
            if len(self._violations) < _MAX_VIOLATIONS:
                self._violations.append((loc, step, reason, self._thread_name(ident)))
            if opts.policy == "record":
                return None
            first_time = loc.key not in self._warned
            self._warned.add(loc.key)
            if opts.policy == "warn":
                return functools.partial(self._warn, stats, step, reason) if first_time else None
            error = SyncError(
                message(stats, step, reason),
                site_record(stats, max(0, self._steps - opts.warmup_steps)).to_dict(),
            )
            if ident != self._thread_ident:
                # Raising in a worker thread would kill it, not the run: the
                # guard's own thread raises it at stop().
                if not self._deferred:
                    self._deferred.append(error)
                return functools.partial(self._warn, stats, step, reason) if first_time else None
        return functools.partial(_raise, error)

    def _new_site(self, loc: Location, mechanism: str | None) -> SiteStats:
        known = KINDS.get(loc.kind)
        allowed = self._options.allowed(
            loc.file,
            loc.line,
            loc.kind,
            loc.origin,
            mechanism.split(" (", 1)[0] if mechanism else None,
        )
        stats = SiteStats(loc, allowed=allowed, blocking=known.blocking if known else True)
        self._sites[loc.key] = stats
        return stats

    def _thread_name(self, ident: int) -> str:
        # Listing the threads costs microseconds on every violating sync: a
        # thread keeps the name it had when first seen.
        name = self._thread_names.get(ident)
        if name is None:
            name = self._thread_names[ident] = _thread_name(ident)
        return name

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
        """A snapshot of what was found so far (also while running)."""
        with self._lock:
            stats = list(self._sites.values())
            violations = tuple(
                Violation(
                    file=loc.file,
                    line=loc.line,
                    kind=loc.kind,
                    origin=loc.origin,
                    step=step,
                    reason=reason,
                    thread=thread,
                )
                for loc, step, reason, thread in self._violations
            )
            extra = self._violation_count - len(self._violations)
            notes = list(self._notes) + list(self._faults)
            steps = self._steps
            per_step = tuple(self._per_step)
        if extra > 0:
            notes.append(f"{extra} further policy violations were counted but not listed")
        if steps == 0:
            notes.append(
                "no step boundary was seen (no optimizer.step() and no guard.step()): every "
                "sync counts as setup, and the policy never applied"
            )
        elapsed = self._elapsed + (time.perf_counter() - self._started if self._running else 0.0)
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
            try:
                from barrierguard.session.timeline import summarize

                tl = self._timeline
                timeline = summarize(
                    tl.steps,
                    tl.host_s,
                    tl.ahead,
                    tl.device_s,
                    list(self._step_stall),
                    warmup,
                    sampling=tl.sampling,
                )
            except Exception as exc:
                self.fault(exc)
        return Report(
            engine=self._engine_name,
            detection=self._engine_name != "none",
            policy=self._options.policy,
            steps=steps,
            warmup_steps=min(warmup, steps),
            measured_steps=max(0, steps - warmup),
            sites=tuple(site_record(s, max(0, steps - warmup)) for s in stats),
            violations=violations,
            syncs_per_step=per_step,
            notes=tuple(notes),
            duration_s=elapsed,
            environment=dict(self._env),
            timeline=timeline,
            memory=memory,
            rank=ranks.current_rank(),
        )


def _raise(error: SyncError) -> None:
    raise error
