"""The pytest plugin, run inside pytester sandboxes with the CUDA engine faked on CPU."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from _gate_helpers import PLAIN_LOOP, READ_IN_LOOP
from barrierguard import Report
from barrierguard.cli.main import main
from barrierguard.integrations import pytest_plugin as _pytest_plugin

# The plugin module is imported by this file (and, once installed, by pytest's
# entry points), so inner runs cannot assertion-rewrite it: that warning is noise.
PLUGIN = (
    "-p",
    "barrierguard.integrations.pytest_plugin",
    "-W",
    "ignore::pytest.PytestAssertRewriteWarning",
)
FAKE = Path(__file__).resolve().parents[1] / "_fake_cuda.py"

CONFTEST = """\
import pytest

pytest_plugins = ["_fake_cuda"]


@pytest.fixture(autouse=True)
def _cuda_on_cpu(fake_cuda):
    yield fake_cuda
"""

# Two steps with one .item() each after the setup step, through a real optimizer.
LOOP = """\
import pytest
import torch

from _fake_cuda import FakeTensor


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def test_clean():
    opt = _optimizer()
    FakeTensor().item()  # setup only
    for _ in range(3):
        opt.step()


def test_dirty():
    opt = _optimizer()
    t = FakeTensor(2.0)
    for _ in range(3):
        value = t.item()  # BAD-ITEM
        opt.step()
"""


def _warm_torch() -> None:
    # optimizer.step() imports torch._dynamo lazily; pytester's in-process runs
    # drop modules first imported inside them, and torch cannot import those twice.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()


_warm_torch()


@pytest.fixture(autouse=True)
def _only_this_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    # Once barrierguard is installed its entry point loads the plugin by itself,
    # and "-p" would register the module a second time: load plugins by hand only.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if marker in text)


@pytest.fixture
def sandbox(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    pytester.makepyfile(test_loop=LOOP)
    return pytester


def test_off_unless_asked(sandbox: pytest.Pytester) -> None:
    result = sandbox.runpytest(*PLUGIN)
    result.assert_outcomes(passed=2)
    assert "barrierguard" not in result.stdout.str()


def test_error_policy_fails_with_line_kind_and_fix(sandbox: pytest.Pytester) -> None:
    result = sandbox.runpytest(*PLUGIN, "--barrierguard=error")
    result.assert_outcomes(passed=1, failed=1)
    line = _line(LOOP, "BAD-ITEM")
    result.stdout.fnmatch_lines(
        [
            "*FAILED test_loop.py::test_dirty*",
        ]
    )
    out = result.stdout.str()
    assert "barrierguard: 2 synchronization(s) broke the policy" in out
    assert f"test_loop.py:{line}: item (user) first in step 1, 2 in steps: not allowed" in out
    assert "value = t.item()  # BAD-ITEM" in out
    assert "fix: keep the value on the device" in out
    assert f"allow=['test_loop.py:{line}']" in out
    # The terminal summary gives the totals.
    result.stdout.fnmatch_lines(
        [
            "*= barrierguard =*",
            "2 test(s) watched (engine cuda): 2 site(s), 4 syncs (2 in measured steps), "
            "2 policy violation(s), 1 test(s) failed by barrierguard",
        ]
    )


def test_warn_policy_passes_with_one_warning_per_site(sandbox: pytest.Pytester) -> None:
    result = sandbox.runpytest(*PLUGIN, "--barrierguard=warn")
    result.assert_outcomes(passed=2, warnings=1)
    out = result.stdout.str()
    assert "SyncWarning: BG101 item sync at" in out
    assert "1 test(s) failed by barrierguard" not in out


def test_record_policy_only_counts(sandbox: pytest.Pytester) -> None:
    result = sandbox.runpytest(*PLUGIN, "--barrierguard=record")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*test_loop.py:* item (user): 2 in steps, 0.67 per step: value = t.item()*"]
    )


@pytest.mark.parametrize(
    ("ini", "cli", "failed"),
    [
        ("error", None, 1),
        ("warn", None, 0),
        ("error", "record", 0),  # the command line wins
        ("warn", "error", 1),
        ("record", "warn", 0),
        (None, "error", 1),
    ],
)
def test_ini_and_command_line_precedence(
    sandbox: pytest.Pytester, ini: str | None, cli: str | None, failed: int
) -> None:
    if ini is not None:
        sandbox.makeini(f"[pytest]\nbarrierguard = {ini}\n")
    args = [*PLUGIN] + ([f"--barrierguard={cli}"] if cli else [])
    result = sandbox.runpytest(*args)
    result.assert_outcomes(passed=2 - failed, failed=failed)


@pytest.mark.parametrize(
    ("ini", "cli", "message"),
    [
        ("loud", None, "ini key barrierguard='loud' is not a valid policy"),
        (None, "strict", "--barrierguard='strict' is not a valid policy"),
    ],
)
def test_bad_policy_is_a_usage_error(
    sandbox: pytest.Pytester, ini: str | None, cli: str | None, message: str
) -> None:
    if ini is not None:
        sandbox.makeini(f"[pytest]\nbarrierguard = {ini}\n")
    args = [*PLUGIN] + ([f"--barrierguard={cli}"] if cli else [])
    result = sandbox.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*'record', 'warn', 'error'*"])


def test_ini_allow_and_budget(sandbox: pytest.Pytester) -> None:
    sandbox.makeini("[pytest]\nbarrierguard = error\nbarrierguard_allow =\n    item\n")
    sandbox.runpytest(*PLUGIN).assert_outcomes(passed=2)
    sandbox.makeini("[pytest]\nbarrierguard = error\nbarrierguard_max_syncs_per_step = 1\n")
    sandbox.runpytest(*PLUGIN).assert_outcomes(passed=2)


def test_bad_ini_allow_rule_is_a_usage_error(sandbox: pytest.Pytester) -> None:
    sandbox.makeini("[pytest]\nbarrierguard = error\nbarrierguard_allow =\n    itme\n")
    result = sandbox.runpytest(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*allow rule 'itme' is malformed (did you mean 'item'?)*"])


MARKED = """\
import pytest
import torch

