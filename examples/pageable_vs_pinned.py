"""Batches copied from pageable memory against pinned memory with ``non_blocking=True``.

    python examples/pageable_vs_pinned.py             # CUDA when available: real sizes
    python examples/pageable_vs_pinned.py --device cpu --steps 8 --batch 64 --width 64

A ``DataLoader`` hands out batches in ordinary (pageable) host memory. Copying
one to the GPU with ``.to(device)`` makes the host wait until the copy is done,
and the copy waits for the work already queued: a barrier every step. With
``DataLoader(pin_memory=True)`` the batches land in page-locked memory, and
``.to(device, non_blocking=True)`` only queues the copy: the host goes on to
the next batch while the device computes.

Even ``non_blocking=True`` blocks for pageable memory above a couple of MiB
(the driver stages the data through a pinned buffer of its own), so pinning is
what makes the copy asynchronous.

On a CPU nothing is copied and nothing can be pinned: the rows take the same
time, and barrierguard's report shows the copy each pageable step would wait for.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _seed

import barrierguard


class Loop:
    """A dataset in host memory, a model on the device, and an epoch over the data."""

    def __init__(
        self, device: torch.device, steps: int, batch: int, width: int, layers: int
    ) -> None:
        torch.manual_seed(0)
        self.device = device
        self.batch = batch
        self.data = TensorDataset(
            torch.randn(steps * batch, width), torch.randint(0, 10, (steps * batch,))
        )
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(width, width), nn.ReLU()]
        self.model = nn.Sequential(*mods, nn.Linear(width, 10)).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def loader(self, pinned: bool) -> DataLoader[tuple[torch.Tensor, ...]]:
        # Whole batches by index lists: no per-row collation on the host.
        batches = BatchSampler(SequentialSampler(self.data), self.batch, drop_last=True)
        pin = pinned and self.device.type == "cuda"
        return DataLoader(self.data, sampler=batches, batch_size=None, pin_memory=pin)

    def epoch(self, pinned: bool) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for x, y in self.loader(pinned):
            if pinned:
                x = x.to(self.device, non_blocking=True)  # queued; the host moves on
                y = y.to(self.device, non_blocking=True)
            else:
                x = x.to(self.device)  # the host waits for the copy, and the copy for the queue
                y = y.to(self.device)
            loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += loss.detach()
        return total


def main(argv: list[str] | None = None) -> dict[str, barrierguard.Report]:
    parser = _seed.base_parser(__doc__)
    parser.add_argument("--steps", type=int, default=40, help="batches per epoch")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    device = _seed.pick_device(args.device)
    loop = Loop(device, args.steps, args.batch, args.width, args.layers)
    mb = args.batch * args.width * 4 / 2**20
    print(f"device {device}: {args.steps} batches of {args.batch}x{args.width} ({mb:.2f} MiB)")
    times = _seed.compare(
        {"pageable": lambda: loop.epoch(False), "pinned + non_blocking": lambda: loop.epoch(True)},
        device,
        args.repeats,
    )
    print(_seed.timing_table(times, "pageable", args.steps))
    _seed.save_json(
        args.json,
        {"device": str(device), "steps": args.steps, "batch_mib": mb, "seconds": times},
    )
    reports: dict[str, barrierguard.Report] = {}
    if args.no_watch:
        return reports
    small = Loop(device, args.watch_steps, args.batch, args.width, args.layers)
    for name, pinned in (("pageable", False), ("pinned", True)):

        def run(guard: barrierguard.Guard, pinned: bool = pinned) -> None:
            small.epoch(pinned)

        reports[name] = _seed.watched(name, run, args)
    return reports


if __name__ == "__main__":
    main()
