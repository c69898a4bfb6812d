"""Does the CPU audit find the lines that synchronize on a GPU, in real public scripts?

Question:
    On public training scripts written for no profiler (``benchmarks/corpus/``:
    pytorch/examples' mnist, vae, word_language_model and mnist_forward_forward,
    and minGPT's adder), which lines synchronize on a GPU, and how many of them
    does the audit engine find on CPU, with how many false alarms? And does the
    CUDA engine report the same lines as raw CUDA sync-debug mode?

Design:
    Each script runs in its own process, in a fresh working folder, on small
    synthetic data through its own arguments (the transcriptions change data
    only; each file's header says what), three ways:

    * ``audit``: ``barrierguard run --engine audit --policy record`` with
      ``CUDA_VISIBLE_DEVICES=""``, so the script takes its CPU path;
    * ``cuda``: ``barrierguard run --engine cuda --policy record`` on the GPU;
    * ``raw``: no barrierguard: ``torch.cuda.set_sync_debug_mode("warn")``, an
      "always" filter for its warning, and a ``warnings.showwarning`` that walks
      the stack to the innermost frame in the script's folder and counts that
      line (this file, run as ``--raw-child``).

    A line is a (file, line) in the script's folder, whatever its kind, phase or
    count. The CUDA engine's lines are the truth for the audit: found (both),
    missed (only the GPU), false (only the audit). The CUDA engine and raw
    sync-debug mode are compared line for line; the CUDA engine also reports
    what sync-debug mode does not flag (``torch.cuda.synchronize()``, large
    pageable ``non_blocking`` copies), which the table names.

    Parts not run in this invocation are read from earlier results: the audit's
    from ``--audit-dir``, the GPU's from ``--truth-dir``.

Reproduce:
    On a CPU-only machine (the audit part; commit its files):
        PYTHONPATH=src python benchmarks/bench_agreement.py --parts audit \\
            --results benchmarks/results/agreement_audit_cpu/ \\
            --out benchmarks/results/agreement_cpu.json
    On a GPU machine (all three parts, a few minutes):
        PYTHONPATH=src python benchmarks/bench_agreement.py --parts audit,cuda,raw \\
            --results $OUT/agreement --out $OUT/agreement.json
    then commit ``$OUT/agreement/`` as ``benchmarks/results/h200/agreement/`` (the GPU
    truth files: each script's CUDA engine report, raw sync-debug lines, audit report and
    log), and ``$OUT/agreement.json`` as
    ``benchmarks/results/h200/agreement.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CORPUS = ROOT / "benchmarks" / "corpus"
SYNC_MESSAGE = "called a synchronizing CUDA operation"
MODES = ("audit", "cuda", "raw")
WORDS = [f"w{i}" for i in range(200)]


def make_corpus(folder: Path, seed: int = 0) -> None:
    """Tiny train/valid/test.txt files of synthetic words (word_language_model's data)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train.txt", 400), ("valid.txt", 60), ("test.txt", 60)):
        text = "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) for _ in range(lines)
        )
        (folder / name).write_text(text + "\n")


@dataclass(frozen=True)
class Script:
    """One public script: its folder under ``benchmarks/corpus``, entry file and arguments."""

    name: str
    folder: str
    main: str
    args: tuple[str, ...]
    text_data: bool = False  # word_language_model reads train/valid/test.txt from --data
    notes: tuple[str, ...] = field(default=())


SCRIPTS: tuple[Script, ...] = (
    Script(
        "mnist",
        "mnist",
        "main.py",
        (
            "--epochs",
            "2",
            "--batch-size",
            "32",
            "--test-batch-size",
            "64",
            "--log-interval",
            "2",
            "--save-model",
        ),
    ),
    Script("vae", "vae", "main.py", ("--epochs", "2", "--batch-size", "32", "--log-interval", "2")),
    Script(
        "word_language_model",
        "word_language_model",
        "main.py",
        (
            "--data",
            "{data}",
            "--epochs",
            "1",
            "--emsize",
            "32",
            "--nhid",
            "32",
            "--nlayers",
            "1",
            "--bptt",
            "10",
            "--batch_size",
            "8",
            "--log-interval",
            "20",
            "--save",
            "model.pt",
            "--accel",
        ),
        text_data=True,
    ),
    Script(
        "mnist_forward_forward",
        "mnist_forward_forward",
        "main.py",
        (
            "--epochs",
            "20",
            "--train_size",
            "128",
            "--test_size",
            "64",
            "--log-interval",
            "10",
            "--save_model",
        ),
    ),
    Script(
        "mingpt_adder",
        "mingpt",
        "adder.py",
        (
            "--trainer.max_iters=30",
            "--trainer.num_workers=0",
            "--trainer.batch_size=32",
            "--data.ndigit=1",
            "--system.work_dir=out",
        ),
    ),
)


