"""Reports of a distributed run: one per rank, and the ranks' reports merged.

Two ways to one merged report:

* **per-rank files** (any launcher, any number of nodes, no collective): each
  rank saves its own report to :func:`rank_path` of one path
  (``report.json`` -> ``report.rank3.json``, or ``{rank}`` in the path), and
  ``barrierguard merge`` builds the merged report offline;
* **in process** (:func:`merge`): one ``gather_object`` of every rank's
  report to rank 0 after the run, merged there.

The framework adapters use both (the Lightning and Hugging Face callbacks,
``watch(out=...)``, ``barrierguard run --out``). Nothing here may lose the
run: a failed collective leaves each rank with its own report and a note.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from barrierguard._errors import BarrierGuardError
from barrierguard.report.records import Report

__all__ = [
    "RANK_PLACEHOLDER",
    "RANK_REPORT_NAME",
    "REPORT_NAME",
    "barrier",
    "current_rank",
    "merge",
    "not_run_report",
    "publish",
    "rank_path",
    "report_file",
    "save",
    "world_size",
]

RANK_PLACEHOLDER = "{rank}"


def _group() -> Any:
    """``torch.distributed`` when a process group is initialized, else ``None``."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # a broken torch.distributed is no process group
        return None
    return None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _ask(what: str, env: str) -> int | None:
    """The process group's ``get_rank``/``get_world_size``, else the launcher's ``$env``."""
    dist = _group()
    if dist is not None:
        try:
            return int(getattr(dist, what)())
        except Exception:
            pass
    return _env_int(env)


def current_rank() -> int | None:
    """This process's global rank: the process group's, else ``$RANK`` (torchrun,
    Slurm launchers, accelerate), else ``None`` (not a distributed run)."""
    return _ask("get_rank", "RANK")


def world_size() -> int:
    """The number of ranks: the process group's, else ``$WORLD_SIZE``, else 1."""
    return _ask("get_world_size", "WORLD_SIZE") or 1


def rank_path(
    path: str | os.PathLike[str], *, rank: int | str | None = None, world: int | None = None
) -> str:
    """The file this rank writes for ``path``.

    ``{rank}`` in the path is replaced by the rank. Without it, a run of more
    than one rank inserts ``.rank<N>`` before the suffix, and a run of one rank
    keeps the path as it is.

    Args:
        path: The path asked for (``--out``, ``watch(out=...)``).
        rank: The rank (or a pattern such as ``"*"``, for a glob of every
            rank's file); default :func:`current_rank` (0 when unknown).
        world: The number of ranks; default :func:`world_size`.

    Example:
        >>> rank_path("out/bg.json", rank=3, world=8)
        'out/bg.rank3.json'
        >>> rank_path("out/bg-{rank}.json", rank=3, world=8)
        'out/bg-3.json'
        >>> rank_path("out/bg.json", rank=0, world=1)
        'out/bg.json'
    """
    name = os.fspath(path)
    if rank is None:
        rank = current_rank() or 0
    if RANK_PLACEHOLDER in name:
        return name.replace(RANK_PLACEHOLDER, str(rank))
    if world is None:
        world = world_size()
    if world <= 1:
        return name
    head, tail = os.path.split(name)
    stem, suffix = os.path.splitext(tail)
    return os.path.join(head, f"{stem}.rank{rank}{suffix}")


def save(report: Report, path: str | os.PathLike[str]) -> str:
    """Save ``report`` to this rank's file for ``path``, atomically; returns the file.

    The directory is created when missing; the JSON goes to a temporary file
    next to the target and replaces it, so a reader (or ``barrierguard
    merge``) never sees half a report.

    Raises:
        OSError: When the file cannot be written.
    """
    target = rank_path(path, rank=report.rank)
    folder = os.path.dirname(target)
    if folder:
        os.makedirs(folder, exist_ok=True)
    report.save(target)
    return target


