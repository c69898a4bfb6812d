"""The audit engine on CPU against the corpus annotations (the GPU's verdicts)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import barrierguard
from corpus import cases

CORPUS = os.path.abspath(cases.__file__)

# Lines the audit cannot reproduce without a GPU (docs/audit.md says why).
KNOWN_MISSES = {
    "torch.cuda.current_stream().synchronize()",
    'd["event"].synchronize()',
    "scaler.step(opt)",
}


def _verdicts() -> tuple[dict[int, tuple[str, str] | None], dict[int, set[tuple[str, str]]]]:
    with barrierguard.watch(engine="audit", policy="record") as guard:
        # Built under the guard, like a script run with `barrierguard run`:
        # the audit sees which tensors go to the training device.
        d = cases.prepare("cpu")
        d["cuda_sync"] = True
        cases.run_all(d)  # warm-up, as on the GPU
        guard.step()
        cases.run_all(d)
    found: dict[int, set[tuple[str, str]]] = {}
    for site in guard.report.sites:
        if site.file == CORPUS and site.step_count > 0:
            found.setdefault(site.line, set()).add((site.kind, site.origin))
    return cases.annotations(), found


def _code(line: int) -> str:
    return Path(CORPUS).read_text().splitlines()[line - 1].split("#")[0].strip()


def test_corpus_agreement_at_least_95_percent() -> None:
    expected, found = _verdicts()
    agree = [
        line
        for line, want in expected.items()
        if (want is None and line not in found) or (want is not None and found.get(line) == {want})
    ]
    disagree = {
        line: (_code(line), expected[line], found.get(line))
        for line in expected
        if line not in agree
    }
    ratio = len(agree) / len(expected)
    assert ratio >= 0.95, f"agreement {ratio:.1%}; disagreements: {disagree}"
    assert {code for code, _, _ in disagree.values()} <= KNOWN_MISSES, disagree


def test_no_quiet_or_host_line_is_flagged() -> None:
    expected, found = _verdicts()
    noisy = {line: got for line, got in found.items() if expected.get(line) is None}
    assert not noisy, {line: (_code(line), got) for line, got in noisy.items()}


def test_corpus_leaves_no_mode_behind() -> None:
    before = torch._C._len_torch_function_stack()
    _verdicts()
    assert torch._C._len_torch_function_stack() == before
