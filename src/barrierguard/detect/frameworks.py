"""The syncs that frameworks make, why, and the setting on the user's side that removes each.

:data:`MECHANISMS` is the table of known framework syncs; :data:`PHASES` marks the functions
that tell a sync's phase. ``detect.stack`` reads both through :func:`file_entry`. A new sync is
one :class:`Mechanism`, its fix proven on a GPU (docs/frameworks.md) and a test row.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from barrierguard.detect.frames import LIBRARY, OWN, TORCH, classify_file

__all__ = [
    "MECHANISMS",
    "PHASES",
    "PHASE_PACKAGES",
    "Mechanism",
    "file_entry",
    "mechanism",
    "mechanism_fixes",
    "package_path",
]


@dataclass(frozen=True)
class Mechanism:
    """One known sync inside a framework.

    Attributes:
        name: A short stable name, recorded in each site's ``mechanisms``.
        functions: Where it lives: ``"package/path.py:function"`` (``*``: any function of the
            file); the innermost match on the stack wins.
        why: One sentence: what the framework reads on the host, and when.
        fix: The setting on the user's side that removes the sync, or ``""``.
        no_fix: When ``fix`` is empty: why nothing removes it (and what it costs).
        direct: Only a sync made in these functions themselves, not in one they call.
    """

    name: str
    functions: tuple[str, ...]
    why: str
    fix: str = ""
    no_fix: str = ""
    direct: bool = False

    @property
    def hint(self) -> str:
        """The fix, or the plain statement that none exists."""
        return self.fix or f"no setting removes it: {self.no_fix}"


MECHANISMS: tuple[Mechanism, ...] = (
    # Lightning
    Mechanism(
        "batch_transfer",
        (
            "lightning/pytorch/core/module.py:_apply_batch_transfer_handler",
            "lightning/pytorch/core/hooks.py:transfer_batch_to_device",
            "lightning/pytorch/strategies/strategy.py:batch_to_device",
        ),
        why="the batch is copied to the device before every batch (move_data_to_device); from "
        "pageable host memory the copy waits for the device queue",
        fix="DataLoader(pin_memory=True): Lightning already passes non_blocking=True, and from "
        "pinned memory the copy no longer blocks",
    ),
    Mechanism(
        "prog_bar",
        ("lightning/pytorch/trainer/connectors/logger_connector/result.py:metrics",),
        why="values logged with prog_bar=True are converted to Python numbers (.item()) after "
        "every batch, even with the progress bar disabled or throttled",
        fix="self.log(..., prog_bar=False) for per-step values, or on_step=False (converted "
        "once per epoch); enable_progress_bar=False and refresh_rate do not remove it",
    ),
    Mechanism(
        "logger",
        ("lightning/pytorch/trainer/connectors/logger_connector/logger_connector.py:log_metrics",),
        why="logged values are converted to Python numbers for the loggers every "
        "log_every_n_steps training steps, and at every validation step for on_step=True values",
        fix="raise Trainer(log_every_n_steps=...), log with on_step=False, or logger=False for "
        "values no logger needs",
    ),
    Mechanism(
        "self_log",
        (
            "lightning/pytorch/core/module.py:log",
            "lightning/pytorch/core/module.py:log_dict",
            "lightning/pytorch/core/module.py:__to_tensor",
        ),
        why="self.log() of a Python number makes a tensor of it on the device: a copy on "
        "every call",
        fix="log tensors already on the device (the loss tensor, not loss.item())",
    ),
    Mechanism(
        "sync_dist",
        ("lightning/fabric/utilities/distributed.py:_sync_ddp",),
        why="self.log(..., sync_dist=True) reduces each step value across ranks behind a "
        "torch.distributed barrier, which waits for the device",
        fix="sync_dist=True only for epoch-level values (on_step=False, on_epoch=True): one "
        "reduction per epoch",
    ),
    Mechanism(
        "results_to_cpu",
        (
            "lightning/pytorch/trainer/connectors/logger_connector/result.py:cpu",
            "lightning/pytorch/trainer/connectors/logger_connector/logger_connector.py:teardown",
        ),
        why="logged results are moved to the CPU when a loop ends",
        no_fix="once per loop, outside the steps",
    ),
    Mechanism(
        "dataloader_length",
        ("lightning/pytorch/utilities/data.py:has_len_all_ranks",),
        why="the dataloader length is copied to the device, reduced across ranks and read on "
        "the host",
        no_fix="once per dataloader setup (three reads), also on one GPU",
    ),
    Mechanism(
        "finite_loss_check",
        ("lightning/pytorch/loops/utilities.py:check_finite_loss",),
        why="Trainer(detect_anomaly=True) checks that the loss is finite after every step",
        fix="Trainer(detect_anomaly=False) outside debugging",
    ),
    Mechanism(
        "ddp_decision",
        ("lightning/pytorch/strategies/parallel.py:reduce_boolean_decision",),
        why="a decision (stop, save a checkpoint) is reduced across ranks and read on the host",
        fix="fine at epoch ends; if it runs every batch, check less often (val_check_interval, "
        "EarlyStopping/ModelCheckpoint intervals)",
    ),
    Mechanism(
        "sigterm_check",
        ("lightning/pytorch/loops/training_epoch_loop.py:_broadcast_sigterm_tensor",),
        why="under DDP, every training step broadcasts the SIGTERM flag from rank 0 and reads "
        "it on the host (Lightning issue #21487)",
        no_fix="Lightning 2.6 has no setting for it; one small read per step under DDP",
    ),
    Mechanism(
        "checkpoint",
        ("lightning/pytorch/callbacks/model_checkpoint.py:*",),
        why="ModelCheckpoint reads the monitored value on the host",
        fix="check less often (every_n_train_steps, every_n_epochs)",
    ),
    Mechanism(
        "early_stopping",
        ("lightning/pytorch/callbacks/early_stopping.py:*",),
        why="EarlyStopping reads the monitored value on the host (and checks it is finite)",
        fix="check less often (check_on_train_epoch_end, fewer validation runs); "
        "check_finite=False drops one read",
    ),
    Mechanism(
        "progress_bar",
        (
            "lightning/pytorch/callbacks/progress/rich_progress.py:*",
            "lightning/pytorch/callbacks/progress/tqdm_progress.py:*",
        ),
        why="the progress bar converts metrics to Python numbers at each refresh",
        fix="Trainer(enable_progress_bar=False), TQDMProgressBar(refresh_rate=N), or fewer "
        "prog_bar=True values",
    ),
    Mechanism(
        "model_to_device",
        (
            "lightning/pytorch/strategies/strategy.py:model_to_device",
            "lightning/pytorch/strategies/strategy.py:teardown",
            "lightning/fabric/utilities/optimizer.py:_optimizers_to_device",
        ),
        why="the model is moved to the device at setup, and the model and the optimizer state "
        "back to the CPU at teardown",
        no_fix="once per run (fit, validate, test or predict), outside the steps",
    ),
    # transformers and accelerate
    Mechanism(
        "packed_sequence_check",
        ("transformers/masking_utils.py:find_packed_sequence_indices",),
        why="with no attention_mask and no KV cache, every forward checks on the host whether "
        "the batch holds packed sequences (bool of .all()); the Trainer turns the cache off "
        "by default",
        fix="TrainingArguments(use_cache=True) (not with gradient_checkpointing, which turns "
        "the cache off again); passing position_ids does not help, and an attention_mask only "
        "moves the read to the SDPA mask check",
    ),
    Mechanism(
        "sdpa_mask_check",
        ("transformers/masking_utils.py:_ignore_causal_mask_sdpa",),
        why="with a 2-D attention_mask, SDPA attention checks on the host whether the mask can "
        "be dropped for a plain causal mask",
        fix="leave attention_mask out of batches without padding, with "
        "TrainingArguments(use_cache=True)",
    ),
    Mechanism(
        "loss_nan_filter",
        ("transformers/trainer.py:_run_epoch",),
        why="TrainingArguments(logging_nan_inf_filter=True), the default, checks every "
        "micro-batch's loss for NaN or Inf on the host (two reads) before adding it to the "
        "logged loss",
        fix="TrainingArguments(logging_nan_inf_filter=False)",
        direct=True,
    ),
    Mechanism(
        "hf_logging",
        ("transformers/trainer.py:_maybe_log_save_evaluate",),
        why="at each logging step the Trainer reads the accumulated loss and the gradient norm "
        "with .item()",
        fix="log less often: TrainingArguments(logging_steps=...); the reads stay, once per "
        "log (a CI gate can accept them: allow=['mechanism:hf_logging'])",
        direct=True,
    ),
    Mechanism(
        "token_count",
        ("transformers/trainer.py:_track_num_input_tokens",),
        why="include_num_input_tokens_seen copies each micro-batch's token count to the "
        "device, gathers it and reads it back",
        fix="TrainingArguments(include_num_input_tokens_seen='no') (the default)",
    ),
    Mechanism(
        "store_flos",
        ("transformers/trainer.py:store_flos",),
        why="under DDP the Trainer sums the FLOP count across ranks through the device at "
        "every log and save",
        no_fix="once per log, save and end of training, only under DDP",
    ),
    Mechanism(
        "eval_to_cpu",
        ("transformers/trainer_pt_utils.py:nested_numpify",),
        why="evaluation copies its accumulated losses, predictions and labels to the host",
        no_fix="once per evaluation (eval_accumulation_steps adds more copies, not fewer)",
    ),
    Mechanism(
        "train_loss_total",
        ("transformers/trainer.py:_finalize_training",),
        why="after the last step the Trainer reads the total loss for train_loss",
        no_fix="once per train(), after the last step",
    ),
    Mechanism(
        "send_to_device",
        ("accelerate/utils/operations.py:send_to_device",),
        why="accelerate's dataloader copies each batch tensor to the device with "
        "non_blocking=False, which waits for the device queue",
        fix="TrainingArguments(accelerator_config={'non_blocking': True}) with "
        "dataloader_pin_memory=True (the default); plain accelerate: "
        "Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=True)) and "
        "DataLoader(pin_memory=True)",
    ),
    Mechanism(
        "pad_across_processes",
        ("accelerate/utils/operations.py:pad_across_processes",),
        why="evaluation pads logits and labels across processes by sending each tensor's shape "
        "through the device and back, four reads per batch, even on one GPU",
        fix="evaluate without compute_metrics, or TrainingArguments(prediction_loss_only=True)",
    ),
    # torchmetrics
    Mechanism(
        "nan_check",
        ("torchmetrics/aggregation.py:_cast_and_nan_check_input",),
        why="aggregation metrics (MeanMetric, SumMetric, MaxMetric, MinMetric, CatMetric) look "
        "for NaN in every update (two host reads) under every nan_strategy but 'disable'",
        fix="nan_strategy='disable' once no NaN can reach the metric (in torchmetrics 1.9 it "
        "also ignores a weight passed to MeanMetric, torchmetrics #3434)",
    ),
    Mechanism(
        "metric_python_number",
        ("torchmetrics/aggregation.py:update",),
        why="update() with a Python number copies it to the device on every call",
        fix="pass a tensor that is already on the device (loss, not loss.item())",
    ),
    Mechanism(
        "compute_groups",
        ("torchmetrics/collections.py:_equal_metric_states",),
        why="MetricCollection(compute_groups=True) compares the metrics' states on the host at "
        "the first update to find groups",
        fix="MetricCollection(..., compute_groups=False), or accept it: once per collection",
    ),
    # torch
    Mechanism(
        "grad_scaler_step",
        ("torch/amp/grad_scaler.py:_maybe_opt_step",),
        why="with fp16 mixed precision, GradScaler.step reads the inf/NaN check "
        "(found_inf.item()) every optimizer step to decide whether to skip the step",
        fix="bf16 mixed precision (no scaler), or a fused optimizer "
        "(torch.optim.AdamW(..., fused=True); HF: optim='adamw_torch_fused'), with which the "
        "scaler skips the step on the device",
    ),
    Mechanism(
        "clip_grad_nonfinite",
        (
            "torch/nn/utils/clip_grad.py:_get_total_norm",
            "torch/nn/utils/clip_grad.py:clip_grad_norm_",
        ),
        why="clip_grad_norm_(error_if_nonfinite=True) reads the total gradient norm on the host "
        "to decide whether to raise",
        fix="error_if_nonfinite=False (the default); check for non-finite values less often",
    ),
    Mechanism(
        "save_to_host",
        ("torch/serialization.py:_save", "safetensors/torch.py:_to_ndarray"),
        why="saving copies each device tensor to host memory with a blocking copy, one per tensor",
        fix="save less often (Lightning: ModelCheckpoint(every_n_epochs=...); HF: save_steps, "
        "and save_only_model=True skips the optimizer state's copies); in a plain loop, copy "
        "into pinned CPU buffers with non_blocking=True and synchronize once before saving",
    ),
)

Marker = str | Callable[[FrameType], str | None] | None


def _evaluation_stage(frame: FrameType) -> str | None:
    """Lightning's evaluation loop runs validation, tests and the sanity check."""
    loop = frame.f_locals.get("self")
    if getattr(getattr(loop, "trainer", None), "sanity_checking", False):
        return "sanity"
    stage = getattr(getattr(loop, "_stage", None), "value", None)
    return {"sanity_check": "sanity", "test": "test"}.get(str(stage), "validate")


