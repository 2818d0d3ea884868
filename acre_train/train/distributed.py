"""Process-group setup for the three launch styles (single process, torchrun, deepspeed launcher).

Both launchers export ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; the
ranks and world size are read from there, not from HF ``TrainingArguments`` (which has been seen to
report ``world_size == 1`` under the deepspeed launcher on CPU).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist



@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few scalars over ranks (float64 on CPU for gloo; on the device for nccl)."""
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor.tolist()


def peer_failure(exc: BaseException) -> bool:
    """Does ``exc`` say that a collective lost its peers (closed connection, timeout, backend error)?"""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out",
                            "timeout", "socket"))


def setup(use_deepspeed: bool, timeout_s: int | None = None) -> DistInfo:
    """Initialise the process group when launched with several ranks (or DeepSpeed) and pick the device.

    ``timeout_s``: longest wait in a collective or the rendezvous (``train.dist_timeout_s``).
    """
    from datetime import timedelta

    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one CPU share its cores; oversubscription makes everything slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))
    backend = "nccl" if cuda else "gloo"
    if use_deepspeed:
        # DeepSpeed needs a process group even for one rank; give it a local rendezvous.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        import deepspeed

        _skip_shm_kernel(cuda)
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend=backend, **timeout)
    elif world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, **timeout)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world, device=device)


def _skip_shm_kernel(cuda: bool) -> None:
    """On CPU, DeepSpeed JIT-compiles a shared-memory allreduce kernel on first use (a minute of C++ on two
    cores, per machine) that only speeds up large allreduces between ranks of one node; CPU runs are tiny
    recipes and tests, and gloo serves them. ``ACRE_TRAIN_DS_SHM=1`` builds and uses the kernel.

    For the whole process, not just ``init_distributed``: ``deepspeed.initialize`` builds its own
    communication backend again whenever the process group was set up before or torn down since (a
    second run in one process, as the export tests do)."""
    # Not ``import deepspeed.comm.torch as ...``: that binds the ``torch`` package that ``deepspeed.comm``
    # imports under the same name, and the patch would land nowhere.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if cuda or os.environ.get("ACRE_TRAIN_DS_SHM") == "1" or not hasattr(ds_torch, "build_shm_op"):
        return
    ds_torch.build_shm_op = lambda: None  # DeepSpeed's own fallback when the kernel is unavailable


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
