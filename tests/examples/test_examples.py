"""The examples run (short settings) under ``barrierguard run``; the Lightning example logs
through MetricBuffer what ``self.log(on_epoch=True)`` logs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _examples_helpers import EXAMPLES, load_example
from barrierguard import Report
from barrierguard.cli.main import main


@pytest.mark.parametrize("name", ["plain_loop.py", "fixed_loop.py"])
def test_example_runs(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    code = main(
        [
            "run",
            "--policy",
            "record",
            "--out",
            str(out),
            str(EXAMPLES / name),
            "--steps",
            "4",
            "--batch",
            "8",
        ]
    )
    assert code == 0
    assert "mean loss" in capsys.readouterr().out
    assert out.exists()


_LIGHTNING_SMALL = [
    "--epochs",
    "2",
    "--batches",
    "4",
    "--batch",
    "8",
    "--width",
    "16",
    "--depth",
    "1",
]
_HF_SMALL = ["--steps", "8", "--batch", "2", "--length", "32", "--layers", "1", "--width", "64"]


@pytest.mark.parametrize(
    ("name", "small", "allow", "mechanisms"),
    [
        ("lightning_fit.py", _LIGHTNING_SMALL, [], {"prog_bar"}),
        (
            "hf_fit.py",
            _HF_SMALL,
            ["--allow", "mechanism:hf_logging"],
            {"packed_sequence_check", "loss_nan_filter", "send_to_device"},
        ),
    ],
)
def test_framework_fits_pass_the_error_policy_once_hinted(
    name: str,
    small: list[str],
    allow: list[str],
    mechanisms: set[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers" if name == "hf_fit.py" else "lightning")
    default = tmp_path / "default.json"
    argv = ["run", "--policy", "record", *allow, "--out", str(default), str(EXAMPLES / name)]
    assert main([*argv, *small]) == 0
    before = Report.load(default)
    assert before.violations  # the default fit would break the error policy
    found = {m.split(" (", 1)[0] for s in before.sites if s.step_count for m, _ in s.mechanisms}
    assert mechanisms <= found
    hinted = tmp_path / "hinted.json"
    argv = ["run", "--policy", "error", *allow, "--out", str(hinted), str(EXAMPLES / name)]
    assert main([*argv, *small, "--hinted"]) == 0
    report = Report.load(hinted)
    assert report.steps > 0 and not [s for s in report.sites if s.step_count and not s.allowed]
    capsys.readouterr()


LIGHTNING_ARGV = ["--epochs", "2", "--steps", "5", "--batch", "16", "--width", "16"]


def test_lightning_example_logs_what_self_log_logs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("lightning_metric_buffer", monkeypatch, "cpu")
    buffered = example.main([*LIGHTNING_ARGV, "--logging", "buffer"])
    logged = example.main([*LIGHTNING_ARGV, "--logging", "self_log"])
    assert set(buffered) == {"train/loss", "train/acc", "train/loss_max"}
    # Weighted by batch size (the last batch is short): MetricBuffer in float64, Lightning in
    # float32.
    assert buffered == pytest.approx(logged, rel=1e-5)
    assert "last epoch (buffer): train/acc" in capsys.readouterr().out


def test_lightning_example_checkpoint_keeps_the_running_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    example = load_example("lightning_metric_buffer", monkeypatch, "cpu")
    model = example.Classifier(width=8)
    for loss, acc, n in ((1.0, 0.5, 4), (3.0, 0.25, 12)):
        values = {"train/loss": torch.tensor(loss), "train/acc": torch.tensor(acc)}
        model.train_metrics.update({**values, "train/loss_max": torch.tensor(loss)}, n=n)
    checkpoint: dict[str, object] = {}
    model.on_save_checkpoint(checkpoint)
    resumed = example.Classifier(width=8)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.train_metrics.compute() == pytest.approx(
        {"train/loss": 2.5, "train/acc": 0.3125, "train/loss_max": 3.0}
    )
    with pytest.raises(ValueError, match="logging='item'"):
        example.Classifier(logging="item")
