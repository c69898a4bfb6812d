"""``watch()``: the one entry point that builds a guard from keyword options."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from barrierguard._errors import BarrierGuardError
from barrierguard.session.guard import Guard
from barrierguard.session.options import GUARD_OPTIONS, make_options, unknown_options

__all__ = ["watch"]

_WATCH_OPTIONS = (*GUARD_OPTIONS, "out", "capture_probe")


def watch(func: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Watch a block of training code for host-device synchronizations.

    The callbacks and the pytest marker take the same keyword options.

    Args:
        func: The function to watch (``@watch`` without brackets). A recursive call runs
            inside the outer watch, a call from a second thread runs unwatched (noted); a
            generator is watched over its iterations, an ``async def`` until it returns.
        policy: ``"record"`` (silent), ``"warn"`` (one :class:`~barrierguard.SyncWarning`
            per new site) or ``"error"`` (raise :class:`~barrierguard.SyncError` at the first
            site not allowed). Default: ``$BARRIERGUARD_POLICY``, else ``"warn"``.
        engine: ``"auto"`` (``"cuda"`` when CUDA is available, else ``"audit"``), ``"cuda"``
            or ``"audit"`` (on a CPU, the lines that would sync on a GPU; docs/audit.md).
        warmup_steps: Steps after the first that also count as setup.
        allow: Allow rules: a kind (``"item"``), an origin (``"framework:lightning"``), or
            ``"path/file.py:LINE"`` with LINE ``*``, ``N`` or ``N-M``.
        max_syncs_per_step: A budget of syncs per step not allowed by a rule; ``None``: none.
        memory: Sample host and device memory at step boundaries, adaptively (the sampler's
            own time, counted twice for what it leaves the steps after it, under 0.1 % of the
            step time; never syncing), and give a growth verdict.
        max_growth_per_step: Growth per step, sustained until the end, above which memory
            leaks: bytes, or a string such as ``"512KB"``, ``"1.5MiB"``. ``"warn"`` issues a
            :class:`~barrierguard.MemoryGrowthWarning`, ``"error"`` raises
            :class:`~barrierguard.MemoryGrowthError`.
        memory_every: Sample every N steps instead of adaptively.
        memory_children: Also sample the RSS of child processes (DataLoader workers).
        out: Save the report as JSON to this path at every ``stop()``, atomically. With
            several ranks each writes its own file (``report.rank<N>.json``, or ``{rank}``
            in the path); ``barrierguard merge`` joins them (docs/distributed.md).
        capture_probe: After warm-up, capture one call of the step with ``torch.cuda.graph``
            (never replayed) and report the first line that blocks capture, or that it is
            capturable (``report.compile.probe``; docs/compile.md). ``True``: the decorated
            function; a name such as ``"train_step"``: the first call of a function of that
            name. Or call :meth:`Guard.probe_capture` yourself.

    Returns:
        A :class:`Guard` (for ``with``, a decorator, or ``start()``/``stop()``), or the
        wrapped ``func``.

    Raises:
        BarrierGuardError: For an unknown policy or engine, a malformed allow rule, a bad
            count, a size ``max_growth_per_step`` cannot parse, or an ``out`` not a path.
        TypeError: For an unknown keyword argument.

    Example:
        >>> import barrierguard, torch
        >>> with barrierguard.watch(policy="record") as guard:
        ...     loss = torch.ones(()) * 3
        >>> guard.report.policy
        'record'
    """
    unknown = [name for name in options if name not in _WATCH_OPTIONS]
    if unknown:
        raise unknown_options("watch", unknown, _WATCH_OPTIONS)
    guard = Guard(make_options(**options))
    if func is not None:
        if not callable(func):
            raise BarrierGuardError(
                f"watch({func!r}): the only positional argument is a function to decorate; "
                "pass options by keyword, e.g. watch(policy='error')"
            )
        return guard(func)
    return guard
