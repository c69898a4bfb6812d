"""A report with the variety a real one has: hot and cold sites, a framework line, memory."""

from __future__ import annotations

from typing import Any

from barrierguard import Report, Site, Violation


def sample_report(steps: int = 40) -> Report:
    sites = (
        Site(
            file="/w/train.py",
            line=31,
            function="train",
            code="running += loss.item()",
            kind="item",
            origin="user",
            count=41,
            setup_count=1,
            step_count=40,
            per_step=1.0,
            fix="keep the value on the device",
        ),
        Site(
            file="/w/train.py",
            line=35,
            function="train",
            code="if (pred > 0.9).any():",
            kind="bool",
            origin="user",
            count=81,
            setup_count=1,
            step_count=80,
            per_step=2.0,
            stall_s=0.0021,
            fix="use torch.where",
        ),
        Site(
            file="/w/train.py",
            line=12,
            function="setup",
            code="model.to(device)",
            kind="copy",
            detail="h2d",
            origin="user",
            count=3,
            setup_count=3,
            fix="pin",
        ),
        Site(
            file="/w/module.py",
            line=88,
            function="training_step",
            code="self.log('loss', loss, prog_bar=True)",
            kind="item",
            origin="framework:lightning",
            count=8,
            step_count=8,
            per_step=0.2,
            allowed=True,
            framework_file="/site/lightning/pytorch/core/module.py",
            framework_line=512,
            framework_function="log",
            fix="log on epoch",
        ),
        Site(
            file="/w/evil.py",
            line=1,
            function="f",
            code="x = '<script>alert(1)</script>'",
            kind="format",
            origin="user",
            count=5,
            step_count=5,
            per_step=0.125,
            fix="<b>no</b>",
        ),
    )
    per_step = tuple([2] + [3 + (i % 7 == 0) for i in range(steps)])
    return Report(
        engine="cuda",
        detection=True,
        policy="error",
        steps=steps,
        warmup_steps=2,
        measured_steps=steps - 2,
        sites=sites,
        violations=(Violation("/w/train.py", 31, "item", "user", 3, "not allowed"),),
        syncs_per_step=per_step,
        notes=("a note",),
        duration_s=1.5,
        environment={"torch": "2.13", "device": "NVIDIA H200"},
    )


def sample_memory(steps: int = 40) -> dict[str, Any]:
    xs = list(range(0, steps + 1, 2))
    return {
        "steps": xs,
        "series": {
            "host_rss": [2.0e9 + 5e6 * x for x in xs],
            "device_allocated": [1.2e9 + (x % 4) * 1e7 for x in xs],
        },
        "leak": True,
    }