def barrier() -> None:
    """Wait for every rank, where a process group of several ranks exists (never raises)."""
    try:
        dist = _group()
        if dist is not None and dist.get_world_size() > 1:
            dist.barrier()
    except Exception:  # a failed barrier must not lose the run
        return


def merge(local: Report) -> Report | None:
    """Rank 0: the ranks' reports merged; other ranks: ``None``. One collective.

    Without a process group of several ranks, ``local`` itself. The cost grows
    with the ranks: rank 0 receives every rank's report, some 10 KB pickled
    each (docs/distributed.md measures it, and plans for 1,000 ranks, where
    per-rank files and ``barrierguard merge`` are the way).
    """
    try:
        dist = _group()
        if dist is None or dist.get_world_size() < 2:
            return local
        # To rank 0 alone: an all-gather would send every report to every rank,
        # N times the bytes for nothing (docs/distributed.md).
        rank = dist.get_rank()
        gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(local.to_dict(), gathered, dst=0)
        if gathered is None:
            return None
        return Report.merge(
            [Report.from_dict(d, source=f"rank {i}") for i, d in enumerate(gathered)]
        )
    except BarrierGuardError:
        raise
    except Exception as exc:  # a failed merge must not lose the run
        note = (
            f"merging the ranks' reports failed ({type(exc).__name__}: {exc}); this is one rank's"
        )
        return replace(local, notes=(*local.notes, note))


# The framework adapters' default file names, inside their run's directory.
REPORT_NAME = "barrierguard_report.json"
RANK_REPORT_NAME = "barrierguard_report.rank{rank}.json"


def report_file(
    setting: bool | str | os.PathLike[str], directory: Callable[[], str], name: str
) -> str | None:
    """Where an adapter's ``save_report``/``rank_reports`` setting writes.

    ``False``: nowhere; a path: that path; ``True``: ``name`` inside
    ``directory()``, which is called only then (a framework's log directory
    can be a collective to ask for).

    Example:
        >>> report_file(True, lambda: "out", REPORT_NAME)
        'out/barrierguard_report.json'
        >>> report_file(False, lambda: "out", REPORT_NAME) is None
        True
    """
    if setting is False:
        return None
    if setting is not True:
        return os.fspath(setting)
    return os.path.join(directory(), name)


def not_run_report(policy: str) -> Report:
    """The report of an adapter whose guard has not started yet."""
    return Report(
        engine="none",
        detection=False,
        policy=policy,
        notes=("the callback has not run yet",),
    )


def publish(
    local: Report,
    *,
    rank_file: str | None,
    merged_file: str | None,
    merge_ranks: bool,
    print_report: bool,
    fault: Callable[[BaseException], None],
) -> tuple[Report, str | None, str | None]:
    """End a framework run's reporting: this rank's file, then the merge on rank 0.

    Each rank writes its own file first (``rank_file``), so a merge that fails,
    or a rank that hangs in it, loses nothing. With ``merge_ranks`` rank 0
    merges every rank's report (one collective), prints it and saves it to
    ``merged_file``; then the ranks leave together. Without, rank 0 prints its
    own report. Nothing here raises into the run: a write that fails goes to
    ``fault``.

    Returns:
        ``(the report to keep, the rank file written, the merged file written)``.
    """
    final = local
    written: str | None = None
    saved: str | None = None
    if rank_file is not None:
        try:
            written = save(local, rank_file)
        except OSError as exc:
            fault(exc)
    if not merge_ranks:
        if print_report and not local.rank:
            print(local, flush=True)
        return final, written, saved
    merged = merge(local)
    if merged is not None:
        final = merged
        if print_report:
            print(merged, flush=True)
        if merged_file is not None:
            try:
                os.makedirs(os.path.dirname(merged_file) or ".", exist_ok=True)
                merged.save(merged_file)
                saved = merged_file
            except OSError as exc:
                fault(exc)
    # Ranks leave together: rank 1 shutting gloo down while rank 0 still writes
    # the report was seen to abort a spawned rank.
    barrier()
    return final, written, saved
