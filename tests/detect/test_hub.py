"""The hub's one path for every sync: each recorder records, a fault is reported, then the actions."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from barrierguard.detect import hub
from barrierguard.detect.frames import Location
from barrierguard.detect.stack import Sync

SYNC = Sync(Location("/w/train.py", 7, "main", "item", "", "user"))


class _Engine:
    name = "test-hub"

    def __init__(self) -> None:
        self.installed = 0

    def install(self) -> None:
        self.installed += 1

    def uninstall(self) -> None:
        self.installed -= 1


class _Recorder:
    """Records what it is given; raises when told to; returns an action that logs."""

    def __init__(self, name: str, log: list[str], *, broken: bool = False) -> None:
        self.name, self.log, self.broken = name, log, broken
        self.faults: list[BaseException] = []

    def record(
        self, sync: Sync, ident: int, stall: float | None = None, again: bool = False
    ) -> Callable[[], None] | None:
        if self.broken:
            raise ValueError(f"{self.name} broke")
        self.log.append(f"{self.name} records {stall} {again}")
        return lambda: self.log.append(f"{self.name} acts")

    def fault(self, exc: BaseException) -> None:
        self.faults.append(exc)

    def note(self, text: str) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[_Engine]:
    engine = _Engine()
    yield engine
    assert engine.installed == 0
    assert not hub._recorders.get(engine.name) and not hub._deliveries.get(engine.name)


def test_one_recorder_records_then_acts(engine: _Engine) -> None:
    log: list[str] = []
    recorder = _Recorder("a", log)
    hub.attach(recorder, engine)
    try:
        hub.emit(engine.name, SYNC, 0.5)
        hub.emit(engine.name, SYNC, None, again=True)
    finally:
        hub.detach(recorder, engine.name)
    hub.emit(engine.name, SYNC)  # none left: delivered to nobody
    assert log == ["a records 0.5 False", "a acts", "a records None True", "a acts"]


def test_a_fault_in_the_only_recorder_is_reported_not_raised(engine: _Engine) -> None:
    recorder = _Recorder("a", [], broken=True)
    hub.attach(recorder, engine)
    try:
        hub.emit(engine.name, SYNC, 0.5)  # does not raise
    finally:
        hub.detach(recorder, engine.name)
    assert [str(e) for e in recorder.faults] == ["a broke"]


def test_every_recorder_records_before_any_acts_and_a_fault_stays_with_its_own(
    engine: _Engine,
) -> None:
    log: list[str] = []
    first, broken, last = _Recorder("a", log), _Recorder("b", log, broken=True), _Recorder("c", log)
    for recorder in (first, broken, last):
        hub.attach(recorder, engine)
    assert engine.installed == 1
    try:
        hub.emit(engine.name, SYNC, 0.5)
        hub.detach(broken, engine.name)
        hub.emit(engine.name, SYNC)
    finally:
        hub.detach(first, engine.name)
        hub.detach(last, engine.name)
    assert [str(e) for e in broken.faults] == ["b broke"]
    assert not first.faults and not last.faults
    assert log == [
        "a records 0.5 False",
        "c records 0.5 False",
        "a acts",
        "c acts",
        "a records None False",
        "c records None False",
        "a acts",
        "c acts",
    ]
