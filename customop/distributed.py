"""Tensor-parallel state and the collectives the parallel layers need, on ``torch.distributed``.

The process group comes from the caller (``torch.distributed.init_process_group`` or a subgroup
made with ``new_group``); customop never starts a transport of its own. NCCL on CUDA/ROCm, gloo
on CPU, XCCL on XPU and the XLA backend on TPU all work, because every collective here is one call
into ``torch.distributed``.

Without any set-up the process is its own tensor-parallel group of size 1 and every collective is
the identity, so single-device users never touch this module::

    dist.init_process_group("nccl")          # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR ...
    customop.distributed.init_tp_group()      # the default group; or init_tp_group(my_subgroup)
    layer = ColumnParallelLinear(4096, 14336) # captures get_tp_group() when it is built

Layers capture the group current at construction (as vLLM's layers do), so ``use_tp_group`` in a
test changes only the layers built inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TPGroup",
    "get_tp_group",
    "init_tp_group",
    "set_tp_group",
    "use_tp_group",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_gather",
]


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); the TPU and
# XPU tiers pin torch 2.8/2.9, which only have the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """This process's place in one tensor-parallel group: ``tp_rank`` of ``tp_size``.

    ``group`` is the ``torch.distributed`` process group (None only for the single-process
    default). The constructor checks that rank and size agree with the group, so a stale or
    hand-made state fails here rather than as a hang inside a collective.
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup | None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"TPGroup: tp_rank={self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if self.group is None:
            if self.tp_size != 1:
                raise ValueError(f"TPGroup: tp_size={self.tp_size} needs a torch.distributed process group; "
                                 "build it with customop.distributed.init_tp_group(group)")
            return
        if not _dist_ready():
            raise RuntimeError("TPGroup: a process group was given but torch.distributed is not initialised; "
                               "call torch.distributed.init_process_group(...) first")
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if rank < 0:
            raise ValueError("TPGroup: this process is not a member of the given process group")
        if (size, rank) != (self.tp_size, self.tp_rank):
            raise ValueError(f"TPGroup: tp_rank={self.tp_rank}, tp_size={self.tp_size} do not match the process "
                             f"group (rank {rank} of {size})")

    # ---- sharding arithmetic ------------------------------------------------------------------

    def shard_size(self, full: int, what: str) -> int:
        """``full / tp_size``; raises naming ``what`` when it does not divide evenly."""
        if full % self.tp_size:
            raise ValueError(f"{what}: size {full} is not divisible by tp_size={self.tp_size}")
        return full // self.tp_size

    # ---- collectives (each one call into torch.distributed; identity at tp_size 1) -----------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group. Reduces ``x`` in place and returns it."""
        if self.tp_size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's ``x`` along ``dim``, rank 0's first, on every rank."""
        if self.tp_size == 1:
            return x
        dim = dim % x.dim()
        # all_gather_single fills one buffer, rank-major along dim 0 (gloo insists on the
        # concatenated shape; NCCL takes any shape of the right size). Viewing it as
        # (rank, *x.shape), moving the rank axis next to ``dim`` and merging the two concatenates.
        out = x.new_empty((self.tp_size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        out = out.view(self.tp_size, *x.shape).movedim(0, dim)
        return out.reshape(*x.shape[:dim], self.tp_size * x.shape[dim], *x.shape[dim + 1:])

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenates every rank's ``x`` along ``dim`` on group rank ``dst``; None elsewhere."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.tp_rank == dst else None
        dist.gather(x, parts, group=self.group, group_dst=dst)
        return torch.cat(parts, dim=dim) if parts is not None else None


_SINGLE = TPGroup()
_current: TPGroup = _SINGLE


def get_tp_group() -> TPGroup:
    """The current tensor-parallel group (the single-process one unless set)."""
    return _current


def set_tp_group(state: TPGroup | None) -> TPGroup:
    """Makes ``state`` current (None: back to the single-process default); returns the previous."""
    global _current
    previous, _current = _current, state or _SINGLE
    return previous


def _from_group(group: Any) -> TPGroup:
    if not _dist_ready():
        raise RuntimeError(
            "customop.distributed: torch.distributed is not initialised. Call "
            "torch.distributed.init_process_group(backend) first (torchrun sets RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT), or build the layers without a group for tp_size 1."
        )
    group = group if group is not None else dist.group.WORLD
    return TPGroup(tp_rank=dist.get_rank(group), tp_size=dist.get_world_size(group), group=group)


def init_tp_group(group: Any = None) -> TPGroup:
    """Builds the TP state from ``group`` (default: the whole world), makes it current, returns it."""
    state = _from_group(group)
    set_tp_group(state)
    return state


@contextlib.contextmanager
def use_tp_group(group: Any = None) -> Iterator[TPGroup]:
    """Scopes the current TP group: a ``TPGroup``, a process group, or None (single process).

    Layers built inside the block keep that group after it ends::

        with use_tp_group(None):   # a tp-1 reference layer inside a 2-rank job
            reference = ColumnParallelLinear(64, 96)
    """
    state = group if isinstance(group, TPGroup) else (_SINGLE if group is None else _from_group(group))
    previous = set_tp_group(state)
    try:
        yield state
    finally:
        set_tp_group(previous)


# vLLM's names, on the current group.

def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    return get_tp_group().gather(x, dst, dim)


#: NVLink multicast stays off on shared hosts (a program using it can take the host's GPUs down).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_from_torchrun(backend: str | None = None) -> torch.device:
    """Starts the default process group that ``torchrun`` describes (NCCL on CUDA, else gloo) and
    returns this rank's device. Sets ``NO_MULTICAST_ENV`` unless already set."""
    import os

    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        for var, value in NO_MULTICAST_ENV.items():
            os.environ.setdefault(var, value)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group(backend or "gloo")
    return torch.device("cpu")
