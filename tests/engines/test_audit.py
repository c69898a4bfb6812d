"""The audit engine on CPU: provenance, kinds, notes, restoration."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import barrierguard
from barrierguard import _env
from barrierguard._engines import audit as audit_mod

HERE = __file__
DEV = torch.device("cpu")


def _found(guard: barrierguard.Guard) -> set[tuple[str, str]]:
    return {(s.kind, s.detail) for s in guard.report.sites if s.file == HERE and s.count}


def _watch(fn: Callable[[], Any]) -> set[tuple[str, str]]:
    with barrierguard.watch(engine="audit", policy="record") as guard:
        fn()
    return _found(guard)


def _dev(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(DEV)  # a tensor moved to the training device


# (name, what the case does to a device tensor, expected kind)
DEVICE_READS: list[tuple[str, Callable[[torch.Tensor], Any], str]] = [
    ("item", lambda x: x.sum().item(), "item"),
    ("tolist", lambda x: x.tolist(), "tolist"),
    ("numpy", lambda x: x.detach().numpy(), "numpy"),
    ("np.asarray", lambda x: np.asarray(x), "numpy"),
    ("bool", lambda x: bool(x.sum() > 0), "bool"),
    ("contains", lambda x: 0.5 in x, "bool"),
    ("int", lambda x: int(x.sum()), "int"),
    ("index", lambda x: [1, 2, 3][x.sum().long().clamp(0, 2)], "int"),
    ("float", lambda x: float(x.sum()), "float"),
    ("complex", lambda x: complex(x.sum()), "complex"),
    ("repr", lambda x: print(x, file=io.StringIO()), "print"),
    ("format", lambda x: f"{x.sum():.2f}", "format"),
    ("nonzero", lambda x: torch.nonzero(x), "nonzero"),
    ("argwhere", lambda x: x.argwhere(), "nonzero"),
    ("where1", lambda x: torch.where(x > 0), "nonzero"),
    ("mask index", lambda x: x[x > 0], "index"),
    ("mask assign", lambda x: x.__setitem__(x > 0, 0.0), "index"),
    ("masked_select", lambda x: x.masked_select(x > 0), "masked_select"),
    ("unique", lambda x: torch.unique(x), "unique"),
    ("unique method", lambda x: x.unique(), "unique"),
    ("unique_consecutive", lambda x: torch.unique_consecutive(x), "unique"),
    ("repeat_interleave", lambda x: x.repeat_interleave((x > 0).long()), "repeat_interleave"),
    ("one_hot", lambda x: F.one_hot(x.abs().long()), "one_hot"),
    ("allclose", lambda x: torch.allclose(x, x), "compare"),
    ("equal", lambda x: torch.equal(x, x), "compare"),
    ("bincount", lambda x: torch.bincount(x.abs().long()), "dynamic_shape"),
    ("cpu", lambda x: x.cpu(), "copy"),
    ("to cpu", lambda x: x.to("cpu"), "copy"),
    ("to cpu device", lambda x: x.to(torch.device("cpu")), "copy"),
    ("copy_ to host", lambda x: torch.empty(8).copy_(x), "copy"),
    ("assign to host", lambda x: torch.zeros(8).__setitem__(0, x[0]), "copy"),
    ("async d2h", lambda x: x.to("cpu", non_blocking=True), "async_d2h"),
]


@pytest.mark.parametrize(("name", "op", "kind"), DEVICE_READS, ids=[c[0] for c in DEVICE_READS])
def test_device_reads_are_flagged(name: str, op: Callable[[torch.Tensor], Any], kind: str) -> None:
    def run() -> None:
        op(_dev(8))

    assert kind in {k for k, _ in _watch(run)}


@pytest.mark.parametrize(("name", "op", "kind"), DEVICE_READS, ids=[c[0] for c in DEVICE_READS])
def test_the_same_reads_of_host_tensors_stay_quiet(
    name: str, op: Callable[[torch.Tensor], Any], kind: str
) -> None:
    def run() -> None:
        op(torch.randn(8))

    assert _watch(run) == set()


QUIET_ON_DEVICE: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("where3", lambda x: torch.where(x > 0, x, 0.0)),
    ("masked_fill", lambda x: x.masked_fill(x < 0, 0.0)),
    ("long index", lambda x: x[torch.tensor([0, 1]).to(DEV)]),
    ("repeat_interleave int", lambda x: x.repeat_interleave(2)),
    (
        "repeat_interleave output_size",
        lambda x: x.repeat_interleave(x.new_ones(8).long(), output_size=8),
    ),
    ("one_hot num_classes", lambda x: F.one_hot(x.abs().long().clamp(0, 3), num_classes=4)),
    ("nonzero_static", lambda x: torch.nonzero_static(x, size=3)),
    ("topk", lambda x: x.topk(3)),
    ("to device again", lambda x: x.to(DEV)),
    ("shape", lambda x: (x.shape[0], len(x), x.dim())),
]


@pytest.mark.parametrize(("name", "op"), QUIET_ON_DEVICE, ids=[c[0] for c in QUIET_ON_DEVICE])
def test_fixed_shape_ops_on_device_stay_quiet(name: str, op: Callable[[torch.Tensor], Any]) -> None:
    x = None

    def run() -> None:
        nonlocal x
        x = _dev(8)
        op(x)

    found = _watch(run)
    # Only the setup move of the input itself (h2d) may appear.
    assert found <= {("copy", "h2d")}, found


def test_provenance_follows_computation_and_parameters() -> None:
    model = nn.Linear(4, 2)  # built before the guard: parameters still count

    def run() -> None:
        out = model(torch.randn(3, 4))
        out.sum().item()  # L-param
        with torch.no_grad():
            pred = out.argmax(1)
        (pred == torch.zeros(3).long().to(DEV)).sum().item()  # L-nograd

    with barrierguard.watch(engine="audit", policy="record") as guard:
        run()
    lines = {s.code for s in guard.report.sites if s.kind == "item"}
    assert lines == {
        "out.sum().item()  # L-param",
        "(pred == torch.zeros(3).long().to(DEV)).sum().item()  # L-nograd",
    }


def test_moved_copy_and_host_original_keep_their_own_provenance() -> None:
    host = torch.randn(8)
    with barrierguard.watch(engine="audit", policy="record") as guard:
        moved = host.to(DEV)
        assert moved is not host and moved.data_ptr() == host.data_ptr()
        assert torch.equal(moved, host)  # compare: a device tensor is involved
        host.sum().item()  # host: quiet
        moved.sum().item()  # device: item
        back = moved.cpu()
        back.tolist()  # a host copy now: quiet
    kinds = sorted(s.kind for s in guard.report.sites)
    assert kinds == ["compare", "copy", "copy", "item"], guard.report.sites


def test_module_to_host_makes_parameters_host() -> None:
    model = nn.Linear(2, 2)
    with barrierguard.watch(engine="audit", policy="record") as guard:
        model.to(DEV)  # h2d
        model.to("cpu")  # d2h
        model.weight.sum().item()  # on the host now: quiet
    found = sorted((s.kind, s.detail) for s in guard.report.sites)
    assert found == [("copy", "d2h"), ("copy", "h2d")]


def test_factories_with_device_are_device_tensors() -> None:
    with barrierguard.watch(engine="audit", policy="record") as guard:
        z = torch.zeros(3, device=DEV)
        z.sum().item()
        h = torch.zeros(3, device="cpu")  # the host, by name
        h.sum().item()
        c = torch.tensor([1.0, 2.0], device=DEV)  # copies from the host: h2d
        del c
    found = sorted((s.kind, s.detail) for s in guard.report.sites)
    assert found == [("copy", "h2d"), ("item", "")]


@pytest.mark.parametrize(
    ("nbytes", "nonblocking", "expected", "note"),
    [
        (1024, False, {("copy", "h2d")}, None),
        (1024, True, set(), "2 MiB or less"),
        (8 * 1024 * 1024, True, {("copy", "h2d pageable non_blocking")}, "pageable"),
    ],
)
def test_host_to_device_copies(
    nbytes: int, nonblocking: bool, expected: set[tuple[str, str]], note: str | None
) -> None:
    src = torch.empty(nbytes // 4)
    with barrierguard.watch(engine="audit", policy="record") as guard:
        src.to(DEV, non_blocking=nonblocking)
    assert {(s.kind, s.detail) for s in guard.report.sites} == expected
    if note is not None:
        assert any(note in n for n in guard.report.notes), guard.report.notes


def test_nonblocking_copy_into_host_is_assumed_pinned_and_noted() -> None:
    buf = torch.empty(8)
    with barrierguard.watch(engine="audit", policy="record") as guard:
        buf.copy_(_dev(8), non_blocking=True)
    assert [s.kind for s in guard.report.sites] == ["copy"]  # only the h2d of _dev
    assert any("assumed to target pinned memory" in n for n in guard.report.notes)


def test_synchronize_is_recorded_and_returns_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "cuda_available", lambda: False)
    with barrierguard.watch(engine="audit", policy="record") as guard:
        assert torch.cuda.synchronize() is None
    assert [(s.kind, s.code) for s in guard.report.sites] == [
        ("synchronize", "assert torch.cuda.synchronize() is None")
    ]


def test_mask_index_with_grad_flags_the_backward() -> None:
    def run() -> None:
        w = _dev(8).requires_grad_()
        w[w.detach() > 0].sum().backward()
        (w * 2).sum().backward()  # no mask since the last backward: quiet

    found = _watch(run)
    assert ("backward", "") in found and ("index", "") in found
    with barrierguard.watch(engine="audit", policy="record") as guard:
        run()
    assert [s.count for s in guard.report.sites if s.kind == "backward"] == [1]


def test_sync_inside_a_custom_backward_is_seen() -> None:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * float(grad.abs().max())  # L-custom

    def run() -> None:
        Scale.apply(_dev(4).requires_grad_()).sum().backward()

    with barrierguard.watch(engine="audit", policy="record") as guard:
        run()
    assert any(s.kind == "float" and s.code.endswith("# L-custom") for s in guard.report.sites)


def test_error_policy_raises_at_the_user_line() -> None:
    with pytest.raises(barrierguard.SyncError, match="item") as info:  # noqa: SIM117
        with barrierguard.watch(engine="audit", policy="error") as guard:
            x = _dev(4)  # setup: before the first step
            guard.step()
            x.sum().item()  # the offending line
    assert info.value.site is not None
    assert info.value.site["code"] == "x.sum().item()  # the offending line"
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_state_restored_after_exception(exc_type: type[BaseException]) -> None:
    sync = torch.cuda.synchronize
    zero_grad = torch.optim.Optimizer.zero_grad
    from torch.autograd.function import BackwardCFunction

    apply = BackwardCFunction.apply
    with pytest.raises(exc_type), barrierguard.watch(engine="audit", policy="record"):
        assert torch._C._len_torch_function_stack() == 1
        assert torch.cuda.synchronize is not sync
        raise exc_type("stop")
    assert torch._C._len_torch_function_stack() == 0
    assert torch.cuda.synchronize is sync
    assert torch.optim.Optimizer.zero_grad is zero_grad
    assert BackwardCFunction.apply is apply


def test_a_mode_pushed_above_ours_survives_stop() -> None:
    from torch.overrides import TorchFunctionMode

    other = TorchFunctionMode()
    guard = barrierguard.watch(engine="audit", policy="record").start()
    other.__enter__()
    try:
        guard.stop()
        assert torch._C._len_torch_function_stack() == 1
        assert torch._C._get_function_stack_at(0) is other
    finally:
        other.__exit__(None, None, None)


def test_optimizer_step_is_outside_the_mode_and_back_after() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    depths: list[int] = []
    opt.register_step_pre_hook(lambda *a: depths.append(torch._C._len_torch_function_stack()))
    with barrierguard.watch(engine="audit", policy="record") as guard:
        model(torch.randn(3, 2)).sum().backward()
        opt.step()
        assert torch._C._len_torch_function_stack() == 1
        opt.zero_grad()
        assert torch._C._len_torch_function_stack() == 1
    assert depths == [0] and guard.report.steps == 1


def test_nested_guards_share_one_mode() -> None:
    with barrierguard.watch(engine="audit", policy="record") as outer:
        x = _dev(4)
        x.sum().item()
        with barrierguard.watch(engine="audit", policy="record") as inner:
            assert torch._C._len_torch_function_stack() == 1
            x.tolist()
    assert {s.kind for s in outer.report.sites} == {"copy", "item", "tolist"}
    assert {s.kind for s in inner.report.sites} == {"tolist"}


def test_auto_picks_the_audit_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "cuda_available", lambda: False)
    with barrierguard.watch(policy="record") as guard:
        pass
    assert guard.report.engine == "audit" and guard.report.detection


def test_watch_does_not_change_results() -> None:
    def run() -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(DEV)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            x = torch.randn(32, 8).to(DEV)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    bare = run()
    with barrierguard.watch(engine="audit", policy="record"):
        watched = run()
    assert bare == watched


def test_provenance_table_ignores_reused_ids_and_purges() -> None:
    prov = audit_mod.Provenance()
    a = torch.ones(1)
    prov.set(a, True)
    assert prov.get(a) is True
    key = id(a)
    del a
    b = torch.ones(1)
    # Whatever id b got, a dead entry never answers for it.
    assert prov.get(b) is None or key != id(b)
    for _ in range(3000):
        prov.set(torch.ones(1), True)
    assert len(prov.table) < 3000
