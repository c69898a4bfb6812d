"""Every process of the job: ``barrierguard run`` follows the children that re-execute its target.

As coverage.py measures subprocesses, ``run`` passes its options in ``$BARRIERGUARD_FOLLOW`` and
puts ``_bootstrap`` (a ``sitecustomize.py``) first on ``$PYTHONPATH``; a Python child that runs
the same script or module (or the one a launcher module names) is watched with the same options
and saves its rank's report at exit. Nothing here may break a child (docs/distributed.md).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from barrierguard._errors import MemoryGrowthError, SyncError
from barrierguard.report.records import Report
from barrierguard.session import rank_reports
from barrierguard.session.guard import Guard
from barrierguard.session.options import GUARD_OPTIONS
from barrierguard.session.watch import watch

__all__ = [
    "ENV",
    "LAUNCHERS",
    "RankProbe",
    "bootstrap_dir",
    "child_path",
    "following",
    "save",
    "settings",
    "start_child",
    "wait_for_ranks",
    "watched",
]

ENV = "BARRIERGUARD_FOLLOW"
"""The environment variable that carries ``run``'s options to its children."""

LAUNCHERS = frozenset({"torch.distributed.run", "torch.distributed.launch"})
"""Modules whose children run the script or module named in their arguments."""


def bootstrap_dir() -> str:
    """The directory that holds the children's ``sitecustomize.py``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


def settings(
    options: dict[str, Any], script: str | None, module: str | None, args: Sequence[str]
) -> dict[str, Any]:
    """What a child needs to know: the guard's options, the target, and ``out``."""
    launched: list[str] = []
    if module in LAUNCHERS:  # its arguments name what its children run: scripts and modules
        for arg in args:
            if arg.endswith(".py") and os.path.isfile(arg):
                launched.append(os.path.realpath(arg))
            elif not arg.startswith("-"):
                launched.append(arg)
    return {
        **options,
        "script": os.path.realpath(script) if script else None,
        "module": module,
        "launched": launched,
    }


@contextmanager
def following(data: dict[str, Any]) -> Iterator[None]:
    """Within the block, Python children inherit ``data`` and the bootstrap; restored after."""
    saved = {name: os.environ.get(name) for name in (ENV, "PYTHONPATH")}
    here = bootstrap_dir()
    rest = [p for p in (saved["PYTHONPATH"] or "").split(os.pathsep) if p and p != here]
    os.environ[ENV] = json.dumps(data)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *rest])
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _target(argv: Sequence[str], orig_argv: Sequence[str]) -> tuple[str, str] | None:
    """``("script", path)`` or ``("module", name)`` run here; None for ``-c``, stdin or a REPL."""
    first = argv[0] if argv else ""
    if first == "-m":
        for i, token in enumerate(orig_argv[1:], 1):
            if token == "-m" and i + 1 < len(orig_argv):
                return "module", orig_argv[i + 1]
            if token.startswith("-m") and len(token) > 2:
                return "module", token[2:]
        return None
    if first in ("-c", "-") or not os.path.isfile(first):
        return None
    return "script", os.path.realpath(first)


def follows(data: dict[str, Any], argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """Whether a child running ``argv`` is a process of the job ``data`` describes."""
    if (target := _target(argv, orig_argv)) is None:
        return False
    what, name = target
    return name == data.get(what) or name in data.get("launched", ())


class RankProbe:
    """A step listener that remembers the rank and the world size once it sees them (launchers
    may tear the process group down, and Lightning deletes ``$WORLD_SIZE``, before the exit)."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.world = 1
        self(0)

    def __call__(self, step: int) -> None:
        if self.rank is not None and self.world > 1:
            return
        rank, world = rank_reports.current_rank(), rank_reports.world_size()
        if rank is not None:
            self.rank, self.world = rank, max(world, self.world)


def child_path(out: str, rank: int | None, world: int) -> str:
    """The file a followed child writes: its rank's, else one named by its pid."""
    if rank is not None:
        return rank_reports.rank_path(out, rank=rank, world=max(world, 2))
    stem, suffix = os.path.splitext(out.replace(rank_reports.RANK_PLACEHOLDER, "pid"))
    return f"{stem}.pid{os.getpid()}{suffix}"


def start_child() -> Guard | None:
    """Called by the bootstrap at a child's start: watch it when it is one of the job's."""
    if not (raw := os.environ.get(ENV)):
        return None
    data = json.loads(raw)
    if not follows(data, sys.argv, getattr(sys, "orig_argv", sys.argv)):
        return None
    guard, probe = watched({k: v for k, v in data.items() if k in GUARD_OPTIONS})
    atexit.register(_finish_child, guard, probe, data.get("out"))
    return guard


def watched(options: dict[str, Any]) -> tuple[Guard, RankProbe]:
    """A guard of ``options``, started, and the probe that learns its rank."""
    guard: Guard = watch(**options)
    probe = RankProbe()
    guard.add_step_listener(probe)
    guard.start()
    return guard, probe


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return -math.inf


def _finish_child(guard: Guard, probe: RankProbe, out: str | None) -> None:
    try:
        try:
            report = guard.stop()
        except (SyncError, MemoryGrowthError):
            report = guard.report  # the run is over: the report says it
        probe(guard.steps)
        if probe.rank is not None:
            report = replace(report, rank=probe.rank)
        who = f"rank {probe.rank}" if probe.rank is not None else f"pid {os.getpid()}"
        if not out:
            print(
                f"barrierguard: {who}: {report.step_syncs} syncs in {report.measured_steps} "
                f"measured steps at {len(report.sites)} site(s) (use --out to keep its report)",
                file=sys.stderr,
            )
            return
        path = child_path(out, probe.rank, probe.world)
        save(report, path)
        print(f"barrierguard: {who} report written to {path}", file=sys.stderr)
    except Exception as exc:  # the child's run is done: never fail its exit
        print(f"barrierguard: the report of pid {os.getpid()} was lost: {exc}", file=sys.stderr)


def save(report: Report, path: str) -> None:
    """Save ``report`` to ``path``, making its folder first."""
    if folder := os.path.dirname(path):
        os.makedirs(folder, exist_ok=True)
    report.save(path)


def wait_for_ranks(out: str, world: int, since: float, timeout: float) -> dict[int, str]:
    """``{rank: path}`` of the rank files of ``out`` written since ``since``, waiting up to
    ``timeout`` s for all (followed children write theirs as they exit)."""
    deadline = time.monotonic() + timeout
    paths = {rank: rank_reports.rank_path(out, rank=rank, world=world) for rank in range(world)}
    while True:
        found = {rank: path for rank, path in paths.items() if _mtime(path) >= since}
        if len(found) == world or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)
