"""What does the audit engine cost a training step on CPU, and each read it records?

Question:
    On a CPU-only machine ``watch()`` uses the audit engine, a
    ``TorchFunctionMode`` that follows which tensors would live on the device.
    How much slower does a small training step run under it (the target: at
    most 1.2x for a transformer step of many small ops), and what does it add
    to each read it records (at most 4 us, 20 frames deep)?

Design:
    Adam steps of small MLPs (``--configs``, WIDTHxHIDDEN_LAYERS, batch 64, a
    ``non_blocking`` batch copy, forward, cross-entropy, backward), with no sync
    in the step, so what is measured is the price of watching, not of recording.
    The guard is started while the model is built (as under ``barrierguard
    run``), so the audit follows every tensor from its creation. Variants
    ``bare``, ``audit`` (a running ``watch(engine="audit")``) and, for scale, a
    no-op ``TorchFunctionMode`` time blocks of ``--steps`` steps in ``--pairs``
    paired rounds (the order rotating); the figure is the median of the
    per-round ratios to bare, with its IQR. One torch thread (``--threads``).

    The transformer step (``--gpt``, on by default) is a minGPT-sized model
    written as minGPT writes it (``n_layer`` 3, ``n_head`` 3, ``n_embd`` 48,
    block 32, vocabulary 64, batch 8; attention as view/transpose/matmul/
    masked_fill/softmax, GELU MLP, LayerNorm, AdamW), timed the same way: about
    a hundred small ops per forward, each one a call the mode intercepts.

    Per read: a device tensor's ``.item()`` called ``--calls`` times from a
    function ``--depths`` frames below the benchmark's loop (no framework on
    the stack, so the walk goes to the root), bare and under a running
    ``watch(engine="audit")`` in paired rounds; the figure is the median
    added microseconds per read.

Reproduce:
    PYTHONPATH=src python benchmarks/bench_audit.py --clock thread --pairs 40 --gpt-pairs 30 \\
        --read-pairs 15 --out benchmarks/results/audit_cpu.json

    On the 2-core CPU machine of the CPU results (see ``docs/benchmarks.md``), shared with
    other jobs (load average above 10): ``--clock thread`` times each block in the thread's
    CPU time, which leaves out the waits for a core that wall time would count.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, paired_rounds, quartiles, table, write
from _common import timed as _wall_timed

import barrierguard

_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
_clock = _CLOCKS["wall"]


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn``: wall time, or with ``--clock thread`` this thread's CPU time.

    On a CPU machine shared with other jobs, a thread's CPU time leaves out the
    time it waited for a core (one torch thread: the thread does all the work).
    """
    if _clock is time.perf_counter:
        return _wall_timed(fn)
    t0 = _clock()
    fn()
    return _clock() - t0


class _Noop(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*args, **(kwargs or {}))


