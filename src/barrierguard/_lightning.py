"""The Lightning callback: a thin adapter over the guard that ``watch()`` builds.

Imported only when a :class:`~barrierguard.BarrierGuard` is created (it imports
Lightning). What it adds to a plain guard:

* steps are training batches, validation/test/predict batches are a phase of
  their own (counted apart), setup and the sanity check are setup;
* each sync inside Lightning is named by the Lightning mechanism that made it
  (:data:`MECHANISMS`), found by walking the live stack when the sync is
  recorded, together with the Lightning hook in flight;
* figures to the loggers at epoch end, the report printed and saved at the end
  of ``fit``, counts kept in checkpoints, and the ranks' reports merged.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from types import CodeType
from typing import Any

import lightning.pytorch as pl

from barrierguard._callback import BarrierGuard
from barrierguard._errors import BarrierGuardError
from barrierguard._frames import Location
from barrierguard._guard import Guard
from barrierguard._options import make_options, unknown_options
from barrierguard._report import Report, Site

__all__ = [
    "MECHANISMS",
    "REPORT_NAME",
    "BarrierGuardCallback",
    "combine",
    "describe",
    "mechanism_of",
]

REPORT_NAME = "barrierguard_report.json"

# Lightning's own syncs: mechanism -> (what happens, the fix).
MECHANISMS: dict[str, tuple[str, str]] = {
    "batch_transfer": (
        "the batch is copied to the device before every batch (move_data_to_device); from "
        "pageable host memory the copy blocks the host",
        "DataLoader(pin_memory=True): Lightning already passes non_blocking=True, and from "
        "pinned memory the copy no longer blocks",
    ),
    "prog_bar": (
        "values logged with prog_bar=True are converted to Python numbers (.item()) each time "
        "Lightning collects metrics: after every training batch, and at each progress-bar "
        "refresh",
        "fewer self.log(..., prog_bar=True) values, or prog_bar=True only with on_step=False "
        "(converted once per epoch)",
    ),
    "logger": (
        "logged values are converted to Python numbers for the loggers every "
        "log_every_n_steps steps and at epoch end",
        "raise Trainer(log_every_n_steps=...), or log with on_step=False",
    ),
    "self_log": (
        "self.log() puts the value on the device: a Python number or a host tensor is copied "
        "on every call",
        "log tensors already on the device (the loss tensor, not loss.item())",
    ),
    "results_to_cpu": (
        "logged results are moved to the CPU when a loop ends",
        "nothing to fix: once per loop",
    ),
    "dataloader_length": (
        "the dataloader length is reduced across ranks and read on the host",
        "nothing to fix: once per dataloader setup",
    ),
    "finite_loss_check": (
        "Trainer(detect_anomaly=True) checks that the loss is finite after every step",
        "Trainer(detect_anomaly=False) outside debugging",
    ),
    "ddp_decision": (
        "a decision (stop, save a checkpoint) is reduced across ranks and read on the host",
        "fine at epoch ends; if it runs every batch, check less often (val_check_interval, "
        "EarlyStopping/ModelCheckpoint intervals)",
    ),
    "sigterm_check": (
        "the SIGTERM flag is broadcast across ranks and read on the host",
        "part of Lightning's preemption handling under DDP",
    ),
    "checkpoint": (
        "ModelCheckpoint reads the monitored value on the host",
        "check less often (every_n_train_steps, every_n_epochs)",
    ),
    "early_stopping": (
        "EarlyStopping reads the monitored value on the host",
        "check less often (check_on_train_epoch_end, fewer validation runs)",
    ),
    "progress_bar": (
        "the progress bar converts metrics to Python numbers at each refresh",
        "Trainer(enable_progress_bar=False), or fewer prog_bar=True values",
    ),
    "model_to_device": (
        "the model is moved to the device at setup, and back to the CPU at teardown",
        "nothing to fix: once per run",
    ),
    "other": (
        "a sync inside Lightning (see the site's framework frame)",
        "see the Lightning line in the site's framework frame",
    ),
}

# (path inside Lightning, function or "*") -> mechanism. Paths are relative to
# lightning/pytorch ("pytorch/...") or lightning/fabric ("fabric/..."), also
# for the standalone pytorch_lightning / lightning_fabric packages. The
# innermost match on the stack wins.
_TABLE: dict[tuple[str, str], str] = {
    ("pytorch/core/module.py", "_apply_batch_transfer_handler"): "batch_transfer",
    ("pytorch/core/hooks.py", "transfer_batch_to_device"): "batch_transfer",
    ("pytorch/strategies/strategy.py", "batch_to_device"): "batch_transfer",
    ("pytorch/trainer/connectors/logger_connector/result.py", "metrics"): "prog_bar",
    ("pytorch/trainer/connectors/logger_connector/result.py", "cpu"): "results_to_cpu",
    ("pytorch/trainer/connectors/logger_connector/logger_connector.py", "log_metrics"): "logger",
    ("pytorch/trainer/connectors/logger_connector/logger_connector.py", "teardown"): (
        "results_to_cpu"
    ),
    ("pytorch/core/module.py", "log"): "self_log",
    ("pytorch/core/module.py", "log_dict"): "self_log",
    ("pytorch/utilities/data.py", "has_len_all_ranks"): "dataloader_length",
    ("pytorch/loops/utilities.py", "check_finite_loss"): "finite_loss_check",
    ("pytorch/strategies/parallel.py", "reduce_boolean_decision"): "ddp_decision",
    ("pytorch/loops/training_epoch_loop.py", "_broadcast_sigterm_tensor"): "sigterm_check",
    ("pytorch/callbacks/model_checkpoint.py", "*"): "checkpoint",
    ("pytorch/callbacks/early_stopping.py", "*"): "early_stopping",
    ("pytorch/callbacks/progress/rich_progress.py", "*"): "progress_bar",
    ("pytorch/callbacks/progress/tqdm_progress.py", "*"): "progress_bar",
    ("pytorch/strategies/strategy.py", "model_to_device"): "model_to_device",
    ("pytorch/strategies/strategy.py", "teardown"): "model_to_device",
}

_HOOK_CALLERS = frozenset(
    {
        "_call_callback_hooks",
        "_call_lightning_module_hook",
        "_call_strategy_hook",
        "_call_lightning_datamodule_hook",
    }
)
_ROOTS = (
    ("/lightning/pytorch/", "pytorch/"),
    ("/pytorch_lightning/", "pytorch/"),
    ("/lightning/fabric/", "fabric/"),
    ("/lightning_fabric/", "fabric/"),
)

# Lightning's loop drivers: no hook caller lies outward of them, so a walk that
# reaches one has seen all it needs (and skips the trainer's and the user's
# frames beyond: a stack inside fit() is some 60 frames deep).
_LOOP_DRIVERS = frozenset({"run", "advance"})
_HOOK = "\0hook"
_STOP = "\0stop"
_STOP_DEPTH = 80
# Keyed by id(code): hashing a code object hashes its constants and names, which
# costs more than the rest of a frame's visit. The entry keeps the code object
# alive, so its id cannot be reused while the entry exists.
_code_kinds: dict[int, tuple[CodeType, str | None]] = {}


def _relative(filename: str) -> str | None:
    path = filename.replace(os.sep, "/")
    for marker, prefix in _ROOTS:
        i = path.rfind(marker)
        if i >= 0:
            return prefix + path[i + len(marker) :]
    return None


def _code_kind(code: CodeType) -> str | None:
    """A mechanism name, ``_HOOK`` for Lightning's hook callers, ``_STOP`` for its
    loop drivers, or ``None``."""
    rel = _relative(code.co_filename)
    if rel is None:
        return None
    if rel == "pytorch/trainer/call.py" and code.co_name in _HOOK_CALLERS:
        return _HOOK
    found = _TABLE.get((rel, code.co_name)) or _TABLE.get((rel, "*"))
    if found is None and rel.startswith("pytorch/loops/") and rel.endswith("_loop.py"):
        return _STOP if code.co_name in _LOOP_DRIVERS else None
    return found


def mechanism_of(loc: Location, frame: Any = None) -> str | None:
    """Name the Lightning mechanism behind a sync, with the hook in flight.

    Walks the live stack outward (from ``frame``, else the caller): the
    innermost frame listed in the table names the mechanism, the innermost of
    Lightning's hook callers names the hook. The walk ends there, or at the
    first of Lightning's loop drivers (a loop's ``run`` or ``advance``), outward
    of which no hook is in flight. Code objects are classified once.

    Args:
        loc: The sync's location; only ``framework:lightning`` syncs are named.
        frame: Where to start the walk (tests); default: the caller's frame.

    Returns:
        ``"mechanism (hook)"``, ``"mechanism"`` when no hook is in flight, or
        ``None`` for syncs outside Lightning.
    """
    if loc.origin != "framework:lightning":
        return None
    f = frame if frame is not None else sys._getframe(1)
    mechanism: str | None = None
    hook: str | None = None
    depth = 0
    kinds = _code_kinds
    while f is not None and depth < _STOP_DEPTH:
        code = f.f_code
        entry = kinds.get(id(code))
        if entry is not None and entry[0] is code:
            kind = entry[1]
        else:
            kind = _code_kind(code)
            kinds[id(code)] = (code, kind)
        if kind == _HOOK:
            name = f.f_locals.get("hook_name")
            hook = name if isinstance(name, str) else None
            break
        if kind == _STOP:
            break
        if kind is not None and mechanism is None:
            mechanism = kind
        f = f.f_back
        depth += 1
    if mechanism is None:
        mechanism = "other"
    return f"{mechanism} ({hook})" if hook else mechanism


def _base(mechanism: str) -> str:
    return mechanism.split(" (", 1)[0]


def describe(site: Site) -> Site:
    """``site`` with the fix of its Lightning mechanisms (most frequent first)."""
    if not site.mechanisms:
        return site
    names: dict[str, int] = {}
    for name, n in site.mechanisms:
        base = _base(name)
        names[base] = names.get(base, 0) + n
    ordered = sorted(names, key=lambda k: -names[k])
    fixes = [f"{name}: {MECHANISMS.get(name, MECHANISMS['other'])[1]}" for name in ordered]
    return replace(site, fix="; ".join(fixes))


def combine(before: Report, after: Report) -> Report:
    """A resumed run's report: ``before`` (from the checkpoint), then ``after``.

    Steps of ``after`` are numbered on from ``before``; counts are summed; the
    memory section is ``after``'s (this process's samples only).
    """
    offset = before.steps
    sites: dict[tuple[str, int, str, str], Site] = {s.key: s for s in before.sites}
    for site in after.sites:
        shifted = tuple((a + offset, b + offset) for a, b in site.steps)
        old = sites.get(site.key)
        if old is None:
            sites[site.key] = replace(site, steps=shifted)
            continue
        sites[site.key] = replace(
            old,
            count=old.count + site.count,
            setup_count=old.setup_count + site.setup_count,
            step_count=old.step_count + site.step_count,
            steps=old.steps + shifted,
            threads=tuple(dict.fromkeys(old.threads + site.threads)),
            phases=_add(old.phases, site.phases),
            mechanisms=_add(old.mechanisms, site.mechanisms),
        )
    measured = before.measured_steps + after.measured_steps
    merged = [
        replace(s, per_step=s.step_count / measured if measured else 0.0) for s in sites.values()
    ]
    per_step = list(before.syncs_per_step) or [0]
    tail = list(after.syncs_per_step) or [0]
    per_step[-1] += tail[0]
    per_step.extend(tail[1:])
    return replace(
        after,
        steps=before.steps + after.steps,
        warmup_steps=before.warmup_steps,
        measured_steps=measured,
        sites=tuple(merged),
        violations=before.violations
        + tuple(replace(v, step=v.step + offset) for v in after.violations),
        syncs_per_step=tuple(per_step),
        notes=tuple(dict.fromkeys(before.notes + after.notes)),
        duration_s=before.duration_s + after.duration_s,
        epochs=before.epochs + tuple(e + offset for e in after.epochs),
    )


def _add(
    a: tuple[tuple[str, int], ...], b: tuple[tuple[str, int], ...]
) -> tuple[tuple[str, int], ...]:
    total = dict(a)
    for k, n in b:
        total[k] = total.get(k, 0) + n
    return tuple(total.items())


_OPTIONS = (
    "policy",
    "engine",
    "warmup_steps",
    "allow",
    "max_syncs_per_step",
    "memory",
    "max_growth_per_step",
    "memory_every",
    "memory_children",
    "print_report",
    "save_report",
    "log_figures",
)


class BarrierGuardCallback(BarrierGuard, pl.Callback):
    """The Lightning implementation behind :class:`~barrierguard.BarrierGuard`."""

    def __init__(
        self,
        *,
        policy: str | None = None,
        engine: str = "auto",
        warmup_steps: int = 0,
        allow: Any = (),
        max_syncs_per_step: int | None = None,
        memory: bool = True,
        max_growth_per_step: int | str = "1MB",
        memory_every: int | None = None,
        memory_children: bool = False,
        print_report: bool = True,
        save_report: bool | str | os.PathLike[str] = True,
        log_figures: bool = True,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise unknown_options("BarrierGuard", unknown, _OPTIONS)
        self._options = make_options(
            policy=policy,
            engine=engine,
            warmup_steps=warmup_steps,
            allow=allow,
            max_syncs_per_step=max_syncs_per_step,
            memory=memory,
            max_growth_per_step=max_growth_per_step,
            memory_every=memory_every,
            memory_children=memory_children,
            owner="BarrierGuard",
        )
        for name, value in (("print_report", print_report), ("log_figures", log_figures)):
            if not isinstance(value, bool):
                raise BarrierGuardError(
                    f"BarrierGuard({name}={value!r}) is not valid: expected True or False"
                )
        if not isinstance(save_report, (bool, str, os.PathLike)):
            raise BarrierGuardError(
                f"BarrierGuard(save_report={save_report!r}) is not valid: expected True "
                "(barrierguard_report.json in trainer.log_dir), False, or a file path"
            )
        self.print_report = print_report
        self.save_report = save_report
        self.log_figures = log_figures
        self.report_path: str | None = None
        self._guard: Guard | None = None
        self._before: Report | None = None
        self._final: Report | None = None
        self._epochs: list[int] = []
        self._epoch_start = 0
        self._resume_phase = "setup"

    # Guards hold locks and hooks: ddp_spawn pickles the callback before the
    # run, so only the settings and the restored counts travel.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_guard"] = None
        return state

    # -- the report ---------------------------------------------------------
    @property
    def guard(self) -> Guard | None:
        """The guard behind the callback (``None`` before the first ``setup``)."""
        return self._guard

    @property
    def report(self) -> Report:
        """The report so far: merged over ranks after a distributed ``fit``."""
        if self._final is not None and (self._guard is None or not self._guard.is_running):
            return self._final
        return self._local_report()

    def _local_report(self) -> Report:
        if self._guard is None:
            current = Report(
                engine="none",
                detection=False,
                policy=self._options.policy,
                notes=("the callback has not run yet",),
            )
        else:
            current = self._guard.report
        current = replace(current, epochs=tuple(self._epochs))
        if self._before is not None:
            current = combine(self._before, current)
        return current.with_sites([describe(s) for s in current.sites])

    # -- lifecycle ------------------------------------------------------------
    def _start(self, phase: str) -> None:
        if self._guard is None:
            guard = Guard(self._options)
            # Steps are training batches (marked at on_train_batch_end), so the
            # optimizer hook must not count them as well.
            guard._manual = True
            guard._annotate = mechanism_of
            self._guard = guard
        if not self._guard.is_running:
            self._final = None
            self._guard._phase = phase
            self._guard.start()

    def _set_phase(self, phase: str) -> None:
        if self._guard is not None:
            self._guard._phase = phase

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._start("setup" if stage == "fit" else _STAGE_PHASES.get(stage, "setup"))

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("sanity")

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("setup")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("train")
        self._resume_phase = "train"
        if self._guard is not None:
            self._epoch_start = self._guard.steps
            self._epochs.append(self._epoch_start)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._guard is not None and self._guard.is_running:
            self._guard.step()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("sanity" if trainer.sanity_checking else "validate")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("setup" if trainer.sanity_checking else self._resume_phase)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("predict")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("teardown")
        self._resume_phase = "teardown"

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.log_figures or not trainer.loggers or self._guard is None:
            return
        try:
            metrics = self._figures()
        except Exception as exc:
            self._guard._fault(exc)
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _figures(self) -> dict[str, float]:
        """This epoch's figures, as Python numbers: logging them adds no sync."""
        guard = self._guard
        assert guard is not None
        end = guard.steps
        start = min(self._epoch_start, end)
        # _per_step[k] holds the syncs recorded after k steps, i.e. in step k + 1.
        series = guard._per_step[start:end]
        steps = end - start
        metrics: dict[str, float] = {
            "barrierguard/syncs_per_step": (sum(series) / steps) if steps else 0.0,
        }
        memory = guard._memory
        if memory is not None:
            slopes = memory.report().slopes
            for name, slope in slopes.items():
                metrics[f"barrierguard/memory_growth_per_step/{name}"] = float(slope)
        return metrics

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._guard is not None and self._guard.is_running:
            self._finish(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # The run is failing: restore every global, keep what was found, and
        # neither merge (the other ranks may be gone) nor raise a policy error.
        if self._guard is not None and self._guard.is_running:
            self._guard._deferred.clear()
            self._guard._stop(act=False)
            self._final = self._local_report()

    def _finish(self, trainer: pl.Trainer) -> None:
        guard = self._guard
        assert guard is not None
        try:
            guard.stop()
        finally:
            local = self._local_report()
            self._final = local
            path = self._path(trainer)
            merged = _merge_ranks(local)
            if merged is not None:
                self._final = merged
                if self.print_report:
                    print(merged, flush=True)
                if path is not None:
                    try:
                        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                        merged.save(path)
                        self.report_path = path
                    except OSError as exc:
                        guard._fault(exc)
            # Ranks leave together: rank 1 shutting gloo down while rank 0 still
            # writes the report was seen to abort a spawned rank.
            _barrier()

    def _path(self, trainer: pl.Trainer) -> str | None:
        if self.save_report is False:
            return None
        if self.save_report is not True:
            return os.fspath(self.save_report)
        # trainer.log_dir is a collective under DDP: every rank asks.
        log_dir = trainer.log_dir or trainer.default_root_dir
        return os.path.join(log_dir, REPORT_NAME)

    # -- checkpoints ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counts so far, so that a resumed run goes on from them."""
        # Through JSON, so the checkpoint holds plain types only and loads with
        # torch.load(weights_only=True) (the environment holds str subclasses).
        return {"report": json.loads(json.dumps(self._local_report().to_dict()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Go on from the counts of a checkpoint written by :meth:`state_dict`.

        Raises:
            BarrierGuardError: When the state holds no report this release
                reads.
        """
        data = state_dict.get("report")
        if data is None:
            raise BarrierGuardError(
                "BarrierGuard.load_state_dict(): the state has no 'report' entry; expected "
                "what BarrierGuard.state_dict() returns"
            )
        # The checkpoint's report already holds everything before it.
        self._before = Report.from_dict(data, source="checkpoint")


_STAGE_PHASES = {"validate": "validate", "test": "test", "predict": "predict"}


def _barrier() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
    except Exception:  # a failed barrier must not lose the run
        return


def _merge_ranks(local: Report) -> Report | None:
    """Rank 0: the ranks' reports merged; other ranks: ``None``. One collective."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return local
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local.to_dict())
        if dist.get_rank() != 0:
            return None
        return Report.merge(
            [Report.from_dict(d, source=f"rank {i}") for i, d in enumerate(gathered)]
        )
    except BarrierGuardError:
        raise
    except Exception as exc:  # a failed merge must not lose the run
        note = (
            f"merging the ranks' reports failed ({type(exc).__name__}: {exc}); this is one rank's"
        )
        return replace(local, notes=(*local.notes, note))
