"""A resumed run's report: the counts from a checkpoint, then the new run's."""

from __future__ import annotations

from dataclasses import replace

from barrierguard.report.records import Report, Site, SiteKey
from barrierguard.report.site_records import add_sites

__all__ = ["combine"]


def combine(before: Report, after: Report) -> Report:
    """A resumed run's report: ``before`` (from the checkpoint), then ``after``, whose steps
    are numbered on; counts are summed; memory is ``after``'s (this process's samples only)."""
    offset = before.steps
    sites: dict[SiteKey, Site] = {s.key: s for s in before.sites}
    for site in after.sites:
        shifted = tuple((a + offset, b + offset) for a, b in site.steps)
        if (old := sites.get(site.key)) is None:
            sites[site.key] = replace(site, steps=shifted)
        else:
            sites[site.key] = add_sites([old, site], steps=old.steps + shifted)
    measured = before.measured_steps + after.measured_steps
    merged = [
        replace(s, per_step=s.step_count / measured if measured else 0.0) for s in sites.values()
    ]
    per_step = list(before.syncs_per_step) or [0]
    tail = list(after.syncs_per_step) or [0]
    per_step[-1] += tail[0]
    per_step.extend(tail[1:])
    return replace(
        after,
        steps=before.steps + after.steps,
        warmup_steps=before.warmup_steps,
        measured_steps=measured,
        sites=tuple(merged),
        violations=before.violations
        + tuple(replace(v, step=v.step + offset) for v in after.violations),
        syncs_per_step=tuple(per_step),
        notes=tuple(dict.fromkeys(before.notes + after.notes)),
        duration_s=before.duration_s + after.duration_s,
        epochs=before.epochs + tuple(e + offset for e in after.epochs),
    )
