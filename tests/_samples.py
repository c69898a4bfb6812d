"""Sample reports for the tests: a site, a report around sites, and the rich samples.

``site()`` and ``report()`` give a record with plain defaults that a test
overrides by keyword; ``sample_report()`` has the variety of a real run (hot and
cold sites, a framework line, an allowed site, markup to escape);
``merged_report()`` is a distributed run with a logging line on rank 0 only.
"""

from __future__ import annotations

from typing import Any

from barrierguard import MemoryReport, Report, Site, Violation
from barrierguard.report.records import Timeline

__all__ = ["merged_report", "report", "sample_memory", "sample_report", "site"]


def site(**overrides: Any) -> Site:
    """A user site of ``loss.item()`` in ``/w/train.py``, once a step; any field overridden."""
    fields: dict[str, Any] = {
        "file": "/w/train.py",
        "line": 12,
        "function": "train",
        "code": "loss.item()",
        "kind": "item",
        "origin": "user",
        "count": 1,
    }
    fields.update(overrides)
    fields.setdefault("step_count", fields["count"])
    return Site(**fields)


def report(*sites: Site, **overrides: Any) -> Report:
    """A CUDA-engine report of ``sites`` under the record policy; any field overridden."""
    fields: dict[str, Any] = {"engine": "cuda", "detection": True, "policy": "record"}
    fields.update(overrides)
    return Report(sites=sites, **fields)


def sample_report(steps: int = 40) -> Report:
    sites = (
        site(
            line=31,
            code="running += loss.item()",
            count=41,
            setup_count=1,
            step_count=40,
            per_step=1.0,
            fix="keep the value on the device",
        ),
        site(
            line=35,
            code="if (pred > 0.9).any():",
            kind="bool",
            count=81,
            setup_count=1,
            step_count=80,
            per_step=2.0,
            stall_s=0.0021,
            fix="use torch.where",
        ),
        site(
            function="setup",
            code="model.to(device)",
            kind="copy",
            detail="h2d",
            count=3,
            setup_count=3,
            step_count=0,
            fix="pin",
        ),
        site(
            file="/w/module.py",
            line=88,
            function="training_step",
            code="self.log('loss', loss, prog_bar=True)",
            origin="framework:lightning",
            count=8,
            per_step=0.2,
            allowed=True,
            framework_file="/site/lightning/pytorch/core/module.py",
            framework_line=512,
            framework_function="log",
            fix="log on epoch",
        ),
        site(
            file="/w/evil.py",
            line=1,
            function="f",
            code="x = '<script>alert(1)</script>'",
            kind="format",
            count=5,
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


def sample_memory(steps: int = 40) -> MemoryReport:
    xs = tuple(range(0, steps + 1, 2))
    return MemoryReport(
        steps=xs,
        series={
            "host_rss": tuple(int(2.0e9 + 5e6 * x) for x in xs),
            "device_allocated": tuple(int(1.2e9 + (x % 4) * 1e7) for x in xs),
        },
        leak=True,
    )


def merged_report(world: int = 2) -> Report:
    reports = []
    for rank in range(world):
        sites: tuple[Site, ...] = ()
        stall = 0.0
        if rank == 0:
            stall = 0.004
            sites = (
                site(
                    line=42,
                    code="if rank == 0: log(f'<{loss.item()}>')",
                    count=10,
                    per_step=1.0,
                    stall_s=stall * 10,
                    stall_count=10,
                    fix="keep it on the device",
                ),
            )
        reports.append(
            Report(
                engine="cuda",
                detection=True,
                policy="record",
                steps=10,
                measured_steps=10,
                sites=sites,
                rank=rank,
                timeline=Timeline(
                    steps=(1, 2),
                    host_s=(0.010 + stall, 0.010 + stall),
                    stall_s=(stall, stall),
                    device_s=(None, 0.008),
                    ahead=(0, 0),
                    saving_s=2 * stall,
                ),
            )
        )
    return Report.merge(reports)
