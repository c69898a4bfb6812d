"""The CPU audit engine: what it flags, what it leaves alone, and what it restores."""

from __future__ import annotations

import runpy
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import barrierguard
from barrierguard import _env
from barrierguard.detect import audit, audit_provenance

SETUP = textwrap.dedent(
    """\
    import io
    import torch
    import torch.nn.functional as F
    dev = torch.device("cpu")
    model = torch.nn.Linear(4, 4).to(dev)
    x = torch.randn(8, 4).to(dev)
    labels = torch.randint(0, 3, (8,)).to(dev)
    reps = torch.ones(8, dtype=torch.long).to(dev)
    host = torch.randn(8)
    sink = io.StringIO()
    """
)
LINE = SETUP.count("\n") + 1

# The device of a device-agnostic script: a variable, so the training device.
DEV = torch.device("cpu")


def _kinds_at_snippet(tmp_path: Path, snippet: str) -> set[str]:
    path = tmp_path / "snippet.py"
    path.write_text(SETUP + snippet + "\n")
    with barrierguard.watch(engine="audit", policy="record") as guard:
        runpy.run_path(str(path))
    return {s.kind for s in guard.report.sites if s.file == str(path) and s.line == LINE}


@pytest.mark.parametrize(
    ("snippet", "kinds"),
    [
        # host reads of device tensors
        ("x.sum().item()", {"item"}),
        ("x[:2].tolist()", {"tolist"}),
        ("x.detach().numpy()", {"numpy"}),
        ("bool(x.sum() > 0)", {"bool"}),
        ("int(x.sum())", {"int"}),
        ("float(x.sum())", {"float"}),
        ("complex(x.sum())", {"complex"}),
        ("[0, 1, 2][labels[0]]", {"int"}),
        ("print(x, file=sink)", {"print"}),
        ("repr(x)", {"print"}),
        ("f'{x.sum():.2f}'", {"format"}),
        ("model(x).sum().item()", {"item"}),
        ("model.weight.sum().item()", {"item"}),
        ("x.argmax(1).float().mean().item()", {"item"}),
        # copies between host and device
        ("x.cpu()", {"copy"}),
        ("x.to('cpu')", {"copy"}),
        ("x.to(torch.device('cpu'))", {"copy"}),
        ("x.cpu().numpy()", {"copy"}),
        ("x.to('cpu', non_blocking=True)", {"async_d2h"}),
        ("host.to(dev)", {"copy"}),
        ("host.to(dev, non_blocking=True)", set()),
        ("torch.randn(1024 * 1024).to(dev, non_blocking=True)", {"copy"}),
        ("torch.tensor([1.0, 2.0], device=dev)", {"copy"}),
        ("torch.tensor([], device=dev)", set()),
        ("x.new_tensor([1.0])", {"copy"}),
        ("torch.zeros(3, device=dev)", set()),
        ("x.to(torch.float64)", set()),
        # sizes that depend on device values
        ("x[x > 0]", {"index"}),
        ("x[x > 0] = 0.0", {"index"}),
        ("torch.nonzero(x)", {"nonzero"}),
        ("x.nonzero()", {"nonzero"}),
        ("torch.argwhere(x)", {"nonzero"}),
        ("torch.where(x > 0)", {"nonzero"}),
        ("torch.masked_select(x, x > 0)", {"masked_select"}),
        ("torch.unique(labels)", {"unique"}),
        ("labels.unique()", {"unique"}),
        ("torch.repeat_interleave(x, reps, dim=0)", {"repeat_interleave"}),
        ("torch.repeat_interleave(x, reps, dim=0, output_size=8)", set()),
        ("x.repeat_interleave(2, dim=0)", set()),
        ("F.one_hot(labels)", {"one_hot"}),
        ("F.one_hot(labels, num_classes=3)", set()),
        ("torch.allclose(x, x)", {"compare"}),
        ("torch.equal(x, x)", {"compare"}),
        ("torch.bincount(labels)", {"dynamic_shape"}),
        ("torch.cuda.synchronize()", {"synchronize"}),
        # fixed-shape device work: quiet
        ("torch.where(x > 0, x, 0.0)", set()),
        ("x.masked_fill(x < 0, 0.0)", set()),
        ("x[labels]", set()),
        ("x.topk(2, dim=1)", set()),
        # host-only tensors: never flagged
        ("host.sum().item()", set()),
        ("print(host, file=sink)", set()),
        ("host[host > 0]", set()),
        ("torch.unique(host)", set()),
        ("host.tolist(), host.numpy(), int(host.sum())", set()),
        ("torch.zeros(3).add_(1.0).sum().item()", set()),
        ("torch.randn(3, device='cpu').sum().item()", set()),
        ("f'{torch.zeros(3).mean():.2f}'", set()),
        ("x.cpu().sum().item()", {"copy"}),
        ("host.to(dev); host.sum().item()", {"copy"}),
    ],
)
def test_verdicts(tmp_path: Path, snippet: str, kinds: set[str]) -> None:
    assert _kinds_at_snippet(tmp_path, snippet) == kinds