from _fake_cuda import FakeTensor


def _loop(per_step):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    t = FakeTensor(2.0)
    for _ in range(3):
        for _ in range(per_step):
            t.item()  # THE-ITEM
        opt.step()


@pytest.mark.barrierguard({mark})
def test_marked():
    _loop({per_step})
"""


@pytest.mark.parametrize(
    ("mark", "per_step", "cli", "passed"),
    [
        ("max_syncs_per_step=1", 1, "error", True),
        ("max_syncs_per_step=1", 2, "error", False),
        ("max_syncs_per_step=0", 1, "error", False),
        ("allow=['item']", 2, "error", True),
        ("allow='test_marked.py:12'", 2, "error", True),
        ("allow=['test_marked.py:1-5']", 2, "error", False),
        ("policy='error'", 1, None, False),  # the marker alone turns the watch on
        ("policy='error', warmup_steps=5", 1, None, True),  # all three steps are warm-up
        ("policy='record'", 1, "error", True),  # the marker is more specific
        ("", 1, None, True),  # default policy: warn
    ],
)
def test_marker_options(
    pytester: pytest.Pytester, mark: str, per_step: int, cli: str | None, passed: bool
) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    source = MARKED.format(mark=mark, per_step=per_step)
    assert _line(source, "THE-ITEM") == 12
    pytester.makepyfile(test_marked=source)
    args = [*PLUGIN] + ([f"--barrierguard={cli}"] if cli else [])
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=int(passed), failed=int(not passed))
    if not passed:
        assert "fix: keep the value on the device" in result.stdout.str()


@pytest.mark.parametrize(
    ("mark", "message"),
    [
        ("max_sync_per_step=0", "unknown option(s) 'max_sync_per_step'"),
        ("'error'", "takes keyword arguments only"),
        ("policy='loud'", "policy='loud') is not a valid policy"),
        ("max_syncs_per_step=-1", "max_syncs_per_step=-1) is not valid"),
        ("allow=['itme']", "allow rule 'itme' is malformed"),
        ("max_growth_per_step='1 parsec'", "max_growth_per_step='1 parsec')"),
        # Every option of watch() is the marker's too, validated the same way.
        ("memory='no'", "@pytest.mark.barrierguard(memory='no') is not valid"),
        ("memory_every=0", "@pytest.mark.barrierguard(memory_every=0) is not valid"),
    ],
)
def test_bad_marker_is_an_error_naming_it(
    pytester: pytest.Pytester, mark: str, message: str
) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    pytester.makepyfile(test_marked=MARKED.format(mark=mark, per_step=1))
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(errors=1)
    assert message in result.stdout.str()


FIXTURE = """\
from _fake_cuda import FakeTensor


