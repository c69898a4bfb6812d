"""A resumed run's report: the counts from a checkpoint, then the new run's."""

from __future__ import annotations

from dataclasses import replace

from barrierguard.report.records import Report, Site, SiteKey
from barrierguard.report.site_records import _events

__all__ = ["combine"]


def combine(before: Report, after: Report) -> Report:
    """A resumed run's report: ``before`` (from the checkpoint), then ``after``.

    Steps of ``after`` are numbered on from ``before``; counts are summed; the
    memory section is ``after``'s (this process's samples only).
    """
    offset = before.steps
    sites: dict[SiteKey, Site] = {s.key: s for s in before.sites}
    for site in after.sites:
        shifted = tuple((a + offset, b + offset) for a, b in site.steps)
        old = sites.get(site.key)
        if old is None:
            sites[site.key] = replace(site, steps=shifted)
            continue
        sites[site.key] = replace(
            old,
            count=old.count + site.count,
            setup_count=old.setup_count + site.setup_count,
            step_count=old.step_count + site.step_count,
            steps=old.steps + shifted,
            threads=tuple(dict.fromkeys(old.threads + site.threads)),
            phases=_add(old.phases, site.phases),
            mechanisms=_add(old.mechanisms, site.mechanisms),
            events=_events([old, site]),
        )
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


def _add(
    a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...]
) -> tuple[tuple[str, int], ...]:
    total = dict(a)
    for k, n in b:
        total[k] = total.get(k, 0) + n
    return tuple(total.items())