def test_parameters_made_before_the_guard_are_device_tensors() -> None:
    model = nn.Linear(4, 2)
    early = torch.randn(3)  # made before the guard: a host tensor
    with barrierguard.watch(engine="audit", policy="record") as guard:
        guard.step()
        model.weight.sum().item()  # L-param
        early.sum().item()
    lines = {s.line for s in guard.report.sites if s.file == __file__}
    assert lines == {_line("# L-param")}


def test_auto_is_the_audit_without_cuda_and_audit_runs_anywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_env, "cuda_available", lambda: False)
    with barrierguard.watch(policy="record") as guard:
        pass
    assert guard.report.engine == "audit" and guard.report.detection
    monkeypatch.setattr(_env, "cuda_available", lambda: True)
    with barrierguard.watch(engine="audit", policy="record") as guard:
        pass
    assert guard.report.engine == "audit"


def test_error_policy_raises_at_the_user_line() -> None:
    with barrierguard.watch(engine="audit", policy="record"):
        x = torch.ones(4).to(DEV)
    with pytest.raises(barrierguard.SyncError, match="item") as info:  # noqa: SIM117
        with barrierguard.watch(engine="audit", policy="error") as guard:
            x = torch.ones(4).to(DEV)
            for _ in range(2):  # raised in its second step, at its line
                guard.step()
                x.sum().item()  # L-error
    assert info.value.site is not None
    assert info.value.site["line"] == _line("# L-error")
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_state_restored_after_exception(exc_type: type[BaseException]) -> None:
    sync_before = torch.cuda.synchronize
    with pytest.raises(exc_type), barrierguard.watch(engine="audit", policy="record"):
        assert torch._C._len_torch_function_stack() == 1
        assert torch.cuda.synchronize is not sync_before
        raise exc_type("stop")
    assert torch._C._len_torch_function_stack() == 0
    assert torch.cuda.synchronize is sync_before


def test_nested_guards_share_one_mode() -> None:
    with barrierguard.watch(engine="audit", policy="record") as outer:
        x = torch.ones(4).to(DEV)
        outer.step()
        x.sum().item()
        with barrierguard.watch(engine="audit", policy="record") as inner:
            inner.step()
            x.sum().tolist()
            assert torch._C._len_torch_function_stack() == 1
        assert torch._C._len_torch_function_stack() == 1
    assert {s.kind for s in outer.report.sites} == {"item", "tolist", "copy"}
    assert {s.kind for s in inner.report.sites} == {"tolist"}


