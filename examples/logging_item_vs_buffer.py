"""Logging the loss with ``.item()`` every step against a ``MetricBuffer``, in a balanced loop.

    python examples/logging_item_vs_buffer.py        # CUDA when available: real sizes
    python examples/logging_item_vs_buffer.py --device cpu --steps 10 --width 64 --host-ms 0.5

Each step prepares its batch on the host (a calibrated busy-wait standing in
for decoding and augmentation) and then trains a small MLP on the device. When
the host preparation and the device compute take about as long, an
asynchronous loop overlaps them: step N+1 is prepared while step N computes.

``loss.item()`` makes the host wait for step N before preparing step N+1, so
the two stop overlapping: the step costs host + device instead of
max(host, device), up to 2x when they are equal. A sync costs the overlap it
destroys, at most min(host, device) per step. ``barrierguard.MetricBuffer``
keeps the running mean on the device and reads it once, after the loop.

On a CPU the host does both parts, so there is nothing to overlap and the
three rows take the same time; barrierguard's report still shows which
variant would wait on a GPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _seed

import barrierguard


def busy_wait(ms: float) -> None:
    """Keep the host busy for ``ms`` (a stand-in for data preparation)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Loop:
    """A model, its optimizer and a step with a choice of logging."""

    def __init__(self, device: torch.device, width: int, layers: int, batch: int) -> None:
        torch.manual_seed(0)
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(width, width), nn.ReLU()]
        self.model = nn.Sequential(*mods, nn.Linear(width, 10)).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(batch, width, device=device)
        self.y = torch.randint(0, 10, (batch,), device=device)

    def train_step(self) -> torch.Tensor:
        loss = F.cross_entropy(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss

    def run(self, steps: int, host_ms: float, logging: str) -> float:
        """``steps`` steps; ``logging`` is ``"none"``, ``"item"`` or ``"buffer"``."""
        losses: list[float] = []
        buf = barrierguard.MetricBuffer({"loss": "mean"})
        for _ in range(steps):
            busy_wait(host_ms)
            loss = self.train_step()
            if logging == "item":
                losses.append(loss.item())  # waits for this step's compute
            elif logging == "buffer":
                buf.update(loss=loss)  # stays on the device
        if logging == "item":
            return sum(losses) / len(losses)
        if logging == "buffer":
            return float(buf.compute()["loss"])  # one transfer, after the loop
        return float("nan")


def device_ms(loop: Loop, device: torch.device, steps: int = 20) -> float:
    """Milliseconds one training step takes with the host doing nothing else."""
    for _ in range(3):
        loop.train_step()
    seconds = _seed.time_it(lambda: [loop.train_step() for _ in range(steps)], device)
    return seconds / steps * 1e3


def main(argv: list[str] | None = None) -> dict[str, barrierguard.Report]:
    parser = _seed.base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument(
        "--host-ms", type=float, default=0.0, help="host preparation per step (0: the device time)"
    )
    args = parser.parse_args(argv)
    device = _seed.pick_device(args.device)
    loop = Loop(device, args.width, args.layers, args.batch)
    compute_ms = device_ms(loop, device)
    host_ms = args.host_ms or compute_ms
    print(
        f"device {device}: a training step takes {compute_ms:.3f} ms; host preparation "
        f"{host_ms:.3f} ms per step; {args.steps} steps"
    )
    variants: dict[str, Callable[[], object]] = {
        name: (lambda name=name: loop.run(args.steps, host_ms, name))
        for name in ("none", "item", "buffer")
    }
    times = _seed.compare(variants, device, args.repeats)
    print(_seed.timing_table(times, "none", args.steps))
    bound = min(host_ms, compute_ms)
    print(f"a sync per step can cost at most min(host, device) = {bound:.3f} ms per step")
    _seed.save_json(
        args.json,
        {
            "device": str(device),
            "steps": args.steps,
            "device_ms_per_step": compute_ms,
            "host_ms_per_step": host_ms,
            "seconds": times,
        },
    )
    reports: dict[str, barrierguard.Report] = {}
    if args.no_watch:
        return reports
    for name in ("item", "buffer"):

        def run(guard: barrierguard.Guard, name: str = name) -> None:
            loop.run(args.watch_steps, host_ms, name)

        reports[name] = _seed.watched(name, run, args)
    return reports


if __name__ == "__main__":
    main()
