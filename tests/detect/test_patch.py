"""Reversible patches: deferred changes, and what a start costs a class's attribute cache."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

import barrierguard
from _fake_cuda import FakeMode
from barrierguard.detect import patch
from barrierguard.detect.patch import Patches


def test_deferred_sets_at_exit_in_order_and_undo_restores() -> None:
    ns = types.SimpleNamespace(f=1)
    p = Patches()
    with p.deferred():
        p.set(ns, "f", 2)
        p.set(ns, "g", 3)
        assert (ns.f, hasattr(ns, "g")) == (1, False)
    assert (ns.f, ns.g) == (2, 3)
    p.undo()
    assert (ns.f, hasattr(ns, "g")) == (1, False)


def test_deferred_sets_nothing_when_the_block_raises() -> None:
    ns = types.SimpleNamespace(f=1)
    p = Patches()
    with pytest.raises(RuntimeError, match="boom"), p.deferred():
        p.set(ns, "f", 2)
        raise RuntimeError("boom")
    assert ns.f == 1
    p.undo()  # nothing to undo
    assert ns.f == 1
    p.set(ns, "f", 3)  # immediate again
    assert ns.f == 3
    p.undo()
    assert ns.f == 1


def test_a_cuda_start_and_stop_cost_torch_tensor_one_cache_version(
    fake_cuda: FakeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lookup after a change gives the class a new version of its attribute cache; CPython
    # 3.13 stops caching a class after 1,000 (every tensor method is then looked up slower).
    type_get_version = pytest.importorskip("_testcapi").__dict__.get("type_get_version")
    if type_get_version is None:
        pytest.skip("_testcapi.type_get_version is missing")
    changes = {"n": 0, "versions": 0}

    def counted(change: Any) -> Any:
        def wrapped(owner: Any, *args: Any) -> Any:
            if owner is torch.Tensor:
                if changes["n"] and type_get_version(owner) != 0:
                    changes["versions"] += 1  # looked up since the last change
                changes["n"] += 1
            return change(owner, *args)

        return wrapped

    monkeypatch.setattr(patch, "setattr", counted(setattr), raising=False)
    monkeypatch.setattr(patch, "delattr", counted(delattr), raising=False)
    with barrierguard.watch(engine="cuda", policy="record", memory=False):
        torch.ones(2).add(1).sum()  # lookups while it runs
    assert changes["n"] >= 20  # the start's patches and the stop's
    assert changes["versions"] == 1  # the stop's first change, after the run's lookups
