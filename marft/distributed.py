"""Data parallelism over processes: ``torchrun`` / ``accelerate launch`` with P processes (one per GPU, or gloo on CPU).

Every process holds the same team (one base model + adapters) and its own ``n_rollout_threads / P``
environments; rank ``r``'s env ``k`` is seeded ``seed + r * (n_rollout_threads / P) + k``, so the P shards
together are the envs of a single-process run. Rollouts run in parallel; what must agree is reduced here:

* **Gradients**: after a minibatch's backward passes, the gradients of the adapter being trained (the critic:
  its adapter + value head) are summed over processes in ONE all-reduce of a flat buffer
  (:meth:`Distributed.sync_gradients`). Each process weights its chunks by the GLOBAL minibatch's loss units,
  so the sum is the gradient of the union of the batches. Clipping then sees the global gradient norm, and a
  non-finite loss on any process skips the step on all of them (the flag travels in the same buffer).
* **Minibatches**: the processes' shares may differ in size (an orchestrator calls agents unevenly); rank 0
  draws each epoch's permutation of the union of the rows (:meth:`Distributed.permutation`), so every process
  runs the same number of minibatches (its part of one possibly empty) and the collectives stay matched.
* **Statistics**: advantage mean/std, the PPO epoch's KL for ``--target_kl`` and the critic's explained
  variance are computed over the global batch (:meth:`Distributed.mean_std`, :meth:`Distributed.sum_floats`).

Why not ``DistributedDataParallel`` (``accelerator.prepare(model)``): DDP fixes the set of parameters it
synchronises when the model is wrapped, and registers hooks on every parameter that requires grad at that
moment. The agent schedule switches which adapter requires grad from one update to the next (agent *i*,
then the critic, then agent *j*), and one base model carries all adapters, so one DDP wrapper would wait
forever for gradients of adapters not being trained (or reduce every adapter each step). Reducing the active
adapter's gradients ourselves, once per optimizer step, works with the switching and moves only what trains.

With one process (no ``WORLD_SIZE`` > 1 in the environment) :data:`SINGLE` is used: no collective is called
and nothing is wrapped, so the single-process path is the plain code path.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as tdist


def world_size_from_env() -> int:
    """Processes of this launch as ``torchrun`` / ``accelerate launch`` announce them (1 when not launched so)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class Distributed:
    """Process info and the few collectives marft needs. The default instance (:data:`SINGLE`) is one process."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank

    @property
    def enabled(self) -> bool:
        """More than one process: collectives are needed."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes logs, TensorBoard, the progress bar, summaries and checkpoints."""
        return self.rank == 0

    # ------------------------------------------------------------------ collectives (no-ops with one process)
    def sum_floats(self, values: Sequence[float], device=None) -> list[float]:
        """Each value summed over processes (float64, one all-reduce)."""
        if not self.enabled:
            return [float(v) for v in values]
        buffer = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device(device))
        tdist.all_reduce(buffer)
        return buffer.tolist()

    def mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean and (unbiased) std of the 1-D ``x`` over all processes' entries; None with fewer than 2 entries in all.

        One process: exactly ``x.mean(), x.std()``. Several: two passes (sum and count, then squared deviations),
        as numerically careful as ``torch.std``."""
        if not self.enabled:
            return (x.mean(), x.std()) if x.numel() > 1 else None
        total, count = self.sum_floats([x.double().sum(), x.numel()], x.device)
        if count < 2:
            return None
        mean = total / count
        (squares,) = self.sum_floats([((x.double() - mean) ** 2).sum()], x.device)
        return torch.tensor(mean, dtype=x.dtype, device=x.device), torch.tensor((squares / (count - 1)) ** 0.5, dtype=x.dtype, device=x.device)

    def sync_gradients(self, params: Sequence[torch.nn.Parameter], ok: bool) -> bool:
        """Sum ``params``' gradients over processes in one all-reduce of a flat float32 buffer; return whether
        every process's losses were finite (``ok`` on all). A parameter keeps ``grad None`` only when no
        process gave it a gradient (AdamW skips those, as in a single process)."""
        if not self.enabled:
            return ok
        device = params[0].device
        grads = [p.grad.detach().flatten().float() if p.grad is not None else torch.zeros(p.numel(), device=device) for p in params]
        has_grad = [1.0 if p.grad is not None else 0.0 for p in params]
        buffer = torch.cat([*grads, torch.tensor([*has_grad, 0.0 if ok else 1.0], device=device)])  # (sum numel + n_params + 1,)
        tdist.all_reduce(buffer)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = buffer[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
        for p, count in zip(params, buffer[offset : offset + len(params)].tolist()):
            if count == 0:
                p.grad = None
        return buffer[-1].item() == 0

    def broadcast_parameters(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Copy rank 0's values of ``params`` to every process (one broadcast of a flat buffer)."""
        if not self.enabled or not params:
            return
        buffer = torch.cat([p.detach().flatten().float() for p in params])
        tdist.broadcast(buffer, src=0)
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def permutation(self, n: int) -> torch.Tensor:
        """``torch.randperm(n)`` drawn by rank 0 (from its torch RNG) and the same on every process (one broadcast).
        One process: exactly ``torch.randperm(n)``."""
        if not self.enabled:
            return torch.randperm(n)
        perm = torch.randperm(n) if self.is_main else torch.empty(n, dtype=torch.long)
        buffer = perm.to(self._comm_device(None))
        tdist.broadcast(buffer, src=0)
        return buffer.cpu()

    def gather_objects(self, obj) -> list:
        """``obj`` of every process, by rank (picklable Python objects: states, metrics)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every process."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    @contextmanager
    def main_process_first(self):
        """Rank 0 runs the block first (e.g. builds and caches the embedded model), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def _comm_device(self, device):
        """Where collective buffers live: the GPU for NCCL, the CPU for gloo."""
        if tdist.get_backend() == "nccl":
            return device if device is not None and torch.device(device).type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


