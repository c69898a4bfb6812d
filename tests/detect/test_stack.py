"""The one walk per sync: location, mechanism and phase together, and its anchors."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

from barrierguard.detect import frameworks, stack

SP = os.path.join(os.sep, "sp", "site-packages")


@pytest.fixture(autouse=True)
def _framework_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    # Phases are looked for once a framework that has them is imported.
    monkeypatch.setattr(frameworks, "PHASE_PACKAGES", ("sys",))
    stack.forget()


def _define(path: str, src: str) -> dict[str, Any]:
    """Run ``src`` as if it were the installed framework file ``path``."""
    namespace: dict[str, Any] = {}
    exec(compile(src, os.path.join(SP, path), "exec"), namespace)
    return namespace


def _nested(depth: int, fn: Callable[[], Any]) -> Any:
    return fn() if depth <= 1 else _nested(depth - 1, fn)


# A framework function that synchronizes itself (its frame is the innermost),
# called through `depth` more framework frames.
_METRICS = _define(
    "lightning/pytorch/trainer/connectors/logger_connector/result.py",
    "import sys\n"
    "def metrics(observe):\n"
    "    return observe(sys._getframe(), 'item')\n"
    "def through(depth, observe):\n"
    "    return metrics(observe) if depth <= 1 else through(depth - 1, observe)\n",
)
_FIT = _define("lightning/pytorch/loops/fit_loop.py", "def run(inner):\n    return inner()\n")
_EVAL = _define(
    "lightning/pytorch/loops/evaluation_loop.py",
    "class _EvaluationLoop:\n"
    "    def __init__(self, stage):\n        self._stage = stage\n"
    "    def run(self, inner):\n        return inner()\n",
)


class _Stage:
    value = "validate"


def _line_a() -> stack.Sync | None:
    return _METRICS["through"](20, stack.observe)  # line A


def _line_b() -> stack.Sync | None:
    return _METRICS["through"](20, stack.observe)  # line B


def test_one_framework_sync_from_two_user_lines_is_two_locations() -> None:
    seen = [(_line_a(), _line_b()) for _ in range(3)]
    for a, b in seen:
        assert a is not None and b is not None
        assert a.loc.function == "_line_a" and b.loc.function == "_line_b"
        assert a.loc.line != b.loc.line
        # ... the same framework line, and the mechanism of that function.
        assert a.loc.framework_line == b.loc.framework_line
        assert a.loc.origin == b.loc.origin == "framework:lightning"
        assert a.mechanism == b.mechanism == "prog_bar"
    assert seen[0][0].loc is seen[2][0].loc  # interned: a hot site is one lookup


_TRAINER = _define(
    "lightning/pytorch/trainer/trainer.py",
    "def fit(run, inner, times):\n    return [run(inner) for _ in range(times)]\n",
)


# metrics() syncs inside fit_loop.run (the phase marker) inside fit(): the
# search ends at the marker, and the walk keeps the frame past it.
_SYNC = functools.partial(_METRICS["metrics"], stack.observe)


def test_the_location_anchor_tells_user_lines_apart_past_a_phase_marker() -> None:
    def first() -> list[stack.Sync | None]:
        return _TRAINER["fit"](_FIT["run"], _SYNC, 2)  # type: ignore[no-any-return]

    def second() -> list[stack.Sync | None]:
        return _TRAINER["fit"](_FIT["run"], _SYNC, 2)  # type: ignore[no-any-return]

    rounds = [(first(), second()) for _ in range(3)]
    for a, b in rounds:
        assert all(s is not None and s.phase == "train" for s in (*a, *b))
        assert {s.loc.function for s in a if s} == {"first"}
        assert {s.loc.function for s in b if s} == {"second"}
    assert stack._anchors.located is not None  # the second sync of a fit() met it


@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("depth", [1, 30, 90])
def test_the_phase_of_a_sync_whose_marker_is_many_frames_out(
    depth: int, routed: bool, walks: list[int]
) -> None:
    def probe() -> stack.Sync | None:
        # Routed: the caller says where the frame is, so a route is replayed.
        return stack.observe(sys._getframe(), "item", "", 0 if routed else -1)

    loop = _EVAL["_EvaluationLoop"](_Stage())
    for _ in range(3):
        # The same user frames, under the training loop, the evaluation loop
        # and no loop at all, one after the other: each gets its own phase.
        in_train = _FIT["run"](lambda: _nested(depth, probe))
        in_eval = loop.run(lambda: _nested(depth, probe))
        outside = _nested(depth, probe)
        assert in_train is not None and in_train.phase == "train"
        assert in_eval is not None and in_eval.phase == "validate"
        assert outside is not None and outside.phase is None
        assert in_train.loc.origin == "user" and in_train.mechanism is None
    if routed:
        # Both loops' routes replay (their markers decide). Outside of any loop the
        # search runs out at the root: the route holds the frame past the user's own
        # (this test's, which lives on) when they are few enough to probe, else one of
        # them, new each time.
        assert len(walks) == 2 + (1 if depth <= stack._WITNESS_SKIP else 3)


def test_a_plain_loop_keeps_finding_a_mechanism_outward_of_the_user_frame() -> None:
    # The searched anchor says "nothing outward of here": a call path that
    # passes a mechanism's function must not take it.
    send = _define(
        "accelerate/utils/operations.py", "def send_to_device(inner):\n    return inner()\n"
    )

    def probe() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "copy")

    for _ in range(2):
        plain = _nested(5, probe)
        inside = send["send_to_device"](lambda: _nested(5, probe))
        assert plain is not None and plain.mechanism is None
        assert inside is not None and inside.mechanism == "send_to_device"


def test_anchors_are_dropped_by_forget() -> None:
    def probe() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "item")

    _TRAINER["fit"](_FIT["run"], _SYNC, 2)
    probe()
    assert stack._anchors.located is not None and stack._anchors.searched is not None
    stack.forget()
    assert stack._anchors.located is None and stack._anchors.searched is None
    assert stack._anchors.last is None


def test_holding_says_whether_forget_has_anything_to_do() -> None:
    # A step boundary calls forget() only while something may be kept: a walk sets
    # the flag, a forget that drops what it held keeps it for the next one, which
    # finds nothing and clears it.
    def probe() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "item")

    stack.forget()
    stack.forget()
    assert not stack.holding
    _TRAINER["fit"](_FIT["run"], _SYNC, 2)
    probe()
    assert stack.holding and stack._anchors.located is not None
    stack.forget()
    assert stack._anchors.located is None
    stack.forget()
    assert not stack.holding
    stack._phases_seen = (-1, False)
    stack._phases_possible()  # a look kept until the next boundary
    assert stack.holding
    stack.forget()
    assert stack._phases_seen == (-1, False)


def test_annotate_is_the_walk_without_the_location() -> None:
    got = _FIT["run"](lambda: _METRICS["metrics"](lambda frame, kind: stack.annotate(frame)))
    assert got == ("prog_bar", "train")


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per walk of the stack."""
    counted: list[int] = []
    real = stack._walk

    def walk(*args: Any) -> Any:
        counted.append(1)
        return real(*args)

    monkeypatch.setattr(stack, "_walk", walk)
    return counted


