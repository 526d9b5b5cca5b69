"""Collective weight sync, sender side: learner rank 0 broadcasts the policy to every generator.

The sync group is a process group of its own, separate from the learner ranks' group: rank 0 is
the learner's rank 0, ranks 1..W-1 are the generators' inference workers (a tensor-parallel
generator contributes one rank per worker). It is built straight from a ``TCPStore`` that rank 0
hosts, so neither side needs a global ``torch.distributed`` world of this shape: NCCL when the
policy lives on GPUs, gloo on CPUs. Every sync broadcasts each tensor of the (gathered, merged)
policy in the order of its ``ParamSpec`` list, which the receivers got once when they joined.

Colocated on GPUs (``learner.weight_sync=ipc``) there is no copy at all: learner rank i hands the
generator on its GPU CUDA-IPC handles of the policy's tensors (``IpcChunk``), in the layout of
vLLM 0.32's IPC weight-transfer engine (``vllm/distributed/weight_transfer/ipc_engine.py``,
``IPCWeightTransferUpdateInfo``, unpacked mode), which rebuilds them in its worker and loads them.

Receivers live in ``rayppo/actors/weight_receiver.py`` (a vLLM weight-transfer engine, and the
transformers backend's receiver); both use ``open_sync_group`` from here. Only ``torch`` is
imported, so the learner does not depend on vLLM.
"""

from __future__ import annotations

import datetime
import random
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rayppo.models.weights import with_aliases

BACKENDS = ("gloo", "nccl")

SyncGroup = torch._C._distributed_c10d.Backend
"""A gloo or NCCL group built outside torch.distributed's world (``ProcessGroupGloo``/``ProcessGroupNCCL``
are this class in torch 2.13; the public ``dist.Backend`` is the backend-name enum, not it)."""


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


@dataclass(frozen=True)
class SyncLayout:
    """What the receivers of a sync group learn once, when they join (``PolicySync.layout``)."""

    specs: list[ParamSpec]
    """Every tensor of a sync, in send order."""
    adapter: dict[str, Any] | None = None
    """With LoRA adapter sync, the adapter's peft config (the tensors are its A and B, served
    on the base the generators loaded); None: the tensors are the full policy."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The ports Linux hands out for outgoing connections and ``bind(0)`` (default 32768-60999)."""


def free_port() -> int:
    """A TCP port free on this node right now, for a rendezvous store to bind next. Drawn below the
    kernel's ephemeral range: a port from ``bind(0)`` is one the kernel may give to any other
    process's connection or ``bind(0)`` (dozens of them while the actors start) before the store
    binds it, and the learner then fails with EADDRINUSE."""
    low = 32768
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    draw = random.SystemRandom()  # not the seeded module generator: processes must not agree
    for _ in range(64) if low > 2048 else ():
        port = draw.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def open_sync_group(endpoint: SyncEndpoint, rank: int) -> SyncGroup:
    """Join the sync group as ``rank`` (rank 0 hosts the store). Blocks until all ranks joined."""
    if endpoint.backend not in BACKENDS:
        raise ValueError(f"weight sync backend must be one of {BACKENDS}, got {endpoint.backend!r}")
    timeout = datetime.timedelta(seconds=endpoint.timeout_s)
    store = dist.PrefixStore("rayppo-weight-sync", dist.TCPStore(
        endpoint.host, endpoint.port, endpoint.world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False))
    if endpoint.backend == "nccl":
        # The timeout bounds every NCCL collective of the group, as gloo's does (without it a
        # generator that died mid-sync would leave rank 0 waiting on NCCL's default of 10 min+).
        # torch 2.13, torch/csrc/distributed/c10d/init.cpp: ProcessGroupNCCL(store, rank, size,
        # options) with ProcessGroupNCCL.Options()._timeout.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, endpoint.world_size, options)
    return dist.ProcessGroupGloo(store, rank, endpoint.world_size, timeout)


def param_spec(name: str, tensor: torch.Tensor) -> ParamSpec:
    return ParamSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def param_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """The stream's layout, in send order."""
    return [param_spec(n, t) for n, t in named]


def broadcast_from_root(group: SyncGroup, tensor: torch.Tensor) -> None:
    """One tensor from rank 0 to every rank of ``group`` (in place on the receivers)."""
    # torch 2.13's stub declares broadcast on ProcessGroup only; the Backend binding has it too.
    group.broadcast([tensor], dist.BroadcastOptions()).wait()  # type: ignore[attr-defined]


