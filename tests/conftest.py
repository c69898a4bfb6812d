"""Shared fixtures: every test leaves torch, warnings and hooks as it found them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from _leaks import global_state
from barrierguard.detect import hub

pytest_plugins = ["_fake_cuda", "pytester"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        need = (
            2
            if item.get_closest_marker("multigpu")
            else 1
            if item.get_closest_marker("cuda")
            else 0
        )
        if gpus < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {gpus}"))


@pytest.fixture(autouse=True)
def check_global_state() -> Iterator[None]:
    """Fail any test after which barrierguard left a global touched."""
    before = global_state()
    yield
    after = global_state()
    leaked = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    # A leaked guard would keep the others leaked too: stop it so later tests run clean.
    for guard in hub.running_recorders():
        guard.stop()
    assert not leaked, f"global state leaked: {sorted(leaked)}"
