"""The CUDA engine on a real GPU: the corpus, the policy, threads, restoration."""

from __future__ import annotations

import os
import sys
import threading
import traceback
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import barrierguard
from _runif import run_if
from corpus import cases

pytestmark = run_if(min_cuda_gpus=1)

CORPUS = os.path.abspath(cases.__file__)


def _corpus_report() -> barrierguard.Report:
    d = cases.prepare("cuda")
    cases.run_all(d)  # warm-up: lazy init, cuBLAS handles, allocator
    torch.cuda.synchronize()
    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        cases.run_all(d)
        guard.step()  # closes the measured step
        torch.cuda.synchronize()  # not in the corpus file: must not appear there
    return guard.report


def test_corpus_matches_annotations() -> None:
    report = _corpus_report()
    expected = cases.annotations()
    found: dict[int, set[tuple[str, str]]] = {}
    for site in report.sites:
        if site.file == CORPUS and site.step_count > 0:
            found.setdefault(site.line, set()).add((site.kind, site.origin))
    missing = {
        line: want
        for line, want in expected.items()
        if want is not None and want not in found.get(line, set())
    }
    noisy = {line: got for line, got in found.items() if expected.get(line) is None}
    wrong = {
        line: got
        for line, got in found.items()
        if expected.get(line) is not None and got != {expected[line]}
    }
    print(report)
    assert not missing, f"syncing lines not reported: {missing}"
    assert not noisy, f"quiet or unannotated lines reported: {noisy}"
    assert not wrong, f"lines reported with extra kinds: {wrong}"


def test_copy_directions_are_named() -> None:
    report = _corpus_report()
    details = {(s.line, s.detail) for s in report.sites if s.file == CORPUS and s.kind == "copy"}
    assert any(d == "d2h" for _, d in details)
    assert any(d.startswith("h2d") for _, d in details)


def test_error_policy_raises_at_the_user_line() -> None:
    x = torch.ones(4, device="cuda")
    with pytest.raises(barrierguard.SyncError) as info:  # noqa: SIM117
        with barrierguard.watch(engine="cuda", policy="error") as guard:
            for _ in range(2):  # raised in its second step, at its line
                guard.step()
                x.sum().item()  # the offending line
    frames = traceback.extract_tb(info.value.__traceback__)
    user = [f for f in frames if f.filename == __file__]
    assert user[-1].line == "x.sum().item()  # the offending line"
    assert info.value.site is not None and info.value.site["kind"] == "item"
    assert torch.cuda.get_sync_debug_mode() == 0


