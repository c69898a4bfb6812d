"""The kind vocabulary and its fixes."""

from __future__ import annotations

import pytest

from barrierguard.detect.kinds import KINDS, fix_for, kind_for_call


@pytest.mark.parametrize(
    ("kind", "detail", "start"),
    [
        ("copy", "h2d", "pin the source"),
        ("copy", "h2d pageable non_blocking", "pin the source"),
        ("copy", "d2h", "keep the tensor on the device"),
        ("copy", "", KINDS["copy"].fix[:20]),
        ("index", "", "use torch.where"),
        ("no-such-kind", "", KINDS["call"].fix[:20]),
        ("collective", "barrier", "take it out of the training loop"),
        ("collective", "monitored_barrier", "take it out of the training loop"),
        ("collective", "all_gather_object", "an *_object call"),
        ("collective", "broadcast_object_list", "an *_object call"),
        ("collective", "wait (all_reduce, gloo)", "wait later"),
        ("collective", "all_reduce (gloo)", "a collective on CPU tensors"),
        ("collective", "", KINDS["collective"].fix[:20]),
    ],
)
def test_fix_follows_kind_and_direction(kind: str, detail: str, start: str) -> None:
    assert fix_for(kind, detail).startswith(start)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("item", "item"),
        ("unique", "unique"),
        ("cpu", "copy"),
        ("frob", "call"),
        ("barrier", "collective"),
        ("all_gather_object", "collective"),
    ],
)
def test_kind_for_call(name: str, kind: str) -> None:
    assert kind_for_call(name) == kind
