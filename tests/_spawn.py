"""The multi-process harness of the distributed tests: spawn ranks, wait, kill stragglers.

Each worker module (``_metrics_dist``, ``_ranks_dist``) keeps its own worker, so
that spawned processes import only it; this module is what they share.
"""

from __future__ import annotations

import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.spawn import ProcessExitedException

__all__ = ["free_port", "spawn"]


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(
    worker: Callable[..., None],
    args: tuple[Any, ...],
    world: int,
    *,
    timeout_s: float,
    what: str,
    done: Callable[[], bool] | None = None,
) -> None:
    """Run ``worker(rank, *args)`` in ``world`` spawned processes and wait for them.

    Ranks still running past ``timeout_s`` are killed and ``TimeoutError`` names
    ``what``. A rank that aborts (SIGABRT) at exit after ``done()`` says the work
    is done is warned about, not raised: seen now and then, a C++ thread of
    torch.distributed aborts the interpreter's exit after the files are written.
    """
    ctx = torch.multiprocessing.start_processes(
        worker, args=args, nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish in {timeout_s} s")
    except ProcessExitedException as exc:
        if "SIGABRT" not in str(exc) or done is None or not done():
            raise
        warnings.warn(f"a spawned rank aborted at exit after its work: {exc}", stacklevel=1)
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
