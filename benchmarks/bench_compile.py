"""Does barrierguard name the graph breaks and CUDA-graph skips torch names, and do the fixes pay?

Question:
    Under ``torch.compile``, does each sync site carry dynamo's graph break at the line
    ``TORCH_LOGS=graph_breaks,cudagraphs`` names, does a ``reduce-overhead`` step report
    inductor's CUDA-graph skip at the user's line, does the capture probe name the
    blocking line (and call the fixed step capturable), and how much faster is the fixed
    step?

Design:
    Each scenario runs in a subprocess with ``TORCH_LOGS=graph_breaks,cudagraphs`` (its
    stderr is the reference), watched by ``barrierguard.watch`` (its report is checked
    against the reference, line by line):

    * ``nanogpt``: a nanoGPT-style model (2 blocks) compiled with inductor on a cold
      cache (its own fresh ``TORCHINDUCTOR_CACHE_DIR``), AdamW, ``loss.item()`` at the
      log interval outside the compiled model: no graph break, the syncs made while
      compiling counted apart, none labelled ``user`` inside inductor's files;
    * ``metric_item`` / ``metric_fixed``: a compiled step with ``acc.item()`` inside, and
      the same step returning the metric as a device tensor;
    * ``host_tensor`` / ``host_fixed``: a ``mode="reduce-overhead"`` loss that makes its
      class weights as a host tensor argument copied to the device on every call (a
      non-cudagraphable partition in torch 2.9+, a skip before), and the loss with the
      weights made once on the device.

    The metric steps train an MLP classifier whose device work per step is of the order
    of the host's (512-2048-2048-10, batch 512); the ``reduce-overhead`` steps a small,
    launch-bound one (256-512-512-10, batch 64), what CUDA graphs are for.

    The capture probe (``Guard.probe_capture``) captures, before and after each fix, the
    eager forward+backward of the metric steps, and the ``reduce-overhead`` training step
    itself (its compiled code runs as plain Python inside the capture; where inductor's
    CUDA graphs hold the last step's autograd graph, the backward is inductor's verdict).

    Timing: per pair, one more subprocess (unwatched, no ``TORCH_LOGS``) builds the step
    before and after its fix (each its own model copy), warms both up, and runs paired
    rounds: ``--rounds`` (9) rounds of ``--round-steps`` (100) steps of each, the order
    alternated, wall time per step with the device drained at each round's ends. Each
    step does the same host work (a spin standing for reading and collating the next
    batch) of the fixed step's own time, measured first: a barrier in the step keeps that
    host work from overlapping the device's; without it they overlap. Reported: medians
    and quartiles, the median of the per-round ratios, and in how many rounds the fixed
    step was faster (the check asks for all but at most one).

    The tables and a PASS/FAIL line per check are printed; ``bench_compile.json`` and
    each subprocess's logs go to ``$OUT`` (or ``--out DIR``).

Reproduce:
    PYTHONPATH=src python benchmarks/bench_compile.py

    The committed ``benchmarks/results/h200/compile.json`` (and ``compile.txt``, the
    printed table) is the run at 5e9cb33 with ``--out /tmp/compile --budget 130``, before
    the paired rounds (one timing per scenario then).

    GPU, under 5 minutes (every subprocess has its own time limit, ``--timeout``). On a
    CPU, ``PYTHONPATH=src python benchmarks/bench_compile.py --dry-run`` runs the compile
    scenarios with the ``eager`` backend and the metric pair's rounds untimed by checks
    (a test runs ``metric_item``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = os.path.abspath(__file__)
SCENARIOS = ("nanogpt", "metric_item", "metric_fixed", "host_tensor", "host_fixed")
PAIRS = {"metric": ("metric_item", "metric_fixed"), "host": ("host_tensor", "host_fixed")}


# -- the scenarios (run in a subprocess) ----------------------------------------------


def _nanogpt(device: str, backend: str, steps: int) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    import barrierguard

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.heads = heads

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.attn(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, vocab: int = 256, d: int = 128, layers: int = 2, ctx: int = 64) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(Block(d, 4) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    torch.manual_seed(0)
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)
    data = torch.randint(0, 256, (steps, 16, 65), device=device)
    with barrierguard.watch(policy="record", memory=False, warmup_steps=1) as guard:
        for i in range(steps):
            loss = compiled(data[i, :, :-1], data[i, :, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i % 10 == 0:
                print(f"step {i} loss {loss.item():.3f}", file=sys.stderr)  # log interval
    report = guard.report
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/nonexistent")
    return {
        "report": report.to_dict(),
        "user_sites_in_inductor_files": [
            s.location for s in report.sites if s.origin == "user" and s.file.startswith(cache)
        ],
    }


def _classifier(device: str, big: bool) -> tuple[Any, Any, Any]:
    """A classifier, its optimizer and one batch.

    ``big``: the device's work per step is of the order of the host's (about
    half a millisecond on an H200), so that what a barrier serializes shows;
    else a small, launch-bound one (what ``mode="reduce-overhead"`` is for).
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    features, wide, batch = (512, 2048, 512) if big and device == "cuda" else (256, 512, 64)
    model = nn.Sequential(
        nn.Linear(features, wide), nn.GELU(), nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, 10)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, features, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, opt, (x, y)


