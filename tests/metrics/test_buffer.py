"""MetricBuffer on CPU: each reduction against a float64 reference, errors, state, no syncs."""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

# Imported at collection: torchmetrics adds warnings filters on first import, which the
# global-state fixture would otherwise see as a leak of the first test to import it.
from torchmetrics.classification import BinaryAccuracy, BinaryF1Score

import barrierguard
from barrierguard import MetricBuffer
from barrierguard._errors import BarrierGuardError
from barrierguard.metrics.buffer import (
    BLOCK_STEPS,
    NAN_POLICIES,
    REDUCTIONS,
    WEIGHTABLE,
)

# Same reason: the first meta-device stack imports sympy, which adds a warnings filter.
with contextlib.suppress(RuntimeError):
    torch.stack([torch.ones(()), torch.ones((), device="meta")])

ROOT = Path(__file__).resolve().parents[2]
RUNNING = tuple(r for r in REDUCTIONS if r != "cat")
# Tensor calls that read a device value on the host: update() must make none of them.
TRANSFERS = frozenset(
    {"item", "__bool__", "cpu", "tolist", "__float__", "__int__", "numpy", "__index__"}
)


def _data(bad: bool, steps: int = 60) -> tuple[list[float], list[int]]:
    rng = np.random.default_rng(1234)
    xs = rng.normal(loc=0.5, scale=3.0, size=steps).tolist()
    ws = rng.integers(1, 9, size=steps).tolist()
    if bad:
        xs[7] = math.nan
        xs[13] = math.inf
        xs[29] = -math.inf
    return xs, ws


def _reference(red: str, weighted: bool, nan: str, xs: list[float], ws: list[int]) -> float:
    """The float64 answer, computed with numpy only."""
    with np.errstate(invalid="ignore"):
        return _reference64(red, weighted, nan, xs, ws)


def _reference64(red: str, weighted: bool, nan: str, xs: list[float], ws: list[int]) -> float:
    x = np.asarray(xs, dtype=np.float64)
    w = np.asarray(ws, dtype=np.float64) if weighted else np.ones_like(x)
    if nan == "ignore":
        keep = np.isfinite(x)
        x, w = x[keep], w[keep]
    if red == "mean":
        return float((w * x).sum() / w.sum()) if w.sum() else math.nan
    if red == "sum":
        return float((w * x).sum())
    if red == "count":
        return float(w.sum())
    if x.size == 0:
        return math.nan
    if red == "min":
        return float(np.min(x))  # np.min propagates NaN, as the buffer does
    if red == "max":
        return float(np.max(x))
    return float(x[-1])  # last


def _close(got: float, want: float) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return got == want or math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12)


def _cases() -> list[Any]:
    cases = []
    for red in RUNNING:
        for weighted in (False, True) if red in WEIGHTABLE else (False,):
            for nan in NAN_POLICIES:
                for bad in (False, True):
                    cases.append(
                        pytest.param(
                            red,
                            weighted,
                            nan,
                            bad,
                            id=f"{red}-w{int(weighted)}-{nan}-bad{int(bad)}",
                        )
                    )
    return cases


def _feed(buf: MetricBuffer, xs: list[float], ws: list[int], inputs: str, weights: str) -> None:
    for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
        as_tensor = inputs == "tensor" or (inputs == "mixed" and i % 3 != 0)
        value: float | torch.Tensor = torch.tensor(x, dtype=torch.float64) if as_tensor else x
        n: int | torch.Tensor = torch.tensor(w) if weights == "tensor" else w
        buf.update(m=value, n=n)


@pytest.mark.parametrize(("red", "weighted", "nan", "bad"), _cases())
@pytest.mark.parametrize("inputs", ["tensor", "python", "mixed"])
@pytest.mark.parametrize("weights", ["int", "tensor"])
def test_reduction_matches_float64_reference(
    red: str, weighted: bool, nan: str, bad: bool, inputs: str, weights: str
) -> None:
    xs, ws = _data(bad)
    spec: Any = (red, "weighted") if weighted else red
    buf = MetricBuffer({"m": spec}, nan=nan)
    _feed(buf, xs, ws, inputs, weights)
    if nan == "error" and bad:
        with pytest.raises(BarrierGuardError, match=r"'m'.*NaN or inf"):
            buf.compute()
        return
    got = buf.compute()["m"]
    want = _reference(red, weighted, nan, xs, ws)
    assert isinstance(got, float)
    assert _close(got, want), (got, want)


