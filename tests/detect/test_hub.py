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


class _Tallier(_Recorder):
    """Counts every sync as a repeat in its own tally."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__(name, log)
        self.tally = hub.Tally()

    def record(  # type: ignore[override]
        self, sync: Sync, ident: int, stall: float | None = None, again: bool = False
    ) -> hub.Tally:
        self.tally.n += 1
        return self.tally


def test_a_tally_is_handed_to_the_engine_only_for_one_recorder(engine: _Engine) -> None:
    log: list[str] = []
    first, second = _Tallier("a", log), _Tallier("b", log)
    epoch = hub.epoch
    hub.attach(first, engine)
    try:
        assert hub.epoch != epoch  # attaching makes the tallies handed out stale
        assert hub.emit(engine.name, SYNC) is first.tally
        hub.attach(second, engine)
        try:
            # The engine would count one recorder's repeat for both: none handed out.
            assert hub.emit(engine.name, SYNC) is None
            assert (first.tally.n, second.tally.n) == (2, 1)
        finally:
            hub.detach(second, engine.name)
    finally:
        hub.detach(first, engine.name)
    assert not log  # a tally is no action: nothing ran
