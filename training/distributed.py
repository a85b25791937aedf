"""torch.distributed helpers: ``torchrun --nproc_per_node=K -m training.train …`` runs DDP (NCCL on GPU, Gloo on CPU).

Evaluation never pads: :class:`UnpaddedDistributedSampler` gives rank ``r`` the indices ``r, r+K, r+2K, …``, so the
ranks together see every sample exactly once (``DistributedSampler`` would repeat samples to equalise the shards and
bias the metrics); :func:`gather_tensors` concatenates shards of different lengths.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["init_distributed", "is_distributed", "rank", "world_size", "is_main_process", "barrier", "cleanup",
           "UnpaddedDistributedSampler", "gather_tensors", "broadcast_object"]


def init_distributed(device_type: str) -> bool:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1 in the environment); return whether
    running distributed. NCCL for CUDA devices, Gloo otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    return True


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def cleanup() -> None:
    if is_distributed():
        dist.destroy_process_group()


class UnpaddedDistributedSampler(Sampler[int]):
    """Rank ``r`` of ``K`` iterates ``r, r+K, …`` in order: every sample exactly once across ranks, no padding."""

    def __init__(self, dataset, num_replicas: int | None = None, rank_: int | None = None):
        self.num_replicas = world_size() if num_replicas is None else num_replicas
        self.rank = rank() if rank_ is None else rank_
        self.length = len(dataset)

    def __iter__(self):
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self):
        return len(range(self.rank, self.length, self.num_replicas))


def gather_tensors(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` (first dimension may differ per rank) from every rank, in rank order, on every rank.

    With :class:`UnpaddedDistributedSampler` the result holds each sample exactly once (in strided order)."""
    if not is_distributed():
        return tensor
    length = torch.tensor([tensor.shape[0]], device=tensor.device)
    lengths = [torch.zeros_like(length) for _ in range(world_size())]
    dist.all_gather(lengths, length)
    longest = int(max(l.item() for l in lengths))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    shards = [torch.zeros_like(padded) for _ in range(world_size())]
    dist.all_gather(shards, padded)
    return torch.cat([shard[: int(l.item())] for shard, l in zip(shards, lengths)])


def broadcast_object(obj, src: int = 0):
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]
