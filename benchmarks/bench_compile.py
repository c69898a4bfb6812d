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
    against the reference, line by line), then timed without the guard (CUDA events
    around each of 100 steps after 10 of warm-up, the median):

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

    The capture probe captures one call of the eager forward+backward of the same step
    (``Guard.probe_capture``), before and after each fix. The table and a PASS/FAIL line
    per check are printed; ``bench_compile.json`` and each scenario's logs go to ``$OUT``
    (or ``--out DIR``).

Reproduce:
    PYTHONPATH=src python benchmarks/bench_compile.py

    The committed ``benchmarks/results/h200/compile.json`` (and ``compile.txt``, the
    printed table) is the run at 5e9cb33 with ``--out /tmp/compile --budget 130``.

    GPU, under 5 minutes (every scenario has its own time limit, ``--timeout``). On a
    CPU, ``PYTHONPATH=src python benchmarks/bench_compile.py --dry-run`` runs the compile
    scenarios with the ``eager`` backend and no timing (a test runs ``metric_item``).
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
PAIRS = (("metric_item", "metric_fixed"), ("host_tensor", "host_fixed"))


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


def _classifier(device: str) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)
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


def _median_ms(step: Any, device: str, n: int, warmup: int) -> dict[str, float]:
    import torch

    for _ in range(warmup):
        step()
    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(n)
    ]
    t0 = time.perf_counter()
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e3
    return {
        "step_ms_median": statistics.median(s.elapsed_time(e) for s, e in events),
        "wall_ms_per_step": wall,
    }


def _compiled_scenario(name: str, device: str, backend: str, steps: int) -> dict[str, Any]:
    import torch

    import barrierguard

    model, opt, (x, y) = _classifier(device)
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

    with barrierguard.watch(policy="record", memory=False, warmup_steps=1) as guard:
        for _ in range(steps):
            train_step()
        probe = guard.probe_capture(eager_fwd_bwd)
        for _ in range(2):
            train_step()
    result: dict[str, Any] = {"report": guard.report.to_dict(), "probe": probe.to_dict()}
    result.update(_median_ms(train_step, device, n=100, warmup=10))
    return result


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


def run_one(name: str, args: argparse.Namespace, out_dir: Path, cache: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["TORCH_LOGS"] = "graph_breaks,cudagraphs"
    env["TORCHINDUCTOR_CACHE_DIR"] = (
        tempfile.mkdtemp(prefix="torchinductor_cold_") if name == "nanogpt" else cache
    )
    src = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    result_file = out_dir / f"{name}.result.json"
    cmd = [
        sys.executable,
        HERE,
        "--scenario",
        name,
        "--device",
        args.device,
        "--backend",
        args.backend,
        "--steps",
        str(args.steps),
        "--result",
        str(result_file),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        (out_dir / f"{name}.stderr.log").write_text(err or "")
        return {"error": f"timed out after {args.timeout} s", "seconds": args.timeout}
    took = time.perf_counter() - t0
    (out_dir / f"{name}.stderr.log").write_text(proc.stderr)
    (out_dir / f"{name}.stdout.log").write_text(proc.stdout)
    if proc.returncode != 0 or not result_file.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}", "seconds": took}
    data = json.loads(result_file.read_text())
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


def checks(results: dict[str, Any], dry: bool) -> dict[str, bool]:
    """What would confirm the feature, scenario by scenario (a missing scenario fails)."""

    def get(name: str) -> dict[str, Any]:
        r = results.get(name) or {}
        return r if "error" not in r else {}

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
        # Inductor's CUDA graphs keep the last step's outputs (and their
        # autograd graph) alive, so the eager probe may be inconclusive here:
        # what counts is that it names no blocking line.
        c["host_fixed: no skip, the probe names no blocking line"] = (
            bool(r) and not r["reported"]["cudagraph_skip"] and r["probe"]["status"] != "blocked"
        )
        c["metric_fixed: probe capturable"] = (
            bool(get("metric_fixed")) and get("metric_fixed")["probe"]["status"] == "capturable"
        )
        for before, after in PAIRS:
            a, b = get(before), get(after)
            c[f"{after} faster than {before}"] = (
                bool(a and b) and b["step_ms_median"] < a["step_ms_median"]
            )
    return c


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--backend", default=None, help="inductor (GPU default) or eager")
    ap.add_argument("--steps", type=int, default=None, help="watched steps per scenario")
    ap.add_argument("--only", nargs="*", choices=SCENARIOS, help="run only these scenarios")
    ap.add_argument("--dry-run", action="store_true", help="CPU: eager backend, no timing")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per scenario")
    ap.add_argument("--budget", type=int, default=240, help="start no scenario after S seconds")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for JSON and logs")
    args = ap.parse_args(argv)
    if args.scenario:
        result = scenario(args.scenario, args.device, args.backend, args.steps)
        Path(args.result).write_text(json.dumps(result, indent=2, default=str))
        return result

    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.backend = args.backend or ("inductor" if cuda else "eager")
    args.steps = args.steps or (20 if cuda else 4)
    dry = args.device != "cuda"
    names = args.only or (["nanogpt", "metric_item", "metric_fixed"] if dry else list(SCENARIOS))
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="bench_compile_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="torchinductor_bench_")
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    for name in names:
        if time.perf_counter() - t0 > args.budget:
            results[name] = {"error": f"not run: past the {args.budget} s budget", "seconds": 0.0}
            print(f"{name}: {results[name]['error']}")
            continue
        results[name] = run_one(name, args, out_dir, cache)
        r = results[name]
        print(f"{name}: {r.get('verdict', r.get('error', '')[:300])} ({r['seconds']:.0f} s)")
    verdicts = checks(results, dry)
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
                f"{r['step_ms_median']:.3f}" if "step_ms_median" in r else "-",
                str(r["compile_syncs"]),
            ]
        )
    header = [
        "scenario",
        "graph breaks (report)",
        "cudagraph skips",
        "= TORCH_LOGS",
        "probe",
        "step ms (median)",
        "compile syncs",
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    for what, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    summary = {
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": args.backend,
        "seconds": time.perf_counter() - t0,
        "results": results,
        "checks": verdicts,
        "speedups": {
            f"{b} -> {a}": results[b]["step_ms_median"] / results[a]["step_ms_median"]
            for b, a in PAIRS
            if all("step_ms_median" in results.get(n, {}) for n in (a, b))
        },
    }
    path = out_dir / "bench_compile.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"results written to {path} ({summary['seconds']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
