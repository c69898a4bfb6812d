"""A stand-in for CUDA on CPU machines: tensors whose host reads emit the exact
warning that CUDA sync-debug mode emits, from a file that barrierguard treats as
part of torch. With :func:`fake_cuda` the real CUDA engine runs on a CPU.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from barrierguard import _env
from barrierguard.detect import cuda as cuda_engine
from barrierguard.detect import frames as _frames

MESSAGE = (
    "called a synchronizing CUDA operation (Triggered internally at fake/CUDAFunctions.cpp:1.)"
)


def _sync() -> None:
    warnings.warn(MESSAGE, UserWarning, stacklevel=2)


class FakeTensor:
    """Each host read of this tensor 'synchronizes', like a CUDA tensor would."""

    def __init__(self, value: float = 1.0) -> None:
        self.value = value

    def item(self) -> float:
        _sync()
        return self.value

    def tolist(self) -> list[float]:
        _sync()
        return [self.value]

    def cpu(self) -> FakeTensor:
        _sync()
        return self

    def __bool__(self) -> bool:
        _sync()
        return bool(self.value)

    def __int__(self) -> int:
        _sync()
        return int(self.value)

    def __float__(self) -> float:
        _sync()
        return float(self.value)

    def __format__(self, spec: str) -> str:
        _sync()
        return format(self.value, spec)

    def __repr__(self) -> str:
        _sync()
        return f"FakeTensor({self.value})"

    def __getitem__(self, key: Any) -> FakeTensor:
        _sync()
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        _sync()

    def backward(self) -> None:
        _sync()


def unique(t: FakeTensor) -> FakeTensor:
    _sync()
    return t


class FakeMode:
    """Records what the engine sets the sync-debug mode to."""

    def __init__(self) -> None:
        self.mode = 0
        self.history: list[int | str] = []

    def get(self) -> int:
        return self.mode

    def set(self, mode: int | str) -> None:
        self.history.append(mode)
        self.mode = {"default": 0, "warn": 1, "error": 2}.get(str(mode), mode)  # type: ignore[assignment]


@contextmanager
def _registered() -> Iterator[None]:
    path = os.path.abspath(__file__)
    _frames._classifier.classify(path)
    saved = _frames._classifier._cache[path]
    _frames._classifier._cache[path] = (_frames.TORCH, "torch")
    try:
        yield
    finally:
        _frames._classifier._cache[path] = saved


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMode]:
    """Make the CUDA engine run on CPU: CUDA 'available', the mode faked."""
    mode = FakeMode()
    monkeypatch.setattr(_env, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda_engine, "_get_mode", mode.get)
    monkeypatch.setattr(cuda_engine, "_set_mode", mode.set)
    # CPU tensors stand in for CUDA ones.
    monkeypatch.setattr(cuda_engine, "_on_device", lambda tensor: True)
    with _registered():
        yield mode


class InstantEvent:
    """A CUDA event stand-in for the step timeline: complete at once, so the host never
    runs ahead."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def blocking_item(clock: FakeClock, wait: float) -> Any:
    """A stand-in for ``Tensor.item`` that 'waits' ``wait`` seconds, then syncs."""

    def item(self: Any) -> float:
        clock.advance(wait)
        _sync()
        return 0.0

    return item


def blocking_call(clock: FakeClock, wait: float) -> Any:
    """A stand-in for a torch call that 'waits', then syncs; returns its first argument."""

    def blocking(*args: Any, **kwargs: Any) -> Any:
        clock.advance(wait)
        _sync()
        return args[0] if args else None

    return blocking


def syncing_repr(clock: FakeClock, wait: float, times: int) -> Any:
    """A stand-in for ``Tensor.__repr__`` that waits ``wait``, then syncs ``times`` times
    (torch's printing reads a device tensor several times)."""

    def repr_(self: Any) -> str:
        clock.advance(wait)
        for _ in range(times):
            _sync()
            clock.advance(0.0001)
        return "tensor(1.)"

    return repr_


def blocking_copy(clock: FakeClock, wait: float, times: int = 1) -> Any:
    """A stand-in for ``Tensor.to`` that 'waits' ``wait`` seconds, then syncs ``times``
    times, and returns the tensor itself."""

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        clock.advance(wait)
        for _ in range(times):
            _sync()
        return self

    return to
