"""The command line: ``run``, ``demo``, the CI gate (``baseline``, ``check``,
``report``, ``diff``) and ``merge``.

Exit status: 0 ok; 1 ``check`` or ``diff`` found a regression (a new site, more
lines of a site, more syncs per step); 2 bad usage or a bad file (the message
names the file); 3 ``run``/``demo`` broke the error policy.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace

from barrierguard._errors import BarrierGuardError, SyncError
from barrierguard.cli import follow, gate
from barrierguard.cli.gate import CI_FORMATS, FORMAT_HELP
from barrierguard.report.render import html
from barrierguard.session import rank_reports
from barrierguard.session.guard import Guard
from barrierguard.session.options import ENGINES, POLICIES
from barrierguard.session.site_stats import ci_text
from barrierguard.session.watch import watch

__all__ = ["main"]

EXIT_POLICY = 3
EXIT_USAGE = 2

# How long rank 0 waits for the other ranks' files before saying which it found.
RANK_FILES_WAIT_S = 10.0

_ROOT_HELP = (
    "files under DIR are matched by their path relative to it, others by basename "
    "(default: the current directory)"
)
_BASELINE = ".barrierguard-baseline.json"
_SHOWN = ("text", "json", "html")  # the formats that show a saved report


def _guard_options(p: argparse.ArgumentParser, default_policy: str = "warn") -> None:
    p.add_argument(
        "--policy",
        help=f"one of {', '.join(POLICIES)}: record counts, warn warns once per line, error "
        f"fails (exit 3) (default: $BARRIERGUARD_POLICY, else {default_policy})",
    )
    p.add_argument(
        "--engine",
        default="auto",
        help=f"one of {', '.join(ENGINES)}: cuda on a GPU, audit on a CPU (default auto: "
        "cuda when CUDA is available, else audit)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="treat the first N steps as setup: recorded, never held against the policy "
        "(default 0; everything before the first step is setup anyway)",
    )
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="RULE",
        help="accept matching syncs (repeatable): a kind or rule code (item, BG101), an origin "
        "(user, framework:lightning, framework:*), mechanism:<name>, or a file and lines: "
        "train.py:42, train.py:40-50, train.py:*, or a glob such as 'src/*/metrics.py:*'",
    )
    p.add_argument(
        "--max-syncs-per-step",
        type=int,
        metavar="N",
        help="a budget: up to N not-allowed syncs per measured step pass, the N+1th breaks "
        "the policy (default: none pass)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the report as JSON to FILE; under torchrun, and for the ranks that "
        "'run' follows (children re-running the script), each rank writes its own "
        "(FILE.rank<N>.json, or {rank} in FILE), for barrierguard merge",
    )
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write the report as one self-contained HTML page to FILE",
    )
    _format_options(p, FORMAT_HELP)


def _format_options(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--format", choices=CI_FORMATS, default="text", help=help)
    p.add_argument(
        "--format-out",
        metavar="FILE",
        help="write the --format output (github, sarif) to FILE instead of stdout",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="barrierguard",
        description="Find the hidden CPU-GPU synchronizations in PyTorch training loops.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a script or module under watch() and print the report",
        usage="barrierguard run [options] (script.py | -m module) [args ...]",
    )
    _guard_options(run)
    run.add_argument(
        "-m", dest="module", metavar="MODULE", help="run a module, like python -m MODULE"
    )
    run.add_argument(
        "--capture-probe",
        metavar="FUNC",
        default=False,
        help="after warm-up, try to capture the first call of the function named FUNC (the "
        "step) with torch.cuda.graph, never replayed, and report the first line that blocks "
        "capture (docs/compile.md)",
    )
    run.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args ...]")
    demo = sub.add_parser(
        "demo",
        help="train a small model with typical barriers, then report (policy record: it shows "
        "the report and exits 0)",
    )
    _guard_options(demo, default_policy="record")
    demo.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    demo.add_argument(
        "--steps", type=int, default=30, metavar="N", help="training steps (default 30)"
    )

    base = sub.add_parser(
        "baseline",
        help="save today's sites of a report as the baseline that check compares against",
    )
    base.add_argument("report", metavar="REPORT.json")
    base.add_argument(
        "-o",
        "--out",
        default=_BASELINE,
        metavar="FILE",
        help=f"where to write the baseline (default {_BASELINE})",
    )
    base.add_argument("--root", metavar="DIR", help=_ROOT_HELP)
    check = sub.add_parser(
        "check",
        help="fail (exit 1) when a report has a site the baseline lacks, or more syncs per step",
    )
    check.add_argument("report", metavar="REPORT.json")
    check.add_argument(
        "--baseline",
        default=_BASELINE,
        metavar="FILE",
        help=f"the baseline to compare against (default {_BASELINE})",
    )
    check.add_argument("--root", metavar="DIR", help=_ROOT_HELP)
    check.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        metavar="X",
        help="how much a site's syncs per step may grow before it fails (default 0)",
    )
    _format_options(check, "also print each regression as: " + FORMAT_HELP)
    show = sub.add_parser("report", help="show a saved report as text, JSON or HTML")
    show.add_argument("report", metavar="REPORT.json")
    show.add_argument(
        "--format",
        choices=_SHOWN,
        default="text",
        help="text (the console report, the default), json, or html (one self-contained page)",
    )
    show.add_argument("-o", "--out", metavar="FILE", help="write to FILE instead of stdout")
    diff = sub.add_parser(
        "diff", help="what report B adds over report A (exit 1 when B has new sites)"
    )
    diff.add_argument("a", metavar="A.json")
    diff.add_argument("b", metavar="B.json")
    diff.add_argument("--root", metavar="DIR", help=_ROOT_HELP)
    merge = sub.add_parser(
        "merge", help="merge the per-rank reports of a distributed run (offline, no collective)"
    )
    merge.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT.json",
        help="the ranks' reports, or a quoted glob such as 'bg.rank*.json'",
    )
    merge.add_argument("-o", "--out", metavar="FILE", help="write the merged report as JSON")
    merge.add_argument(
        "--format", choices=_SHOWN, default="text", help="what goes to stdout (default text)"
    )
    return parser


def _options(ns: argparse.Namespace) -> dict[str, object]:
    """The guard options given on the command line (the followed children get them too)."""
    names = ("policy", "engine", "warmup_steps", "allow", "max_syncs_per_step")
    return {name: getattr(ns, name) for name in names}


def _finish(
    guard: Guard,
    ns: argparse.Namespace,
    code: int,
    probe: follow.RankProbe | None = None,
    started: float = 0.0,
) -> int:
    report = guard.report
    world = rank_reports.world_size()
    if probe is not None:  # the process group may be gone by now: the steps saw the rank
        probe(guard.steps)
        world = max(world, probe.world)
        if report.rank is None and probe.rank is not None:
            report = replace(report, rank=probe.rank)
    # Under torchrun rank 0 prints the report, the others one line each (their files hold it).
    first = world <= 1 or not report.rank
    if first:
        print(report, file=sys.stderr)
    if ns.out:
        path = rank_reports.rank_path(ns.out, rank=report.rank or 0, world=world)
        try:
            follow.save(report, path)
        except OSError as err:
            raise BarrierGuardError(f"{ns.out}: {err.strerror or err}") from err
        who = f"rank {report.rank} " if world > 1 and report.rank is not None else ""
        print(f"barrierguard: {who}report written to {_shown(path)}", file=sys.stderr)
        if world > 1 and not report.rank:
            _say_rank_files(ns.out, world, started)
    if first:
        if (text := ci_text(report, ns.format)) is not None:
            gate.write(ns.format_out, text, f"{ns.format} output")
        if ns.html:
            gate.write(ns.html, html.render(report), "HTML report")
    return EXIT_POLICY if report.policy == "error" and not report.ok else code


def _shown(path: str) -> str:
    """``path`` as the console shows it: relative to the current directory when under it."""
    here = os.getcwd()
    return os.path.relpath(path, here) if path.startswith(here + os.sep) else path


def _say_rank_files(out: str, world: int, started: float) -> None:
    """Rank 0's line on the rank files: those written by now, and those missing."""
    found = follow.wait_for_ranks(out, world, since=started, timeout=RANK_FILES_WAIT_S)
    text = (
        f"barrierguard: {len(found)} of {world} rank reports written "
        f"({', '.join(map(_shown, found.values())) or 'none'})"
    )
    if missing := [str(r) for r in range(world) if r not in found]:
        text += (
            f"; none yet from rank {', '.join(missing)} (a rank still running, or "
            "one that barrierguard did not follow: see docs/distributed.md)"
        )
    pattern = _shown(rank_reports.rank_path(out, rank="*", world=world))
    print(f"{text}; merge them with barrierguard merge '{pattern}'", file=sys.stderr)