def test_with_fixture(barrierguard):
    t = FakeTensor(2.0)
    t.item()  # setup
    for _ in range(2):
        barrierguard.step()
        t.item()  # IN-STEP
    assert barrierguard.is_running
    assert barrierguard.steps == 2
"""


@pytest.mark.parametrize(("cli", "failed"), [("error", 1), ("record", 0), (None, 0)])
def test_fixture_yields_a_running_guard(
    pytester: pytest.Pytester, cli: str | None, failed: int
) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    pytester.makepyfile(test_fixture=FIXTURE)
    args = [*PLUGIN] + ([f"--barrierguard={cli}"] if cli else [])
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=1 - failed, failed=failed, warnings=1 if cli is None else 0)
    if failed:
        assert f"test_fixture.py:{_line(FIXTURE, 'IN-STEP')}: item" in result.stdout.str()


def test_a_failing_test_keeps_its_own_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    pytester.makepyfile(
        test_own="""
        def test_own(barrierguard):
            barrierguard.step()
            assert 1 == 2, "the test's own failure"
        """
    )
    result = pytester.runpytest(*PLUGIN, "--barrierguard=error")
    result.assert_outcomes(failed=1)
    assert "the test's own failure" in result.stdout.str()


def test_no_step_boundary_is_said_in_the_summary(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    pytester.makepyfile(
        test_nostep="""
        from _fake_cuda import FakeTensor

        def test_nostep():
            FakeTensor().item()
        """
    )
    result = pytester.runpytest(*PLUGIN, "--barrierguard=error")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["1 test(s) saw no step boundary*"])


def test_growth_limit_without_memory_samples_warns(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    marked = MARKED.format(mark="max_growth_per_step=1024", per_step=0)
    pytester.makepyfile(
        test_growth=marked.replace(
            "max_growth_per_step=1024", "max_growth_per_step='1KB', engine='cuda'"
        )
    )
    result = pytester.runpytest(*PLUGIN, "-W", "ignore::DeprecationWarning")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed") == 1


@pytest.mark.parametrize(("leak", "fails"), [(True, True), (False, False)])
def test_growth_limit_follows_the_memory_verdict(leak: bool, fails: bool) -> None:
    from barrierguard import MemoryReport

    memory = MemoryReport(
        steps=(1, 2, 3),
        series={"host_rss": (100, 200, 300)},
        leak=leak,
        threshold=50,
        reason="host_rss grows 100 bytes per step from step 1",
        fix="detach the loss",
    )
    report = Report(engine="cuda", detection=True, policy="record", memory=memory)
    message = _pytest_plugin._growth_failure(report)
    assert (message is not None) == fails
    if fails:
        assert message is not None
        assert "host_rss grows 100 bytes per step" in message and "fix: detach the loss" in message


@pytest.mark.parametrize("bad", ["-1", "1 parsec", True, -5])
def test_growth_limit_marker_rejects_bad_sizes(pytester: pytest.Pytester, bad: object) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    pytester.makepyfile(
        test_bad=f"""