# "package/path.py:function" -> the phase it marks, or a function of its frame returning it.
# The innermost marker on the stack wins.
PHASES: dict[str, str | Callable[[FrameType], str | None]] = {
    "lightning/pytorch/loops/fit_loop.py:run": "train",
    "lightning/pytorch/loops/fit_loop.py:advance": "train",
    "lightning/pytorch/loops/training_epoch_loop.py:run": "train",
    "lightning/pytorch/loops/training_epoch_loop.py:advance": "train",
    "lightning/pytorch/loops/evaluation_loop.py:run": _evaluation_stage,
    "lightning/pytorch/loops/prediction_loop.py:run": "predict",
    "lightning/pytorch/trainer/trainer.py:_teardown": "teardown",
    "lightning/pytorch/trainer/trainer.py:save_checkpoint": "checkpoint",
    "transformers/trainer.py:_inner_training_loop": "train",
    "transformers/trainer.py:evaluate": "validate",
    "transformers/trainer.py:predict": "predict",
    "transformers/trainer.py:_save_checkpoint": "checkpoint",
    "transformers/trainer.py:save_model": "checkpoint",
    "transformers/trainer.py:_finalize_training": "teardown",
    "transformers/trainer.py:_load_best_model": "teardown",
    # torch.compile at work: dynamo tracing, inductor compiling a graph (the backward one at
    # the first backward), and autotuning kernels at their first call.
    "torch/_dynamo/convert_frame.py:_compile": "compile",
    "torch/_inductor/compile_fx.py:compile_fx_inner": "compile",
    "torch/_inductor/compile_fx.py:fx_codegen_and_compile": "compile",
    "torch/_inductor/runtime/triton_heuristics.py:precompile": "compile",
    "torch/_inductor/runtime/triton_heuristics.py:benchmark_all_configs": "compile",
    "torch/_inductor/runtime/triton_heuristics.py:autotune_to_one_config": "compile",
    "torch/_inductor/runtime/benchmarking.py:benchmark": "compile",
    "torch/_inductor/runtime/benchmarking.py:benchmark_gpu": "compile",
    "torch/_inductor/runtime/coordinate_descent_tuner.py:autotune": "compile",
    "torch/_inductor/select_algorithm.py:__call__": "compile",
    # mode="reduce-overhead": CUDA-graph trees' warm-up runs and recordings.
    "torch/_inductor/cudagraph_trees.py:run_eager": "compile",
    "torch/_inductor/cudagraph_trees.py:record_function": "compile",
    "torch/_inductor/cudagraph_trees.py:_allocate_and_copy_recording_inputs": "compile",
}