def make_step(width: int, layers: int, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    device = torch.device("cpu")  # the device-agnostic script's "device"
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(width, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    host_x = torch.randn(batch, width)
    host_y = torch.randint(0, 10, (batch,))

    def step() -> None:
        x = host_x.to(device, non_blocking=True)
        y = host_y.to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


class _Attention(nn.Module):
    """minGPT's CausalSelfAttention, op for op."""

    def __init__(self, n_embd: int, n_head: int, block: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = nn.functional.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _Attention(n_embd, n_head, block)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(nn.functional.gelu(self.fc(self.ln_2(x))))


class _GPT(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, block) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_gpt_step(batch: int = 8, block: int = 32, vocab: int = 64) -> Callable[[], None]:
    """A minGPT 'gpt-nano' training step (AdamW), its batch copied to the device."""
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = _GPT(vocab, block, n_layer=3, n_head=3, n_embd=48).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    host_x = torch.randint(0, vocab, (batch, block))
    host_y = torch.randint(0, vocab, (batch, block))

    def step() -> None:
        x = host_x.to(device, non_blocking=True)
        y = host_y.to(device, non_blocking=True)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def overhead(
    width: int, layers: int, batch: int, steps: int, pairs: int, gpt: bool = False
) -> dict[str, Any]:
    # The guard starts before the model is built, as under `barrierguard run`,
    # so the audit follows every tensor from its creation.
    guard = barrierguard.watch(engine="audit", policy="record")
    guard.start()
    step = make_gpt_step() if gpt else make_step(width, layers, batch)
    guard.stop()
    noop = _Noop()

    def block() -> None:
        for _ in range(steps):
            step()

    for _ in range(3):
        block()

    def run(name: str) -> float:
        if name == "audit":
            guard.start()
            try:
                return timed(block)
            finally:
                guard.stop()
        if name == "noop_mode":
            with noop:
                return timed(block)
        return timed(block)

    names = ["bare", "audit", "noop_mode"]
    rounds = paired_rounds(names, run, pairs)
    ratios = {n: [r[n] / r["bare"] for r in rounds] for n in names[1:]}
    report = guard.report
    assert report.step_syncs == 0, report
    assert report.steps == steps * pairs, report.steps
    return {
        "model": "mingpt-nano" if gpt else "mlp",
        "width": width,
        "layers": layers,
        "batch": batch,
        "steps_per_block": steps,
        "pairs": pairs,
        "step_us": {n: median([r[n] / steps for r in rounds]) * 1e6 for n in names},
        "ratio_median": {n: median(v) for n, v in ratios.items()},
        "ratio_quartiles": {n: quartiles(v) for n, v in ratios.items()},
    }


def _nested(depth: int, fn: Callable[[], None]) -> None:
    if depth <= 1:
        fn()
    else:
        _nested(depth - 1, fn)


def per_read(depth: int, calls: int, pairs: int) -> dict[str, Any]:
    """Microseconds a recorded ``.item()`` adds, ``depth`` frames below the loop."""
    guard = barrierguard.watch(engine="audit", policy="record", memory=False)
    device = torch.device("cpu")  # the device-agnostic script's "device"
    box = [torch.ones(1)]

    def loop() -> None:
        x = box[0]
        for _ in range(calls):
            x.item()

    def run(name: str) -> float:
        if name == "audit":
            guard.start()
            try:
                # Made under the guard: a device tensor in the audit's eyes.
                box[0] = torch.ones(1).to(device)
                return timed(lambda: _nested(depth, loop))
            finally:
                guard.stop()
        box[0] = torch.ones(1).to(device)
        return timed(lambda: _nested(depth, loop))

    run("bare")
    run("audit")
    rounds = paired_rounds(["bare", "audit"], run, pairs)
    added = [(r["audit"] - r["bare"]) / calls * 1e6 for r in rounds]
    (site,) = [s for s in guard.report.sites if s.kind == "item"]
    assert site.count == calls * (pairs + 1), site.count
    return {
        "depth": depth,
        "calls": calls,
        "pairs": pairs,
        "us_bare": median([r["bare"] for r in rounds]) / calls * 1e6,
        "us_added": median(added),
        "us_added_quartiles": quartiles(added),
    }


def start_stop(repeats: int) -> float:
    guard = barrierguard.watch(engine="audit", policy="record")
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        guard.start()
        guard.stop()
        samples.append(time.perf_counter() - t0)
    return median(samples)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument(
        "--configs",
        default="128x2,256x2,64x2",
        help="comma-separated WIDTHxHIDDEN_LAYERS; the first is the headline",
    )
    ap.add_argument("--gpt", type=int, default=1, help="time the minGPT step too (0: skip)")
    ap.add_argument("--gpt-pairs", type=int, default=60)
    ap.add_argument("--depths", default="3,20", help="comma-separated frame depths of the read")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--read-pairs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument(
        "--clock",
        choices=sorted(_CLOCKS),
        default="wall",
        help="thread: time each block in this thread's CPU time (a loaded shared machine)",
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    global _clock
    _clock = _CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "clock": args.clock,
        "torch_threads": torch.get_num_threads(),
        "target_ratio": 1.5,
    }
    runs = []
    rows = []
    for spec in args.configs.split(","):
        width, layers = (int(v) for v in spec.split("x"))
        ov = overhead(width, layers, args.batch, args.steps, args.pairs)
        runs.append(ov)
        q = ov["ratio_quartiles"]
        rows.append(
            [
                f"{layers + 1} Linear, width {width}, batch {args.batch}",
                f"{ov['step_us']['bare']:.0f}",
                f"{ov['step_us']['audit']:.0f}",
                f"{ov['ratio_median']['audit']:.3f} ({q['audit'][0]:.3f}-{q['audit'][1]:.3f})",
                f"{ov['ratio_median']['noop_mode']:.3f}",
            ]
        )
    if args.gpt:
        ov = overhead(0, 3, 8, args.steps, args.gpt_pairs, gpt=True)
        runs.append(ov)
        q = ov["ratio_quartiles"]
        rows.append(
            [
                "minGPT nano (3 layers, 3 heads, 48 wide, block 32), batch 8",
                f"{ov['step_us']['bare']:.0f}",
                f"{ov['step_us']['audit']:.0f}",
                f"{ov['ratio_median']['audit']:.3f} ({q['audit'][0]:.3f}-{q['audit'][1]:.3f})",
                f"{ov['ratio_median']['noop_mode']:.3f}",
            ]
        )
        results["gpt_ratio"] = ov["ratio_median"]["audit"]
        results["gpt_target_ratio"] = 1.2
    results["runs"] = runs
    results["headline_ratio"] = runs[0]["ratio_median"]["audit"]
    reads = [per_read(int(d), args.calls, args.read_pairs) for d in args.depths.split(",") if d]
    results["reads"] = reads
    results["read_target_us_at_20"] = 4.0
    results["start_stop_ms"] = start_stop(5) * 1e3
    print("\n## audit engine on a CPU training step (no sync in the step)")
    print(
        table(
            [
                "MLP step",
                "bare us",
                "audit us",
                "audit / bare, median (IQR)",
                "no-op TorchFunctionMode / bare",
            ],
            rows,
        )
    )
    print(
        f"{args.pairs} interleaved rounds x {args.steps} steps, {torch.get_num_threads()} torch "
        f"threads; start()+stop(): {results['start_stop_ms']:.1f} ms (after the first)"
    )
    if reads:
        print("\n## what the audit adds to one recorded .item() (us per read, median of pairs)")
        print(
            table(
                ["frames below the loop", "bare us", "added us (IQR)"],
                [
                    [
                        r["depth"],
                        f"{r['us_bare']:.2f}",
                        f"{r['us_added']:.2f} ({r['us_added_quartiles'][0]:.2f}-"
                        f"{r['us_added_quartiles'][1]:.2f})",
                    ]
                    for r in reads
                ],
            )
        )
    write(args.out, results)
    return results


if __name__ == "__main__":
    main()
