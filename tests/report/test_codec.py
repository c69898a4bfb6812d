"""The record codec: types by hint, optional keys, pairs as objects, errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from barrierguard.report.codec import AS_MAP, OMIT_EMPTY, OMIT_NONE, from_json, to_json


@dataclass(frozen=True)
class _Inner:
    x: float
    tag: str = ""


@dataclass(frozen=True)
class _Outer:
    name: str
    count: int = 0
    maybe: int | None = field(default=None, metadata=OMIT_NONE)
    spans: tuple[tuple[int, int], ...] = ()
    values: tuple[float | None, ...] = ()
    stalls: tuple[tuple[int, float], ...] = field(default=(), metadata={**AS_MAP, **OMIT_EMPTY})
    series: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    inner: _Inner | None = None
    inners: tuple[_Inner, ...] = ()


def test_round_trip_keeps_types() -> None:
    rec = _Outer(
        name="a",
        count=2,
        maybe=0,
        spans=((1, 3),),
        values=(None, 0.5),
        stalls=((3, 0.25),),
        series={"s": (1, 2)},
        inner=_Inner(1.0, "t"),
        inners=(_Inner(2.0),),
    )
    data = to_json(rec)
    assert data["spans"] == [[1, 3]] and data["stalls"] == {"3": 0.25}
    assert data["maybe"] == 0  # OMIT_NONE keeps a zero
    assert from_json(_Outer, data) == rec


def test_optional_keys_are_left_out_and_defaulted() -> None:
    data = to_json(_Outer(name="a"))
    assert "maybe" not in data and "stalls" not in data
    assert from_json(_Outer, {"name": "a", "unknown": 1}) == _Outer(name="a")


def test_values_are_converted_to_the_field_type() -> None:
    rec = from_json(_Outer, {"name": "a", "count": 3.0, "inner": {"x": 1}})
    assert type(rec.count) is int and rec.inner is not None and type(rec.inner.x) is float


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"count": 1}, KeyError),
        ({"name": "a", "count": "x"}, ValueError),
        ({"name": "a", "spans": 3}, TypeError),
        ({"name": "a", "spans": [[1, 2, 3]]}, ValueError),
        ({"name": "a", "inner": [1]}, TypeError),
    ],
)
def test_malformed_data_raises(data: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        from_json(_Outer, data)


def test_an_element_that_does_not_read_names_its_index() -> None:
    with pytest.raises(ValueError, match=r"^\[1\]: KeyError\('x'\)$"):
        from_json(_Outer, {"name": "a", "inners": [{"x": 1}, {"tag": "t"}]})


@dataclass(frozen=True)
class _Renamed:
    entries: tuple[int, ...] = field(default=(), metadata={"key": "sites"})


def test_a_field_can_name_its_json_key() -> None:
    assert to_json(_Renamed((1, 2))) == {"sites": [1, 2]}
    assert from_json(_Renamed, {"sites": [3], "entries": [4]}) == _Renamed((3,))
