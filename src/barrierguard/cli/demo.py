"""The demo: a small training loop with the barriers people write every day."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["train"]


def train(device: str = "cpu", steps: int = 30, log_every: int = 10, quiet: bool = False) -> float:
    """Train a small classifier on synthetic data, the usual (barrier-laden) way.

    Each step copies a pageable batch to the device, reads the loss with ``.item()``, branches on
    a device value and counts confident predictions with a boolean mask; every ``log_every``
    steps it formats the loss.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(steps, 32, 64)
    targets = torch.randint(0, 10, (steps, 32))
    running = 0.0
    for i in range(steps):
        x = data[i].to(device)
        y = targets[i].to(device)
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        running += loss.item()
        confident = out.softmax(-1).amax(-1) > 0.5
        n_confident = out[confident].shape[0]
        if loss > 10:
            raise RuntimeError("training diverged")
        if not quiet and i % log_every == 0:
            print(f"step {i:3d}  loss {loss:.3f}  confident {n_confident}")
    return running / steps
