"""A compiled step under watch(): each sync site with dynamo's graph break, the fix without."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import barrierguard
from barrierguard import Report

torch._dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(step: object, steps: int = 3) -> Report:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(step, backend=BACKEND)  # type: ignore[call-overload]
    with barrierguard.watch(policy="record", engine="audit", memory=False) as guard:
        for _ in range(steps):
            loss = compiled(model, torch.randn(8, 4))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return guard.report


BACKEND = "eager"


def step_with_syncs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    seen = loss.item()  # line: item
    if loss > 0.5:  # line: bool
        loss = loss * 0.5
    return loss + 0 * seen


def step_fixed(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    return torch.where(loss > 0.5, loss * 0.5, loss)


def _line(func: object, marker: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(func)  # type: ignore[arg-type]
    return first + next(i for i, text in enumerate(lines) if marker in text)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_each_sync_site_carries_dynamo_graph_break(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "BACKEND", backend)
    report = _train(step_with_syncs)
    sites = {s.kind: s for s in report.sites if s.file == __file__}
    assert set(sites) == {"item", "bool"}
    item, branch = sites["item"], sites["bool"]
    assert item.line == _line(step_with_syncs, "# line: item")
    assert branch.line == _line(step_with_syncs, "# line: bool")
    assert "Tensor.item()" in item.graph_break
    assert item.compile_flag == "capture_scalar_outputs"
    assert item.graph_break_id.startswith("gb")
    assert branch.graph_break == "Data-dependent branching"
    assert branch.compile_flag == ""
    assert report.compile is not None
    assert {(b.line, b.sync) for b in report.compile.graph_breaks} == {
        (item.line, True),
        (branch.line, True),
    }
    text = str(report)
    assert "capture_scalar_outputs = True keeps it in the graph, but the sync still happens" in text
    assert "compile: 2 graph breaks in the watched code" in text
    # The JSON keeps it all.
    again = Report.from_dict(report.to_dict())
    assert again.compile == report.compile
    assert {s.graph_break for s in again.sites} == {s.graph_break for s in report.sites}


def test_the_fixed_step_has_no_break_and_no_site() -> None:
    report = _train(step_fixed)
    assert [s for s in report.sites if s.file == __file__] == []
    assert report.compile is not None
    assert report.compile.graph_breaks == ()
    assert report.compile.verdict.startswith("compile: no graph break in the watched code")


def step_with_plain_break(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    torch._dynamo.graph_break()  # line: break
    return loss * 2


def test_a_graph_break_that_is_no_sync_is_listed_apart() -> None:
    report = _train(step_with_plain_break)
    assert report.compile is not None
    (brk,) = report.compile.graph_breaks
    assert (brk.file, brk.line) == (__file__, _line(step_with_plain_break, "# line: break"))
    assert not brk.sync
    assert "graph_break" in brk.reason
    assert "graph breaks that are not syncs:" in str(report)


def test_no_compile_no_section() -> None:
    with barrierguard.watch(policy="record", engine="audit", memory=False) as guard:
        torch.ones(3).sum()
    assert guard.report.compile is None


def test_syncs_while_compiling_are_counted_apart(tmp_path: Path) -> None:
    # A function where torch's compiler keeps it ("torch/_dynamo/convert_frame.py:
    # _compile"): a sync inside it is the compiler's, not the training's.
    fake = tmp_path / "torch" / "_dynamo" / "convert_frame.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        textwrap.dedent(
            """
            def _compile(fn):
                return fn()
            """
        )
    )
    namespace: dict[str, object] = {}
    exec(compile(fake.read_text(), os.fspath(fake), "exec"), namespace)
    compile_frame = namespace["_compile"]
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with barrierguard.watch(policy="record", engine="audit", memory=False) as guard:
        for _ in range(2):
            loss = model(torch.ones(1, 2)).sum()
            compile_frame(loss.item)  # type: ignore[operator]
            loss.backward()
            opt.step()
    (site,) = [s for s in guard.report.sites if s.kind == "item"]
    assert dict(site.phases) == {"compile": 2}
    assert site.step_count == 0 and site.setup_count == 0
    assert guard.report.compile is not None and guard.report.compile.compile_syncs == 2
    assert "counted apart: compile 2" in str(guard.report)
