"""Training on many processes with torch.distributed: DDP and FSDP under ``torchrun``.

``torchrun`` starts one process per device and tells each its ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` through the environment; ``init_distributed`` reads them and joins the process
group (gloo on CPU, nccl on CUDA). Outside torchrun everything here is a no-op, so the
single-process trainer is the same code with ``world_size == 1``.

What a rank does differently from a single process, and why the result is the same run:

* **data** — every rank draws the *global* batch of window starts from the same seeded
  generator and keeps its own rows (``shard_rows``). A run with ``batch_size=2b`` on two ranks
  sees exactly the windows a single process with ``batch_size=2b`` sees, and a checkpoint's
  data position means the same thing at any world size;
* **gradients** — each rank's loss is weighted by its share of the *global* target tokens, and
  DDP/FSDP average over ranks, so the gradient is that of the whole global batch;
* **dropout** — rank 0 keeps the single-process random stream; rank ``r > 0`` reseeds from
  ``(seed, rank, step)`` before every step, so resuming is exact without per-rank state;
* **checkpoints** — weights and optimizer state are gathered to full tensors and written by
  rank 0 alone, in the single-process format: a run trained on many devices loads on a laptop.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn

from handformer.config import STRATEGIES
from handformer.data import Batch

__all__ = [
    "STRATEGIES",
    "DistContext",
    "ParallelModel",
    "exit_worker",
    "init_distributed",
    "launched_by_torchrun",
    "shard_rows",
    "shutdown_distributed",
]

_TIMEOUT_ENV = "HANDFORMER_DIST_TIMEOUT_S"


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job. The default is a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files, logs and draws the progress bar; the others stay quiet."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def all_reduce_sum(self, values: Tensor) -> Tensor:
        """Sum ``values`` over ranks (a copy on the input's device; the input is unchanged).
        nccl reduces only CUDA tensors, so CPU sums travel through this rank's GPU there."""
        if not self.is_distributed:
            return values
        on = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        out = values.detach().to(on, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(values.device)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (for small picklable things made on rank 0 only)."""
        if not self.is_distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def dropout_seed(self, seed: int, step: int) -> int | None:
        """The seed rank ``r > 0`` uses for dropout at ``step``; None for rank 0."""
        if self.rank == 0:
            return None
        return (seed * 1_000_003 + self.rank * 7919 + step * 104_729) % (2**63 - 1)


def launched_by_torchrun() -> bool:
    """True when the environment names a job of more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: torch.device) -> DistContext:
    """Join the process group that ``torchrun`` describes in the environment.

    gloo for CPU, nccl for CUDA (each rank on ``cuda:LOCAL_RANK``). Returns a single-process
    context when not launched by torchrun. Collective operations time out after
    ``HANDFORMER_DIST_TIMEOUT_S`` seconds (default 1800), so a lost rank never hangs forever.
    """
    if not launched_by_torchrun():
        return DistContext()
    try:
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except (KeyError, ValueError) as err:
        raise ValueError(f"WORLD_SIZE > 1 but the torchrun environment is incomplete ({err}); "
                         "start the job with torchrun --nproc_per_node=N -m handformer ...")\
            from None
    if device.type == "cuda":
        torch.cuda.set_device(local)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise ValueError(f"distributed training supports cpu (gloo) and cuda (nccl); "
                         f"got device {device}")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=float(os.environ.get(_TIMEOUT_ENV, "1800")))
        dist.init_process_group(backend=backend, timeout=timeout)
    return DistContext(rank=rank, world_size=world, local_rank=local)


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker process now, skipping the interpreter's teardown.

    Once DDP or FSDP has used the gloo group, torch keeps a reference to it past
    ``destroy_process_group``: its worker and transport threads live until the process ends,
    and a rank that tears the interpreter and C++ statics down beside them can abort
    (``terminate called without an active exception``, SIGABRT) after a job that succeeded,
    which fails the whole torchrun job. So the worker runs its exit handlers (``atexit``: log
    handlers, progress bars, writers) and flushes its streams itself, then leaves with
    ``os._exit``, which runs no destructor.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not change the exit code
            stream.flush()
    os._exit(code)


def rank_device(device: torch.device, ctx: DistContext) -> torch.device:
    """``cuda`` means this rank's own GPU under torchrun; other devices are unchanged."""
    if device.type == "cuda" and ctx.is_distributed:
        return torch.device("cuda", ctx.local_rank)
    return device


def check_batch_splits(batch_size: int, ctx: DistContext) -> None:
    if batch_size % ctx.world_size:
        raise ValueError(
            f"batch_size={batch_size} is the global micro-batch and must split evenly over "
            f"{ctx.world_size} ranks; expected a multiple of {ctx.world_size} (each rank "
            f"then takes batch_size / {ctx.world_size} windows)")


