"""Every benchmark says its question, its design and the command behind its committed result."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCH / "results"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))
LABELS = ("Question:", "Design:", "Reproduce:")


def _doc(path: Path) -> str:
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(path.read_text())) or ""
    # A shell script's header: its leading comment lines.
    lines = []
    for line in path.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return "\n".join(lines)


def _reproduce(path: Path) -> str:
    return _doc(path).partition("Reproduce:")[2]


@pytest.mark.parametrize("path", [*SCRIPTS, BENCH / "run_all.sh"], ids=lambda p: p.name)
def test_docstring_has_question_design_and_reproduce(path: Path) -> None:
    doc = _doc(path)
    where = [doc.find(label) for label in LABELS]
    assert all(w >= 0 for w in where), f"{path.name} lacks one of {LABELS}"
    assert where == sorted(where), f"{path.name}: {LABELS} out of order"
    assert f"benchmarks/{path.name}" in _reproduce(path)


def test_every_committed_result_has_a_command_that_reproduces_it() -> None:
    named: set[str] = set()
    for path in [*SCRIPTS, BENCH / "run_all.sh"]:
        named |= set(re.findall(r"benchmarks/results/([\w./-]+)", _reproduce(path)))
    folders = {n.rstrip("/") for n in named if (RESULTS / n).is_dir()}  # run_all.sh's
    missing = []
    for path in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        rel = path.relative_to(RESULTS).as_posix()
        if rel in named or (rel.endswith(".txt") and rel[:-4] + ".json" in named):
            continue
        if any(rel.startswith(f"{folder}/examples/") for folder in folders):
            continue
        if any(n.endswith("/") and rel.startswith(n) for n in named):  # a folder of results
            continue
        missing.append(rel)
    assert not missing, f"results no benchmark docstring reproduces: {missing}"
