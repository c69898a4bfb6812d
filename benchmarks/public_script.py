"""What do the engines report on a public training script that nobody wrote for them?

Question:
    Run unmodified, PyTorch's own ``word_language_model`` example (an LSTM
    language model): which lines does each engine report as syncs, and do the
    CUDA engine on a GPU and the audit engine on CPU agree?

Design:
    The script runs under ``barrierguard run --engine ENGINE --policy record``
    for one epoch of small synthetic text (200 words; no download), an LSTM of
    1 layer of 32, bptt 10, batch 8; the example's own ``--cuda`` flag is passed
    with the CUDA engine. Nothing is fetched here: put the example's
    ``main.py``, ``model.py`` and ``data.py`` (pytorch/examples
    ``word_language_model``) in a folder and pass it with ``--example``. The
    report's sites are printed; ``--compare A.json B.json`` prints which sites
    two reports share.

Reproduce:
    PYTHONPATH=src python benchmarks/public_script.py --example WLM --engine cuda \
        --out benchmarks/results/h200/public_script_cuda.json
    PYTHONPATH=src python benchmarks/public_script.py --example WLM --engine audit \
        --out benchmarks/results/public_script_audit_cpu.json

    The first on a GPU machine, the second on a CPU-only one. The committed
    reports ran on ``main.py`` at commit ``cd01f930``, ``model.py`` at
    ``001d4932`` and ``data.py`` at ``6d08877a``, transcribed with comments
    trimmed: their line numbers are those of that transcription, not of the
    upstream files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORDS = [f"w{i}" for i in range(200)]


def make_corpus(folder: Path, seed: int = 0) -> None:
    """Tiny train/valid/test.txt files of synthetic words."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train.txt", 400), ("valid.txt", 60), ("test.txt", 60)):
        text = "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) for _ in range(lines)
        )
        (folder / name).write_text(text + "\n")


def run(example: Path, engine: str, out: Path, work: Path) -> int:
    data = work / "data"
    make_corpus(data)
    src = Path(__file__).resolve().parents[1] / "src"
    cmd = [
        sys.executable,
        "-m",
        "barrierguard",
        "run",
        "--engine",
        engine,
        "--policy",
        "record",
        "--out",
        str(out),
        str(example / "main.py"),
        "--data",
        str(data),
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
        str(work / "model.pt"),
    ]
    if engine == "cuda":
        cmd.append("--cuda")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
    # Newer torch loads weights only by default; the example saves a whole model.
    env.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    print("$", " ".join(cmd))
    return subprocess.run(cmd, env=env, check=False).returncode


def sites(path: Path) -> list[dict[str, Any]]:
    report = json.loads(path.read_text())
    return [
        {
            "where": f"{os.path.basename(s['file'])}:{s['line']}",
            "kind": s["kind"],
            "detail": s.get("detail", ""),
            "origin": s["origin"],
            "count": s["count"],
            "code": s["code"],
        }
        for s in report["sites"]
    ]


def summarise(path: Path) -> None:
    print(f"\n## {path}")
    for s in sorted(sites(path), key=lambda s: (s["where"], s["kind"])):
        print(f"  {s['where']:14s} {s['kind']:10s} {s['detail']:12s} x{s['count']:<5d} {s['code']}")


def compare(a: Path, b: Path) -> None:
    left = {(s["where"], s["kind"]) for s in sites(a)}
    right = {(s["where"], s["kind"]) for s in sites(b)}
    print(f"both: {sorted(left & right)}")
    print(f"only {a.name}: {sorted(left - right)}")
    print(f"only {b.name}: {sorted(right - left)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--example", type=Path, help="folder with main.py, model.py, data.py")
    ap.add_argument("--engine", default="audit", choices=["audit", "cuda", "auto"])
    ap.add_argument("--out", type=Path, default=Path("wlm_report.json"))
    ap.add_argument("--compare", nargs=2, type=Path, metavar="REPORT")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.example is None or not (args.example / "main.py").is_file():
        ap.error("--example must name a folder holding the example's main.py")
    with tempfile.TemporaryDirectory() as tmp:
        code = run(args.example.resolve(), args.engine, args.out.resolve(), Path(tmp))
    if args.out.exists():
        summarise(args.out)
    sys.exit(code)


if __name__ == "__main__":
    main()
