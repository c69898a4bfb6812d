"""Warnings raised inside a torch op under the audit keep the user's location."""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import barrierguard
from barrierguard.detect.audit import home_frame

HERE = __file__


def _cxx_warning() -> int:
    torch.tensor(torch.ones(2))  # torch warns in C++: "To copy construct from a tensor"
    return sys._getframe().f_lineno - 1


def _python_warning() -> int:
    F.softmax(torch.ones(2, 2))  # torch's Python code warns with a stacklevel
    return sys._getframe().f_lineno - 1


@pytest.mark.parametrize("raise_it", [_cxx_warning, _python_warning])
def test_a_warning_inside_a_torch_op_points_at_the_users_line(raise_it: Callable[[], int]) -> None:
    with (
        barrierguard.watch(engine="audit", policy="record"),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        line = raise_it()
    assert [(w.filename, w.lineno) for w in seen] == [(HERE, line)]
    assert seen[0].category is UserWarning


def test_a_filter_on_the_users_module_still_applies() -> None:
    with (
        barrierguard.watch(engine="audit", policy="record"),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module=re.escape(__name__))
        _cxx_warning()
        _python_warning()
    assert seen == []


def test_an_error_filter_raises_from_the_op_as_without_the_audit() -> None:
    with barrierguard.watch(engine="audit", policy="record"), warnings.catch_warnings():
        warnings.filterwarnings("error", message="Implicit dimension choice")
        with pytest.raises(UserWarning, match="Implicit dimension choice"):
            _python_warning()


def test_the_default_action_shows_a_location_once_in_the_users_registry() -> None:
    registry = globals().setdefault("__warningregistry__", {})
    registry.clear()
    with (
        barrierguard.watch(engine="audit", policy="record"),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("default")
        for _ in range(3):
            _python_warning()
    assert len(seen) == 1
    assert any(key[2] == seen[0].lineno for key in registry if isinstance(key, tuple))


def test_home_frame_skips_barrierguard_and_torch_dispatch() -> None:
    assert home_frame(sys._getframe()) is sys._getframe()
    assert home_frame(None) is None