def _command(script: Script, mode: str, out: Path, work: Path) -> tuple[list[str], dict[str, str]]:
    path = str(CORPUS / script.folder / script.main)
    args = [a.replace("{data}", str(work / "data")) for a in script.args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    if mode == "raw":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-child", str(out), path, *args]
    else:
        cmd = [sys.executable, "-m", "barrierguard", "run", "--engine", mode, "--policy",
               "record", "--out", str(out), path, *args]  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "2")  # several runs share the machine's cores
    if mode == "audit":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the script takes its CPU path
    return cmd, env


def run_one(script: Script, mode: str, results: Path, timeout: float) -> dict[str, Any]:
    """Run ``script`` under ``mode``; its report (or the raw counts) goes to ``results``."""
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{script.name}.{mode}.json"
    log = results / f"{script.name}.{mode}.log"
    with tempfile.TemporaryDirectory(prefix=f"agree-{script.name}-") as tmp:
        work = Path(tmp)
        if script.text_data:
            make_corpus(work / "data")
        cmd, env = _command(script, mode, out, work)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout
            )
            code, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, text = -1, f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
        wall = time.perf_counter() - t0
    log.write_text(" ".join(cmd) + "\n\n" + str(text))
    return {"script": script.name, "mode": mode, "exit": code, "wall_s": round(wall, 2)}


def lines_of(script: Script, mode: str, results: Path) -> dict[str, int] | None:
    """``{"file:line": count}`` of a finished run, files relative to the script's folder."""
    path = results / f"{script.name}.{mode}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    folder = str(CORPUS / script.folder) + os.sep
    found: dict[str, int] = {}
    if mode == "raw":
        items = [(r["file"], r["line"], r["count"]) for r in data["lines"]]
    else:
        items = [(s["file"], s["line"], s["count"]) for s in data["sites"]]
    for file, line, count in items:
        file = os.path.abspath(file)
        if file.startswith(folder):
            key = f"{os.path.relpath(file, folder)}:{line}"
            found[key] = found.get(key, 0) + count
    return found


def _code(script: Script, key: str) -> str:
    file, line = key.rsplit(":", 1)
    try:
        return (CORPUS / script.folder / file).read_text().splitlines()[int(line) - 1].strip()
    except (OSError, IndexError):
        return ""


def compare(script: Script, audit: dict[str, int] | None, cuda: dict[str, int] | None,
            raw: dict[str, int] | None) -> dict[str, Any]:  # fmt: skip
    """Found, missed and false lines of the audit vs the CUDA engine; CUDA vs raw."""
    row: dict[str, Any] = {"script": script.name}
    if audit is not None:
        row["audit_lines"] = sorted(audit, key=_sort_key)
    if cuda is not None:
        row["cuda_lines"] = sorted(cuda, key=_sort_key)
    if audit is not None and cuda is not None:
        a, c = set(audit), set(cuda)
        row["found"] = sorted(a & c, key=_sort_key)
        row["missed"] = {k: _code(script, k) for k in sorted(c - a, key=_sort_key)}
        row["false"] = {k: _code(script, k) for k in sorted(a - c, key=_sort_key)}
    if cuda is not None and raw is not None:
        c, r = set(cuda), set(raw)
        row["raw_lines"] = sorted(r, key=_sort_key)
        row["cuda_not_raw"] = {k: _code(script, k) for k in sorted(c - r, key=_sort_key)}
        row["raw_not_cuda"] = {k: _code(script, k) for k in sorted(r - c, key=_sort_key)}
    return row


def _sort_key(key: str) -> tuple[str, int]:
    file, line = key.rsplit(":", 1)
    return file, int(line)


