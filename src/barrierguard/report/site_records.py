"""A site (a place in the code that synchronizes), a violation, and how sites add up."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from barrierguard.report.codec import AS_MAP, OMIT_EMPTY, OMIT_NONE, Record

__all__ = ["Site", "SiteKey", "Violation", "add_sites"]

SiteKey = tuple[str, int, str, str, str, int]
"""What names a site: see :attr:`Site.key`."""

# The dynamo settings that keep a sync in the graph (it still syncs at run time).
_FLAGS = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")
# Pairs written as a JSON object, left out when empty.
_PAIRS = {**AS_MAP, **OMIT_EMPTY}


@dataclass(frozen=True)
class Site(Record):
    """One place in the code that synchronizes, with everything known about it.

    ``file``/``line``/``function``: the user's own frame; inside a framework (``origin``
    ``"framework:<name>"``) ``framework_*`` name its line. ``cause``: why it syncs; ``fix``:
    what removes it; ``rule``: the kind's code (``"BG101"``, docs/rules.md). ``count``
    counts calls (one ``print(t)`` is one), ``events`` the raw syncs when more. Merged
    over ranks: ``rank_counts``, ``rank_stalls``, ``asymmetric`` (fired on some ranks
    only), ``job_cost_s``. ``graph_break``, ``graph_break_id``, ``compile_flag``,
    ``cudagraph_skip``: what torch.compile said about the line (docs/compile.md).

    Example:
        >>> s = Site(file="/w/train.py", line=12, function="train", code="loss.item()",
        ...          kind="item", origin="user", count=3, step_count=3, per_step=1.0)
        >>> s.location
        'train.py:12'
    """

    file: str
    line: int
    function: str
    code: str
    kind: str
    origin: str
    count: int
    detail: str = ""
    setup_count: int = 0
    step_count: int = 0
    per_step: float = 0.0
    steps: tuple[tuple[int, int], ...] = ()
    stall_s: float | None = None
    stall_count: int = 0
    setup_stall_s: float | None = None
    threads: tuple[str, ...] = ("MainThread",)
    allowed: bool = False
    blocking: bool = True
    fix: str = ""
    framework_file: str | None = None
    framework_line: int | None = None
    framework_function: str | None = None
    # Optional sections appear in the JSON only when set.
    cause: str = field(default="", metadata=OMIT_EMPTY)
    events: int = field(default=0, metadata={"omit": lambda site, n: n <= site.count})
    asymmetric: bool = field(default=False, metadata=OMIT_EMPTY)
    job_cost_s: float | None = field(default=None, metadata=OMIT_NONE)
    phases: tuple[tuple[str, int], ...] = field(default=(), metadata=_PAIRS)
    mechanisms: tuple[tuple[str, int], ...] = field(default=(), metadata=_PAIRS)
    rank_counts: tuple[tuple[int, int], ...] = field(default=(), metadata=_PAIRS)
    rank_stalls: tuple[tuple[int, float], ...] = field(default=(), metadata=_PAIRS)
    rule: str = field(default="", metadata=OMIT_EMPTY)
    graph_break: str = field(default="", metadata=OMIT_EMPTY)
    graph_break_id: str = field(default="", metadata=OMIT_EMPTY)
    compile_flag: str = field(default="", metadata=OMIT_EMPTY)
    cudagraph_skip: str = field(default="", metadata=OMIT_EMPTY)

    @property
    def location(self) -> str:
        """``basename:line`` of the user's frame."""
        return f"{os.path.basename(self.file)}:{self.line}"

    @property
    def compile_consequence(self) -> str:
        """What the site does to torch.compile and CUDA graphs, in words (``""``: nothing)."""
        parts = []
        if self.graph_break:
            tag = f" [{self.graph_break_id}]" if self.graph_break_id else ""
            effect = (
                f"torch._dynamo.config.{self.compile_flag} = True keeps it in the graph, but the "
                "sync still happens each time the compiled code runs"
                if self.compile_flag in _FLAGS
                else "no dynamo setting keeps it in the graph"
            )
            parts.append(f"graph break{tag}: {self.graph_break}; {effect}")
        if self.cudagraph_skip:
            parts.append(f"CUDA graphs skipped: {self.cudagraph_skip}")
        return "; ".join(parts)

    @property
    def key(self) -> SiteKey:
        """What makes two records the same site: file, line, kind, origin, framework line."""
        framework = (self.framework_file or "", self.framework_line or 0)
        return (self.file, self.line, self.kind, self.origin, *framework)


def _sum_pairs(groups: Iterable[tuple[tuple[str, int], ...]]) -> tuple[tuple[str, int], ...]:
    total: Counter[str] = Counter()
    for name, n in (pair for pairs in groups for pair in pairs):
        total[name] += n
    return tuple(total.items())


def add_sites(sites: Sequence[Site], **fields: Any) -> Site:
    """Records of one site as one: the first's fields, the counts summed; ``fields`` override."""
    count = sum(s.count for s in sites)
    events = sum(max(s.events, s.count) for s in sites)
    added = {
        "count": count,
        "setup_count": sum(s.setup_count for s in sites),
        "step_count": sum(s.step_count for s in sites),
        "threads": tuple(dict.fromkeys(t for s in sites for t in s.threads)),
        "phases": _sum_pairs(s.phases for s in sites),
        "mechanisms": _sum_pairs(s.mechanisms for s in sites),
        "events": events if events > count else 0,
    }
    return replace(sites[0], **{**added, **fields})


@dataclass(frozen=True)
class Violation(Record):
    """A point where the policy was broken: which site, at which step, and why."""

    file: str
    line: int
    kind: str
    origin: str
    step: int
    reason: str
    thread: str = "MainThread"
