"""Collective weight sync, sender side: learner rank 0 broadcasts the policy to every generator.

The sync group is a process group of its own, separate from the learner ranks' group: rank 0 is
the learner's rank 0, ranks 1..W-1 are the generators' inference workers (a tensor-parallel
generator contributes one rank per worker). It is built straight from a ``TCPStore`` that rank 0
hosts, so neither side needs a global ``torch.distributed`` world of this shape: NCCL when the
policy lives on GPUs, gloo on CPUs. Every sync broadcasts each tensor of the (gathered, merged)
policy in the order of its ``ParamSpec`` list, which the receivers got once when they joined.

Receivers live in ``rayppo/actors/weight_receiver.py`` (a vLLM weight-transfer engine, and the
transformers backend's receiver); both use ``open_sync_group`` from here. Only ``torch`` is
imported, so the learner does not depend on vLLM.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class SyncEndpoint:
    """Where and how to join the sync group."""

    backend: str
    """``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors)."""
    host: str
    """Address of the node of learner rank 0, which hosts the rendezvous store."""
    port: int
    """Port of the rendezvous store."""
    world_size: int
    """1 (the sender) + the number of receiving inference workers."""
    timeout_s: float = 600.0
    """How long joining and each broadcast may wait for the other side before failing."""


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of the sync stream: the receivers allocate it before each broadcast."""

    name: str
    """Hugging Face parameter name."""
    dtype: str
    """torch dtype name, e.g. ``float32``."""
    shape: tuple[int, ...]


def free_port() -> int:
    """A TCP port free on this node right now (for a rendezvous store to bind next)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def open_sync_group(endpoint: SyncEndpoint, rank: int) -> dist.ProcessGroup:
    """Join the sync group as ``rank`` (rank 0 hosts the store). Blocks until all ranks joined."""
    if endpoint.backend not in BACKENDS:
        raise ValueError(f"weight sync backend must be one of {BACKENDS}, got {endpoint.backend!r}")
    timeout = datetime.timedelta(seconds=endpoint.timeout_s)
    store = dist.TCPStore(endpoint.host, endpoint.port, endpoint.world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore("rayppo-weight-sync", store)
    if endpoint.backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, endpoint.world_size)
    return dist.ProcessGroupGloo(store, rank, endpoint.world_size, timeout)


def param_specs(named: dict[str, torch.Tensor]) -> list[ParamSpec]:
    """The stream's layout, in send order."""
    return [ParamSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named.items()]


def broadcast_from_root(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """One tensor from rank 0 to every rank of ``group`` (in place on the receivers)."""
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


def receive_stream(group: dist.ProcessGroup, specs: list[ParamSpec], device: torch.device):
    """Yield ``(name, tensor)`` as each broadcast of a sync arrives (receiver side)."""
    for spec in specs:
        tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
        broadcast_from_root(group, tensor)
        yield spec.name, tensor


class WeightSender:
    """Learner rank 0's end of the sync group."""

    def __init__(self, endpoint: SyncEndpoint, specs: list[ParamSpec], device: torch.device):
        self.specs = specs
        self.device = device
        self.group = open_sync_group(endpoint, rank=0)
        self.receivers = endpoint.world_size - 1

    def send(self, named: dict[str, torch.Tensor]) -> int:
        """Broadcast every tensor; returns the bytes delivered (payload x receivers)."""
        if param_specs(named) != self.specs:
            raise RuntimeError("the policy's tensors changed name, dtype or shape since the sync group was opened")
        sent = 0
        for tensor in named.values():
            # Broadcast reads raw memory: send a contiguous copy on the group's device.
            tensor = tensor.detach().to(self.device).contiguous()
            broadcast_from_root(self.group, tensor)
            sent += tensor.numel() * tensor.element_size()
        return sent * self.receivers