@pytest.mark.parametrize("red", RUNNING)
def test_float32_and_bool_inputs_accumulate_in_float64(red: str) -> None:
    xs, _ = _data(False, steps=1000)
    buf = MetricBuffer({"m": red, "flag": "mean"})
    for x in xs:
        buf.update(m=torch.tensor(x, dtype=torch.float32), flag=torch.tensor(x > 0))
    out = buf.compute()
    x32 = [float(np.float32(x)) for x in xs]
    assert _close(out["m"], _reference(red, False, "propagate", x32, [1] * len(xs)))
    assert out["flag"] == pytest.approx(np.mean(np.asarray(xs) > 0), abs=1e-12)


def test_empty_metrics_have_neutral_values() -> None:
    buf = MetricBuffer({r: r for r in REDUCTIONS})
    out = buf.compute()
    assert out["sum"] == 0.0 and out["count"] == 0.0
    assert all(math.isnan(out[r]) for r in ("mean", "min", "max", "last"))
    assert out["cat"].numel() == 0


def test_last_follows_call_order_across_tensors_and_numbers() -> None:
    buf = MetricBuffer({"lr": "last"}, nan="ignore")
    buf.update(lr=torch.tensor(0.1))
    buf.update(lr=0.2)
    assert buf.compute()["lr"] == 0.2
    buf.update(lr=torch.tensor(math.nan))  # ignored: the host value stays the last one
    assert buf.compute()["lr"] == 0.2
    buf.update(lr=torch.tensor(0.3, dtype=torch.float64))
    assert buf.compute()["lr"] == 0.3


def test_cat_keeps_values_in_order_on_the_device() -> None:
    buf = MetricBuffer({"per_sample": "cat", "step_loss": "cat"})
    chunks = [torch.arange(4.0) + 10 * i for i in range(3)]
    for i, chunk in enumerate(chunks):
        buf.update(per_sample=chunk, step_loss=torch.tensor(float(i)))
        chunk.add_(100)  # a later in-place change by the caller must not leak in
    out = buf.compute()
    assert torch.equal(out["per_sample"], torch.cat([torch.arange(4.0) + 10 * i for i in range(3)]))
    assert torch.equal(out["step_loss"], torch.tensor([0.0, 1.0, 2.0]))
    buf.update(step_loss=3.0)
    assert out["step_loss"].dtype == torch.float32
    assert buf.compute()["step_loss"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_cat_with_nan_error_raises_at_compute() -> None:
    buf = MetricBuffer({"v": "cat"}, nan="error")
    buf.update(v=torch.tensor([1.0, math.nan]))
    with pytest.raises(BarrierGuardError, match="'v'"):
        buf.compute()


def test_nan_error_names_every_bad_metric_and_update_does_not_raise() -> None:
    buf = MetricBuffer({"loss": "mean", "gn": "max", "ok": "sum"}, nan="error")
    buf.update(loss=torch.tensor(math.nan), gn=torch.tensor(math.inf), ok=torch.tensor(1.0))
    buf.update(loss=torch.tensor(1.0), gn=torch.tensor(2.0), ok=2.0)
    with pytest.raises(BarrierGuardError) as err:
        buf.compute()
    assert "'loss'" in str(err.value) and "'gn'" in str(err.value) and "'ok'" not in str(err.value)


def test_unknown_names_get_the_default_or_an_error() -> None:
    buf = MetricBuffer()
    buf.update(loss=torch.tensor(2.0), n=4)
    buf.update(loss=4.0, n=1)
    assert buf.compute() == {"loss": 3.0}
    assert buf.reductions == {"loss": "mean"}
    weighted = MetricBuffer(default=("mean", "weighted"))
    weighted.update(loss=torch.tensor(2.0), n=3)
    weighted.update(loss=4.0, n=1)
    assert weighted.compute() == {"loss": 2.5}
    strict = MetricBuffer({"loss": "mean"}, default=None)
    with pytest.raises(
        BarrierGuardError, match=r"update\(acc=\.\.\.\) names an unknown metric.*'loss'"
    ):
        strict.update(acc=1.0)


def test_values_mapping_for_names_that_are_not_identifiers() -> None:
    buf = MetricBuffer({"val/loss": "sum"})
    buf.update({"val/loss": torch.tensor(1.5)})
    buf.update({"val/loss": 1.0}, **{"val/loss": 2.0})
    assert buf.compute() == {"val/loss": 3.5}


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (lambda: MetricBuffer(nan="skip"), ["nan='skip'", "'propagate', 'ignore', 'error'"]),
        (lambda: MetricBuffer({"loss": "median"}), ["'median'", "'loss'", "'mean', 'sum'"]),
        (lambda: MetricBuffer({"loss": ("mean", "heavy")}), ["('mean', 'heavy')", "'weighted'"]),
        (
            lambda: MetricBuffer({"gn": ("max", "weighted")}),
            ["('max', 'weighted')", "'mean', 'sum', 'count'"],
        ),
        (lambda: MetricBuffer(default="avg"), ["'avg'", "'mean'"]),
        (lambda: MetricBuffer({"n": "sum"}), ["'n'", "other than 'n'"]),
        (lambda: MetricBuffer(metrics={"f1": object()}), ["'f1'", "torchmetrics Metric"]),
    ],
    ids=["nan", "reduction", "weight-word", "weighted-max", "default", "name-n", "not-a-metric"],
)
def test_bad_construction_names_the_value(make: Any, fragments: list[str]) -> None:
    with pytest.raises(BarrierGuardError) as err:
        make()
    for fragment in fragments:
        assert fragment in str(err.value)