def test_a_loop_body_read_is_found_again_without_a_walk(walks: list[int]) -> None:
    here = sys._getframe()
    found = []
    for _ in range(3):
        found.append(stack.observe(here, "item"))  # the same frame, the same instruction
    other = stack.observe(here, "item")  # another instruction: walked
    assert len(walks) == 2
    assert found[0] is found[1] is found[2]
    assert other is not None and other.loc.line == found[0].loc.line + 1  # type: ignore[union-attr]
    assert stack.observe(here, "tolist") is not found[0]  # another kind: walked
    assert len(walks) == 3


def test_a_generator_frame_is_never_kept(walks: list[int]) -> None:
    def reads() -> Any:
        while True:
            yield stack.observe(sys._getframe(), "item")

    gen = reads()
    first = next(gen)
    assert first is not None and stack._anchors.last is None
    # Resumed from anywhere: walked again, to the same (interned) sync.
    assert next(gen) is first
    assert len(walks) == 2


# The same framework sync, its caller saying where its frame is: a route seen
# before is replayed by probes instead of walked.
_ROUTED = _define(
    "lightning/pytorch/trainer/connectors/logger_connector/result.py",
    "import sys\n"
    "def metrics(observe):\n"
    "    return observe(sys._getframe(), 'item', '', 0)\n"
    "def through(depth, observe):\n"
    "    return metrics(observe) if depth <= 1 else through(depth - 1, observe)\n"
    "def around(depth, observe):\n"
    "    return through(depth, observe)\n",
)