import pytest
@pytest.mark.barrierguard(max_growth_per_step={bad!r})
def test_it():
    pass
"""
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(errors=1)
    assert "max_growth_per_step" in result.stdout.str()


def test_report_file_feeds_the_ratchet(
    sandbox: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    out = sandbox.path / "bg.json"
    result = sandbox.runpytest(*PLUGIN, "--barrierguard=record", f"--barrierguard-report={out}")
    result.assert_outcomes(passed=2)
    report = Report.load(out)
    assert report.detection and report.engine == "cuda"
    assert {s.code for s in report.sites} == {
        "FakeTensor().item()  # setup only",
        "value = t.item()  # BAD-ITEM",
    }
    assert json.loads(out.read_text())["schema"] == "barrierguard.report/1"
    baseline = sandbox.path / "baseline.json"
    root = str(sandbox.path)
    assert main(["baseline", str(out), "-o", str(baseline), "--root", root]) == 0
    assert main(["check", str(out), "--baseline", str(baseline), "--root", root]) == 0
    # A new .item() in the suite fails the ratchet.
    sandbox.makepyfile(
        test_more=textwrap.dedent(
            """
            import torch
            from _fake_cuda import FakeTensor

            def test_more():
                opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
                for _ in range(2):
                    FakeTensor().tolist()
                    opt.step()
            """
        )
    )
    sandbox.runpytest(*PLUGIN, "--barrierguard=record", f"--barrierguard-report={out}")
    capsys.readouterr()
    assert main(["check", str(out), "--baseline", str(baseline), "--root", root]) == 1
    assert "new site: test_more.py:7 in test_more(): 'FakeTensor().tolist()' [tolist]" in (
        capsys.readouterr().out
    )


def test_an_internal_fault_is_a_warning_not_a_failure(
    sandbox: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(report: Report, plan: object) -> str:
        raise RuntimeError("boom")

    monkeypatch.setattr(_pytest_plugin, "_failure_text", broken)
    result = sandbox.runpytest(*PLUGIN, "--barrierguard=error")
    result.assert_outcomes(passed=2, warnings=1)
    assert "internal error in barrierguard: RuntimeError: boom" in result.stdout.str()


# The plain loop of the fix messages, run by tests: a read after the loop, a read inside.
PLAIN = """\
import runpy


def test_read_after_the_loop():
    runpy.run_path("loop_after.py")


def test_read_inside_the_loop():
    runpy.run_path("loop_inside.py")
"""


def test_a_read_after_the_loop_passes_one_inside_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=PLAIN, loop_after=PLAIN_LOOP, loop_inside=READ_IN_LOOP)
    result = pytester.runpytest(*PLUGIN, "--barrierguard=error")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_plain.py::test_read_inside_the_loop*"])
    line = _line(READ_IN_LOOP, "print(loss.item())")
    assert f"loop_inside.py:{line}" in result.stdout.str()


# Seven watched tests with different steps and syncs, for the xdist run.
MANY = """\
import pytest
import torch

from _fake_cuda import FakeTensor


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_loop(n):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    t = FakeTensor()
    t.item()  # setup
    for _ in range(n + 1):
        for _ in range(n % 3):
            t.tolist()  # in the loop
        opt.step()
    t.item()  # after the loop