def _steps(name: str, model: Any) -> tuple[Any, Any]:
    """The step of a scenario (forward and loss; what is compiled) and its eager twin."""
    import torch
    from torch.nn import functional as F

    weights_on_device = torch.linspace(0.5, 1.5, 10, device=next(model.parameters()).device)

    def metric_item(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean().item()  # bench: item
        return loss, acc

    def metric_fixed(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        return loss, acc

    def host_tensor(
        x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        # The class weights live on the host and are copied in each call: the
        # graph has a CPU input, so inductor cannot put it in a CUDA graph (a
        # torch.tensor(...) of constants made inside would be folded instead).
        logits = model(x)
        w = weights.to(x.device)  # bench: host
        return F.cross_entropy(logits, y, weight=w), None

    def host_fixed(
        x: torch.Tensor, y: torch.Tensor, weights: Any = None
    ) -> tuple[torch.Tensor, Any]:
        logits = model(x)
        return F.cross_entropy(logits, y, weight=weights_on_device), None

    fn = {
        "metric_item": metric_item,
        "metric_fixed": metric_fixed,
        "host_tensor": host_tensor,
        "host_fixed": host_fixed,
    }[name]
    return fn, fn


def _train_step(name: str, device: str, backend: str) -> tuple[Any, Any]:
    """A scenario's training step (compiled) and the eager forward+backward of the same code."""
    import torch

    model, opt, (x, y) = _classifier(device, big=name.startswith("metric"))
    fn, eager = _steps(name, model)
    mode = "reduce-overhead" if name.startswith("host") and backend == "inductor" else None
    compiled = torch.compile(fn, backend=backend, mode=mode)
    cudagraphs = mode == "reduce-overhead"
    # The host scenarios take the class weights as an argument (a host tensor).
    extra = (torch.linspace(0.5, 1.5, 10),) if name.startswith("host") else ()

    def train_step() -> None:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss, _ = compiled(x, y, *extra)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def eager_fwd_bwd() -> None:
        loss, _ = eager(x, y, *extra)
        loss.backward()

    return train_step, eager_fwd_bwd


def _compiled_scenario(name: str, device: str, backend: str, steps: int) -> dict[str, Any]:
    import barrierguard

    train_step, eager_fwd_bwd = _train_step(name, device, backend)
    # The metric scenarios probe the eager twin of the compiled forward and
    # backward; the reduce-overhead ones probe the compiled step itself, as
    # ``capture_probe="train_step"`` would: its compiled code runs as plain
    # Python inside the capture (inductor's CUDA graphs are never nested).
    probed = train_step if name.startswith("host") else eager_fwd_bwd
    with barrierguard.watch(policy="record", memory=False, warmup_steps=1) as guard:
        for _ in range(steps):
            train_step()
        probe = guard.probe_capture(probed)
        for _ in range(2):
            train_step()
    return {"report": guard.report.to_dict(), "probe": probe.to_dict()}


def _host_work(ms: float) -> None:
    """The loop's own host work (reading and collating the next batch): ``ms`` of it."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _round_ms(step: Any, n: int, cuda: bool) -> float:
    """Wall milliseconds per step over ``n`` steps, the device drained before and after."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def paired_summary(before: list[float], after: list[float]) -> dict[str, Any]:
    """Medians, quartiles and per-round ratios of paired timing rounds (ms per step).

    Example:
        >>> s = paired_summary([2.0, 2.2, 2.1], [1.0, 1.1, 1.2])
        >>> s["before_ms"]["median"], s["after_ms"]["median"], s["after_faster_rounds"]
        (2.1, 1.1, 3)
    """
    b, a = _quartiles(before), _quartiles(after)
    ratios = [x / y for x, y in zip(before, after, strict=True)]
    return {
        "before_ms": {"median": b[1], "q1": b[0], "q3": b[2]},
        "after_ms": {"median": a[1], "q1": a[0], "q3": a[2]},
        "speedup_median": statistics.median(ratios),
        "after_faster_rounds": sum(1 for r in ratios if r > 1.0),
        "rounds_paired": len(ratios),
    }


def _timing(pair: str, device: str, backend: str, rounds: int, steps: int) -> dict[str, Any]:
    """Paired rounds: the step before and after its fix, alternated in one process.

    Each variant trains its own copy of the model, with the same host work
    per step in both: the fixed step's own time, measured first (without host
    work). Where a barrier serializes the host and the device, the overlap it
    prevents is then largest; a step without the barrier overlaps the two.
    """
    before, after = PAIRS[pair]
    cuda = device == "cuda"
    host = {"ms": 0.0}
    steps_of = {}
    for name in (before, after):
        train_step, _ = _train_step(name, device, backend)

        def step(train_step: Any = train_step) -> None:
            _host_work(host["ms"])
            train_step()

        for _ in range(10):  # compile, record inductor's CUDA graphs, warm up
            step()
        steps_of[name] = step
    host["ms"] = statistics.median(_round_ms(steps_of[after], steps, cuda) for _ in range(3))
    walls: dict[str, list[float]] = {before: [], after: []}
    for r in range(rounds):
        for name in (before, after) if r % 2 == 0 else (after, before):
            walls[name].append(_round_ms(steps_of[name], steps, cuda))
    return {
        "before": before,
        "after": after,
        "host_ms_per_step": host["ms"],
        "steps_per_round": steps,
        "rounds_ms": walls,
        **paired_summary(walls[before], walls[after]),
    }


def scenario(name: str, device: str, backend: str, steps: int) -> dict[str, Any]:
    if name == "nanogpt":
        return _nanogpt(device, backend, steps)
    return _compiled_scenario(name, device, backend, steps)


# -- the driver: subprocesses, the reference logs, the checks -------------------------

_AT = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)\s*$")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def logged_lines(stderr: str, cudagraphs: bool = True) -> dict[str, list[list[Any]]]:
    """(file, line) of each graph break and CUDA-graph skip that torch's logs name in the bench.

    A record names the bench's own line either as dynamo's ``in user code at``
    place or, where that place is another file, as the innermost frame of this
    file in the record's traceback.
    """
    records: list[tuple[str, list[str]]] = []
    for line in stderr.splitlines():
        if "Graph break" in line and "in user code at" in line:
            records.append(("graph_break", [line]))
        elif "skipping cudagraphs due to" in line:
            records.append(("cudagraph_skip", [line]))
        elif cudagraphs and "__cudagraphs" in line and re.search(r"\bop\d+: reason=", line):
            # torch >= 2.9 splits the graph instead: a non-cudagraphable partition.
            records.append(("cudagraph_skip", [line]))
        elif records:
            if (
                re.match(r"^[A-Z]\d{4} ", line)
                and "__graph_breaks" not in line
                and "__cudagraphs" not in line
            ):
                records.append(("", [line]))  # another logger's record ends the last one
            else:
                records[-1][1].append(line)
    found: dict[str, set[tuple[str, int]]] = {"graph_break": set(), "cudagraph_skip": set()}
    for what, lines in records:
        if not what:
            continue
        at = _AT.search(lines[0])
        if at is not None and os.path.abspath(at.group("file")) == HERE:
            found[what].add((os.path.basename(HERE), int(at.group("line"))))
            continue
        ours = [
            int(m.group("line"))
            for ln in lines
            for m in _FRAME.finditer(ln)
            if os.path.abspath(m.group("file")) == HERE
        ]
        if ours:
            found[what].add((os.path.basename(HERE), ours[-1]))
    return {k: sorted([list(x) for x in v]) for k, v in found.items()}


def reported_lines(report: dict[str, Any]) -> dict[str, list[list[Any]]]:
    section = report.get("compile") or {}
    out: dict[str, set[tuple[str, int]]] = {"graph_break": set(), "cudagraph_skip": set()}
    for b in section.get("graph_breaks", ()):
        if os.path.abspath(b["file"]) == HERE:
            out["graph_break"].add((os.path.basename(HERE), b["line"]))
    for s in section.get("cudagraph_skips", ()):
        if s.get("file") and os.path.abspath(s["file"]) == HERE:
            out["cudagraph_skip"].add((os.path.basename(HERE), s["line"]))
    return {k: sorted([list(x) for x in v]) for k, v in out.items()}


def marker_line(marker: str) -> int:
    with open(HERE) as f:
        for i, text in enumerate(f, 1):
            if f"# bench: {marker}" in text and 'f"# bench' not in text:
                return i
    return 0


def _subprocess(
    what: list[str], label: str, args: argparse.Namespace, out_dir: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str] | None, dict[str, Any], float]:
    """Run this file on one scenario or timing pair; its stderr and stdout go to ``out_dir``."""
    src = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
    env = {**env, "PYTHONPATH": src + os.pathsep + env.get("PYTHONPATH", "")}
    result_file = out_dir / f"{label}.result.json"
    cmd = [sys.executable, HERE, *what, "--device", args.device, "--backend", args.backend]
    cmd += ["--result", str(result_file)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        (out_dir / f"{label}.stderr.log").write_text(err or "")
        return None, {"error": f"timed out after {args.timeout} s"}, float(args.timeout)
    took = time.perf_counter() - t0
    (out_dir / f"{label}.stderr.log").write_text(proc.stderr)
    (out_dir / f"{label}.stdout.log").write_text(proc.stdout)
    if proc.returncode != 0 or not result_file.exists():
        return proc, {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}, took
    return proc, json.loads(result_file.read_text()), took


def run_timing(pair: str, args: argparse.Namespace, out_dir: Path, cache: str) -> dict[str, Any]:
    """The paired timing rounds of one pair, in a process of their own, unwatched."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    env.pop("TORCH_LOGS", None)
    what = ["--timing", pair, "--rounds", str(args.rounds), "--round-steps", str(args.round_steps)]
    _, data, took = _subprocess(what, f"timing_{pair}", args, out_dir, env)
    return {**data, "seconds": took}


def run_one(name: str, args: argparse.Namespace, out_dir: Path, cache: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["TORCH_LOGS"] = "graph_breaks,cudagraphs"
    env["TORCHINDUCTOR_CACHE_DIR"] = (
        tempfile.mkdtemp(prefix="torchinductor_cold_") if name == "nanogpt" else cache
    )
    what = ["--scenario", name, "--steps", str(args.steps)]
    proc, data, took = _subprocess(what, name, args, out_dir, env)
    if proc is None or "error" in data:
        return {**data, "seconds": took}
    report = data["report"]
    # Partitions matter only where CUDA graphs are on (mode="reduce-overhead").
    logged = logged_lines(proc.stderr, cudagraphs=name.startswith("host") and not args.dry_run)
    reported = reported_lines(report)
    section = report.get("compile") or {}
    sites = report.get("sites", [])
    return {
        "seconds": took,
        "logged": logged,
        "reported": reported,
        "agree": logged == reported,
        "verdict": section.get("verdict", "(no compile section)"),
        "compile_syncs": section.get("compile_syncs", 0),
        "sites": [
            {
                "where": f"{os.path.basename(s['file'])}:{s['line']}",
                "kind": s["kind"],
                "origin": s["origin"],
                "step_count": s.get("step_count", 0),
                "phases": s.get("phases", {}),
                "graph_break": s.get("graph_break", ""),
                "compile_flag": s.get("compile_flag", ""),
                "cudagraph_skip": s.get("cudagraph_skip", ""),
            }
            for s in sites
        ],
        **{k: v for k, v in data.items() if k != "report"},
    }


def checks(
    results: dict[str, Any], dry: bool, timings: dict[str, Any] | None = None
) -> dict[str, bool]:
    """What would confirm the feature, scenario by scenario (a missing scenario fails)."""

    def get(name: str) -> dict[str, Any]:
        r = results.get(name) or {}
        return r if "error" not in r else {}

    timings = timings or {}
    item_line, host_line = marker_line("item"), marker_line("host")
    base = os.path.basename(HERE)
    c: dict[str, bool] = {}
    r = get("nanogpt")
    c["nanogpt: no graph break, logs agree"] = (
        bool(r) and r["agree"] and not r["reported"]["graph_break"]
    )
    c["nanogpt: no user site inside inductor's files"] = bool(r) and not r.get(
        "user_sites_in_inductor_files"
    )
    r = get("metric_item")
    c["metric_item: break at the .item() line, logs agree"] = (
        bool(r) and r["agree"] and [base, item_line] in r["reported"]["graph_break"]
    )
    c["metric_item: the site carries the break and capture_scalar_outputs"] = bool(r) and any(
        s["where"] == f"{base}:{item_line}"
        and s["graph_break"]
        and s["compile_flag"] == "capture_scalar_outputs"
        for s in r["sites"]
    )
    r = get("metric_fixed")
    c["metric_fixed: no graph break"] = bool(r) and r["agree"] and not r["reported"]["graph_break"]
    if not dry:
        r = get("host_tensor")
        c["host_tensor: CUDA-graph skip at the host copy line, logs agree"] = (
            bool(r) and r["agree"] and [base, host_line] in r["reported"]["cudagraph_skip"]
        )
        c["host_tensor: probe blocked at the host copy line"] = (
            bool(r) and r["probe"]["status"] == "blocked" and r["probe"]["line"] == host_line
        )
        c["metric_item: probe blocked at the .item() line"] = (
            bool(get("metric_item")) and get("metric_item")["probe"]["line"] == item_line
        )
        r = get("host_fixed")
        # The probe captures the forward; inductor's CUDA graphs hold the last
        # step's autograd graph, so the backward is inductor's verdict (its
        # reason says so), unless the capture of it succeeded here too.
        c["host_fixed: no skip, the probe reports the step capturable"] = (
            bool(r) and not r["reported"]["cudagraph_skip"] and r["probe"]["status"] == "capturable"
        )
        c["metric_fixed: probe capturable"] = (
            bool(get("metric_fixed")) and get("metric_fixed")["probe"]["status"] == "capturable"
        )
        for pair, (before, after) in PAIRS.items():
            t = timings.get(pair) or {}
            # Paired rounds: the fix pays in all of them but at most one.
            c[f"{after} faster than {before} (paired rounds)"] = (
                "error" not in t
                and bool(t.get("rounds_paired"))
                and t["after_faster_rounds"] >= t["rounds_paired"] - 1
            )
    return c


def _ms(q: dict[str, float]) -> str:
    return f"{q['median']:.3f} [{q['q1']:.3f}-{q['q3']:.3f}]"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    ap.add_argument("--timing", choices=tuple(PAIRS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--backend", default=None, help="inductor (GPU default) or eager")
    ap.add_argument("--steps", type=int, default=None, help="watched steps per scenario")
    ap.add_argument("--rounds", type=int, default=None, help="paired timing rounds per pair")
    ap.add_argument("--round-steps", type=int, default=None, help="steps per timing round")
    ap.add_argument("--only", nargs="*", choices=SCENARIOS, help="run only these scenarios")
    ap.add_argument("--dry-run", action="store_true", help="CPU: eager backend, no timed checks")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per subprocess")
    ap.add_argument("--budget", type=int, default=240, help="start no subprocess after S seconds")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for JSON and logs")
    args = ap.parse_args(argv)
    if args.scenario or args.timing:
        if args.timing:
            result = _timing(args.timing, args.device, args.backend, args.rounds, args.round_steps)
        else:
            result = scenario(args.scenario, args.device, args.backend, args.steps)
        Path(args.result).write_text(json.dumps(result, indent=2, default=str))
        return result

    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.backend = args.backend or ("inductor" if cuda else "eager")
    args.steps = args.steps or (20 if cuda else 4)
    args.rounds = args.rounds or (9 if cuda else 3)
    args.round_steps = args.round_steps or (100 if cuda else 3)
    dry = args.device != "cuda"
    names = args.only or (["nanogpt", "metric_item", "metric_fixed"] if dry else list(SCENARIOS))
    pairs = [p for p, members in PAIRS.items() if all(n in names for n in members)]
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="bench_compile_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="torchinductor_bench_")
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    jobs = [(n, False) for n in names] + [(p, True) for p in pairs]
    for name, timed in jobs:
        into = timings if timed else results
        if time.perf_counter() - t0 > args.budget:
            into[name] = {"error": f"not run: past the {args.budget} s budget", "seconds": 0.0}
            print(f"{name}: {into[name]['error']}")
            continue
        into[name] = (run_timing if timed else run_one)(name, args, out_dir, cache)
        r = into[name]
        said = r.get("error", "")[:300] or (
            f"{r['before']} {_ms(r['before_ms'])} -> {r['after']} {_ms(r['after_ms'])} ms/step"
            if timed
            else r.get("verdict", "")
        )
        print(f"{'timing ' if timed else ''}{name}: {said} ({r['seconds']:.0f} s)")
    verdicts = checks(results, dry, timings)
    step_ms = {
        t[side]: t[f"{side}_ms"]
        for t in timings.values()
        if "error" not in t
        for side in ("before", "after")
    }
    rows = []
    for name in names:
        r = results[name]
        if "error" in r:
            rows.append([name, "ERROR", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                name,
                " ".join(f"{f}:{n}" for f, n in r["reported"]["graph_break"]) or "-",
                " ".join(f"{f}:{n}" for f, n in r["reported"]["cudagraph_skip"]) or "-",
                "yes" if r["agree"] else "NO",
                (
                    f"{r['probe']['status']} {r['probe'].get('line') or ''}".strip()
                    if "probe" in r
                    else "-"
                ),
                _ms(step_ms[name]) if name in step_ms else "-",
                str(r["compile_syncs"]),
            ]
        )
    header = [
        "scenario",
        "graph breaks (report)",
        "cudagraph skips",
        "= TORCH_LOGS",
        "probe",
        "ms/step median [IQR]",
        "compile syncs",
    ]
    _table(header, rows)
    trows = [
        [
            pair,
            f"{t['before']} {_ms(t['before_ms'])}",
            f"{t['after']} {_ms(t['after_ms'])}",
            f"{t['speedup_median']:.2f}x",
            f"{t['after_faster_rounds']}/{t['rounds_paired']}",
            f"{t['host_ms_per_step']:.3f}",
        ]
        for pair, t in timings.items()
        if "error" not in t
    ]
    if trows:
        print(
            f"paired rounds ({args.rounds} per pair, {args.round_steps} steps each, the order "
            "alternated; ms/step: wall time, the device drained at each round's ends)"
        )
        _table(["pair", "before", "after", "speedup", "after faster", "host ms/step"], trows)
    for what, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    summary = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": args.backend,
        "seconds": time.perf_counter() - t0,
        "results": results,
        "timings": timings,
        "checks": verdicts,
    }
    path = out_dir / "bench_compile.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"results written to {path} ({summary['seconds']:.0f} s)")
    return summary


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
