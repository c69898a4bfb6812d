"""Allow rules where the code is: inline comments and allowed() blocks, in both engines."""

from __future__ import annotations

import pytest
import torch

import barrierguard
from _fake_cuda import FakeMode, FakeTensor
from barrierguard import BarrierGuardError
from barrierguard.session.allowing import admits


def _cuda_loop(guard: barrierguard.Guard) -> None:
    t = FakeTensor(2.0)
    for _ in range(3):
        guard.step()
        t.item()  # barrierguard: allow
        t.item()  # barrierguard: allow[BG301]
        t.tolist()  # barrierguard: allow[index, tolist]
        float(t)


def test_inline_comments_under_the_cuda_engine(fake_cuda: FakeMode) -> None:
    with barrierguard.watch(policy="record", engine="cuda") as guard:
        _cuda_loop(guard)
    sites = {(s.code, s.kind): (s.allowed, s.step_count) for s in guard.report.sites}
    assert sites == {
        ("t.item()  # barrierguard: allow", "item"): (True, 3),
        # allow[BG301] names index: this item is not allowed
        ("t.item()  # barrierguard: allow[BG301]", "item"): (False, 3),
        ("t.tolist()  # barrierguard: allow[index, tolist]", "tolist"): (True, 3),
        ("float(t)", "float"): (False, 3),
    }
    bad = {(v.kind, v.line) for v in guard.report.violations}
    assert len(bad) == 2
    assert {kind for kind, _ in bad} == {"item", "float"}


def test_scoped_block_under_the_cuda_engine(fake_cuda: FakeMode) -> None:
    t = FakeTensor(2.0)
    with barrierguard.watch(policy="error", engine="cuda") as guard:
        for _ in range(3):
            guard.step()
            with barrierguard.allowed():
                t.item()
            with barrierguard.allowed("BG102"):
                t.tolist()
    assert guard.report.violations == ()
    assert guard.report.step_syncs == 6


def test_first_only_admits_one_occurrence_per_block(fake_cuda: FakeMode) -> None:
    t = FakeTensor(2.0)
    with barrierguard.watch(policy="error", engine="cuda") as guard:
        guard.step()
        with barrierguard.allowed("item", first_only=True):
            t.item()
            with pytest.raises(barrierguard.SyncError, match="BG101 item sync"):
                for _ in range(2):
                    t.item()
                    guard.step()  # a step follows: the read was in the loop
    # The block admits the loop line's first read (step 1), not its second.
    assert [v.step for v in guard.report.violations] == [2]


def test_a_block_for_other_kinds_admits_nothing(fake_cuda: FakeMode) -> None:
    t = FakeTensor(2.0)
    with barrierguard.watch(policy="record", engine="cuda") as guard:
        guard.step()
        with barrierguard.allowed("index"):
            t.item()
        guard.step()
    assert len(guard.report.violations) == 1


def _audit_loop(guard: barrierguard.Guard) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Linear(4, 1).to(device)  # the audit takes it for the GPU
    for _ in range(3):
        loss = model(torch.ones(2, 4, device=device)).sum().detach()
        guard.step()
        loss.item()  # barrierguard: allow[item]
        float(loss)
        with barrierguard.allowed("float", first_only=True):
            float(loss)  # admitted once per block


def test_inline_and_scoped_under_the_audit_engine() -> None:
    with barrierguard.watch(policy="record", engine="audit") as guard:
        _audit_loop(guard)
    report = guard.report
    assert report.engine == "audit"
    inline = [s for s in report.sites if s.kind == "item"]
    assert [s.allowed for s in inline] == [True]
    bad = {(v.kind, v.line) for v in report.violations}
    # float(loss) outside the block breaks the policy each step; inside it never.
    assert len(bad) == 1
    assert next(iter(bad))[0] == "float"
    assert len(report.violations) == 3


def test_blocks_close_and_nest() -> None:
    assert not admits(("k",), "item")
    with barrierguard.allowed("item"):
        with barrierguard.allowed("index", first_only=True):
            assert admits(("a",), "index")
            assert not admits(("a",), "index")  # once; the outer block is for item only
            assert admits(("b",), "item")
            assert admits(("b",), "item")
        assert not admits(("c",), "index")
    assert not admits(("k",), "item")


def test_block_is_per_thread() -> None:
    import threading

    seen: list[bool] = []
    with barrierguard.allowed():
        worker = threading.Thread(target=lambda: seen.append(admits(("k",), "item")))
        worker.start()
        worker.join()
    assert seen == [False]


def test_a_bad_name_says_what_is_valid_first() -> None:
    match = r"^allowed\('itme'\): expected a kind such as"
    with pytest.raises(BarrierGuardError, match=match), barrierguard.allowed("itme"):
        pass


def test_codes_are_allow_rules_too(fake_cuda: FakeMode) -> None:
    t = FakeTensor(2.0)
    with barrierguard.watch(policy="record", engine="cuda", allow=["BG101"]) as guard:
        guard.step()
        t.item()
        guard.step()
    assert guard.report.violations == ()


def test_a_settled_sites_sync_in_an_allowed_block_is_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from barrierguard.detect.frames import Location
    from barrierguard.detect.stack import Sync
    from barrierguard.session import allowing
    from barrierguard.session import guard as guard_module

    # A violating site settles once the violation list is full.
    monkeypatch.setattr(guard_module, "_MAX_VIOLATIONS", 1)
    me = threading.get_ident()
    sync = Sync(Location("/w/train.py", 7, "main", "item", "", "user"))
    with barrierguard.watch(policy="record", engine="audit", memory=False) as guard:
        for _ in range(3):  # the site is confirmed by the loop and settles
            guard.step()
            guard.record(sync, me, None)
            guard.record(sync, me, None)
        assert [q.violating for q in guard._quiet.values()] == [True]  # settled
        guard.step()
        before = guard._violation_count
        assert allowing.open_blocks == 0
        with barrierguard.allowed("item"):
            assert allowing.open_blocks == 1
            guard.record(sync, me, None)
            guard.record(sync, me, None)
        assert allowing.open_blocks == 0
        guard.step()
        # Counted, not held against the policy.
        assert guard.report.sites[0].count == 8
        assert guard._violation_count == before
        with pytest.raises(RuntimeError), barrierguard.allowed():
            raise RuntimeError
        assert allowing.open_blocks == 0