def test_non_scalar_tensor_for_mean_is_an_error() -> None:
    buf = MetricBuffer({"loss": "mean"})
    with pytest.raises(BarrierGuardError) as err:
        buf.update(loss=torch.ones(4, 2))
    message = str(err.value)
    assert "loss=<tensor of shape (4, 2)" in message and "'mean'" in message and "'cat'" in message
    buf.update(loss=torch.ones(1))  # one element in any shape is a single value
    assert buf.compute() == {"loss": 1.0}


def test_mismatched_devices_are_an_error() -> None:
    buf = MetricBuffer({"loss": "mean", "acc": "mean"})
    buf.update(loss=torch.tensor(1.0))
    with pytest.raises(BarrierGuardError) as err:
        buf.update(acc=torch.tensor(1.0, device="meta"))
    assert "acc=<tensor of shape () on meta>" in str(
        err.value
    ) and "expected a tensor on cpu" in str(err.value)
    with pytest.raises(BarrierGuardError, match=r"n=<tensor of shape \(\) on meta>"):
        buf.update(loss=1.0, n=torch.tensor(2, device="meta"))
    fixed = MetricBuffer({"loss": "mean"}, device="meta")
    with pytest.raises(BarrierGuardError, match="on cpu"):
        fixed.update(loss=torch.tensor(1.0))


def test_other_bad_update_values() -> None:
    buf = MetricBuffer({"loss": ("mean", "weighted"), "v": "cat"})
    with pytest.raises(BarrierGuardError, match="loss='high'"):
        buf.update(loss="high")
    with pytest.raises(BarrierGuardError, match=r"n=<tensor of shape \(3,\)"):
        buf.update(loss=1.0, n=torch.ones(3))
    with pytest.raises(BarrierGuardError, match="n='8'"):
        buf.update(loss=1.0, n="8")  # type: ignore[arg-type]
    with pytest.raises(BarrierGuardError, match=r"complex"):
        buf.update(loss=torch.tensor(1 + 2j))
    buf.update(v=torch.ones(2, 3))
    with pytest.raises(BarrierGuardError, match=r"trailing shape \(3,\)"):
        buf.update(v=torch.ones(2, 4))


def _state_size(buf: MetricBuffer) -> tuple[int, int]:
    tensors = [t for t in _walk(buf.state_dict()) if isinstance(t, torch.Tensor)]
    return len(tensors), sum(t.numel() for t in tensors)


def _walk(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _walk(v)]
    if isinstance(obj, list | tuple):
        return [x for v in obj for x in _walk(v)]
    return [obj]


@pytest.mark.parametrize("nan", NAN_POLICIES)
def test_memory_is_bounded_for_running_reductions(nan: str) -> None:
    specs: dict[str, Any] = {r: r for r in RUNNING} | {"wmean": ("mean", "weighted")}
    buf = MetricBuffer(specs, nan=nan)
    logged: list[weakref.ref[torch.Tensor]] = []

    def step(i: int) -> None:
        x = torch.tensor(float(i % 7))
        logged.append(weakref.ref(x))
        buf.update(**{name: x for name in specs}, n=torch.tensor(i % 3 + 1))
        buf.update(**{name: float(i) for name in specs}, n=2)

    sizes = []
    for done, upto in ((0, 1), (1, BLOCK_STEPS), (BLOCK_STEPS, 10 * BLOCK_STEPS + 5)):
        for i in range(done, upto):
            step(i)
        sizes.append(_state_size(buf))
    assert sizes[0] == sizes[1] == sizes[2]
    assert sizes[0][0] == len(specs)  # one [a, w, bad] row per metric
    gc.collect()
    assert not any(ref() is not None for ref in logged)  # nothing logged is kept


def test_inputs_that_require_grad_do_not_build_a_graph() -> None:
    weight = torch.ones((), requires_grad=True)
    buf = MetricBuffer({"loss": "mean", "gn": "max", "lr": "last", "v": "cat"})
    for _ in range(3):
        loss = weight * 2
        buf.update(loss=loss, gn=loss, lr=loss, v=loss)
    state = buf.state_dict()
    assert not any(t.requires_grad for t in _walk(state) if isinstance(t, torch.Tensor))
    assert not buf.compute()["v"].requires_grad