"""


def _summary(report: Report) -> tuple[object, ...]:
    sites = sorted(
        (s.code, s.count, s.setup_count, s.step_count, dict(s.phases).get("after-loop", 0))
        for s in report.sites
    )
    return (report.steps, report.measured_steps, report.total_syncs, report.step_syncs, sites)


def test_xdist_workers_make_the_serial_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST, test_many=MANY)
    serial, parallel = pytester.path / "serial.json", pytester.path / "parallel.json"
    args = (*PLUGIN, "-p", "xdist.plugin", "--barrierguard=record")
    pytester.runpytest_subprocess(*args, f"--barrierguard-report={serial}").assert_outcomes(
        passed=7
    )
    result = pytester.runpytest_subprocess(*args, "-n", "2", f"--barrierguard-report={parallel}")
    result.assert_outcomes(passed=7)
    assert "7 test(s) watched" in result.stdout.str()
    one, two = Report.load(serial), Report.load(parallel)
    assert _summary(one) == _summary(two)
    assert one.steps == sum(n + 1 for n in range(1, 8))


_EXIT_BODIES = {
    "return": ("pass", pytest.ExitCode.OK),
    "exception": ("raise ValueError('out')", pytest.ExitCode.TESTS_FAILED),
    "keyboard_interrupt": ("raise KeyboardInterrupt", pytest.ExitCode.INTERRUPTED),
    "system_exit": ("raise SystemExit(3)", pytest.ExitCode.TESTS_FAILED),
    "hook_exception": (
        "opt.register_step_post_hook(lambda *a: 1 / 0); opt.step()",
        pytest.ExitCode.TESTS_FAILED,
    ),
}


@pytest.mark.parametrize("exit_path", sorted(_EXIT_BODIES))
def test_every_exit_path_of_a_watched_test_restores_everything(
    pytester: pytest.Pytester, exit_path: str
) -> None:
    from _leaks import global_state

    body, code = _EXIT_BODIES[exit_path]
    pytester.makepyfile(
        test_exit=f"""
        import torch

        def test_exit():
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            opt.step()
            torch.ones(2).sum().item()
            {body}
        """
    )
    before = global_state()
    result = pytester.runpytest_inprocess(
        *PLUGIN, "--barrierguard=record", "-p", "no:cacheprovider", no_reraise_ctrlc=True
    )
    assert result.ret == code
    assert global_state() == before


def test_github_format_annotates_the_failing_line(sandbox: pytest.Pytester) -> None:
    result = sandbox.runpytest(*PLUGIN, "--barrierguard=error", "--barrierguard-format=github")
    result.assert_outcomes(passed=1, failed=1)
    line = _line(LOOP, "BAD-ITEM")
    result.stdout.fnmatch_lines(
        [f"::error file=test_loop.py,line={line},title=barrierguard BG101 item::item sync: *"]
    )


def test_sarif_format_writes_a_log(sandbox: pytest.Pytester) -> None:
    result = sandbox.runpytest(*PLUGIN, "--barrierguard=warn", "--barrierguard-format=sarif")
    result.assert_outcomes(passed=2, warnings=1)
    log = json.loads((sandbox.path / "barrierguard.sarif").read_text())
    (res,) = log["runs"][0]["results"]
    assert (res["ruleId"], res["level"]) == ("BG101", "warning")
    region = res["locations"][0]["physicalLocation"]["region"]
    assert region["startLine"] == _line(LOOP, "BAD-ITEM")


ALLOWED_LOOP = """\
import barrierguard
import torch

from _fake_cuda import FakeTensor


def test_allowed_where_the_code_is():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    t = FakeTensor(2.0)
    opt.step()
    for _ in range(3):
        t.item()  # barrierguard: allow[BG101]
        with barrierguard.allowed("tolist", first_only=True):
            t.tolist()
        opt.step()


def test_first_only_admits_one():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    t = FakeTensor(2.0)
    opt.step()
    with barrierguard.allowed("tolist", first_only=True):
        for _ in range(2):
            t.tolist()  # SECOND-HIT
            opt.step()
"""


def test_inline_and_scoped_allow_rules_in_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_fake_cuda=FAKE.read_text(), conftest=CONFTEST)
    pytester.makepyfile(test_allowed=ALLOWED_LOOP)
    result = pytester.runpytest(*PLUGIN, "--barrierguard=error")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "FAILED test_allowed.py::test_first_only_admits_one" in out
    line = _line(ALLOWED_LOOP, "SECOND-HIT")
    assert f"test_allowed.py:{line}: tolist (user) first in step 2" in out