# Lightning's hook callers hold the name of the hook in flight in `hook_name`.
_HOOK_CALLERS = frozenset(
    {
        "lightning/pytorch/trainer/call.py:_call_callback_hooks",
        "lightning/pytorch/trainer/call.py:_call_lightning_module_hook",
        "lightning/pytorch/trainer/call.py:_call_strategy_hook",
        "lightning/pytorch/trainer/call.py:_call_lightning_datamodule_hook",
    }
)

# Where a framework's files lie inside a path, and their name in the tables.
_ROOTS = (
    ("/lightning/pytorch/", "lightning/pytorch/"),
    ("/pytorch_lightning/", "lightning/pytorch/"),
    ("/lightning/fabric/", "lightning/fabric/"),
    ("/lightning_fabric/", "lightning/fabric/"),
    ("/transformers/", "transformers/"),
    ("/accelerate/", "accelerate/"),
    ("/torchmetrics/", "torchmetrics/"),
    ("/safetensors/", "safetensors/"),
    ("/torch/", "torch/"),
)

_BY_NAME: dict[str, Mechanism] = {m.name: m for m in MECHANISMS}
_BY_FUNCTION: dict[str, str] = {f: m.name for m in MECHANISMS for f in m.functions}


def mechanism(name: str) -> Mechanism | None:
    """The table's entry for a mechanism name (a hook in brackets is ignored).

    Example:
        >>> mechanism("prog_bar (on_train_batch_end)").name
        'prog_bar'
    """
    return _BY_NAME.get(name.split(" (", 1)[0])