def shard_rows(batch: Batch, ctx: DistContext) -> Batch:
    """This rank's contiguous share of a global batch: rows ``[r·b, (r+1)·b)``."""
    if not ctx.is_distributed:
        return batch
    rows = batch.ids.shape[0]
    check_batch_splits(rows, ctx)
    per = rows // ctx.world_size
    sl = slice(ctx.rank * per, (ctx.rank + 1) * per)
    return Batch(batch.ids[sl], batch.targets[sl],
                 None if batch.padding_mask is None else batch.padding_mask[sl])


class ParallelModel:
    """The model as each strategy needs it, behind one small interface.

    * ``module`` — the plain model (under FSDP its parameters are sharded DTensors);
    * ``forward_module`` — what the forward pass calls (the DDP wrapper, or the module);
    * ``no_sync()`` — skip the gradient all-reduce for a micro-step that is not the last;
    * ``full_model()`` — a plain module with the full weights (collective under FSDP; every
      rank must call it), for saving, sampling and single-process reuse.

    Under FSDP a CPU replica of the unsharded model is kept: gathered weights and optimizer
    state are loaded into it so the checkpoint writer and the optimizer flattening stay the
    single-process code.
    """

    def __init__(self, model: nn.Module, strategy: str, ctx: DistContext,
                 device: torch.device) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
        self.module = model
        self.strategy = strategy
        self.ctx = ctx
        self.replica: nn.Module | None = None
        self.forward_module: nn.Module = model
        if not ctx.is_distributed:
            return
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [device.index] if device.type == "cuda" else None
            self.forward_module = DistributedDataParallel(model, device_ids=device_ids)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            self.replica = copy.deepcopy(model).cpu()  # before sharding: tied weights kept
            mesh = init_device_mesh(device.type, (ctx.world_size,))
            # Shard each block on its own (its weights are gathered just for its forward and
            # backward), then the root: embeddings, final norm and the (tied) head.
            for block in _blocks(model):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)

    @property
    def is_sharded(self) -> bool:
        return self.replica is not None

    def reshard(self) -> None:
        """Put the sharded parameters back on the modules. FSDP keeps the root's weights
        gathered after a forward without backward (evaluation); the state-dict helpers and
        the optimizer know only the sharded ones."""
        if self.replica is not None:
            self.module.reshard()  # type: ignore[operator]
            for block in _blocks(self.module):
                block.reshard()  # type: ignore[operator]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate this micro-step's gradients locally; the last micro-step syncs."""
        if not self.ctx.is_distributed:
            yield
        elif self.strategy == "ddp":
            with self.forward_module.no_sync():  # type: ignore[operator]
                yield
        else:
            self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def full_model(self) -> nn.Module:
        """The plain, unsharded model with the current weights (on rank 0 at least)."""
        if self.replica is None:
            return self.module
        api, full = _state_dict_api()
        self.reshard()
        weights = api.get_model_state_dict(self.module, options=full(cpu_offload=True))
        if self.ctx.is_main:
            self.replica.load_state_dict(weights)
        return self.replica

    def load_full_weights(self, source: nn.Module) -> None:
        """Copy a plain model's weights into the (sharded) training model on every rank."""
        if self.replica is None:
            if source is not self.module:
                self.module.load_state_dict(source.state_dict())
            return
        api, full = _state_dict_api()
        self.reshard()
        api.set_model_state_dict(self.module, source.state_dict(), options=full())

    def gather_optimizer(self, optimizer: torch.optim.Optimizer,
                         replica_optimizer: torch.optim.Optimizer) -> None:
        """Full optimizer state into ``replica_optimizer`` (collective; filled on rank 0)."""
        assert self.replica is not None
        api, full = _state_dict_api()
        self.reshard()
        state = api.get_optimizer_state_dict(self.module, optimizer,
                                             options=full(cpu_offload=True))
        if self.ctx.is_main:
            api.set_optimizer_state_dict(self.replica, replica_optimizer, state, options=full())

    def scatter_optimizer(self, optimizer: torch.optim.Optimizer,
                          replica_optimizer: torch.optim.Optimizer) -> None:
        """Shard the full state held by ``replica_optimizer`` (same on every rank) back."""
        assert self.replica is not None
        api, full = _state_dict_api()
        self.reshard()
        state = api.get_optimizer_state_dict(self.replica, replica_optimizer, options=full())
        api.set_optimizer_state_dict(self.module, optimizer, state, options=full())


def _state_dict_api() -> tuple[Any, Any]:
    """torch's state-dict helpers for sharded models, and a maker of their "full tensors"
    option. Imported on first use: a single-process run never pays for them."""
    import functools

    from torch.distributed.checkpoint import state_dict as api

    return api, functools.partial(api.StateDictOptions, full_state_dict=True)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers FSDP shards one by one: any ``blocks`` ModuleList in the model."""
    found: list[nn.Module] = []
    for name, module in model.named_modules():
        if name.split(".")[-1] == "blocks" and isinstance(module, nn.ModuleList):
            found.extend(module)
    return found


def local_value(value: Tensor) -> Tensor:
    """A DTensor (FSDP's gradient norm) as a plain tensor; other tensors unchanged."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value
