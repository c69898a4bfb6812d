"""A tiny GPT-2 built from its config (no download) and a Trainer for the HF tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

# The settings the report's hints name for the syncs of a default fit.
HINTED: dict[str, Any] = {
    "use_cache": True,
    "logging_nan_inf_filter": False,
    "accelerator_config": {"non_blocking": True},
}


class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the labels being the inputs (a language model)."""

    def __init__(self, n: int = 32, length: int = 16, vocab: int = 128, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(seed: int = 0) -> Any:
    import transformers

    transformers.set_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def trainer(out: Path, callbacks: list[Any] | None = None, *, steps: int = 6, **args: Any) -> Any:
    import transformers

    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": steps,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "learning_rate": 1e-3,
        "logging_steps": 2,
        "eval_strategy": "steps",
        "eval_steps": 3,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
        "seed": 0,
    }
    settings.update(args)
    return transformers.Trainer(
        model=tiny_gpt2(),
        args=transformers.TrainingArguments(**settings),
        train_dataset=TokenDataset(),
        eval_dataset=TokenDataset(n=8, seed=1),
        callbacks=callbacks or [],
    )