def test_a_route_seen_before_is_replayed_and_tells_user_lines_apart(walks: list[int]) -> None:
    def line_a() -> stack.Sync | None:
        return _ROUTED["through"](20, stack.observe)  # routed A

    def line_b() -> stack.Sync | None:
        return _ROUTED["through"](20, stack.observe)  # routed B

    seen = [(line_a(), line_b()) for _ in range(4)]
    assert len(walks) == 2  # one per user line; the rest replayed
    for a, b in seen:
        assert a is not None and b is not None
        assert (a.loc.function, b.loc.function) == ("line_a", "line_b")
        assert a.loc.line != b.loc.line
        assert a.mechanism == b.mechanism == "prog_bar"
    assert seen[0][0] is seen[3][0]  # a static answer: the same sync object


def test_a_route_that_differs_at_a_probed_frame_is_walked_again(walks: list[int]) -> None:
    def read(fn: str) -> stack.Sync | None:
        return _ROUTED[fn](20, stack.observe)  # one user line, two call paths

    first = read("through")
    other = read("around")  # one frame more: the user's frame is elsewhere
    again = read("through")
    assert len(walks) == 2
    assert first is again
    assert other is not None and first is not None and other.loc == first.loc


def test_a_step_boundary_keeps_what_holds_a_live_frame_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Routes hold the frame just past the user's (none skipped): the test's own frames.
    monkeypatch.setattr(stack, "_WITNESS_SKIP", 0)

    def probe() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "item", "", 0)

    def finished() -> None:
        probe()  # its route holds this frame, which then returns

    for _ in range(2):
        probe()  # the route holds this test's frame, on the stack at the boundary
    finished()
    assert len(stack._held) == 2
    stack.forget(live=True)
    assert [route.outer[1] for _, route in stack._held] == [sys._getframe()]  # type: ignore[index]
    stack.forget()
    assert not stack._held


def test_a_step_boundary_finds_held_frames_where_the_last_one_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Routes hold the frame just past the user's (none skipped): the test's own frames.
    monkeypatch.setattr(stack, "_WITNESS_SKIP", 0)

    def probe() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "item", "", 0)

    def boundary(depth: int) -> None:
        # A boundary called from deeper each time: the depth remembered from
        # the last one misses, and the walk finds the frame again.
        if depth:
            boundary(depth - 1)
        else:
            stack.forget(live=True)

    probe()
    probe()  # the route holds this test's frame
    me = sys._getframe()
    for depth in (0, 0, 3, 3, 0):
        boundary(depth)
        assert [route.outer[1] for _, route in stack._held] == [me]  # type: ignore[index]
        assert stack._depths == {id(me): depth + 2}  # from forget: depth + 1 boundaries, then here

    def finished() -> None:
        probe()
        probe()  # a route that holds this frame, which then returns

    finished()
    boundary(0)  # the finished frame is not where any held frame was, nor on the stack
    assert [route.outer[1] for _, route in stack._held] == [me]  # type: ignore[index]
    stack.forget()
    assert not stack._held


def test_a_boundary_with_nothing_new_probes_the_kept_frames_and_still_drops_finished_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Routes hold the frame just past the user's (none skipped): the test's own frames.
    monkeypatch.setattr(stack, "_WITNESS_SKIP", 0)

    def probe() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "item", "", 0)

    def loop() -> None:
        probe()
        probe()  # a route that holds this frame
        me = sys._getframe()
        stack.forget(live=True)  # something new since the last boundary: checked in full
        checked = stack._depths
        assert [route.outer[1] for _, route in stack._held] == [me]  # type: ignore[index]
        for _ in range(3):
            stack.forget(live=True)  # nothing new: its frames probed where they were
            assert stack._depths is checked
            assert [route.outer[1] for _, route in stack._held] == [me]  # type: ignore[index]

    stack.forget()
    loop()
    # No sync since the last boundary, but the frame it kept has returned.
    stack.forget(live=True)
    assert not stack._held
    assert stack._depths == {}


def test_a_frame_that_returned_is_told_from_one_that_runs_or_raised() -> None:
    frames: list[Any] = []

    def returns() -> int:
        frames.append(sys._getframe())
        return 1

    def raises() -> None:
        frames.append(sys._getframe())
        raise ValueError

    returns()
    with pytest.raises(ValueError):
        raises()
    assert stack._returned(frames[0])
    assert not stack._returned(frames[1])  # it may be anywhere: looked for
    assert not stack._returned(sys._getframe())


