"""Reading dynamo's graph breaks and inductor's CUDA-graph skips from torch's loggers."""

from __future__ import annotations

import logging

import pytest
import torch

from barrierguard.detect.compile_logs import (
    CompileListener,
    parse_cudagraph_skip,
    parse_graph_break,
)

# The two forms dynamo 2.x logs (symbolic_convert.py): the first time a break
# is seen at a place, with the user's stack; then the short duplicate form.
FULL = """Graph break in user code at /w/bg/audit_provenance.py:256
Graph Break Reason: Encountered graph break when attempting to trace CALL: a function call, e.g. f(x, y):

Unsupported Tensor.item() call with capture_scalar_outputs=False
  Explanation: Dynamo does not support tracing `Tensor.item()` with config.capture_scalar_outputs=False.
  Hint: Set `torch._dynamo.config.capture_scalar_outputs = True` to include these operations in the captured graph.

  Developer debug context: call_method TensorVariable() item () {}

 For more details about this graph break, please visit: https://meta-pytorch.github.io/compile-graph-break-site/gb/gb0124.html

User code traceback:
  File "/w/train.py", line 17, in <module>
    for i in range(3): c(torch.randn(8,4))
  File "/w/train.py", line 12, in step
    v = loss.item()
  File "/usr/lib/python3/site-packages/torch/nn/modules/module.py", line 3, in _call
    x
"""

DUPLICATE = """Graph break (user stack suppressed due to duplicate graph break) in user code at /w/train.py:13
Graph Break Reason: Data-dependent branching
  Explanation: Detected data-dependent branching (e.g. `if my_tensor.sum() > 0:`).
        # File "/w/train.py", line 99, in torch_dynamo_resume_in_step_at_12, code: if loss > 0.5:
  Hint: Use `torch.cond` to express dynamic control flow.

 For more details about this graph break, please visit: https://meta-pytorch.github.io/compile-graph-break-site/gb/gb0170.html"""


def test_full_record_names_the_innermost_user_line_and_the_reason() -> None:
    event = parse_graph_break(FULL)
    assert event is not None
    assert (event.file, event.line, event.function) == ("/w/train.py", 12, "step")
    assert event.reason == "Unsupported Tensor.item() call with capture_scalar_outputs=False"
    assert event.gb == "gb0124"
    assert event.flag == "capture_scalar_outputs"
    assert event.detail.startswith("Explanation: Dynamo does not support")
    assert event.user


def test_duplicate_record_falls_back_to_dynamo_place_not_the_explanation_frames() -> None:
    event = parse_graph_break(DUPLICATE)
    assert event is not None
    # The "# File ..., line 99" inside the explanation is not the traceback.
    assert (event.file, event.line) == ("/w/train.py", 13)
    assert event.reason == "Data-dependent branching"
    assert event.gb == "gb0170"
    assert event.flag == ""


def test_cudagraph_skip_names_the_user_line_of_inductor_stack() -> None:
    event = parse_cudagraph_skip(
        "skipping cudagraphs due to cpu device (arg3_1). Found from : \n"
        '   File "/w/train.py", line 30, in loss_fn\n'
        "    w = torch.tensor([1.0, 2.0])\n"
    )
    assert event is not None
    assert (event.file, event.line, event.reason) == ("/w/train.py", 30, "cpu device (arg3_1)")
    assert parse_cudagraph_skip("something else") is None
    bare = parse_cudagraph_skip("skipping cudagraphs due to mutated inputs (1 instances)")
    assert bare is not None and bare.file == "" and bare.reason == "mutated inputs (1 instances)"


def _artifact_logger(name: str) -> logging.Logger:
    return torch._logging.getArtifactLogger(f"barrierguard_test.{name}", name)


def test_listener_reads_loggers_made_before_and_while_running_and_restores_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = _artifact_logger("graph_breaks")
    state = (before.level, before.propagate, list(before.handlers))
    listener = CompileListener()
    listener.start()
    try:
        before.debug("%s", DUPLICATE)
        made_now = torch._logging.getArtifactLogger("barrierguard_test.late", "cudagraphs")
        made_now.warning("skipping cudagraphs due to cpu device (arg0_1)")
    finally:
        listener.stop()
    assert [e.what for e in listener.events] == ["graph_break", "cudagraph_skip"]
    assert (before.level, before.propagate, list(before.handlers)) == state
    assert not made_now.handlers
    # What the loggers passed on before (a warning) is passed on still;
    # dynamo's debug record is not, as without the listener.
    passed_on = [r.getMessage() for r in caplog.records]
    assert passed_on == ["skipping cudagraphs due to cpu device (arg0_1)"]
    before.debug("%s", DUPLICATE)
    assert len(listener.events) == 2


def test_listener_places_each_non_cudagraphable_partition_op_at_its_innermost_user_line() -> None:
    # torch >= 2.9 logs a partition split, one record per line, as on an H200 run.
    records = [
        "Created 2 graph partitions: 1 cudagraphable, 1 non-cudagraphable",
        "  Partition 0: 1 nodes, non-cudagraphable, inputs=1, outputs=1",
        "    op3: reason=DeviceCopy ops, ir=DeviceCopy, fx=prims.device_put.default(p, cuda:0)",
        '         File "/w/train.py", line 40, in step',
        "             loss = loss_fn(out, y)",
        '         File "/w/train.py", line 30, in loss_fn',
        "             w = weights.to(x.device)",
        "    op5: reason=CPU ops, ir=FallbackKernel, fx=aten.add.Tensor(a, b)",
        '         File "/w/train.py", line 41, in step',
        "  Partition 1: 5 nodes, cudagraphable, inputs=7, outputs=11",
        '         File "/w/train.py", line 99, in elsewhere',
    ]
    import torch._inductor.config as inductor_config

    logger = torch._logging.getArtifactLogger("barrierguard_test.parts", "cudagraphs")
    events = {}
    for cudagraphs in (True, False):
        listener = CompileListener()
        listener.start()
        try:
            with inductor_config.patch({"triton.cudagraphs": cudagraphs}):
                for text in records:
                    logger.debug("%s", text)
        finally:
            listener.stop()
        events[cudagraphs] = [(e.what, e.line, e.reason) for e in listener.events]
    assert events[True] == [
        ("cudagraph_skip", 30, "not in a CUDA graph: DeviceCopy ops"),
        ("cudagraph_skip", 41, "not in a CUDA graph: CPU ops"),
    ]
    # Without CUDA graphs (no mode="reduce-overhead"), a partition costs nothing.
    assert events[False] == []
