"""The Hugging Face TrainerCallback on a real GPU: framework syncs named with their fixes.

Run on a GPU machine:
    PYTHONPATH=src python -m pytest -q -s tests/integrations/test_hf_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import barrierguard
from _runif import run_if
from barrierguard import Report

transformers = pytest.importorskip("transformers")
from _hf_helpers import HINTED, trainer  # noqa: E402  (needs transformers)

# A GPU fit with the Trainer's own defaults (pinned loader, blocking batch copy).
ON_GPU = {"use_cpu": False, "dataloader_pin_memory": True}
STEPS = 8


def _by_mechanism(report: Report) -> dict[str, barrierguard.Site]:
    return {name.split(" (", 1)[0]: s for s in report.sites for name, _ in s.mechanisms}


@run_if(min_cuda_gpus=1)
def test_default_fit_names_every_framework_sync_with_its_fix(tmp_path: Path) -> None:
    cb = barrierguard.HFBarrierGuard(
        engine="cuda", policy="record", print_report=False, save_report=False, memory=False
    )
    trainer(tmp_path, [cb], steps=STEPS, **ON_GPU).train()
    report = cb.report
    assert report.engine == "cuda" and report.steps == STEPS, str(report)
    by_mechanism = _by_mechanism(report)
    assert {"send_to_device", "packed_sequence_check", "loss_nan_filter", "hf_logging"} <= set(
        by_mechanism
    ), str(report)
    # Every site behind a framework line carries its mechanism, its cause and a fix.
    framework = [s for s in report.sites if s.framework_line is not None]
    assert framework, str(report)
    for site in framework:
        assert site.mechanisms and site.cause and site.fix, site
    assert "logging_nan_inf_filter=False" in by_mechanism["loss_nan_filter"].fix
    assert "non_blocking" in by_mechanism["send_to_device"].fix
    assert by_mechanism["loss_nan_filter"].step_count > 0


@run_if(min_cuda_gpus=1)
def test_fit_configured_by_the_hints_passes_the_error_policy(tmp_path: Path) -> None:
    cb = barrierguard.HFBarrierGuard(
        engine="cuda",
        policy="error",
        allow=["mechanism:hf_logging"],
        print_report=False,
        save_report=False,
        memory=False,
    )
    trainer(tmp_path, [cb], steps=STEPS, **ON_GPU, **HINTED).train()
    report = cb.report
    assert report.ok and report.steps == STEPS, str(report)
    assert [s for s in report.sites if s.step_count and not s.allowed] == [], str(report)
    left = _by_mechanism(report)
    for gone in ("loss_nan_filter", "packed_sequence_check", "send_to_device"):
        assert gone not in left, str(report)