def print_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the per-script table; return the totals."""
    head = f"{'script':<24}{'audit':>6}{'cuda':>6}{'found':>7}{'missed':>8}{'false':>7}{'raw':>6}{'cuda=raw':>10}"
    print(head)
    total = {"cuda": 0, "found": 0, "missed": 0, "false": 0, "cuda_vs_raw_differences": 0}
    for row in rows:
        cells = [f"{row['script']:<24}"]
        cells.append(f"{len(row['audit_lines']):>6}" if "audit_lines" in row else f"{'-':>6}")
        cells.append(f"{len(row['cuda_lines']):>6}" if "cuda_lines" in row else f"{'-':>6}")
        if "found" in row:
            cells.append(f"{len(row['found']):>7}{len(row['missed']):>8}{len(row['false']):>7}")
            total["cuda"] += len(row["cuda_lines"])
            total["found"] += len(row["found"])
            total["missed"] += len(row["missed"])
            total["false"] += len(row["false"])
        else:
            cells.append(f"{'-':>7}{'-':>8}{'-':>7}")
        if "raw_lines" in row:
            diff = len(row["cuda_not_raw"]) + len(row["raw_not_cuda"])
            total["cuda_vs_raw_differences"] += diff
            cells.append(f"{len(row['raw_lines']):>6}{'yes' if not diff else f'no ({diff})':>10}")
        else:
            cells.append(f"{'-':>6}{'-':>10}")
        print("".join(cells))
        for label in ("missed", "false", "cuda_not_raw", "raw_not_cuda"):
            for key, code in row.get(label, {}).items():
                print(f"    {label}: {key}  {code}")
    if total["cuda"]:
        share = total["found"] / total["cuda"]
        total["found_share"] = round(share, 4)
        print(
            f"audit found {total['found']} of {total['cuda']} GPU lines ({share:.1%}), "
            f"missed {total['missed']}, false alarms {total['false']}"
        )
    return total


def raw_child(out: str, script: str, argv: list[str]) -> None:
    """Run ``script`` under raw sync-debug mode, counting the script's lines that warn."""
    import runpy
    import warnings

    import torch

    folder = os.path.dirname(os.path.abspath(script)) + os.sep
    counts: dict[tuple[str, int], int] = {}
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if SYNC_MESSAGE not in str(message):
            shown(message, category, filename, lineno, *rest)
            return
        f = sys._getframe(1)
        while f is not None and not os.path.abspath(f.f_code.co_filename).startswith(folder):
            f = f.f_back  # type: ignore[assignment]
        if f is not None:
            key = (os.path.abspath(f.f_code.co_filename), f.f_lineno)
            counts[key] = counts.get(key, 0) + 1

    warnings.filterwarnings("always", message=SYNC_MESSAGE)
    warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
    warnings.showwarning = show
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        runpy.run_path(os.path.abspath(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    finally:
        torch.cuda.set_sync_debug_mode(0)
        lines = [{"file": f, "line": n, "count": c} for (f, n), c in sorted(counts.items())]
        Path(out).write_text(json.dumps({"mode": "raw", "lines": lines}, indent=1) + "\n")
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="audit", help="comma-separated: audit,cuda,raw")
    parser.add_argument("--scripts", default="", help="comma-separated names (default: all)")
    parser.add_argument("--results", type=Path, help="where this run's files go")
    parser.add_argument(
        "--audit-dir", type=Path, default=ROOT / "benchmarks/results/agreement_audit_cpu"
    )
    parser.add_argument(
        "--truth-dir", type=Path, default=ROOT / "benchmarks/results/h200/agreement"
    )
    parser.add_argument("--out", type=Path, help="the summary JSON")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--jobs", type=int, default=4, help="runs at once")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--raw-child"]:
        raw_child(argv[1], argv[2], argv[3:])
        return 0
    ns = parser.parse_args(argv)
    parts = [p for p in ns.parts.split(",") if p]
    bad = [p for p in parts if p not in MODES]
    if bad:
        parser.error(f"--parts: unknown {bad}; choose from {', '.join(MODES)}")
    chosen = [s for s in SCRIPTS if not ns.scripts or s.name in ns.scripts.split(",")]
    env_out = os.environ.get("OUT")
    results = (ns.results or (Path(env_out) / "agreement" if env_out else ns.audit_dir)).resolve()
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, ns.jobs)) as pool:
        futures = [
            pool.submit(run_one, s, mode, results, ns.timeout) for s in chosen for mode in parts
        ]
        for fut in concurrent.futures.as_completed(futures):
            run = fut.result()
            runs.append(run)
            print(f"ran {run['script']:<24} {run['mode']:<6} exit {run['exit']:>3}  "
                  f"{run['wall_s']:6.1f} s", flush=True)  # fmt: skip
    rows = []
    for s in chosen:
        got = {
            mode: lines_of(s, mode, results if mode in parts else
                           (ns.audit_dir if mode == "audit" else ns.truth_dir))
            for mode in MODES
        }  # fmt: skip
        rows.append(compare(s, got["audit"], got["cuda"], got["raw"]))
    print()
    total = print_table(rows)
    summary = {
        "parts": parts,
        "wall_s": round(time.perf_counter() - t0, 1),
        "runs": sorted(runs, key=lambda r: (r["script"], r["mode"])),
        "scripts": rows,
        "total": total,
        "environment": _environment(),
    }
    out = ns.out or results / "summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out}")
    failed = [r for r in runs if r["exit"] != 0]
    return 1 if failed else 0


def _environment() -> dict[str, str]:
    import platform

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


if __name__ == "__main__":
    sys.exit(main())