def package_path(filename: str) -> str | None:
    """``filename`` as the tables name it: from its package folder on, or ``None``.

    Example:
        >>> package_path("/sp/lightning_fabric/utilities/apply_func.py")
        'lightning/fabric/utilities/apply_func.py'
    """
    path = filename.replace(os.sep, "/")
    # The innermost package (the rightmost marker) wins: a vendored copy is its own.
    marker, prefix = max(_ROOTS, key=lambda root: path.rfind(root[0]))
    i = path.rfind(marker)
    return prefix + path[i + len(marker) :] if i >= 0 else None


Function = tuple["str | None", bool, Marker, bool]


def file_entry(filename: str) -> tuple[bool, dict[str, Function] | None]:
    """What the walk of ``detect.stack`` needs of a source file (asked once per file).

    Returns:
        ``(real, functions)``: whether a frame of the file can be the one that synchronized
        (not barrierguard's, torch's core nor the standard library's); the file's functions
        the tables name (``"*"``: any other) to ``(mechanism, direct only, phase marker, hook
        caller)``, or ``None``.

    Example:
        >>> file_entry("/sp/lightning/pytorch/loops/fit_loop.py")[1]["run"]
        (None, False, 'train', False)
    """
    category, package = classify_file(filename)
    real = category not in (OWN, TORCH) and not (category == LIBRARY and package == "python")
    rel = package_path(filename)
    if rel is None:
        return real, None
    prefix = rel + ":"
    names = {
        key[len(prefix) :]
        for key in (*_BY_FUNCTION, *PHASES, *_HOOK_CALLERS)
        if key.startswith(prefix)
    }
    if not names:
        return real, None
    wildcard = _BY_FUNCTION.get(prefix + "*")
    functions: dict[str, Function] = {}
    for function in names:
        key = prefix + function
        name = _BY_FUNCTION.get(key) or wildcard
        direct = name is not None and _BY_NAME[name].direct
        functions[function] = (name, direct, PHASES.get(key), key in _HOOK_CALLERS)
    return real, functions


# Packages whose functions mark phases: without one imported, the walk seeks none.
PHASE_PACKAGES = ("lightning", "pytorch_lightning", "transformers", "torch._dynamo")


def mechanism_fixes(mechanisms: Any) -> str | None:
    """The fix of a site from its mechanisms, most frequent first.

    Args:
        mechanisms: ``(name, count)`` pairs, as a site records them.

    Returns:
        ``"name: fix | name: fix"``, or ``None`` when no mechanism is known.

    Example:
        >>> mechanism_fixes([("prog_bar (on_train_batch_end)", 3), ("logger", 1)]).split(" | ")[1]
        'logger: raise Trainer(log_every_n_steps=...), log with on_step=False, or logger=False for values no logger needs'
    """
    totals: Counter[str] = Counter()
    for name, n in mechanisms:
        totals[name.split(" (", 1)[0]] += n
    known = [name for name, _ in totals.most_common() if name in _BY_NAME]
    return " | ".join(f"{name}: {_BY_NAME[name].hint}" for name in known) or None
