"""bench_compile.py on CPU: its reading of torch's logs, and one compile scenario run for real."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_compile.py"

_spec = importlib.util.spec_from_file_location("bench_compile", BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_logged_lines_reads_both_forms_of_a_break_and_a_skip() -> None:
    here = bench.HERE
    stderr = "\n".join(
        [
            f"V1124 00:00:00 1 torch/_dynamo/symbolic_convert.py:5124] [0/0] [__graph_breaks] "
            f"Graph break in user code at {here}:137",
            "Graph Break Reason: Unsupported Tensor.item() call",
            # dynamo's place is another file (a wrapper): the traceback names ours
            "V1124 00:00:01 1 torch/_dynamo/symbolic_convert.py:5124] [1/0] [__graph_breaks] "
            "Graph break in user code at /elsewhere/mode.py:9",
            "User code traceback:",
            f'  File "{here}", line 150, in step',
            '  File "/elsewhere/mode.py", line 9, in __torch_function__',
            "W1124 00:00:02 1 torch/_inductor/cudagraph_utils.py:281] [__cudagraphs] "
            "skipping cudagraphs due to cpu device (_tensor_constant0). Found from : ",
            f'   File "{here}", line 160, in host_tensor',
            "I1124 00:00:03 1 torch/other.py:1] unrelated record",
            f'  File "{here}", line 999, in nothing',
        ]
    )
    name = os.path.basename(here)
    assert bench.logged_lines(stderr) == {
        "graph_break": [[name, 137], [name, 150]],
        "cudagraph_skip": [[name, 160]],
    }


def test_metric_item_scenario_agrees_with_torch_logs_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--only", "metric_item", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "bench_compile.json").read_text())
    assert summary["checks"]["metric_item: break at the .item() line, logs agree"]
    assert summary["checks"]["metric_item: the site carries the break and capture_scalar_outputs"]
    assert (tmp_path / "metric_item.stderr.log").exists()


def test_paired_summary_and_the_timing_check() -> None:
    before, after = [2.0, 2.4, 2.2, 2.1, 2.3], [1.5, 1.6, 2.5, 1.4, 1.55]
    s = bench.paired_summary(before, after)
    assert s["before_ms"] == {"median": 2.2, "q1": 2.1, "q3": 2.3}
    assert s["after_ms"]["median"] == 1.55
    assert (s["after_faster_rounds"], s["rounds_paired"]) == (4, 5)
    assert s["speedup_median"] == 2.3 / 1.55  # the median of the per-round ratios
    key = "metric_fixed faster than metric_item (paired rounds)"
    one_lost = {"metric": s}
    assert bench.checks({}, dry=False, timings=one_lost)[key]
    two_lost = {"metric": {**s, "after_faster_rounds": 3}}
    assert not bench.checks({}, dry=False, timings=two_lost)[key]
    assert not bench.checks({}, dry=False, timings={"metric": {"error": "exit 1"}})[key]
    assert key not in bench.checks({}, dry=True, timings=one_lost)  # no timed check on CPU
