"""A LoRA adapter served by vLLM from tensors in memory (``learner.lora_sync=adapter``, docs/lora.md).

vLLM serves LoRA adapters by request: a ``LoRARequest(name, id, path)`` beside each prompt, the
adapter loaded from ``path`` the first time an id is seen. rayppo's adapters arrive as tensors,
so they are registered with the worker's adapter manager before any request names them, under the
id of their policy version; a request that names a registered id is served from it without
touching ``path`` (``LRUCacheWorkerLoRAManager.add_adapter``, ``vllm/lora/worker_manager.py``,
vLLM 0.32: it loads only ``if lora_int_id not in self.list_adapters()``). A request whose id
is not registered would load from ``path``, which names no folder: it fails loudly, never serves
another adapter.

The adapter reaches the worker by any of the three transports: as tensors through the object
store (``worker_add_adapter``), broadcast over the sync group its weight-transfer engine joined
(``worker_receive_adapter``), or as CUDA-IPC handles of the colocated learner rank's tensors
(``worker_stage_ipc_adapter``, then ``worker_add_staged_adapter``).

The functions named ``worker_*`` run inside a vLLM worker (``LLM.collective_rpc``): they get the
worker and import vLLM's LoRA classes there. A tensor-parallel generator runs them in every
worker: each registers the whole adapter, and vLLM's LoRA layers take their shard of it when the
adapter is activated (``set_lora`` slices A or B by the layer's parallelism, ``lora/layers``).
"""

from __future__ import annotations

from typing import Any

import torch

from rayppo.learner.weight_sync import ParamSpec, open_ipc_handle, receive_stream
from rayppo.models.fingerprint import held_prints
from rayppo.models.weights import SyncFault

PEFT_PREFIX = "base_model.model."
"""How a peft checkpoint's tensor names begin (and the learner's adapter names)."""


def adapter_id(version: int) -> int:
    """vLLM's ``lora_int_id`` of the adapter of policy ``version`` (ids start at 1)."""
    return version + 1


def adapter_path(version: int) -> str:
    """The ``LoRARequest.lora_path`` of a version: required non-empty by vLLM, and no folder, so
    an adapter that is not registered fails to load instead of being served from elsewhere."""
    return f"rayppo-in-memory-adapter/v{version}"


def worker_add_adapter(worker: Any, version: int, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                       keep: list[int]) -> list[int]:
    """Register the adapter of ``version`` (peft-named ``tensors``, peft ``config``) with this
    worker's adapter manager, the way vLLM 0.32's ``WorkerLoRAManager._load_adapter`` builds one
    from a folder (``PEFTHelper.validate_legal``, ``LoRAModel.from_lora_tensors`` on CPU in the
    LoRA dtype); then drop every registered adapter whose version is not in ``keep``. Returns
    the versions registered after."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=adapter_id(version), tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    sent = {name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for name in tensors}
    if len(lora.loras) < len(sent):  # modules the loader skipped (names it maps are counted, not compared)
        raise ValueError(f"vLLM took {len(lora.loras)} of the adapter's {len(sent)} LoRA modules "
                         f"(not: {sorted(sent - set(lora.loras))[:3]})")
    manager._adapter_manager.remove_adapter(lora.id)
    manager._adapter_manager.add_adapter(lora)
    for stale in set(manager.list_adapters()) - {adapter_id(v) for v in keep}:
        manager.remove_adapter(stale)
    return sorted(i - 1 for i in manager.list_adapters())


def worker_receive_adapter(worker: Any, version: int, specs: list[ParamSpec], config: dict[str, Any],
                           keep: list[int], fault: SyncFault) -> bool:
    """Receive the adapter of ``version`` from the sync group this worker's weight-transfer engine
    joined (``weight_receiver.py``: one broadcast per A and B, in the order of ``specs``) and
    register it. Every broadcast is received (the group is collective); ``fault`` (testing) may
    drop some or all. Returns whether an adapter was registered."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None or getattr(engine, "group", None) is None:
        raise RuntimeError("adapter sync: a broadcast before the worker joined the sync group")
    tensors = dict(fault.apply(receive_stream(engine.group, specs, engine.device)))
    if not tensors:
        return False
    worker_add_adapter(worker, version, tensors, config, keep)
    return True


STAGED = "_rayppo_ipc_adapter"
"""The worker attribute that holds an adapter's tensors between its CUDA-IPC run and its version."""


def worker_stage_ipc_adapter(worker: Any, update_info: dict[str, Any]) -> None:
    """Open the CUDA-IPC handles of an adapter run on this worker's GPU and keep copies of the
    tensors (the learner releases its own at its next run); ``worker_add_staged_adapter``
    registers them under the version the sync ends with."""
    device = worker.device.index
    staged = {name: open_ipc_handle(handle, device).clone()
              for name, handle in zip(update_info["names"], update_info["ipc_handles"])}
    if any(t.is_cuda for t in staged.values()):
        # The copies must be made before the learner releases its tensors (at its next run), as
        # vLLM's own update_weights synchronises after loading (weight_transfer/base.py, 0.32).
        torch.cuda.synchronize(device)
    setattr(worker, STAGED, staged)


def worker_add_staged_adapter(worker: Any, version: int, config: dict[str, Any], keep: list[int]) -> list[int]:
    """Register the adapter ``worker_stage_ipc_adapter`` staged as the one of ``version``."""
    tensors = getattr(worker, STAGED, None)
    if not tensors:
        raise RuntimeError("adapter sync: no adapter was handed over by CUDA-IPC before the sync ended")
    setattr(worker, STAGED, None)
    return worker_add_adapter(worker, version, tensors, config, keep)


@torch.no_grad()
def worker_adapter_prints(worker: Any, version: int) -> dict[str, tuple[float, float]]:
    """Fingerprints of the adapter registered for ``version``, under the learner's peft names
    (empty when none is): A as held, B with the scaling vLLM folded into it. A packed layer
    (q/k/v as ``qkv_proj``) is split back into its modules by the manager's own packing map."""
    manager = worker.model_runner.lora_manager._adapter_manager
    lora = manager.get_adapter(adapter_id(version))
    if lora is None:
        return {}
    named: dict[str, torch.Tensor] = {}
    for module, weights in lora.loras.items():
        parts: list[tuple[str, Any, Any]]
        if isinstance(weights.lora_a, list):  # PackedLoRALayerWeights: one entry per packed module
            parts = list(zip(manager.packed_modules[module], weights.lora_a, weights.lora_b))
        else:
            parts = [(module, weights.lora_a, weights.lora_b)]
        for name, a, b in parts:
            if a is not None:
                named[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a
                named[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b
    return held_prints(named)
