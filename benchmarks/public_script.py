"""Run PyTorch's word_language_model example under barrierguard, on synthetic text.

The example's code is not part of this repository: point ``--example`` at a
folder holding its ``main.py``, ``model.py`` and ``data.py`` (from
github.com/pytorch/examples, ``word_language_model/``). This script fetches
nothing; it writes tiny synthetic train/valid/test.txt files and runs the
unmodified ``main.py`` through ``barrierguard run``.

CPU (audit engine):

    PYTHONPATH=src python benchmarks/public_script.py --example /tmp/wlm --engine audit \
        --out /tmp/wlm_audit.json

GPU (CUDA engine; passes ``--cuda`` to the example):

    PYTHONPATH=src python benchmarks/public_script.py --example /tmp/wlm --engine cuda \
        --out /tmp/wlm_cuda.json

Then compare the two reports:

    python benchmarks/public_script.py --compare /tmp/wlm_audit.json /tmp/wlm_cuda.json
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

WORDS = [f"w{i}" for i in range(60)]


def synthetic_corpus(folder: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train.txt", 400), ("valid.txt", 60), ("test.txt", 60)):
        text = "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) for _ in range(lines)
        )
        (folder / name).write_text(text + "\n")


def run(example: Path, engine: str, out: str, extra: list[str]) -> int:
    main = example / "main.py"
    if not main.is_file():
        sys.exit(f"{main} not found: put word_language_model/{{main,model,data}}.py there")
    work = Path(tempfile.mkdtemp(prefix="wlm_"))
    synthetic_corpus(work / "data")
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
        out,
        str(main),
        "--data",
        str(work / "data"),
        "--epochs",
        "1",
        "--emsize",
        "32",
        "--nhid",
        "32",
        "--batch_size",
        "8",
        "--bptt",
        "10",
        "--log-interval",
        "20",
        "--save",
        str(work / "model.pt"),
        *extra,
    ]
    if engine == "cuda":
        cmd.append("--cuda")
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=work)


def summary(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for s in data["sites"]:
        key = (os.path.basename(s["file"]), s["line"])
        entry = out.setdefault(key, {"kinds": set(), "count": 0, "code": s["code"]})
        entry["kinds"].add(s["kind"] + (f"/{s['detail']}" if s["detail"] else ""))
        entry["count"] += s["count"]
    return out


def compare(a: str, b: str) -> None:
    sa, sb = summary(a), summary(b)
    print(f"| line | code | {Path(a).name} | {Path(b).name} |")
    print("|---|---|---|---|")
    for key in sorted(set(sa) | set(sb)):
        code = (sa.get(key) or sb[key])["code"]

        def cell(s: dict[tuple[str, int], dict[str, Any]], key: tuple[str, int] = key) -> str:
            e = s.get(key)
            return f"{','.join(sorted(e['kinds']))} x{e['count']}" if e else "-"

        print(f"| {key[0]}:{key[1]} | `{code}` | {cell(sa)} | {cell(sb)} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--example", type=Path)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--out", default="wlm_report.json")
    ap.add_argument("--compare", nargs=2, metavar="REPORT")
    args, extra = ap.parse_known_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.example is None:
        ap.error("--example DIR is required")
    out = os.path.abspath(args.out)
    code = run(args.example.resolve(), args.engine, out, extra)
    if Path(out).is_file():
        compare(out, out)
    sys.exit(code)


if __name__ == "__main__":
    main()