def test_warn_policy_warns_once_per_site() -> None:
    x = torch.ones(4, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with barrierguard.watch(engine="cuda", policy="warn") as guard:
            guard.step()
            for _ in range(5):
                x.sum().item()
                guard.step()
    ours = [w for w in caught if issubclass(w.category, barrierguard.SyncWarning)]
    assert len(ours) == 1
    assert ours[0].filename == __file__
    assert "item" in str(ours[0].message)
    assert not [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    site = next(s for s in guard.report.sites if s.kind == "item")
    assert site.count == 5 and site.steps == ((1, 5),)


def test_allow_rules_and_budget() -> None:
    x = torch.ones(4, device="cuda")
    with barrierguard.watch(engine="cuda", policy="error", allow=["item"]) as guard:
        guard.step()
        x.sum().item()
    assert guard.report.ok
    here = os.path.basename(__file__)
    with barrierguard.watch(engine="cuda", policy="error", allow=[f"{here}:*"]) as guard:
        guard.step()
        x.sum().tolist()
    assert guard.report.ok
    with barrierguard.watch(engine="cuda", policy="error", max_syncs_per_step=2) as guard:
        for _ in range(3):
            guard.step()
            x.sum().item()
            x.sum().item()
    assert guard.report.ok
    with pytest.raises(barrierguard.SyncError, match="3 syncs in step 2, budget 2"):  # noqa: SIM117
        with barrierguard.watch(engine="cuda", policy="error", max_syncs_per_step=2) as guard:
            for n in (1, 3):
                guard.step()
                for _ in range(n):
                    x.sum().item()


def test_setup_and_optimizer_steps() -> None:
    model = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, device="cuda")
    with barrierguard.watch(engine="cuda", policy="error", warmup_steps=1) as guard:
        for _ in range(2):  # before the 1st step, and the 1 warm-up step: setup
            loss = model(x).pow(2).mean()
            loss.backward()
            loss.item()
            opt.step()
            opt.zero_grad()
        with pytest.raises(barrierguard.SyncError):
            for _ in range(2):  # a read in the loop: raised in its second measured step
                loss.item()
                opt.step()
    report = guard.report
    assert report.steps == 3 and report.measured_steps == 2
    site = next(s for s in report.sites if s.kind == "item" and s.setup_count)
    assert site.setup_count == 2


def test_sync_in_another_thread_is_recorded_with_its_name() -> None:
    x = torch.ones(4, device="cuda")

    def worker() -> None:
        x.sum().item()

    with barrierguard.watch(engine="cuda", policy="record") as guard:
        guard.step()
        t = threading.Thread(target=worker, name="metrics-logger")
        t.start()
        t.join()
    site = next(s for s in guard.report.sites if s.kind == "item")
    assert site.threads == ("metrics-logger",)
    assert site.function == "worker"


def test_error_in_another_thread_is_raised_at_stop() -> None:
    x = torch.ones(4, device="cuda")

    def worker() -> None:
        x.sum().item()

    guard = barrierguard.watch(engine="cuda", policy="error")
    guard.start()
    guard.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", barrierguard.SyncWarning)
        t = threading.Thread(target=worker, name="bg")
        t.start()
        t.join()
    guard.step()  # the step is closed: the worker's sync was in it
    with pytest.raises(barrierguard.SyncError):
        guard.stop()
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_state_restored_after_exception(exc_type: type[BaseException]) -> None:
    torch.cuda.set_sync_debug_mode(0)
    sync_before = torch.cuda.synchronize
    with pytest.raises(exc_type), barrierguard.watch(engine="cuda", policy="record"):
        assert torch.cuda.get_sync_debug_mode() == 1
        assert torch.cuda.synchronize is not sync_before
        raise exc_type("stop")
    assert torch.cuda.get_sync_debug_mode() == 0
    assert torch.cuda.synchronize is sync_before


def test_nested_guards_both_record() -> None:
    x = torch.ones(4, device="cuda")
    with barrierguard.watch(engine="cuda", policy="record") as outer:
        outer.step()
        x.sum().item()
        with barrierguard.watch(engine="cuda", policy="record") as inner:
            inner.step()
            x.sum().tolist()
        assert torch.cuda.get_sync_debug_mode() == 1
    assert {s.kind for s in outer.report.sites} == {"item", "tolist"}
    assert {s.kind for s in inner.report.sites} == {"tolist"}
    assert torch.cuda.get_sync_debug_mode() == 0


def test_metricbuffer_compute_is_reported_and_allowed() -> None:
    x = torch.ones(4, device="cuda")
    buf = barrierguard.MetricBuffer()
    with barrierguard.watch(engine="cuda", policy="error") as guard:
        for _ in range(3):
            guard.step()
            buf.update(loss=x.sum())
        result = buf.compute()  # the one deliberate transfer
    assert result["loss"] == 4.0
    sites = [s for s in guard.report.sites if s.count]
    assert sites and all(s.origin == "framework:barrierguard" and s.allowed for s in sites)
    assert all(dict(s.phases).get("after-loop") == s.count for s in sites)  # after the loop
    framework_file = sites[0].framework_file
    assert framework_file is not None
    assert framework_file.replace("\\", "/").split("/")[-2] == "metrics"
    assert guard.report.ok


def test_fixed_example_passes_the_error_policy(tmp_path: Path) -> None:
    import subprocess

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "barrierguard",
            "run",
            "--policy",
            "error",
            "--out",
            str(tmp_path / "r.json"),
            str(root / "examples" / "fixed_loop.py"),
            "--steps",
            "20",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
    )
    assert proc.returncode == 0, proc.stderr
    report = barrierguard.Report.load(tmp_path / "r.json")
    assert report.engine == "cuda" and report.ok and report.steps == 20
