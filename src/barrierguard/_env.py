"""Seams for what tests cannot own: is CUDA there, which versions run."""

from __future__ import annotations

import functools
import platform
import sys

from barrierguard._version import __version__

__all__ = ["cuda_available", "environment"]


def cuda_available() -> bool:
    """Whether a CUDA device can be used (tests patch this)."""
    import torch

    return bool(torch.cuda.is_available())


@functools.cache
def _environment(engine: str) -> tuple[tuple[str, str], ...]:
    import torch

    env = {
        "barrierguard": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(terse=True),
    }
    if engine == "cuda":
        try:
            env["device"] = torch.cuda.get_device_name()
        except Exception:  # a report never fails for want of a device name
            env["device"] = "unknown"
    return tuple(env.items())


def environment(engine: str) -> dict[str, str]:
    """Versions and device, recorded in every report (read once per process)."""
    return dict(_environment(engine))