def test_a_boundary_drops_a_kept_frame_that_returned_without_looking_for_it() -> None:
    # The last read's frame, a function the step calls, has returned by the boundary: it is
    # dropped first, and the other kept frames are probed where they were (no walk to the
    # root for a frame that is not on the stack).
    def user_read() -> None:
        stack.observe(sys._getframe(), "item")  # its own frame: kept as the last

    def probe() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "item", "", 0)

    stack.forget()
    probe()
    probe()  # a route that holds this test's frame
    stack.forget(live=True)
    checked = stack._depths
    for _ in range(3):
        user_read()
        assert stack._anchors.last is not None
        stack.forget(live=True)
        assert stack._anchors.last is None
        assert stack._depths is checked  # probed where they were: no walk
    stack.forget()


def test_a_read_in_a_function_a_loop_calls_holds_the_loops_frame(
    walks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Outside any framework the phase search runs out at the root (a framework with phase
    # markers imported): the route holds the frame past the user's own frames (one probed
    # by its code), here the loop's, so a read in a function the step calls replays each
    # step, and a boundary keeps the route.
    monkeypatch.setattr(stack, "_phases_possible", lambda: True)

    def read() -> stack.Sync | None:
        return stack.observe(sys._getframe(), "item", "", 0)

    def step() -> stack.Sync | None:
        return read()

    stack.forget()
    found = []
    for _ in range(5):  # a loop of this frame (a comprehension is a frame of its own on 3.11)
        found.append(step())
    assert found[0] is not None and all(s is found[0] for s in found)
    (route,) = [r for _, r in stack._held]
    me = sys._getframe()
    assert route.outer is not None and route.outer[1] is me
    assert [(depth, code) for depth, code, _ in route.probes] == [(1, step.__code__)]
    stack.forget(live=True)
    assert [r for _, r in stack._held] == [route]
    for _ in range(3):
        assert step() is found[0]
    assert len(walks) == 1
    stack.forget()


_CALL = _define(
    "lightning/pytorch/trainer/call.py",
    "def _call_callback_hooks(hook_name, inner):\n    return inner()\n",
)


def test_a_replayed_route_reads_the_hook_in_flight_again(walks: list[int]) -> None:
    def sync(hook: str) -> stack.Sync | None:
        # A hook called inside the fit loop, whose marker ends the search for a phase.
        return _FIT["run"](  # type: ignore[no-any-return]
            lambda: _CALL["_call_callback_hooks"](
                hook, lambda: _ROUTED["through"](3, stack.observe)
            )
        )

    hooks = ("on_train_batch_end", "on_validation_batch_end", "on_train_batch_end")
    seen = [sync(hook) for hook in hooks]
    assert [s.mechanism for s in seen if s is not None] == [
        "prog_bar (on_train_batch_end)",
        "prog_bar (on_validation_batch_end)",
        "prog_bar (on_train_batch_end)",
    ]
    assert all(s is not None and s.phase == "train" for s in seen)
    assert len(walks) == 1  # one route, its hook caller's frame read at each replay


def test_a_boundary_probes_the_innermost_held_frame_alone_unless_it_can_be_resumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # While the innermost held frame is where it was, so is each frame out of it: its callers
    # cannot change. A generator's frame can be resumed from elsewhere: then each is probed.
    def forget(origin: Any) -> Any:  # stack.forget's place: _settle's caller
        return stack._settle(origin)

    def held_here() -> Any:
        here = sys._getframe()
        # Depths as forget's sys._getframe counts them: 1 is forget's caller.
        monkeypatch.setattr(stack, "_depths", {id(here): 1, id(here.f_back): 2})
        return forget(here), id(here), id(here.f_back)

    def held_in_a_generator() -> Any:
        here = sys._getframe()
        monkeypatch.setattr(stack, "_depths", {id(here): 1, id(here.f_back): 2})
        yield forget(here), id(here), id(here.f_back)

    settled, inner, outer = held_here()
    assert settled == ((inner, 0),)  # depths from the origin, forget's caller
    settled, inner, outer = next(held_in_a_generator())
    assert settled == ((inner, 0), (outer, 1))
