"""A training loop written the usual way, barriers and all.

    barrierguard run examples/plain_loop.py --steps 50

Runs on CPU or GPU. Compare with ``fixed_loop.py``, the same loop without barriers.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(args.steps, args.batch, 128)  # pageable host memory
    labels = torch.randint(0, 10, (args.steps, args.batch))
    total_loss, correct = 0.0, 0
    for step in range(args.steps):
        x, y = data[step].to(device), labels[step].to(device)  # blocking pageable copies
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total_loss += loss.item()  # a sync every step
        correct += int((logits.argmax(-1) == y).sum())  # another one
        hard = logits[logits.max(-1).values < 1.0]  # mask indexing: the size is on the device
        if step % 10 == 0:
            print(f"step {step}: loss {loss:.4f}, {len(hard)} hard examples")  # formatting syncs
    print(
        f"mean loss {total_loss / args.steps:.4f}, accuracy {correct / (args.steps * args.batch):.3f}"
    )


if __name__ == "__main__":
    main()