SINGLE = Distributed()
"""One process: every collective is a no-op."""


def init_distributed(device: str, timeout_s: float) -> Distributed:
    """Join the process group that ``torchrun`` / ``accelerate launch`` describe in the environment (accelerate's
    ``PartialState``: NCCL on GPUs, each process on its local GPU; gloo with ``--device cpu`` or without GPUs),
    with collectives that give up after ``timeout_s`` seconds, so a dead process stops the others with an error
    instead of a hang. Returns :data:`SINGLE` when the launch has one process."""
    if world_size_from_env() <= 1:
        return SINGLE
    from accelerate import PartialState

    cpu = device == "cpu" or not torch.cuda.is_available()
    state = PartialState(cpu=cpu, timeout=timedelta(seconds=timeout_s))
    atexit.register(shutdown_distributed)  # whatever the entry point: a process group left to the interpreter's teardown aborts it
    if not cpu:
        torch.cuda.set_device(state.device)  # so --device cuda / auto means this process's local GPU
    return Distributed(rank=state.process_index, world_size=state.num_processes, local_rank=state.local_process_index)


_BEFORE_SHUTDOWN: list = []
"""Callbacks :func:`shutdown_distributed` runs first (an inference engine with process groups of its own)."""


def before_shutdown(callback) -> None:
    """Run ``callback()`` before the process group is destroyed (once; e.g. ``VLLMEngine.close``, whose own groups
    must go first)."""
    _BEFORE_SHUTDOWN.append(callback)


def shutdown_distributed() -> None:
    """Destroy the process group, if one is up (idempotent). A process that exits with its gloo group alive can
    die in ``std::terminate`` (SIGABRT) while the interpreter tears down (pytorch#190489), so
    :func:`marft.cli.train.main` calls this when training ends and :func:`init_distributed` registers it at exit.
    Callbacks given to :func:`before_shutdown` run first."""
    while _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.pop()()
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