def test_reset_keeps_registration_and_clears_values() -> None:
    buf = MetricBuffer({"loss": "mean", "best": "min", "v": "cat"})
    buf.update(loss=torch.tensor(5.0), best=torch.tensor(1.0), v=torch.ones(2))
    buf.update(loss=3.0, best=0.5)
    buf.reset()
    buf.update(loss=torch.tensor(2.0), best=torch.tensor(4.0), v=torch.zeros(1))
    out = buf.compute()
    assert out["loss"] == 2.0 and out["best"] == 4.0 and out["v"].tolist() == [0.0]


def test_state_dict_round_trip_through_torch_save() -> None:
    specs: dict[str, Any] = {
        "loss": ("mean", "weighted"),
        "tokens": ("sum", "weighted"),
        "steps": "count",
        "best": "min",
        "worst": "max",
        "lr": "last",
        "v": "cat",
    }
    full = MetricBuffer(specs, nan="ignore")
    first = MetricBuffer(specs, nan="ignore")
    xs, ws = _data(True, steps=40)
    for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
        value: Any = torch.tensor(x) if i % 2 else x
        batch = {name: value for name in specs if name != "v"}
        for buf in (full, first) if i < 20 else (full,):
            buf.update(**batch, v=torch.tensor([x, x]), n=w)
    blob = io.BytesIO()
    torch.save(first.state_dict(), blob)
    blob.seek(0)
    state = torch.load(blob, weights_only=False)
    assert isinstance(state["slots"]["loss"]["row"], torch.Tensor)
    resumed = MetricBuffer(specs, nan="ignore")
    resumed.load_state_dict(state)
    assert resumed.compute().keys() == first.compute().keys()
    for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
        if i >= 20:
            value = torch.tensor(x) if i % 2 else x
            resumed.update(
                **{name: value for name in specs if name != "v"}, v=torch.tensor([x, x]), n=w
            )
    want, got = full.compute(), resumed.compute()
    for name in specs:
        if name == "v":
            assert torch.equal(
                got[name],
                want[name],
            ) or torch.allclose(got[name], want[name], equal_nan=True)
        else:
            assert _close(got[name], want[name]), name


def test_load_state_dict_rejects_mismatches() -> None:
    buf = MetricBuffer({"loss": "mean"})
    buf.update(loss=1.0)
    state = buf.state_dict()
    with pytest.raises(BarrierGuardError, match=r"expected reduction 'sum' for 'loss'"):
        MetricBuffer({"loss": "sum"}).load_state_dict(state)
    with pytest.raises(BarrierGuardError, match="version=99"):
        MetricBuffer().load_state_dict({**state, "version": 99})


def test_torchmetrics_metric_alongside() -> None:
    gen = torch.Generator().manual_seed(0)
    preds = [torch.rand(16, generator=gen) for _ in range(5)]
    target = [torch.randint(0, 2, (16,), generator=gen) for _ in range(5)]
    reference = BinaryF1Score()
    buf = MetricBuffer(
        {"loss": "mean"},
        metrics={"f1": BinaryF1Score(validate_args=False), "acc": BinaryAccuracy()},
    )
    for p, t in zip(preds, target, strict=True):
        reference.update(p, t)
        buf.update(loss=torch.tensor(1.0), f1=(p, t), acc={"preds": p, "target": t})
    out = buf.compute()
    assert set(out) == {"loss", "f1", "acc"}
    assert torch.equal(out["f1"], reference.compute())
    resumed = MetricBuffer(
        {"loss": "mean"}, metrics={"f1": BinaryF1Score(), "acc": BinaryAccuracy()}
    )
    resumed.load_state_dict(buf.state_dict())
    again = resumed.compute()
    assert torch.equal(again["f1"], out["f1"]) and torch.equal(again["acc"], out["acc"])
    buf.reset()
    ones = (torch.ones(4), torch.ones(4, dtype=torch.long))
    buf.update(f1=ones, acc=ones)
    assert buf.compute()["f1"].item() == 1.0


