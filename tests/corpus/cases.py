"""A corpus of synchronizing and quiet lines, annotated with the expected verdict.

A line that synchronizes on a CUDA device ends in ``# expect: KIND`` (optionally
followed by the origin, e.g. ``# expect: item framework:torch.amp``); a trap that
must stay quiet ends in ``# quiet``. Every case takes prepared inputs (see
:func:`prepare`) so that building them is setup, not part of the case.

The same corpus serves every engine: :func:`annotations` reads the expected
verdicts back from this file.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CASES: list[Callable[[dict[str, Any]], None]] = []


def case(fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    CASES.append(fn)
    return fn


def prepare(device: str) -> dict[str, Any]:
    """Inputs for every case, on ``device`` (built before the measured step)."""
    torch.manual_seed(0)
    d: dict[str, Any] = {"device": device, "sink": io.StringIO()}
    d["x"] = torch.randn(256, device=device)
    d["y"] = torch.randn(256, device=device)
    d["labels"] = torch.randint(0, 5, (64,), device=device)
    d["reps"] = torch.randint(1, 3, (256,), device=device)
    d["idx"] = torch.randint(0, 256, (16,), device=device)
    d["probs"] = torch.rand(8, 10, device=device)
    d["host"] = torch.randn(256)
    d["big_host"] = torch.randn(4 * 1024 * 1024)  # 16 MB pageable
    d["small_host"] = torch.randn(32)  # 128 bytes pageable
    d["pinned"] = torch.randn(256).pin_memory() if device == "cuda" else torch.randn(256)
    d["pinned_out"] = torch.empty(256).pin_memory() if device == "cuda" else torch.empty(256)
    d["model"] = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    d["cpu_model"] = nn.Linear(4, 4)
    d["batch"] = torch.randn(8, 16, device=device)
    d["target"] = torch.randint(0, 4, (8,), device=device)
    d["adam"] = torch.optim.Adam(d["model"].parameters(), lr=1e-3)
    d["acc"] = torch.zeros((), device=device)
    d["scaler"] = torch.amp.GradScaler(device)
    d["host_labels"] = torch.from_numpy(np.arange(32) % 4)
    d["cpu_rnn"] = nn.LSTM(8, 16)
    if device == "cuda":
        d["event"] = torch.cuda.Event()
    return d


@case
def reads(d: dict[str, Any]) -> None:
    x = d["x"]
    v = x.sum().item()  # expect: item
    rows = x[:4].tolist()  # expect: tolist
    on_host = x.cpu()  # expect: copy
    arr = x.cpu().numpy()  # expect: copy
    as_int = int(x.sum())  # expect: int
    as_float = float(x.sum())  # expect: float
    del v, rows, on_host, arr, as_int, as_float


@case
def host_to_device(d: dict[str, Any]) -> None:
    dev = d["device"]
    moved = d["host"].to(dev)  # expect: copy
    const = torch.tensor(0.5, device=dev)  # expect: copy
    d["cpu_model"].to(dev)  # expect: copy
    d["cpu_model"].to("cpu")  # expect: copy
    del moved, const


@case
def printing(d: dict[str, Any]) -> None:
    x = d["x"]
    print(x[:3], file=d["sink"])  # expect: print
    text = f"{x.sum():.3f}"  # expect: format
    del text


@case
def control_flow(d: dict[str, Any]) -> None:
    x = d["x"]
    if x.sum() > 1e9:  # expect: bool
        d["sink"].write("big")
    if x.isnan().any():  # expect: bool
        d["sink"].write("nan")


@case
def dynamic_shapes(d: dict[str, Any]) -> None:
    x, labels = d["x"], d["labels"]
    nz = torch.nonzero(x > 0)  # expect: nonzero
    picked = x[x > 0]  # expect: index
    sel = torch.masked_select(x, x > 0)  # expect: masked_select
    uniq = torch.unique(labels)  # expect: unique
    where1 = torch.where(x > 0)  # expect: nonzero
    rep = torch.repeat_interleave(x, d["reps"])  # expect: repeat_interleave
    del nz, picked, sel, uniq, where1, rep


@case
def comparisons(d: dict[str, Any]) -> None:
    x, y = d["x"], d["y"]
    close = torch.allclose(x, y)  # expect: compare
    same = torch.equal(x, y)  # expect: compare
    del close, same


@case
def device_synchronize(d: dict[str, Any]) -> None:
    # Device-agnostic scripts call this too (timing): the CPU audit records it.
    torch.cuda.synchronize()  # expect: synchronize


@case
def explicit_syncs(d: dict[str, Any]) -> None:
    if d["device"] != "cuda":
        return
    torch.cuda.current_stream().synchronize()  # expect: synchronize
    d["event"].record()
    d["event"].synchronize()  # expect: synchronize


@case
def nonblocking_copies(d: dict[str, Any]) -> None:
    dev = d["device"]
    big = d["big_host"].to(dev, non_blocking=True)  # expect: copy
    small = d["small_host"].to(dev, non_blocking=True)  # quiet
    pinned = d["pinned"].to(dev, non_blocking=True)  # quiet
    d["pinned_out"].copy_(d["x"], non_blocking=True)  # quiet
    early = d["x"].to("cpu", non_blocking=True)  # expect: async_d2h
    del big, small, pinned, early


class _SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        scale = float(grad.abs().max())  # expect: float
        return grad * 2 + 0 * scale


@case
def backward_sync(d: dict[str, Any]) -> None:
    w = d["x"].detach().requires_grad_()
    loss = _SyncInBackward.apply(w).sum()
    # The sync runs in autograd's worker thread, with the Python backward on
    # the stack: it is reported at the float() line above, not here.
    loss.backward()  # quiet


@case
def backward_mask(d: dict[str, Any]) -> None:
    w = d["x"].detach().requires_grad_()
    picked = w[d["x"] > 0]  # expect: index
    picked.sum().backward()  # expect: backward


@case
def amp_step(d: dict[str, Any]) -> None:
    model, scaler, opt = d["model"], d["scaler"], d["adam"]
    dev = d["device"]
    with torch.autocast(dev, dtype=torch.float16 if dev == "cuda" else torch.bfloat16):
        loss = F.cross_entropy(model(d["batch"]), d["target"])
    scaler.scale(loss).backward()
    scaler.step(opt)  # expect: item framework:torch.amp
    scaler.update()
    opt.zero_grad()


@case
def quiet_traps(d: dict[str, Any]) -> None:
    x, model = d["x"], d["model"]
    kept = torch.where(x > 0, x, 0.0)  # quiet
    filled = x.masked_fill(x < 0, 0.0)  # quiet
    loss = F.cross_entropy(model(d["batch"]), d["target"])  # quiet
    loss.backward()  # quiet
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # quiet
    d["adam"].step()  # quiet
    d["adam"].zero_grad()  # quiet
    d["acc"] += loss.detach()  # quiet
    drawn = torch.multinomial(d["probs"], 4)  # quiet
    top = x.topk(3)  # quiet
    srt = x.sort()  # quiet
    biggest = x.max()  # quiet
    gathered = x[d["idx"]]  # quiet
    perm = torch.randperm(16, device=d["device"])  # quiet
    del kept, filled, drawn, top, srt, biggest, gathered, perm


@case
def host_bookkeeping(d: dict[str, Any]) -> None:
    # Host tensors never touch the GPU, whatever the device: never a sync.
    hist = torch.zeros(5)  # quiet
    hist[2] += 1.0  # quiet
    total = hist.sum().item()  # quiet
    share = f"{hist[2] / total:.2f}"  # quiet
    if hist.max() > 0:  # quiet
        d["sink"].write(share)
    print(hist, file=d["sink"])  # quiet
    labels = d["host_labels"]  # quiet
    kept = labels[labels > 1]  # quiet
    classes = torch.unique(labels)  # quiet
    counts = torch.bincount(labels)  # quiet
    rows = labels.tolist()  # quiet
    n = int(labels.sum())  # quiet
    arr = labels.numpy()  # quiet
    again = labels.cpu()  # quiet
    del kept, classes, counts, rows, n, arr, again


@case
def host_after_moves(d: dict[str, Any]) -> None:
    dev, x = d["device"], d["x"]
    batch = torch.from_numpy(np.linspace(0, 1, 64, dtype=np.float32))  # quiet
    batch = (batch - batch.mean()) / batch.std()  # quiet
    on_dev = batch.to(dev)  # expect: copy
    spread = batch.max().item()  # quiet
    scores = (x > 0).float().cpu()  # expect: copy
    hits = scores.sum().item()  # quiet
    n_pos = int(scores.sum())  # quiet
    text = f"{scores.mean():.3f}"  # quiet
    del on_dev, spread, hits, n_pos, text


@case
def checkpoints(d: dict[str, Any]) -> None:
    model, dev = d["model"], d["device"]
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # expect: copy
    buf.seek(0)
    back = torch.load(buf)  # expect: copy
    buf.seek(0)
    onto = torch.load(buf, map_location=dev)  # expect: copy
    buf.seek(0)
    on_host = torch.load(buf, map_location="cpu")  # quiet
    model.load_state_dict(on_host)  # expect: copy
    del back, onto


@case
def index_lists(d: dict[str, Any]) -> None:
    x, labels = d["probs"].clone(), d["labels"][:8]
    picked = x[range(8), labels]  # expect: index
    rows = x[[0, 2]]  # expect: index
    x[range(8), labels] = 0.0  # expect: index
    on_dev = torch.arange(8, device=d["device"])  # quiet
    fine = x[on_dev, labels]  # quiet
    basic = x[0, 2]  # quiet
    del picked, rows, fine, basic


@case
def rnn_weights(d: dict[str, Any]) -> None:
    rnn = d["cpu_rnn"]
    rnn.to(d["device"])  # expect: copy
    rnn.flatten_parameters()  # expect: rnn_flatten
    rnn.to("cpu")  # expect: copy
    rnn.flatten_parameters()  # quiet


_ANNOTATION = re.compile(r"#\s*(expect:\s*(?P<kind>\w+)(?:\s+(?P<origin>[\w:.]+))?|quiet)\s*$")


def annotations() -> dict[int, tuple[str, str] | None]:
    """Line number -> ``(kind, origin)`` for expected syncs, ``None`` for quiet lines."""
    out: dict[int, tuple[str, str] | None] = {}
    for lineno, text in enumerate(Path(__file__).read_text().splitlines(), 1):
        m = _ANNOTATION.search(text)
        if m is None:
            continue
        if m.group("kind") is None:
            out[lineno] = None
        else:
            out[lineno] = (m.group("kind"), m.group("origin") or "user")
    return out


def run_all(d: dict[str, Any]) -> None:
    for fn in CASES:
        fn(d)
