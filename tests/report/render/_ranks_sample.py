"""A merged report of ``world`` ranks with a logging line on rank 0 only."""

from __future__ import annotations

from barrierguard import Report, Site
from barrierguard.report.records import Timeline


def merged_report(world: int = 2) -> Report:
    reports = []
    for rank in range(world):
        sites: tuple[Site, ...] = ()
        stall = 0.0
        if rank == 0:
            stall = 0.004
            sites = (
                Site(
                    file="/w/train.py",
                    line=42,
                    function="train",
                    code="if rank == 0: log(f'<{loss.item()}>')",
                    kind="item",
                    origin="user",
                    count=10,
                    step_count=10,
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