def receive_stream(group: SyncGroup, specs: list[ParamSpec], device: torch.device):
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

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every tensor as it comes; returns the bytes delivered (payload x receivers)."""
        sent, count = 0, 0
        for spec, (name, tensor) in zip(self.specs, named):
            # The receivers allocate from the layout they got at join time: a changed tensor
            # would be read into the wrong buffer, so it stops the sync.
            if param_spec(name, tensor) != spec:
                raise RuntimeError(f"the policy's tensor {name} changed name, dtype or shape since the sync group "
                                   f"was opened ({param_spec(name, tensor)} vs {spec})")
            # Broadcast reads raw memory: send a contiguous copy on the group's device.
            tensor = tensor.detach().to(self.device).contiguous()
            broadcast_from_root(self.group, tensor)
            sent += tensor.numel() * tensor.element_size()
            count += 1
        if count != len(self.specs):
            raise RuntimeError(f"the policy streamed {count} tensors, the sync group expects {len(self.specs)}")
        return sent * self.receivers


HandleExport = Callable[[torch.Tensor], dict[str, tuple]]
"""``export(tensor)``: ``{physical GPU UUID: rebuild args}`` of a CUDA tensor (``cuda_ipc_handle``)."""


def cuda_ipc_handle(tensor: torch.Tensor) -> dict[str, tuple]:
    """A CUDA tensor as what vLLM's IPC engine rebuilds: the arguments of
    ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` under the UUID of the physical GPU
    (the receiver looks up its own UUID, so a handle can only be opened on the same GPU)."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    return {uuid: reduce_tensor(tensor)[1]}


def open_ipc_handle(handle: dict[str, tuple], device_index: int) -> torch.Tensor:
    """The tensor a ``cuda_ipc_handle`` shares, opened on this process's GPU ``device_index``, as
    vLLM 0.32's IPC engine opens one (``vllm/distributed/weight_transfer/ipc_engine.py``,
    ``receive_weights``, unpacked): the handle under this GPU's physical UUID, argument 6 of
    ``rebuild_cuda_tensor`` (the device index) replaced by the receiver's own."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    if uuid not in handle:
        raise ValueError(f"CUDA-IPC sync: no handle for this GPU ({uuid}); the run was shared for {list(handle)}")
    args = list(handle[uuid])
    args[6] = device_index
    return rebuild_cuda_tensor(*args)


@dataclass
class IpcChunk:
    """A run of policy tensors shared by CUDA-IPC: vLLM's ``IPCWeightTransferUpdateInfo`` fields
    (unpacked: one handle per tensor), plus the bytes they hold."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: list[dict[str, tuple]]
    nbytes: int = 0
    adapter: dict[str, Any] | None = None
    """With LoRA adapter sync, the adapter's peft config: the run is its A and B (one run)."""
    held: list[torch.Tensor] = field(default_factory=list, repr=False)
    """The exported tensors, kept alive by the sender until the receiver has loaded them (never
    sent: ``update_info`` leaves them out)."""

    def update_info(self) -> dict:
        """The ``update_info`` of vLLM's ``LLM.update_weights``."""
        return {k: v for k, v in asdict(self).items() if k not in ("nbytes", "held", "adapter")}

    def with_aliases(self, aliases: dict[str, str]) -> IpcChunk:
        """This run with each tensor also under the names ``aliases`` (``{alias: source}``) shares
        with it (a tied head: ``models/weights.py``, ``with_aliases``). An alias reuses the handle:
        torch rebuilds a handle it already opened from its cache of shared storages
        (torch/multiprocessing/reductions.py, ``rebuild_cuda_tensor``, torch 2.13), so the tensor
        is mapped once, not copied."""
        rows = list(with_aliases(((name, i) for i, name in enumerate(self.names)), aliases))
        if len(rows) == len(self.names):
            return self
        pick = [i for _, i in rows]
        return IpcChunk([name for name, _ in rows], [self.dtype_names[i] for i in pick], [self.shapes[i] for i in pick],
                        [self.ipc_handles[i] for i in pick], self.nbytes, self.adapter, self.held)

    def __reduce__(self):  # crossing processes: the handles, never the tensors
        return IpcChunk, (self.names, self.dtype_names, self.shapes, self.ipc_handles, self.nbytes, self.adapter)


LAYER = re.compile(r"^(.*?\.layers\.\d+\.)")
"""The decoder-layer prefix of a tensor name (``model.layers.7.``)."""


def layer_runs(stream: Iterable[tuple[str, torch.Tensor]],
               copy: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream in runs of one decoder layer's consecutive tensors (a tensor outside the layers,
    such as the embedding, is a run of its own): one CUDA-IPC round trip per layer instead of one
    per tensor. ``copy``: each tensor cloned into the run, for a stream whose tensors are released
    when the next one is requested (ZeRO-3's gathered modules); the peak is then one layer."""
    run: list[tuple[str, torch.Tensor]] = []
    key = None
    for name, tensor in stream:
        match = LAYER.match(name)
        if run and (match is None or match.group(1) != key):
            yield run
            run = []
        run.append((name, tensor.clone() if copy else tensor))
        key = match.group(1) if match else None
    if run:
        yield run


def ipc_chunk(named: list[tuple[str, torch.Tensor]], export: HandleExport = cuda_ipc_handle,
              adapter: dict[str, Any] | None = None) -> IpcChunk:
    """CUDA-IPC handles of ``named`` (contiguous tensors; a non-contiguous one is copied and the
    copy held); ``adapter``: the peft config when ``named`` is a LoRA adapter."""
    held = [t.detach().contiguous() for _, t in named]
    return IpcChunk(names=[n for n, _ in named],
                    dtype_names=[str(t.dtype).removeprefix("torch.") for t in held],
                    shapes=[list(t.shape) for t in held],
                    ipc_handles=[export(t) for t in held],
                    nbytes=sum(t.numel() * t.element_size() for t in held), adapter=adapter, held=held)
