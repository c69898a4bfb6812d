"""Classifying source files and reading the kind from the executing instruction."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import barrierguard
from barrierguard.cli import demo as _demo
from barrierguard.detect import frames as _frames
from barrierguard.detect import stack
from barrierguard.metrics import buffer as _metrics


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (_frames.__file__, (_frames.OWN, "barrierguard")),
        (_demo.__file__, (_frames.USER, "")),
        (_metrics.__file__, (_frames.FRAMEWORK, "barrierguard")),
        (torch.__file__, (_frames.TORCH, "torch")),
        (torch.amp.GradScaler.step.__code__.co_filename, (_frames.FRAMEWORK, "torch.amp")),
        (torch.optim.Optimizer.step.__code__.co_filename, (_frames.FRAMEWORK, "torch.optim")),
        (os.__file__, (_frames.LIBRARY, "python")),
        ("<frozen runpy>", (_frames.LIBRARY, "python")),
        ("<stdin>", (_frames.USER, "")),
        (__file__, (_frames.USER, "")),
    ],
)
def test_classify_file(path: str, expected: tuple[int, str]) -> None:
    assert _frames.classify_file(path) == expected


def test_known_frameworks_are_frameworks() -> None:
    import lightning
    import torchmetrics

    assert _frames.classify_file(lightning.__file__) == (_frames.FRAMEWORK, "lightning")
    assert _frames.classify_file(torchmetrics.__file__) == (_frames.FRAMEWORK, "torchmetrics")


def _probe() -> _frames.Location | None:
    sync = stack.observe(sys._getframe(1))
    return sync.loc if sync is not None else None


def test_locate_names_the_caller_and_reads_the_call() -> None:
    loc = _probe()  # the call being executed is _probe()
    assert loc is not None
    assert (
        loc.file == __file__ and loc.function == "test_locate_names_the_caller_and_reads_the_call"
    )
    assert (loc.kind, loc.detail) == ("call", "_probe")
    assert loc.origin == "user"


def test_a_relative_filename_is_stored_absolute() -> None:
    scope: dict[str, object] = {"probe": _probe}
    exec(compile("loc = probe()", "relative_train.py", "exec"), scope)
    loc = scope["loc"]
    assert isinstance(loc, _frames.Location)
    assert loc.file == os.path.abspath("relative_train.py")


def test_locations_are_interned() -> None:
    first = [_probe() for _ in range(3)]
    assert first[0] is first[1] is first[2]


def test_metricbuffer_transfer_is_allowed_by_default() -> None:
    options = barrierguard.watch(policy="error").options
    assert options.allowed("/w/t.py", 1, "tolist", "framework:barrierguard")
    assert not options.allowed("/w/t.py", 1, "tolist", "user")
