"""Report additions for framework runs: phases, mechanisms, epochs and merged ranks."""

from __future__ import annotations

import pytest

from _samples import report, site
from barrierguard import BarrierGuardError, Report, Site


def _site(line: int, count: int, step_count: int, **kw: object) -> Site:
    return site(line=line, function="main", code="x", count=count, step_count=step_count, **kw)


def _report(*sites: Site, steps: int = 4) -> Report:
    return report(
        *sites,
        engine="audit",
        steps=steps,
        measured_steps=steps,
        syncs_per_step=(1,) * (steps + 1),
    )


def test_new_fields_round_trip() -> None:
    site = _site(3, 5, 4, phases=(("train", 4), ("validate", 1)), mechanisms=(("logger", 5),))
    report = Report.merge([_report(site), _report(site)])
    report = Report(**{**report.__dict__, "epochs": (0, 2)})
    assert Report.from_dict(report.to_dict()) == report
    d = report.to_dict()["sites"][0]
    assert d["phases"] == {"train": 8, "validate": 2}
    assert d["rank_counts"] == {"0": 5, "1": 5}


def test_plain_reports_keep_their_json_shape() -> None:
    d = _report(_site(3, 1, 1)).to_dict()
    assert "epochs" not in d and "ranks" not in d
    assert not {"phases", "mechanisms", "rank_counts"} & set(d["sites"][0])
    # and a report written before these fields existed still loads
    assert Report.from_dict(d).sites[0].phases == ()


@pytest.mark.parametrize(
    ("counts", "want_count", "want_ranks"),
    [
        ([5, 3], 8, ((0, 5), (1, 3))),
        ([5, None], 5, ((0, 5),)),
        ([None, 2], 2, ((1, 2),)),
    ],
)
def test_merge_sums_sites_per_rank(
    counts: list[int | None], want_count: int, want_ranks: tuple[tuple[int, int], ...]
) -> None:
    reports = [_report(*([_site(3, n, n)] if n is not None else [])) for n in counts]
    merged = Report.merge(reports)
    (site,) = merged.sites
    assert site.count == want_count
    assert site.rank_counts == want_ranks
    assert site.per_step == pytest.approx(want_count / 8)  # 2 ranks x 4 measured steps
    assert merged.syncs_per_step == (2,) * 5
    assert merged.ranks == tuple(reports)


def test_merge_of_nothing_is_an_error() -> None:
    with pytest.raises(BarrierGuardError, match="at least one"):
        Report.merge([])
