"""Every public entry point x every exit path, from one and from two threads.

After each case the globals barrierguard touches (``tests/_leaks.py``, also
checked after every test by the autouse fixture in ``conftest.py``) are as
they were before, and the exit path reaches the caller unchanged: a return
returns, an exception propagates as itself.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import barrierguard
from _leaks import EXITS, RAISED, global_state
from barrierguard.cli.main import main
from barrierguard.detect import hub

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the training device


# With two threads, each starts and stops its guard while the other is not
# inside optimizer.step(): torch iterates its global step hooks unlocked, so a
# hook added or removed meanwhile fails that step (docs/guide.md).
_together = threading.local()


def _meet() -> None:
    barrier = getattr(_together, "barrier", None)
    if barrier is not None:
        barrier.wait(timeout=60)


def _train(exit_path: str) -> int:
    """A tiny loop with a sync per step, left by ``exit_path``."""
    model = nn.Linear(4, 1).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4).to(DEV)
    _meet()
    for _ in range(2):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    if exit_path != "hook_exception":
        _meet()
    if exit_path == "hook_exception":
        hook = opt.register_step_post_hook(lambda *a: 1 / 0)
        try:
            model(x).sum().backward()
            opt.step()
        finally:
            hook.remove()
            _meet()
    if exit_path in RAISED:
        raise RAISED[exit_path]("out")
    return 7


def _context_manager(exit_path: str) -> int:
    with barrierguard.watch(policy="record"):
        return _train(exit_path)


def _decorator(exit_path: str) -> int:
    @barrierguard.watch(policy="record")
    def run() -> int:
        return _train(exit_path)

    return run()


def _by_hand(exit_path: str) -> int:
    guard = barrierguard.watch(policy="record")
    guard.start()
    try:
        return _train(exit_path)
    finally:
        guard.stop()


ENTRIES: dict[str, Callable[[str], int]] = {
    "context_manager": _context_manager,
    "decorator": _decorator,
    "by_hand": _by_hand,
}


def _outcome(call: Callable[[], int]) -> Any:
    try:
        return call()
    except BaseException as exc:  # the exit path itself is what is compared
        return type(exc)


@pytest.mark.parametrize("exit_path", EXITS)
@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("threads", [1, 2])
def test_watch_restores_everything_on_every_exit_path(
    entry: str, exit_path: str, threads: int
) -> None:
    before = global_state()
    outcomes: list[Any] = []
    stacks: list[int] = []
    if threads == 1:
        outcomes.append(_outcome(lambda: ENTRIES[entry](exit_path)))
    else:
        barrier = threading.Barrier(threads)

        def work() -> None:
            _together.barrier = barrier
            outcomes.append(_outcome(lambda: ENTRIES[entry](exit_path)))
            # A thread that ends with a function mode on its stack can abort
            # the process at exit ("terminate called without an active exception").
            stacks.append(torch._C._len_torch_function_stack())

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    expected = RAISED.get(exit_path, 7)
    assert outcomes == [expected] * threads
    assert stacks == [0] * (threads if threads > 1 else 0)
    assert global_state() == before


# -- one guard, re-entered -------------------------------------------------------


def test_a_recursive_decorated_function_runs_inside_the_outer_watch() -> None:
    @barrierguard.watch(policy="record")
    def depth(n: int) -> int:
        torch.ones(3).to(DEV).sum().item()  # L-recursive
        return 0 if n == 0 else 1 + depth(n - 1)

    assert depth(3) == 3
    guard = depth.guard  # type: ignore[attr-defined]
    assert not guard.is_running
    (site,) = [s for s in guard.report.sites if s.file == __file__ and s.kind == "item"]
    assert site.count == 4  # every level counted, by the one outer watch


def test_a_nested_with_of_the_same_guard_is_a_no_op() -> None:
    guard = barrierguard.watch(policy="error")
    with guard:
        with guard:
            assert guard.is_running
        assert guard.is_running  # the inner exit does not stop the outer
    assert not guard.is_running


def test_two_threads_in_one_decorated_function_start_it_once() -> None:
    started = threading.Barrier(2)
    release = threading.Event()
    calls: list[int] = []

    @barrierguard.watch(policy="error")
    def work(i: int) -> int:
        started.wait(timeout=30)
        release.wait(timeout=30)
        calls.append(i)
        return i

    results: list[int] = []
    threads = [threading.Thread(target=lambda i=i: results.append(work(i))) for i in range(2)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1]
    guard = work.guard  # type: ignore[attr-defined]
    assert not guard.is_running
    assert any("was not started twice" in n for n in guard.report.notes)


def test_many_threads_in_one_decorated_function_exit_cleanly(tmp_path: Path) -> None:
    # The process once aborted at exit (two installs of one guard): run it whole.
    script = tmp_path / "threads.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading, torch, barrierguard

            @barrierguard.watch(policy="record")
            def work():
                for _ in range(20):
                    torch.ones(8).sum().item()

            threads = [threading.Thread(target=work) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            print("done", torch._C._len_torch_function_stack())
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["done", "0"]


def test_stop_from_another_thread_leaves_no_mode_on_the_starting_thread() -> None:
    guard = barrierguard.watch(engine="audit", policy="record")
    inside = threading.Event()
    stopped = threading.Event()
    depth: list[int] = []

    def starter() -> None:
        with guard:
            inside.set()
            stopped.wait(timeout=30)
            torch.ones(2).sum()  # the inert mode is still here: no crash, no record
        depth.append(torch._C._len_torch_function_stack())

    t = threading.Thread(target=starter)
    t.start()
    inside.wait(timeout=30)
    guard.stop()
    stopped.set()
    t.join()
    assert depth == [0]


def test_stop_by_hand_from_another_thread_is_tidied_at_the_next_start() -> None:
    guard = barrierguard.watch(engine="audit", policy="record")
    guard.start()
    t = threading.Thread(target=guard.stop)
    t.start()
    t.join()
    assert not guard.is_running
    # This thread's stack still holds the inert mode: the next guard removes it.
    with barrierguard.watch(engine="audit", policy="record"):
        assert torch._C._len_torch_function_stack() == 1
    assert torch._C._len_torch_function_stack() == 0


# -- generators and coroutines ------------------------------------------------------


def test_a_decorated_generator_is_watched_over_its_iterations() -> None:
    @barrierguard.watch(policy="record")
    def batches() -> Iterator[float]:
        x = torch.ones(3).to(DEV)
        for _ in range(3):
            yield x.sum().item()  # L-generator

    assert list(batches()) == [3.0, 3.0, 3.0]
    guard = batches.guard  # type: ignore[attr-defined]
    assert not guard.is_running
    (site,) = [s for s in guard.report.sites if s.file == __file__ and s.kind == "item"]
    assert site.count == 3


def test_a_generator_closed_early_stops_its_guard() -> None:
    @barrierguard.watch(policy="record")
    def numbers() -> Iterator[int]:
        yield 1
        yield 2

    gen = numbers()
    assert next(gen) == 1
    assert numbers.guard.is_running  # type: ignore[attr-defined]
    gen.close()
    assert not numbers.guard.is_running  # type: ignore[attr-defined]


def test_a_decorated_coroutine_is_watched_until_it_returns() -> None:
    @barrierguard.watch(policy="record")
    async def step() -> float:
        x = torch.ones(3).to(DEV)
        await asyncio.sleep(0)
        return x.sum().item()  # L-coroutine

    assert asyncio.run(step()) == 3.0
    guard = step.guard  # type: ignore[attr-defined]
    assert "item" in [s.kind for s in guard.report.sites if s.file == __file__]


def test_an_async_generator_is_refused_when_decorated() -> None:
    async def agen() -> Any:
        yield 1

    with pytest.raises(barrierguard.BarrierGuardError, match=r"async generator.*with watch"):
        barrierguard.watch(agen)


# -- warnings, options, files ---------------------------------------------------------


def test_a_guard_stopped_inside_catch_warnings_leaves_no_filter(fake_cuda: Any) -> None:
    guard = barrierguard.watch(engine="cuda", policy="record")
    guard.start()
    with warnings.catch_warnings():
        guard.stop()
    assert not [f for f in warnings.filters if "synchroniz" in str(getattr(f[1], "pattern", ""))]


def test_allow_none_names_the_option() -> None:
    with pytest.raises(barrierguard.BarrierGuardError, match=r"watch\(allow=None\).*rule"):
        barrierguard.watch(allow=None)


def test_out_through_a_symlink_writes_its_target(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with barrierguard.watch(policy="record", out=str(link)):
        pass
    assert link.is_symlink()
    assert barrierguard.Report.load(target).policy == "record"


def test_out_naming_a_special_file_is_refused_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with barrierguard.watch(policy="record", out=str(fifo)) as guard:
        pass
    assert fifo.is_fifo()
    assert any("not a regular file" in n for n in guard.report.notes)


# -- the command line -------------------------------------------------------------------


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize(
    ("exit_path", "code"),
    [
        ("return", 0),
        ("exception", 1),
        ("keyboard_interrupt", 130),
        ("system_exit", 4),
        ("hook_exception", 1),
    ],
)
def test_run_restores_everything_on_every_exit_path(
    tmp_path: Path, exit_path: str, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    raise_line = {
        "return": "pass",
        "exception": "raise ValueError('x')",
        "keyboard_interrupt": "raise KeyboardInterrupt",
        "system_exit": "raise SystemExit(4)",
        "hook_exception": (
            "opt.register_step_post_hook(lambda *a: 1 / 0); "
            "model(torch.ones(1, 2)).sum().backward(); opt.step()"
        ),
    }[exit_path]
    script = _script(
        tmp_path,
        f"""
        import torch
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(1, 2)).sum().item()
        {raise_line}
        """,
    )
    before = global_state()
    assert main(["run", "--policy", "record", str(script)]) == code
    assert global_state() == before


def test_run_module_imports_a_package_of_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("print('trained')\n")
    monkeypatch.chdir(tmp_path)
    # As the installed command sees it: sys.path[0] is its own bin folder.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert main(["run", "--policy", "record", "-m", "mypkg.train"]) == 0
    assert "trained" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["run", "-m", "nope_pkg_xyz.mod"], "nope_pkg_xyz.mod"),
        (["run", "--engine", "cuda", "-m", "json.tool"], "engine='cuda'"),
    ],
)
def test_run_bad_input_is_one_line_and_exit_2(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "Traceback" not in err


def test_run_out_is_resolved_where_it_was_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = _script(tmp_path, f"import os\nos.chdir({str(elsewhere)!r})\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--policy", "record", "--out", "rep.json", str(script)]) == 0
    assert (tmp_path / "rep.json").is_file()
    assert not (elsewhere / "rep.json").exists()
    assert f"report written to {tmp_path / 'rep.json'}" in capsys.readouterr().err


def test_deferred_cleanups_run_only_on_their_thread() -> None:
    ran: list[str] = []
    go = threading.Event()

    def worker() -> None:
        go.wait(timeout=30)
        hub.tidy()

    t = threading.Thread(target=worker)
    t.start()
    assert t.ident is not None
    hub.defer(t.ident, lambda: ran.append("ran"))
    hub.tidy()  # this thread's: nothing
    assert ran == []
    go.set()
    t.join()
    assert ran == ["ran"]