def test_a_users_mode_above_ours_survives_stop() -> None:
    class Mine(torch.overrides.TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return func(*args, **(kwargs or {}))

    mine = Mine()
    guard = barrierguard.watch(engine="audit", policy="record").start()
    mine.__enter__()
    guard.stop()
    assert torch._C._len_torch_function_stack() == 1
    assert torch._C._get_function_stack_at(0) is mine
    mine.__exit__(None, None, None)


def _optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_mode_steps_aside_during_optimizer_step() -> None:
    seen: list[int] = []
    with barrierguard.watch(engine="audit", policy="record"):
        model, opt = _optimizer()
        hook = opt.register_step_pre_hook(
            lambda *a: seen.append(torch._C._len_torch_function_stack())
        )
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        assert torch._C._len_torch_function_stack() == 1

        def closure() -> torch.Tensor:
            loss = model(torch.ones(2, 4)).sum()
            loss.backward()
            return loss

        opt.step(closure)  # the closure runs forward: the mode stays
        hook.remove()
    assert seen == [0, 1]


def test_an_exception_in_step_does_not_stop_recording() -> None:
    with barrierguard.watch(engine="audit", policy="record") as guard:
        model, opt = _optimizer()
        model(torch.ones(2, 4)).sum().backward()
        bad = opt.register_step_post_hook(lambda *a: (_ for _ in ()).throw(ValueError("x")))
        with pytest.raises(ValueError):
            opt.step()
        bad.remove()
        # The mode is back at once: the next sync counts, before any other step.
        assert torch._C._len_torch_function_stack() == 1
        torch.ones(2).to(DEV).sum().item()  # L-after-failed-step
        opt.step()
        assert torch._C._len_torch_function_stack() == 1
    assert torch._C._len_torch_function_stack() == 0
    lines = {s.line for s in guard.report.sites if s.file == __file__}
    assert _line("# L-after-failed-step") in lines


def test_backward_of_mask_indexing_is_reported() -> None:
    with barrierguard.watch(engine="audit", policy="record") as guard:
        w = torch.randn(8).to(DEV).requires_grad_()
        guard.step()
        picked = w[w > 0]  # L-mask
        (picked.sum() + w.sum()).backward()  # L-backward
    found = {(s.line, s.kind) for s in guard.report.sites if s.file == __file__}
    assert (_line("# L-mask"), "index") in found
    assert (_line("# L-backward"), "backward") in found


def test_a_sync_inside_a_custom_backward_is_reported() -> None:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            peak = float(grad.abs().max())  # L-in-backward
            return grad * 2 + 0 * peak

    with barrierguard.watch(engine="audit", policy="record") as guard:
        w = torch.randn(4, requires_grad=True)
        guard.step()
        Scale.apply(w).sum().backward()
    found = {(s.line, s.kind) for s in guard.report.sites if s.file == __file__}
    assert found == {(_line("# L-in-backward"), "float")}


def test_notes_say_what_an_audit_cannot_know() -> None:
    with barrierguard.watch(engine="audit", policy="record") as guard:
        x = torch.randn(4).to(DEV)
        guard.step()
        torch.randn(1024 * 1024).to(DEV, non_blocking=True)
        torch.empty(4).copy_(x, non_blocking=True)
    notes = guard.report.notes
    assert audit.NOTE in notes
    assert audit_provenance.NOTE_PINNED_H2D in notes
    assert audit_provenance.NOTE_PINNED_D2H in notes


def test_a_fault_of_ours_is_recorded_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(audit_provenance.AuditMode, "is_dev", broken)
    with barrierguard.watch(engine="audit", policy="record") as guard:
        y = torch.ones(3) * 2
    assert y.tolist() == [2.0, 2.0, 2.0]
    assert any("bookkeeping bug" in n for n in guard.report.notes)


def test_marks_leave_tensors_untouched() -> None:
    with barrierguard.watch(engine="audit", policy="record"):
        x = torch.randn(4).to(DEV)
        y = x * 2
        z = y.cpu()
    for t in (x, y, z):
        assert not t.__dict__
    assert torch.equal(z, y)


def test_other_threads_are_not_followed() -> None:
    # The function-mode stack is per thread: a worker's tensors are not
    # followed (documented), and nothing there is flagged or broken.
    out: list[float] = []
    with barrierguard.watch(engine="audit", policy="record") as guard:
        x = torch.ones(4).to(DEV)
        t = threading.Thread(target=lambda: out.append((x * 2).sum().item()))
        t.start()
        t.join()
    assert out == [8.0]
    assert not [s for s in guard.report.sites if s.kind == "item"]


def test_tagged_ops_come_from_torch() -> None:
    tagged = audit.tagged_ops()
    assert {"nonzero", "masked_select", "bincount"} <= set(tagged)
    assert tagged["nonzero"] == "dynamic_output_shape"


def _line(marker: str) -> int:
    with open(__file__) as fh:
        for i, text in enumerate(fh, 1):
            if text.rstrip().endswith(marker) and "_line(" not in text:
                return i
    raise AssertionError(marker)


def test_a_read_repeated_at_one_line_counts_every_time_with_the_guards_phase() -> None:
    # The second read of a line in a live frame is found without a walk: it
    # must still be counted, at its own line, in the phase of its moment.
    with barrierguard.watch(engine="audit", policy="record", memory=False) as guard:
        x = torch.ones(1).to(DEV)
        for i in range(6):
            guard.set_phase("validate" if i % 2 else None)
            x.item()  # L-repeated-a
            x.item()  # L-repeated-b
    sites = {s.line: s for s in guard.report.sites if s.file == __file__ and s.kind == "item"}
    assert set(sites) == {_line("# L-repeated-a"), _line("# L-repeated-b")}
    for site in sites.values():
        assert site.count == 6
        assert dict(site.phases) == {"validate": 3}


def test_a_generators_read_takes_the_phase_of_whoever_resumes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A generator's frame lives on between resumptions, called from elsewhere
    # each time: the frames outward of it are not the ones of its last read.
    import os

    from barrierguard.detect import frameworks

    monkeypatch.setattr(frameworks, "PHASE_PACKAGES", ("sys",))
    namespace: dict[str, Any] = {}
    path = os.path.join(os.sep, "sp", "site-packages", "lightning/pytorch/loops/fit_loop.py")
    exec(compile("def run(inner):\n    return inner()\n", path, "exec"), namespace)
    run = namespace["run"]

    def reads(t: torch.Tensor) -> Any:
        while True:
            yield t.item()  # L-generator

    with barrierguard.watch(engine="audit", policy="record", memory=False) as guard:
        gen = reads(torch.ones(1).to(DEV))
        for _ in range(2):
            run(lambda: next(gen))
            next(gen)
    (site,) = [s for s in guard.report.sites if s.line == _line("# L-generator")]
    assert site.count == 4
    assert dict(site.phases) == {"train": 2}


def _clipped(watched: bool, **kwargs: Any) -> tuple[list[torch.Tensor], float, Any]:
    torch.manual_seed(0)
    guard = barrierguard.watch(engine="audit", policy="record", memory=False)
    if watched:
        guard.start()
    try:
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)).to(DEV)
        model(torch.randn(16, 4).to(DEV)).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, **kwargs)
        depth = torch._C._len_torch_function_stack()
        value = norm.item()  # L-clip-norm
    finally:
        if watched:
            guard.stop()
    assert depth == (1 if watched else 0)  # the mode is back after the clip
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], value, guard


