"""Collective weight sync, receiver side: a vLLM weight-transfer engine fed by learner rank 0.

vLLM (0.32) runs trainer -> inference weight updates through its weight-transfer API: a
``WeightTransferEngine`` chosen by ``LLM(weight_transfer_config={"backend": ...})`` lives in every
inference worker, joins the trainer's group (``init_weight_transfer_engine``) and, for each update,
receives the tensors between ``start_weight_update`` and ``finish_weight_update``, which wrap
vLLM's layerwise in-place reload (the same path as ``reload_weights``, so CPU weight repacking and
fused q/k/v projections are handled by vLLM).

rayppo registers its own engine, ``rayppo``, instead of using vLLM's ``nccl`` one: vLLM's
trainer side opens the group with vLLM's own rendezvous and communicator, which would make the
learner import vLLM. Ours joins the group of ``rayppo/learner/broadcast_sender.py``: a plain
``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs, so the same code is tested on
CPU machines). Each worker's rank is ``rank_offset + its rank in the engine``, so tensor-parallel
generators work: every worker receives the full tensors and vLLM's loader shards them.

``register`` is also a vLLM general plugin (``pyproject.toml``): vLLM runs it in every worker
process it starts, which is how the engine reaches workers spawned for tensor parallelism.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from rayppo.actors.held_weights import tied_aliases
from rayppo.learner.broadcast_sender import ParamSpec, SyncEndpoint, SyncGroup, open_sync_group, receive_stream
from rayppo.models.weights import SyncFault, with_aliases

BACKEND = "rayppo"


@dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine`` payload: the sync group and this engine's first rank."""

    endpoint: dict[str, Any]
    """``SyncEndpoint`` fields."""
    rank_offset: int
    """Sync-group rank of this engine's worker 0 (the sender is rank 0)."""


@dataclass
class CollectiveUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` payload: the stream layout, in send order."""

    specs: list[dict[str, Any]]
    """``ParamSpec`` fields of every tensor."""
    fault: dict[str, str] | None = None
    """Testing only: ``SyncFault`` fields (a broken load, on purpose)."""


class CollectiveReceiveEngine(WeightTransferEngine[CollectiveInitInfo, CollectiveUpdateInfo]):
    """Receives every broadcast of a sync and loads it through vLLM's layerwise reload."""

    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: SyncGroup | None = None
        # Read now: once a layerwise reload has begun, the layers' parameters are placeholders and
        # a tied head no longer shares the embedding's.
        self.aliases = tied_aliases(model)  # a tied head that is a module of its own gets its tensor too

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        p = self.parallel_config
        worker = p.data_parallel_index * p.world_size + p.rank
        self.group = open_sync_group(SyncEndpoint(**init_info.endpoint), init_info.rank_offset + worker)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("weight sync: update before init_weight_transfer_engine")
        specs = [ParamSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in update_info.specs]
        fault = SyncFault(**(update_info.fault or {}))
        # Every broadcast is received (the group is collective); the fault drops or alters loads.
        for name, tensor in with_aliases(fault.apply(receive_stream(self.group, specs, self.device)), self.aliases):
            self.model.load_weights([(name, tensor)])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only hosts.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Make ``weight_transfer_config={"backend": "rayppo"}`` known to vLLM, let CPU MoE layers
    take weight updates (``cpu_moe.patch``) and serve LoRA with rayppo's CPU products
    (``cpu_lora.patch``) in every process vLLM starts: a tensor-parallel generator's workers are
    processes of their own (idempotent)."""
    from rayppo.actors import cpu_lora, cpu_moe

    cpu_moe.patch()
    cpu_lora.patch()
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, CollectiveReceiveEngine)
    except ValueError:  # already registered in this process
        pass


def init_payload(endpoint: SyncEndpoint, rank_offset: int) -> dict[str, Any]:
    return {"endpoint": asdict(endpoint), "rank_offset": rank_offset}


def update_payload(specs: list[ParamSpec], fault: SyncFault = SyncFault()) -> dict[str, Any]:
    return {"specs": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs],
            "fault": asdict(fault)}
