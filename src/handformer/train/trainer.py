"""A model-agnostic training loop.

The trainer knows three things: how to get a training batch (``train_batch(generator)``),
how to turn a batch into logits (``forward_fn``, by default
``model(batch.ids, padding_mask=batch.padding_mask)``) and how to turn logits into a loss
(``loss_fn``). Logging, plotting and dashboards hang off callbacks; checkpoints go through a
``CheckpointManager``. So the same loop trains a decoder LM, a classifier or a seq2seq model.

One optimiser step: set the lr (a pure function of the step) → draw ``grad_accum_steps``
micro-batches → forward/backward each under autocast → clip (the pre-clip norm is reported)
→ if the loss and gradient norm are finite, step; otherwise skip and count (the non-finite
guard). Every step is reproducible from the trainer state: the step, the optimizer, every
RNG, and the batch generator (the data position).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from handformer.config import PRECISIONS, TrainConfig
from handformer.data import Batch
from handformer.loss import lm_loss
from handformer.train.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    NonFiniteStateError,
    first_nonfinite,
    load_weights,
    read_trainer_state,
    verify_checkpoint,
)
from handformer.train.distributed import (
    DistContext,
    ParallelModel,
    check_batch_splits,
    local_value,
    rank_device,
    shard_rows,
)
from handformer.train.optim import (
    batch_rows_at,
    build_optimizer,
    parameter_split,
    set_lr,
    window_at,
)
from handformer.train.precision import resolve_precision
from handformer.train.rng import capture_rng, restore_rng
from handformer.train.state import (
    TrainerState,
    TrainerStateError,
    flatten_optimizer,
    restore_optimizer,
)

__all__ = ["Callback", "NonFiniteError", "TrainResult", "Trainer", "pick_device"]


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; anything else is passed to torch."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown device {name!r}; expected auto, cpu, cuda[:N] or mps") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available here")
    return device


def default_forward(model: nn.Module, batch: Batch) -> Tensor:
    return model(batch.ids, padding_mask=batch.padding_mask)


class Callback(Protocol):
    """Hooks the trainer calls; implement any subset (missing ones are skipped).

    ``on_log`` after a logged (or skipped) step, ``on_eval`` after an evaluation,
    ``on_step_end`` once every step is complete (its evaluation and checkpoint included),
    ``on_end`` when ``fit`` returns. Under torchrun they run on rank 0 only, unless the
    callback has a true ``every_rank`` attribute: then every rank calls it (it must not write
    files that rank 0 writes).
    """

    def on_log(self, step: int, metrics: dict[str, Any]) -> None: ...
    def on_eval(self, step: int, metrics: dict[str, Any]) -> None: ...
    def on_step_end(self, step: int) -> None: ...
    def on_end(self, result: TrainResult) -> None: ...


class NonFiniteError(RuntimeError):
    """Too many steps had a NaN/Inf loss or gradient norm (none of them reached the weights)."""


@dataclass
class TrainResult:
    """What one ``Trainer.fit`` did: per-step training losses and times of this call, every
    evaluation's metrics, counters, the best validation loss and the last checkpoint."""

    steps: int  # the step the run ended at (optimizer steps taken, resumed ones included)
    start_step: int = 0
    train_losses: list[float] = field(default_factory=list)  # one per step of this fit()
    evals: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    step_ms: list[float] = field(default_factory=list)
    nonfinite_steps: int = 0
    overflow_steps: int = 0
    best_val_loss: float | None = None
    best_step: int | None = None
    stopped_early: bool = False
    reached_target: bool = False  # stopped at the first evaluation <= cfg.target_val_loss
    last_checkpoint: Path | None = None

    @property
    def final_val_loss(self) -> float:
        """The last evaluation's validation loss (NaN when nothing was evaluated)."""
        return self.evals[-1]["val_loss"] if self.evals else float("nan")

    @property
    def median_step_ms(self) -> float:
        """Median wall time of one optimizer step in this ``fit`` (NaN before any step)."""
        if not self.step_ms:
            return float("nan")
        ordered = sorted(self.step_ms)
        return ordered[len(ordered) // 2]


@dataclass
class _StepOutcome:
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # target tokens of the step, summed over ranks
    status: str  # "ok", "skipped" (non-finite: guard), "overflow" (fp16: the scaler skipped)


class Trainer:
    """The training loop: ``Trainer(model, cfg, train_batch=..., val_batches=...).fit()``.

    ``train_batch(generator) -> Batch`` draws a training batch, ``forward_fn(model, batch)``
    gives logits (default: ``model(batch.ids, padding_mask=batch.padding_mask)``) and
    ``loss_fn(logits, targets)`` the loss (default ``lm_loss``). Each step sets the learning
    rate from the step (``lr_at``), accumulates ``cfg.grad_accum_steps`` micro-batches under
    the configured precision, clips to ``cfg.grad_clip`` (the pre-clip norm is logged) and
    skips non-finite steps, raising ``NonFiniteError`` after ``cfg.max_nonfinite_steps`` of
    them. Callbacks receive ``on_log`` / ``on_eval`` / ``on_step_end`` / ``on_end`` (see
    ``Callback``); with ``checkpoints`` (a ``CheckpointManager``) ``fit`` writes resumable
    checkpoints and ``resume(path)`` continues one exactly (``CheckpointError`` if it is
    damaged or foreign)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        *,
        train_batch: Callable[[torch.Generator], Batch],
        val_batches: Sequence[Batch] = (),
        loss_fn: Callable[[Tensor, Tensor], Tensor] = lm_loss,
        forward_fn: Callable[[nn.Module, Batch], Tensor] = default_forward,
        callbacks: Iterable[Any] = (),
        progress: bool = True,
        checkpoints: CheckpointManager | None = None,
        chars_per_token: float | None = None,
        dist: DistContext | None = None,
    ) -> None:
        self.cfg = cfg
        # Under torchrun (``dist``): every rank runs this same loop on its share of each
        # batch; only rank 0 writes checkpoints, calls callbacks and shows progress.
        self.dist = dist or DistContext()
        check_batch_splits(cfg.batch_size, self.dist)
        if cfg.batch_warmup_steps:
            check_batch_splits(cfg.batch_warmup_start, self.dist)
        self.device = rank_device(pick_device(cfg.device), self.dist)
        self.model = model.to(self.device)
        self.precision = resolve_precision(cfg.precision, self.device)
        self.parallel = ParallelModel(self.model, cfg.strategy, self.dist, self.device)
        # Compile a wrapper for the forward pass only; checkpoints save the plain module, so
        # their names carry no ``_orig_mod.`` prefix.
        forward = self.parallel.forward_module
        self.forward_model: nn.Module = torch.compile(forward) if cfg.compile else forward
        self.train_batch = train_batch
        self.val_batches = list(val_batches)
        self.loss_fn = loss_fn
        self.forward_fn = forward_fn
        self.callbacks = list(callbacks)
        self.progress = progress
        self.checkpoints = checkpoints
        self.chars_per_token = chars_per_token
        self.optimizer = build_optimizer(self.model, cfg)  # after sharding: FSDP's params
        # Which parameters each optimizer trains (Muon's hidden matrices, AdamW the rest).
        self.parameter_split = parameter_split(self.model, cfg)
        # Under FSDP the full optimizer state passes through an optimizer of the unsharded
        # replica, so checkpoints keep the single-process format.
        self.replica_optimizer = (build_optimizer(self.parallel.replica, cfg)
                                  if self.parallel.replica is not None else None)
        self.generator = torch.Generator().manual_seed(cfg.seed)  # the data position
        # Counters that make up the trainer state besides optimizer and RNGs.
        self.step = 0
        self.best_val_loss: float | None = None
        self.best_step: int | None = None
        self.evals_since_best = 0
        self.nonfinite_steps = 0
        self.overflow_steps = 0
        self.tokens_seen = 0
        self.elapsed_seconds = 0.0
        self.finished = False

    def _emit(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            if not (self.dist.is_main or getattr(cb, "every_rank", False)):
                continue
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(*args)

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> TrainerState:
        """Everything beyond the weights that the next step depends on, as tensors + JSON.
        Under FSDP this gathers the optimizer state (every rank must call it); the result is
        complete on rank 0."""
        if self.replica_optimizer is not None:
            self.parallel.gather_optimizer(self.optimizer, self.replica_optimizer)
            opt = flatten_optimizer(self.replica_optimizer)
        else:
            opt = flatten_optimizer(self.optimizer)
        rng = capture_rng(self.generator)
        scaler = self.precision.scaler
        meta = {
            "step": self.step,
            "best_val_loss": self.best_val_loss,
            "best_step": self.best_step,
            "evals_since_best": self.evals_since_best,
            "nonfinite_steps": self.nonfinite_steps,
            "overflow_steps": self.overflow_steps,
            "tokens_seen": self.tokens_seen,
            "elapsed_seconds": self.elapsed_seconds,
            "finished": self.finished,
            "precision": self.precision.name,
            "optimizer": opt.meta,
            "rng": rng.meta,
            "scaler": None if scaler is None else dict(scaler.state_dict()),
        }
        return TrainerState({**opt.tensors, **rng.tensors}, meta)

    def load_state_dict(self, state: TrainerState) -> None:
        """Inverse of ``state_dict``; ``TrainerStateError`` if it does not fit."""
        meta = state.meta
        try:
            step = meta["step"]
            counters = {k: meta[k] for k in ("evals_since_best", "nonfinite_steps",
                                             "overflow_steps", "tokens_seen")}
            best_val, best_step = meta["best_val_loss"], meta["best_step"]
            elapsed, finished = float(meta["elapsed_seconds"]), bool(meta["finished"])
            opt_meta, rng_meta, scaler_state = meta["optimizer"], meta["rng"], meta["scaler"]
        except (KeyError, TypeError, ValueError) as err:
            raise TrainerStateError(f"trainer state lacks or mangles {err}") from None
        for name, value in {"step": step, **counters}.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TrainerStateError(f"{name} must be an int >= 0; got {value!r}")
        saved_opt = TrainerState(state.tensors, opt_meta)
        if self.replica_optimizer is not None:
            restore_optimizer(self.replica_optimizer, saved_opt)
            self.parallel.scatter_optimizer(self.optimizer, self.replica_optimizer)
        else:
            restore_optimizer(self.optimizer, saved_opt)
        restore_rng(self.generator, TrainerState(state.tensors, rng_meta))
        saved = meta.get("precision")
        if self.cfg.precision == "auto" and saved in PRECISIONS and saved != self.precision.name:
            # 'auto' chose otherwise when this run started (another machine): continue in the
            # precision it was trained in, so the resumed steps are the ones it would have taken.
            self.precision = resolve_precision(saved, self.device)
            self.precision.why = f"auto: resumed in the run's {saved}"
        scaler = self.precision.scaler
        if scaler is not None and scaler_state:
            scaler.load_state_dict(scaler_state)
        self.step = step
        self.best_val_loss = None if best_val is None else float(best_val)
        self.best_step = best_step
        self.evals_since_best = counters["evals_since_best"]
        self.nonfinite_steps = counters["nonfinite_steps"]
        self.overflow_steps = counters["overflow_steps"]
        self.tokens_seen = counters["tokens_seen"]
        self.elapsed_seconds = elapsed
        self.finished = finished

    def resume(self, path: str | Path) -> CheckpointInfo:
        """Load weights and trainer state from a checkpoint folder: the next ``fit`` continues
        exactly where the saved run was."""
        info = verify_checkpoint(path)
        if self.parallel.replica is not None:  # FSDP: load full weights, then shard them
            load_weights(self.parallel.replica, info.path, verify=False)
            self.parallel.load_full_weights(self.parallel.replica)
        else:
            load_weights(self.model, info.path, verify=False)
        state = read_trainer_state(info.path, verify=False)
        loaded = self.model if self.parallel.replica is None else self.parallel.replica
        for file, tensors in (("model.safetensors", loaded.state_dict()),
                              ("trainer_state.safetensors", state.tensors)):
            bad = first_nonfinite(tensors)
            if bad is not None:
                raise NonFiniteStateError(
                    f"{info.path / file}: {bad!r} holds NaN or Inf; resuming would train into "
                    f"NaN weights and commit them. Move {info.path.name} out of "
                    f"{info.path.parent} to resume from the checkpoint before it")
        try:
            self.load_state_dict(state)
        except TrainerStateError as err:
            raise CheckpointError(f"{info.path}/trainer_state.*: {err}") from None
        if self.step != info.step:
            raise CheckpointError(f"{info.path}: trainer state says step {self.step}, the "
                                  f"commit marker says {info.step}")
        return info

    # -- one step -------------------------------------------------------------------------
    def accumulate_gradients(self, micro_batches: Sequence[Batch],
                             global_tokens: int | None = None) -> Tensor:
        """Backward over micro-batches, each loss weighted by its share of target tokens, so
        the summed gradient equals that of one batch holding them all. Under torchrun the
        shares are of the *global* token count and DDP/FSDP average over ranks, so the
        gradient is that of the whole global batch. ``global_tokens`` (the target tokens of
        all ranks' micro-batches) saves an all-reduce when the caller knows it. Returns the
        combined loss over all ranks, a detached 0-d tensor."""
        if not micro_batches:
            raise ValueError("accumulate_gradients needs at least one micro-batch; got none")
        world = self.dist.world_size
        counts = [b.num_tokens for b in micro_batches]
        total = global_tokens if global_tokens is not None else \
            int(self.dist.all_reduce_sum(torch.tensor([sum(counts)]))[0])
        if len(micro_batches) == 1 and world == 1:
            weights: list[float | None] = [None]
        else:
            # ×world because DDP/FSDP divide the summed gradient by the number of ranks.
            weights = [c * world / max(total, 1) for c in counts]
        scaler = self.precision.scaler
        combined: Tensor | None = None
        last = len(micro_batches) - 1
        for i, (batch, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            # Gradients are all-reduced once, on the last micro-step (DDP no_sync, FSDP's
            # requires_gradient_sync); before it they only accumulate locally.
            with self.parallel.no_sync() if i < last else contextlib.nullcontext():
                with self.precision.autocast():
                    logits = self.forward_fn(self.forward_model, batch)
                    loss = self.loss_fn(logits, batch.targets)  # 0-d
                if weight is not None:
                    loss = loss * weight
                (loss if scaler is None else scaler.scale(loss)).backward()
            part = loss.detach().float()
            combined = part if combined is None else combined + part
        assert combined is not None
        if world > 1:
            combined = self.dist.all_reduce_sum(combined) / world
        return combined

    def _train_step(self) -> _StepOutcome:
        cfg = self.cfg
        lr = set_lr(self.optimizer, self.step, cfg)  # every group: its base lr × schedule
        dropout_seed = self.dist.dropout_seed(cfg.seed, self.step)
        if dropout_seed is not None:  # ranks > 0: their own dropout, a function of the step
            torch.manual_seed(dropout_seed)
        # Every rank draws the global batch from the shared generator and keeps its rows; the
        # global token count is read on the CPU, before the batches move to the device.
        drawn = [self.train_batch(self.generator) for _ in range(cfg.grad_accum_steps)]
        window = window_at(self.step, cfg)
        if window < cfg.block_size:  # sequence-length warm-up: the windows' first tokens
            drawn = [b.first_tokens(window) for b in drawn]
        rows = batch_rows_at(self.step, cfg, self.dist.world_size)
        if rows < cfg.batch_size:  # batch-size warm-up: the batch's first windows (all drawn)
            drawn = [b.first_rows(rows) for b in drawn]
        global_tokens = sum(b.num_tokens for b in drawn)
        micro = [shard_rows(b, self.dist).to(self.device) for b in drawn]
        self.optimizer.zero_grad(set_to_none=True)
        loss_t = self.accumulate_gradients(micro, global_tokens)
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # clip and report the true gradient norm
        norm_t = local_value(torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf))
        # The step's one host sync: the non-finite guard decides here whether to step.
        loss, grad_norm = torch.stack([loss_t.float(), norm_t.float()]).tolist()
        status = "ok"
        if not math.isfinite(loss):
            status = "skipped"
        elif not math.isfinite(grad_norm):
            status = "overflow" if scaler is not None else "skipped"
        if scaler is not None:
            if status != "skipped":
                scaler.step(self.optimizer)  # skips by itself when the gradients overflowed
            scaler.update()
        elif status == "ok":
            self.optimizer.step()
        return _StepOutcome(loss, grad_norm, lr, global_tokens, status)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-weighted validation loss, perplexity and bits per token (and per character
        when ``chars_per_token`` is known). Under torchrun each rank evaluates every
        world_size-th batch and the sums are all-reduced: every rank gets the loss over all
        validation batches, not its own shard's."""
        if not self.val_batches:
            return {}
        was_training = self.model.training
        self.model.eval()
        # DDP's wrapper may broadcast buffers in forward; the plain module needs no collective.
        model = self.model if self.parallel.strategy == "ddp" and self.dist.is_distributed \
            else self.forward_model
        world, rank = self.dist.world_size, self.dist.rank
        rounds = -(-len(self.val_batches) // world)
        total, count = 0.0, 0
        for r in range(rounds):
            index = r * world + rank
            mine = index < len(self.val_batches)
            if not mine and not self.parallel.is_sharded:
                continue
            # Under FSDP every rank must run as many forwards as the others (each one
            # all-gathers weights); a rank without a batch left re-runs one, uncounted.
            batch = self.val_batches[index if mine else 0].to(self.device)
            with self.precision.autocast():
                logits = self.forward_fn(model, batch)
                loss = self.loss_fn(logits, batch.targets)
            if mine:
                n = batch.num_tokens
                total += float(loss) * n
                count += n
        self.parallel.reshard()
        self.model.train(was_training)
        if self.dist.is_distributed:
            sums = self.dist.all_reduce_sum(torch.tensor([total, float(count)],
                                                         dtype=torch.float64))
            total, count = float(sums[0]), int(sums[1])
        loss = total / max(count, 1)
        metrics = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                   "val_bits_per_token": loss / math.log(2)}
        if self.chars_per_token:
            metrics["val_bits_per_char"] = loss / math.log(2) / self.chars_per_token
        return metrics

    def _track_best(self, val_loss: float) -> bool:
        if math.isfinite(val_loss) and (self.best_val_loss is None
                                        or val_loss < self.best_val_loss):
            self.best_val_loss, self.best_step, self.evals_since_best = val_loss, self.step, 0
            return True
        self.evals_since_best += 1
        return False

    def _save(self, result: TrainResult, elapsed_base: float, start: float) -> None:
        assert self.checkpoints is not None
        self.elapsed_seconds = elapsed_base + time.perf_counter() - start
        state = self.state_dict()  # gathers under FSDP: every rank takes part
        model = self.parallel.full_model()
        self.dist.barrier()  # every rank is here before rank 0 writes and renames
        refused = None
        if self.dist.is_main:
            try:
                result.last_checkpoint = self.checkpoints.save(
                    self.step, model, state, best_step=self.best_step,
                    best_val_loss=self.best_val_loss)
            except NonFiniteStateError as err:  # a step ruined the weights: stop, keep the last
                latest = self.checkpoints.latest()
                where = f"the last good checkpoint is {latest.path}" if latest else \
                    "no checkpoint was committed"
                refused = (f"stopped at step {self.step}: {err}; {where}. Try a lower --lr, "
                           "--precision fp32, or check the data.")
        refused = self.dist.broadcast_object(refused)  # every rank stops, none waits alone
        if refused is not None:
            raise NonFiniteError(refused)
        self.dist.barrier()  # nobody runs ahead of (or exits before) the commit

    def _nonfinite_message(self, outcome: _StepOutcome) -> str:
        latest = self.checkpoints.latest() if self.checkpoints is not None else None
        where = f"the last good checkpoint is {latest.path}" if latest else "no checkpoint yet"
        return (f"stopped at step {self.step}: {self.nonfinite_steps} steps had a non-finite "
                f"loss or gradient norm (the limit is max_nonfinite_steps="
                f"{self.cfg.max_nonfinite_steps}; the last had loss={outcome.loss}, "
                f"grad_norm={outcome.grad_norm}). None of them changed the weights; {where}. "
                f"Try a lower --lr, --precision fp32, or check the data.")

    # -- the loop -------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> TrainResult:
        """Train from the current step to ``cfg.max_steps`` (or pause at ``stop_at``, with a
        checkpoint there, to be resumed later)."""
        cfg = self.cfg
        end = cfg.max_steps if stop_at is None else min(stop_at, cfg.max_steps)
        ckpt_every = cfg.effective_checkpoint_interval
        result = TrainResult(steps=self.step, start_step=self.step)
        if self.checkpoints is not None and self.dist.is_main:
            self.checkpoints.remove_stale()
        self.model.train()
        start, elapsed_base = time.perf_counter(), self.elapsed_seconds
        bar = tqdm(total=cfg.max_steps, initial=self.step,
                   disable=not (self.progress and self.dist.is_main),
                   dynamic_ncols=True, desc="train", mininterval=1.0)
        tokens_since, time_since, steps_since = 0, time.perf_counter(), 0
        stop_early = reached_target = False

        def say(text: str) -> None:
            if self.dist.is_main:
                bar.write(text)

        try:
            while self.step < end and not (stop_early or reached_target):
                t0 = time.perf_counter()
                out = self._train_step()
                self.step += 1
                step = self.step
                result.step_ms.append((time.perf_counter() - t0) * 1000.0)
                result.train_losses.append(out.loss)
                tokens_since += out.tokens
                steps_since += 1
                self.tokens_seen += out.tokens
                bar.update(1)
                final = step >= cfg.max_steps
                if out.status == "overflow":
                    self.overflow_steps += 1
                if out.status == "skipped":
                    self.nonfinite_steps += 1
                    self._emit("on_log", step, {
                        "step": step, "loss": out.loss, "lr": out.lr, "grad_norm": out.grad_norm,
                        "skipped": True, "nonfinite_steps": self.nonfinite_steps})
                    if self.nonfinite_steps >= cfg.max_nonfinite_steps:
                        raise NonFiniteError(self._nonfinite_message(out))
                elif step % cfg.log_interval == 0 or final:
                    now = time.perf_counter()
                    metrics = {"step": step, "loss": out.loss, "lr": out.lr,
                               "grad_norm": out.grad_norm,
                               "tokens_per_s": tokens_since / max(now - time_since, 1e-9),
                               "ms_per_step": (now - time_since) * 1000.0 / steps_since,
                               "nonfinite_steps": self.nonfinite_steps}
                    if self.precision.scaler is not None:
                        metrics["overflow_steps"] = self.overflow_steps
                    tokens_since, time_since, steps_since = 0, now, 0
                    bar.set_postfix(loss=f"{out.loss:.3f}", lr=f"{out.lr:.2e}",
                                    tok_s=f"{metrics['tokens_per_s']:.0f}")
                    self._emit("on_log", step, metrics)
                improved = False
                if step % cfg.eval_interval == 0 or final:
                    metrics = self.evaluate()
                    if metrics:
                        improved = self._track_best(metrics["val_loss"])
                        metrics = {"step": step, **metrics, "best_val_loss": self.best_val_loss}
                        result.evals.append(metrics)
                        say(f"step {step:>6}: train loss {out.loss:.4f}  "
                                  f"val loss {metrics['val_loss']:.4f}")
                        self._emit("on_eval", step, metrics)
                        patience = cfg.early_stopping_patience
                        target = cfg.target_val_loss
                        if target and metrics["val_loss"] <= target:
                            reached_target = True
                            say(f"reached the target at step {step}: val loss "
                                f"{metrics['val_loss']:.4f} <= {target}")
                        elif patience and self.evals_since_best >= patience:
                            stop_early = True
                            say(f"early stopping at step {step}: no better validation "
                                      f"loss in {patience} evaluations (best "
                                      f"{self.best_val_loss:.4f} at step {self.best_step})")
                self.finished = final or stop_early or reached_target
                # A regular checkpoint after a skipped step could rotate out the last one
                # before a divergence; a new best is always kept (its weights are healthy).
                due = (step % ckpt_every == 0 and out.status != "skipped") or improved
                if self.checkpoints is not None and (due or self.finished or step == end):
                    self._save(result, elapsed_base, start)
                self._emit("on_step_end", step)
        finally:
            bar.close()
            self.elapsed_seconds = elapsed_base + time.perf_counter() - start
        result.steps = self.step
        result.seconds = time.perf_counter() - start
        result.nonfinite_steps, result.overflow_steps = self.nonfinite_steps, self.overflow_steps
        result.best_val_loss, result.best_step = self.best_val_loss, self.best_step
        result.stopped_early, result.reached_target = stop_early, reached_target
        self.model.eval()
        self._emit("on_end", result)
        return result