class _RecordTransfers(TorchFunctionMode):
    """Records the host-reading Tensor calls made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in TRANSFERS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("nan", NAN_POLICIES)
def test_update_never_reads_a_tensor_and_compute_reads_once(nan: str) -> None:
    specs: dict[str, Any] = {
        "loss": ("mean", "weighted"),
        "acc": "mean",
        "tokens": ("sum", "weighted"),
        "total": "sum",
        "steps": ("count", "weighted"),
        "best": "min",
        "gn": "max",
        "lr": "last",
        "per_sample": "cat",
    }
    buf = MetricBuffer(specs, nan=nan)
    xs, ws = _data(False, steps=50)
    with _RecordTransfers() as during_update:
        for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
            value: Any = torch.tensor(x, dtype=torch.float64, requires_grad=True) if i % 4 else x
            n: Any = torch.tensor(w) if i % 2 else w
            buf.update(
                **{k: value for k in specs if k != "per_sample"}, per_sample=torch.ones(3), n=n
            )
            buf.update(later=torch.tensor(x))  # auto-registered
    assert during_update.calls == []
    with _RecordTransfers() as during_compute:
        out = buf.compute()
    assert during_compute.calls == ["tolist"]
    assert out["loss"] == pytest.approx(_reference("mean", True, nan, xs, ws), rel=1e-12)


def test_export_and_no_cuda_at_import() -> None:
    assert "MetricBuffer" in barrierguard.__all__
    code = "import barrierguard, torch, sys; assert not torch.cuda.is_initialized(); assert 'torchmetrics' not in sys.modules"
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


def test_benchmark_smoke_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_metrics.py"),
        *("--device", "cpu", "--steps", "50", "--repeats", "2", "--out", str(out)),
    ]
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,  # a bound on a hang, not a timing: the CI host may be loaded
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert result.returncode == 0, result.stderr
    import json

    data = json.loads(out.read_text())
    assert set(data["median_s"]) == {"nothing", "item", "buffer"}
    assert "| loop |" in result.stdout


@pytest.mark.parametrize("nan", ["propagate", "error"])
def test_alternating_sets_of_names_keep_every_value(nan: str) -> None:
    # Each set of names gets its own fast-path block; rows move between blocks.
    buf = MetricBuffer(
        {"loss": "mean", "best": "min", "lr": "last", "tok": ("sum", "weighted")}, nan=nan
    )
    loss, best, tok = [], [], []
    for i in range(30):
        x = float(i % 7) - 2.5
        t = torch.tensor(x, dtype=torch.float64)
        if i % 3 == 0:
            buf.update(loss=t, best=t, n=2)
        elif i % 3 == 1:
            buf.update(tok=t, loss=t, lr=t, n=torch.tensor(3))
            tok.append(3 * x)
        else:
            buf.update(lr=x, best=t, tok=t, n=1)
            tok.append(x)
        if i % 3 != 2:
            loss.append(x)
        if i % 3 != 1:
            best.append(x)
    out = buf.compute()
    assert out["loss"] == pytest.approx(sum(loss) / len(loss), rel=1e-12)
    assert out["best"] == min(best)
    assert out["tok"] == pytest.approx(sum(tok), rel=1e-12)
    assert out["lr"] == float(29 % 7) - 2.5


ALL_SPECS: dict[str, Any] = {
    "wmean": ("mean", "weighted"),
    "mean": "mean",
    "wsum": ("sum", "weighted"),
    "sum": "sum",
    "wcount": ("count", "weighted"),
    "count": "count",
    "min": "min",
    "max": "max",
    "last": "last",
}


def _spec_parts(spec: Any) -> tuple[str, bool]:
    return (spec[0], True) if isinstance(spec, tuple) else (spec, False)


def _check_all(buf: MetricBuffer, nan: str, xs: list[float], ws: list[int]) -> None:
    out = buf.compute()
    for name, spec in ALL_SPECS.items():
        red, weighted = _spec_parts(spec)
        want = _reference(red, weighted, nan, xs, ws)
        assert _close(out[name], want), (name, out[name], want)


@pytest.mark.parametrize("nan", NAN_POLICIES)
@pytest.mark.parametrize("weights", ["int", "tensor", "varying-int"])
@pytest.mark.parametrize("steps", [BLOCK_STEPS - 1, BLOCK_STEPS, BLOCK_STEPS + 1])
def test_flush_boundary_matches_reference(nan: str, weights: str, steps: int) -> None:
    xs, ws = _data(nan == "ignore", steps=steps)
    if weights == "int":
        ws = [4] * steps
    buf = MetricBuffer(ALL_SPECS, nan=nan)
    for x, w in zip(xs, ws, strict=True):
        t = torch.tensor(x, dtype=torch.float32 if x == 0.5 else torch.float64)
        n: Any = torch.tensor(w) if weights == "tensor" else w
        buf.update(**dict.fromkeys(ALL_SPECS, t), n=n)
    _check_all(buf, nan, xs, ws)


@pytest.mark.parametrize("nan", NAN_POLICIES)
def test_compute_mid_batch_then_more_steps(nan: str) -> None:
    xs, ws = _data(nan == "ignore", steps=3 * BLOCK_STEPS // 2)
    buf = MetricBuffer(ALL_SPECS, nan=nan)
    for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
        buf.update(**dict.fromkeys(ALL_SPECS, torch.tensor(x, dtype=torch.float64)), n=w)
        if i in (5, BLOCK_STEPS // 2, BLOCK_STEPS + 3):
            _check_all(buf, nan, xs[: i + 1], ws[: i + 1])
    _check_all(buf, nan, xs, ws)


def test_reset_drops_pending_values() -> None:
    buf = MetricBuffer(ALL_SPECS)
    for i in range(BLOCK_STEPS + 10):  # one flush, then 10 pending steps
        buf.update(**dict.fromkeys(ALL_SPECS, torch.tensor(float(i))), n=2)
    buf.reset()
    out = buf.compute()
    assert out["sum"] == 0.0 and out["count"] == 0.0 and math.isnan(out["last"])
    buf.update(**dict.fromkeys(ALL_SPECS, torch.tensor(3.0)), n=2)
    out = buf.compute()
    assert out["wmean"] == 3.0 and out["wcount"] == 2.0 and out["min"] == 3.0
    assert out["last"] == 3.0 and out["count"] == 1.0


def test_state_dict_includes_pending_values() -> None:
    xs, ws = _data(False, steps=BLOCK_STEPS + 7)
    buf = MetricBuffer(ALL_SPECS)
    for x, w in zip(xs, ws, strict=True):
        buf.update(**dict.fromkeys(ALL_SPECS, torch.tensor(x, dtype=torch.float64)), n=w)
    restored = MetricBuffer(ALL_SPECS)
    restored.load_state_dict(buf.state_dict())
    _check_all(restored, "propagate", xs, ws)
    _check_all(buf, "propagate", xs, ws)


@pytest.mark.parametrize("name", ["mean", "count", "min", "max", "last"])
def test_nan_error_for_a_value_still_pending(name: str) -> None:
    buf = MetricBuffer(ALL_SPECS, nan="error")
    for i in range(BLOCK_STEPS + 3):
        values = dict.fromkeys(ALL_SPECS, torch.tensor(float(i)))
        if i == BLOCK_STEPS + 1:
            values[name] = torch.tensor(math.nan)
        buf.update(**values)  # never raises: the value is never read on the host
    with pytest.raises(BarrierGuardError, match=rf"'{name}'.*NaN or inf"):
        buf.compute()


def test_last_keeps_call_order_between_pending_tensors_and_numbers() -> None:
    for nan in ("propagate", "ignore"):
        buf = MetricBuffer({"lr": "last", "loss": "mean"}, nan=nan)
        buf.update(lr=torch.tensor(0.1), loss=torch.tensor(1.0))
        buf.update(lr=torch.tensor(0.2), loss=torch.tensor(1.0))  # pending
        buf.update(lr=0.3, loss=torch.tensor(1.0))  # a number after pending tensors
        assert buf.compute()["lr"] == 0.3
        buf.update(lr=0.4, loss=torch.tensor(1.0))
        buf.update(lr=torch.tensor(math.nan), loss=torch.tensor(1.0))  # pending
        lr = buf.compute()["lr"]
        assert lr == 0.4 if nan == "ignore" else math.isnan(lr)


def test_mixed_tensors_and_numbers_in_one_call() -> None:
    buf = MetricBuffer({"loss": ("mean", "weighted"), "lr": "last", "best": "min"})
    for i in range(10):
        buf.update(loss=torch.tensor(float(i)), lr=0.1 * i, best=torch.tensor(5.0 - i), n=2)
    out = buf.compute()
    assert out == {"loss": 4.5, "lr": pytest.approx(0.9), "best": -4.0}


def test_a_tensor_changed_in_place_after_it_was_logged_keeps_its_logged_value() -> None:
    buf = MetricBuffer({"total": "sum", "last": "last"})
    running = torch.zeros(())
    for _ in range(3):
        running.add_(5.0)  # an accumulator, logged every step
        buf.update(total=running, last=running)
    running.zero_()
    assert buf.compute() == {"total": 5.0 + 10.0 + 15.0, "last": 15.0}


@pytest.mark.parametrize("kind", ["view", "detached-view", "weight", "first-step"])
def test_views_into_large_tensors_do_not_keep_them_alive(kind: str) -> None:
    buf = MetricBuffer({"first": ("mean", "weighted"), "loss": "mean"})
    if kind != "first-step":
        buf.update(first=torch.tensor(0.0), loss=torch.tensor(0.0))  # claims the device
        buf.update(first=torch.tensor(0.0), loss=torch.tensor(0.0))  # the block's first row
    bases = []
    for step in range(6):
        big = torch.full((64, 64), float(step))  # 16 KiB
        bases.append(weakref.ref(big))
        first = big[1, 2] if kind != "detached-view" else big[1, 2].detach()
        n: Any = big[0, 0] + 1 if kind != "weight" else big[0, :1]
        buf.update(first=first, loss=big.sum() / big.numel(), n=n)
        del big, first, n
    gc.collect()
    assert [ref() for ref in bases] == [None] * 6
    out = buf.compute()
    weights = list(range(6)) if kind == "weight" else [s + 1 for s in range(6)]
    skip = 0 if kind == "first-step" else 2  # two steps of 0.0, weight 1
    want = sum(s * w for s, w in zip(range(6), weights, strict=True)) / (sum(weights) + skip)
    assert out["first"] == pytest.approx(want)
    assert out["loss"] == pytest.approx(15 / (6 + skip))


def test_a_number_for_a_name_logged_as_a_tensor_leaves_the_hot_path() -> None:
    buf = MetricBuffer({"loss": "mean", "lr": "last"})
    for step in range(3):
        buf.update(loss=torch.tensor(float(step)), lr=torch.tensor(0.1))
    buf.update(loss=1.5, lr=torch.tensor(0.2))  # a Python number: the slow path folds it
    buf.update(loss=torch.tensor(4.5), lr=torch.tensor(0.3))
    out = buf.compute()
    assert out["loss"] == pytest.approx((0 + 1 + 2 + 1.5 + 4.5) / 5)
    assert out["lr"] == pytest.approx(0.3)


def test_a_value_that_only_looks_like_a_tensor_is_an_error_when_logged() -> None:
    class LooksLikeATensor:
        """Has some of what a tensor has, and is not one."""

        _version = 0
        requires_grad = False
        device = torch.device("cpu")

    buf = MetricBuffer({"loss": "mean"})
    for _ in range(2):
        buf.update(loss=torch.tensor(1.0))
    with pytest.raises(BarrierGuardError, match=r"loss=<.*LooksLikeATensor.*is not a valid value"):
        buf.update(loss=LooksLikeATensor())
    assert buf.compute() == {"loss": 1.0}


def test_parameters_are_copied_when_logged() -> None:
    scale = torch.nn.Parameter(torch.tensor(2.0))
    buf = MetricBuffer({"scale": "mean"})
    for _ in range(3):
        buf.update(scale=scale)
        with torch.no_grad():
            scale.add_(1.0)  # the optimizer's in-place step
    assert buf.compute()["scale"] == 3.0


def test_later_steps_of_one_element_in_any_shape_fold_in() -> None:
    buf = MetricBuffer({"loss": "mean", "best": "min"})
    buf.update(loss=torch.tensor(1.0), best=torch.tensor(3.0))
    buf.update(loss=torch.tensor(2.0), best=torch.tensor(4.0))
    buf.update(loss=torch.ones(1, 1) * 3.0, best=torch.tensor([0.5]))
    buf.update(loss=torch.tensor(6.0, dtype=torch.float64), best=torch.tensor(2, dtype=torch.int8))
    assert buf.compute() == {"loss": 3.0, "best": 0.5}


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        (torch.ones(3), r"loss=<tensor of shape \(3,\) on cpu>\) is not a single value"),
        (torch.tensor(1 + 2j), r"loss=<complex tensor>\) is not a real value"),
        (torch.tensor(1.0, device="meta"), r"loss=<tensor of shape \(\) on meta>\) is on another"),
    ],
    ids=["many-elements", "complex", "other-device"],
)
def test_a_later_step_that_does_not_fit_is_an_error_when_logged(
    bad: torch.Tensor, fragment: str
) -> None:
    buf = MetricBuffer({"loss": "mean", "acc": "mean"})
    buf.update(loss=torch.tensor(1.0), acc=torch.tensor(0.5))
    buf.update(loss=torch.tensor(1.0), acc=torch.tensor(0.5))
    with pytest.raises(BarrierGuardError, match=fragment):
        buf.update(loss=bad, acc=torch.tensor(0.5))
    # The buffer goes on with the steps logged before and after it.
    buf.update(loss=torch.tensor(1.0), acc=torch.tensor(0.5))
    buf.update(loss=torch.tensor(4.0), acc=torch.tensor(1.5))
    assert buf.compute() == {"loss": 1.75, "acc": 0.75}


def test_the_first_step_of_a_set_of_names_is_checked_when_logged() -> None:
    buf = MetricBuffer({"loss": "mean"})
    buf.update(loss=torch.tensor(1.0))  # claims the device
    with pytest.raises(BarrierGuardError, match=r"not a single value"):
        buf.update(loss=torch.ones(2))
    assert buf.compute() == {"loss": 1.0}


def test_later_steps_keep_no_graph_of_values_that_require_grad() -> None:
    weight = torch.nn.Parameter(torch.tensor(2.0))
    buf = MetricBuffer({"loss": "mean", "w": "last"})
    for step in range(4):
        loss = weight * float(step)  # a non-leaf that requires grad
        buf.update(loss=loss, w=weight)
        with torch.no_grad():
            weight.add_(1.0)  # the optimizer's in-place step, after the value was logged
    state = [t for t in _walk(buf.state_dict()) if isinstance(t, torch.Tensor)]
    assert state and not any(t.requires_grad or t.grad_fn is not None for t in state)
    assert buf.compute() == {"loss": (0 * 2 + 1 * 3 + 2 * 4 + 3 * 5) / 4, "w": 5.0}


@pytest.mark.parametrize("float_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_integer_columns_keep_their_values_beside_narrow_floats(float_dtype: torch.dtype) -> None:
    count = 2**24 + 1 if float_dtype == torch.float32 else 3001  # not exact in float_dtype
    buf = MetricBuffer({"loss": "mean", "tokens": "sum", "best": "max"})
    steps = BLOCK_STEPS + 5  # one fold inside the loop, one in compute()
    for _ in range(steps):
        buf.update(
            loss=torch.tensor(0.5, dtype=float_dtype),
            tokens=torch.tensor(count),
            best=torch.tensor(count, dtype=torch.int32),
        )
    assert buf.compute() == {"loss": 0.5, "tokens": float(count * steps), "best": float(count)}


def test_steps_are_checked_when_logged_until_one_passes() -> None:
    buf = MetricBuffer({"loss": "mean"})
    buf.update(loss=torch.tensor(1.0))  # claims the device
    for bad in (torch.ones(2), torch.ones(3)):
        with pytest.raises(BarrierGuardError, match=r"not a single value"):
            buf.update(loss=bad)
    buf.update(loss=torch.tensor(3.0))
    assert buf.compute() == {"loss": 2.0}


def test_steps_that_vary_order_weights_and_dtypes_fold_as_they_were_logged() -> None:
    # Each step varies one thing the copy of a repeated set of names depends on: the
    # names' order, the kind of weight, a dtype, a shape, a name more; the result
    # must be the same as if every step had been checked.
    rng = np.random.default_rng(7)
    specs: dict[str, Any] = {"loss": ("mean", "weighted"), "best": "max", "lr": "last"}
    buf = MetricBuffer(specs)
    xs: dict[str, list[float]] = {name: [] for name in specs}
    ws: list[float] = []
    for i in range(2 * BLOCK_STEPS + 50):
        x = {name: float(rng.integers(-50, 50)) for name in specs}
        w = float(rng.integers(1, 5))
        kind = rng.integers(0, 12)
        dtype = torch.float64 if kind == 1 else torch.int32 if kind == 2 else torch.float32
        values: dict[str, Any] = {name: torch.tensor(v, dtype=dtype) for name, v in x.items()}
        if kind == 3:
            values["loss"] = values["loss"].reshape(1, 1)
        if kind == 4:
            values = dict(reversed(values.items()))
        if kind == 5:
            values["lr"] = x["lr"]  # a Python number
        if kind == 6:
            values["extra"] = 1.0
            xs.setdefault("extra", []).append(1.0)
        n: Any = torch.tensor(w) if kind in (7, 8) or (i // 100) % 2 else w
        buf.update(values, n=n)
        for name in specs:
            xs[name].append(x[name])
        ws.append(w)
    out = buf.compute()
    loss = np.asarray(xs["loss"]) * np.asarray(ws)
    assert out["loss"] == pytest.approx(loss.sum() / sum(ws), rel=1e-12)
    assert out["best"] == max(xs["best"])
    assert out["lr"] == xs["lr"][-1]
    assert out["extra"] == 1.0


def test_a_value_that_requires_grad_after_steps_that_did_not_leaves_no_graph() -> None:
    weight = torch.nn.Parameter(torch.tensor(2.0))
    buf = MetricBuffer({"loss": "mean", "w": "max"})
    for step in range(6):
        loss = weight * float(step)
        if step in (0, 1, 4):  # steps of tensors that do not require grad, then ones that do
            loss = loss.detach()
        buf.update(loss=loss, w=weight.detach())
    state = [t for t in _walk(buf.state_dict()) if isinstance(t, torch.Tensor)]
    assert state and not any(t.requires_grad or t.grad_fn is not None for t in state)
    assert buf.compute() == {"loss": 2.0 * sum(range(6)) / 6, "w": 2.0}
    assert weight.grad is None
