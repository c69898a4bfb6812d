"""A Hugging Face Trainer fit of a small GPT-2 (built from its config), and the same fit with the report's fixes.

    barrierguard run examples/hf_fit.py                             # the default fit: its syncs
    barrierguard run --policy error --allow mechanism:hf_logging examples/hf_fit.py --hinted
    python examples/hf_fit.py --time                                 # ms per step, no barrierguard

No download: the model is built from a ``GPT2Config`` and trained on random
tokens. The default ``TrainingArguments`` make three syncs a step on a GPU:
the packed-sequence check in every forward (the Trainer turns the KV cache off,
and the batches carry no attention mask), the NaN/Inf filter on every
micro-batch's loss, and accelerate's blocking batch copy. ``--hinted`` sets
what barrierguard's report names: ``use_cache=True``,
``logging_nan_inf_filter=False`` and ``accelerator_config={"non_blocking": True}``
(with ``dataloader_pin_memory=True``, the default). What stays is the loss and
gradient-norm read at each logging step (``mechanism:hf_logging``): no setting
removes it, only logging less often.

``--time`` prints the median time per optimizer step over windows after warm-up
(a synchronize only at each window's ends).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(transformers.TrainerCallback):
    """Median ms per optimizer step over windows of ``window`` steps after ``warmup``."""

    def __init__(self, warmup: int, window: int) -> None:
        self.warmup, self.window = warmup, window
        self.per_step: list[float] = []
        self._t0: float | None = None

    def _now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step < self.warmup or (step - self.warmup) % self.window:
            return
        # Logging happens right after on_step_end: windows end on a non-log step
        # only by chance, so every window holds the same number of logs.
        now = self._now()
        if self._t0 is not None:
            self.per_step.append((now - self._t0) / self.window * 1e3)
        self._t0 = now


def main(argv: list[str] | None = None) -> float | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hinted", action="store_true", help="apply the report's fixes")
    p.add_argument("--time", action="store_true", help="print the median ms per step")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--out", default="/tmp/barrierguard_hf_fit")
    ns = p.parse_args(argv)
    transformers.set_seed(0)
    vocab = 8192
    config = transformers.GPT2Config(
        n_layer=ns.layers,
        n_embd=ns.width,
        n_head=8,
        vocab_size=vocab,
        n_positions=ns.length,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    settings: dict[str, Any] = {
        "output_dir": ns.out,
        "max_steps": ns.steps,
        "per_device_train_batch_size": ns.batch,
        "per_device_eval_batch_size": ns.batch,
        "learning_rate": 1e-4,
        "logging_steps": 10,
        "eval_strategy": "steps",
        "eval_steps": max(1, ns.steps // 2),
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": not torch.cuda.is_available(),
        "dataloader_pin_memory": torch.cuda.is_available(),
        "seed": 0,
    }
    if ns.hinted:
        settings.update(
            use_cache=True,
            logging_nan_inf_filter=False,
            accelerator_config={"non_blocking": True},
        )
    warmup = min(20, ns.steps // 4)
    timer = StepTimer(warmup=warmup, window=max(1, min(10, (ns.steps - warmup) // 3)))
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**settings),
        train_dataset=Tokens(ns.steps * ns.batch, ns.length, vocab),
        eval_dataset=Tokens(2 * ns.batch, ns.length, vocab),
        callbacks=[timer] if ns.time else [],
    )
    trainer.train()
    if ns.time and timer.per_step:
        median = statistics.median(timer.per_step)
        print(f"ms/step {median:.3f}")
        return median
    return None


if __name__ == "__main__":
    main()
