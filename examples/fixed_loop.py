"""``plain_loop.py`` without its barriers: it passes the error policy on a GPU.

    barrierguard run --policy error examples/fixed_loop.py --steps 50

Metrics stay on the device in a ``MetricBuffer``; batches come from pinned memory with
``non_blocking=True``; the mask count is a fixed-shape sum; printing happens after the loop.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import barrierguard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(args.steps, args.batch, 128)
    labels = torch.randint(0, 10, (args.steps, args.batch))
    if device == "cuda":
        data, labels = data.pin_memory(), labels.pin_memory()
    metrics = barrierguard.MetricBuffer(
        {"loss": ("mean", "weighted"), "accuracy": ("mean", "weighted"), "hard": "sum"}
    )
    for step in range(args.steps):
        x = data[step].to(device, non_blocking=True)
        y = labels[step].to(device, non_blocking=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        accuracy = (logits.argmax(-1) == y).float().mean()
        hard = (logits.max(-1).values < 1.0).sum()
        metrics.update(loss=loss, accuracy=accuracy, hard=hard, n=args.batch)
    result = metrics.compute()  # one transfer, after the loop
    print(
        f"mean loss {result['loss']:.4f}, accuracy {result['accuracy']:.3f}, "
        f"{int(result['hard'])} hard examples"
    )


if __name__ == "__main__":
    main()