def test_clip_grad_norm_steps_aside_and_its_norm_is_a_device_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.nn.utils import clip_grad

    original = torch.nn.utils.clip_grad_norm_
    depths: list[int] = []
    scale = clip_grad._clip_grads_with_norm_

    def spy(*args: Any, **kwargs: Any) -> Any:
        depths.append(torch._C._len_torch_function_stack())
        return scale(*args, **kwargs)

    monkeypatch.setattr(clip_grad, "_clip_grads_with_norm_", spy)
    grads, norm, _ = _clipped(False)
    watched_grads, watched_norm, guard = _clipped(True)
    assert depths == [0, 0]  # inside the clip, the mode is off the stack
    assert watched_norm == norm
    assert all(torch.equal(a, b) for a, b in zip(grads, watched_grads, strict=True))
    kinds = {(s.line, s.kind) for s in guard.report.sites if s.file == __file__}
    assert (_line("# L-clip-norm"), "item") in kinds
    assert torch.nn.utils.clip_grad_norm_ is original
    assert clip_grad.clip_grad_norm_ is original


def test_clip_grad_norm_with_the_non_finite_check_is_watched() -> None:
    # error_if_nonfinite reads the norm on the host: a sync inside torch.
    _, _, guard = _clipped(True, error_if_nonfinite=True)
    inside = [s for s in guard.report.sites if s.kind == "bool"]
    assert [s.origin for s in inside] == ["framework:torch.nn.utils"]