def _find_module(name: str) -> str | None:
    """Where ``run -m name`` finds its module (its file), like ``python -m``."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:  # a parent package missing, a bad name
        raise BarrierGuardError(f"run -m {name}: no module named {name!r} ({err})") from err
    if spec is None:
        raise BarrierGuardError(f"run -m {name}: no module named {name!r}")
    return spec.origin


def _run(ns: argparse.Namespace) -> int:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if ns.module:  # as python -m: the directory it was started in comes first
            sys.path.insert(0, os.getcwd())
            argv = [_find_module(ns.module) or ns.module, *ns.target]
        else:
            if not ns.target:
                raise BarrierGuardError("run: expected a script (script.py [args]) or -m module")
            if not os.path.isfile(ns.target[0]):
                raise BarrierGuardError(f"run: can't open script {ns.target[0]!r}: no such file")
            argv = list(ns.target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        if ns.out:  # the script may change directory
            ns.out = os.path.abspath(ns.out)
        job = follow.settings(
            {**_options(ns), "out": ns.out}, None if ns.module else argv[0], ns.module, ns.target
        )
        started = time.time() - 1.0  # file times may be coarser than the clock
        # Started before the script runs: an engine that cannot run here is a usage error.
        guard, probe = follow.watched({**_options(ns), "capture_probe": ns.capture_probe})
    except BaseException:
        sys.path[:] = saved_path
        raise
    sys.argv = argv
    code = 0
    try:
        with follow.following(job):
            try:
                if ns.module:
                    runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
                else:  # an absolute path, as `python train.py` gives; argv[0] stays as typed
                    runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")
            except BaseException:  # restore everything; the script's exception is the news
                guard.abandon()
                raise
            guard.stop()
    except SystemExit as exc:
        if isinstance(exc.code, int | None):
            code = exc.code or 0
        else:  # as python does: printed, status 1
            print(exc.code, file=sys.stderr)
            code = 1
    except (Exception, KeyboardInterrupt) as exc:
        traceback.print_exc()
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        code = EXIT_POLICY if isinstance(exc, SyncError) else code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return _finish(guard, ns, code, probe, started)


def _demo(ns: argparse.Namespace) -> int:
    import torch

    from barrierguard.cli.demo import train

    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise BarrierGuardError(f"demo --device {device!r}: expected auto, cpu or cuda")
    if ns.policy is None and not os.environ.get("BARRIERGUARD_POLICY"):
        ns.policy = "record"  # the demo's point is the report, not a warning per site
    guard: Guard = watch(**_options(ns))
    code = 0
    try:
        with guard:
            train(device, steps=ns.steps)
    except SyncError:
        traceback.print_exc()
        code = EXIT_POLICY
    return _finish(guard, ns, code)


def _split_module(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Put ``--`` after ``run ... -m MODULE`` so the module's own options pass through."""
    if not argv or argv[0] != "run":
        return argv
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    takes_value = {o for a in sub.choices["run"]._actions if a.nargs != 0 for o in a.option_strings}
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "-m" and i + 1 < len(argv):
            return [*argv[: i + 2], "--", *argv[i + 2 :]]
        if not token.startswith("-"):
            return argv
        i += 2 if token in takes_value else 1
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``barrierguard`` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    ns = parser.parse_args(_split_module(args, parser))
    if getattr(ns, "target", None) and ns.target[0] == "--":
        ns.target = ns.target[1:]
    try:
        return {"run": _run, "demo": _demo}.get(ns.command, gate.dispatch)(ns)
    except BarrierGuardError as err:
        print(f"barrierguard: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
