"""Reports of a distributed run: each rank's file (:func:`rank_path`, no collective), and
the reports gathered to rank 0 (:func:`merge`; a failed one leaves each rank its own).
"""

from __future__ import annotations

import contextlib
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
# The framework adapters' default file names, inside their run's directory.
REPORT_NAME = "barrierguard_report.json"
RANK_REPORT_NAME = "barrierguard_report.rank{rank}.json"


def _group() -> Any:
    """``torch.distributed`` when a process group is initialized, else ``None``."""
    try:
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None
    except Exception:  # a broken torch.distributed is no process group
        return None


def _ask(what: str, env: str) -> int | None:
    """The process group's ``get_rank``/``get_world_size``, else the launcher's ``$env``."""
    dist = _group()
    if dist is not None:
        with contextlib.suppress(Exception):
            return int(getattr(dist, what)())
    value = os.environ.get(env, "").strip()
    return int(value) if value.isdigit() else None


def current_rank() -> int | None:
    """This process's global rank: the process group's, else ``$RANK``, else ``None``."""
    return _ask("get_rank", "RANK")


def world_size() -> int:
    """The number of ranks: the process group's, else ``$WORLD_SIZE``, else 1."""
    return _ask("get_world_size", "WORLD_SIZE") or 1


def rank_path(
    path: str | os.PathLike[str], *, rank: int | str | None = None, world: int | None = None
) -> str:
    """The file this rank (or a pattern such as ``"*"``) writes for ``path``: ``{rank}``
    replaced, else ``.rank<N>`` before the suffix with several ranks (``bg.rank3.json``)."""
    name = os.fspath(path)
    if rank is None:
        rank = current_rank() or 0
    if RANK_PLACEHOLDER in name:
        return name.replace(RANK_PLACEHOLDER, str(rank))
    if (world_size() if world is None else world) <= 1:
        return name
    stem, suffix = os.path.splitext(name)
    return f"{stem}.rank{rank}{suffix}"


def _write(report: Report, path: str) -> str:
    """Save ``report`` to ``path`` atomically (``Report.save``), making its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    report.save(path)
    return path


def save(report: Report, path: str | os.PathLike[str]) -> str:
    """Save ``report`` to this rank's file for ``path``, atomically; returns the file."""
    return _write(report, rank_path(path, rank=report.rank))


def merge(local: Report) -> Report | None:
    """Rank 0: the ranks' reports merged (one gather); other ranks: ``None``."""
    try:
        dist = _group()
        if dist is None or dist.get_world_size() < 2:
            return local
        # To rank 0 alone: an all-gather would send N times the bytes (docs/distributed.md).
        gathered: list[Any] | None = None
        if dist.get_rank() == 0:
            gathered = [None] * dist.get_world_size()
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


def report_file(
    setting: bool | str | os.PathLike[str], directory: Callable[[], str], name: str
) -> str | None:
    """Where an adapter's ``save_report``/``rank_reports`` setting writes: ``True`` is
    ``name`` in ``directory()``, called only then (it can be a collective)."""
    if setting is True:
        return os.path.join(directory(), name)
    return None if setting is False else os.fspath(setting)


def not_run_report(policy: str) -> Report:
    """The report of an adapter whose guard has not started yet."""
    return Report(
        engine="none", detection=False, policy=policy, notes=("the callback has not run yet",)
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
    """End a framework run's reporting: this rank's file first (a merge that fails or hangs
    loses nothing), then the merge on rank 0; a failed write goes to ``fault``. Returns the
    report to keep, the rank file and the merged file written."""
    written = saved = None
    if rank_file is not None:
        try:
            written = save(local, rank_file)
        except OSError as exc:
            fault(exc)
    if not merge_ranks:
        if print_report and not local.rank:
            print(local, flush=True)
        return local, written, None
    merged = merge(local)
    if merged is not None:
        if print_report:
            print(merged, flush=True)
        if merged_file is not None:
            try:
                saved = _write(merged, merged_file)
            except OSError as exc:
                fault(exc)
    # Ranks leave together: one shutting gloo down while rank 0 writes can abort a rank.
    with contextlib.suppress(Exception):  # a failed barrier must not lose the run
        dist = _group()
        if dist is not None and dist.get_world_size() > 1:
            dist.barrier()
    return local if merged is None else merged, written, saved
