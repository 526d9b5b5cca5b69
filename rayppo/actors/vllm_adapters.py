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

vLLM applies an adapter's module only where a LoRA layer of the model takes it: activation copies
each layer's A and B into the adapter's slot of the layer's stacked buffers (``lora_a_stacked``,
``lora_b_stacked``; ``LoRAModelManager.activate_adapter``, ``lora/model_manager.py``, 0.32), and
the kernels read them from there; a module no layer takes stays in the registered ``LoRAModel``
and is never applied. vLLM's loader from a folder refuses unknown module suffixes
(``WorkerLoRAManager._load_adapter``'s expected modules, ``lora/worker_manager.py``), but
``from_lora_tensors`` checks nothing, and a suffix check misses a module the model names otherwise
(transformers' Mixtral ``mlp.gate`` is vLLM's ``block_sparse_moe.gate``). So the modules are
checked by full name against the layers that take them: at the generator's start
(``refuse_unapplied``), at every registration, and the fingerprints are read from the slots.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from rayppo.learner.adapter_weights import adapter_modules
from rayppo.learner.broadcast_sender import ParamSpec, open_ipc_handle, receive_stream
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
    LoRA dtype), refused (``ValueError`` naming the modules) when a module would not be applied;
    put it in a slot at once, so that the fingerprints read what the next request is served
    with; then drop every registered adapter whose version is not in ``keep``. Returns the
    versions registered after."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model, mapper = manager._adapter_manager.model, rename_mapper(manager._adapter_manager)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=adapter_id(version), tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    sent = {vllm_module(name, mapper): name.rsplit(".", 2)[0] for name in tensors}  # vLLM's module -> peft's
    slots = lora_slots(manager._adapter_manager)
    unapplied = sorted(peft for module, peft in sent.items() if module not in lora.loras or module not in slots)
    if unapplied:  # skipped by the loader, or taken by no LoRA layer
        raise ValueError(f"adapter sync: {len(unapplied)} of the adapter's {len(sent)} LoRA modules would not be "
                         f"applied (or not verified): no linear LoRA layer of vLLM's model takes "
                         f"{module_patterns(unapplied)}")
    manager._adapter_manager.remove_adapter(lora.id)
    manager._adapter_manager.add_adapter(lora)
    manager._adapter_manager.activate_adapter(lora.id)
    modules = {**getattr(worker, MODULES, {}), lora.id: sent}
    for stale in set(manager.list_adapters()) - {adapter_id(v) for v in keep}:
        manager.remove_adapter(stale)
    setattr(worker, MODULES, {i: modules[i] for i in manager.list_adapters() if i in modules})
    return sorted(i - 1 for i in manager.list_adapters())


MODULES = "_rayppo_adapter_modules"
"""The worker attribute: per registered adapter id, its modules' vLLM names -> the peft names sent."""


def rename_mapper(manager: Any) -> Any:
    """The model's HF-to-vLLM renames as vLLM's loader applies them to adapter names (None: none)."""
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    return mapper.get_rename_mapper() if mapper is not None else None


def vllm_module(name: str, mapper: Any) -> str:
    """The vLLM module a peft name (``base_model.model.<module>.lora_A.weight``) loads into: vLLM's
    own parse (``parse_fine_tuned_lora_name``, ``lora/utils.py``, 0.32) with the model's renames."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    return parse_fine_tuned_lora_name(name, mapper)[0]


def lora_slots(manager: Any) -> dict[str, tuple[str, int]]:
    """``{module: (LoRA layer, position in its packed modules)}`` of every module whose A and B a
    linear LoRA layer of the model takes (q/k/v under ``qkv_proj`` at 0, 1, 2). Not the fused-MoE
    experts' layers: rayppo does not read their slots back, so their modules are refused too."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    return {sub: (name, i) for name, layer in manager.modules.items() if isinstance(layer, BaseLinearLayerWithLoRA)
            for i, sub in enumerate(manager.packed_modules.get(name, [name]))}


def worker_unapplied(worker: Any, modules: list[str]) -> tuple[str, list[str]]:
    """The model's vLLM class and those of the adapter's ``modules`` (peft names,
    ``base_model.model.<module>``) that no LoRA layer of it would apply (``lora_slots``)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    slots, mapper = lora_slots(manager), rename_mapper(manager)
    return type(manager.model).__name__, [m for m in modules if vllm_module(f"{m}.lora_A.weight", mapper) not in slots]


def module_patterns(modules: list[str]) -> str:
    """Module names as a reader takes them in: peft's prefix dropped, layer numbers as ``*``."""
    return ", ".join(sorted({re.sub(r"\.\d+(?=\.|$)", ".*", m.removeprefix(PEFT_PREFIX)) for m in modules}))


def refuse_unapplied(llm: Any, model_path: str, rank: int) -> None:
    """At the generator's start: refuse (``ConfigError``) the policy's adapter when some of its
    modules are taken by no linear LoRA layer (``lora_slots``), naming them, before any sync
    registers it: peft's ``all-linear`` on the MoE families (Mixtral's router ``mlp.gate``, which
    vLLM calls ``block_sparse_moe.gate``; the 3D experts of Mixtral and Qwen3-MoE)."""
    from rayppo.config.schema import ConfigError

    modules = adapter_modules(model_path, rank)
    model, unapplied = llm.collective_rpc(worker_unapplied, args=(modules,))[0]
    if unapplied:
        raise ConfigError(f"learner.lora_sync: {len(unapplied)} of the adapter's {len(modules)} modules "
                          f"({module_patterns(unapplied)}) are taken by no linear LoRA layer of vLLM's {model}: "
                          "they would not be applied (or, on its fused-MoE experts, not verified); "
                          "use learner.lora_sync=merged")


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
    """Fingerprints of what the LoRA kernels read for the adapter of ``version``: the A and B in
    its slot of each linear LoRA layer's stacked buffers (the tensors punica's ops and
    ``cpu_lora``'s products take), under the peft names sent (``slot_tensors``); empty when no
    slot holds it. B carries the scaling vLLM folded into it. The registered ``LoRAModel`` gives
    only the layout and, on a tensor-parallel worker, the shards other workers hold."""
    manager = worker.model_runner.lora_manager._adapter_manager
    lora_id = adapter_id(version)
    lora, sent = manager.get_adapter(lora_id), getattr(worker, MODULES, {}).get(lora_id)
    if lora is None or sent is None or lora_id not in manager.lora_index_to_id:
        return {}
    slot, layers = manager.lora_index_to_id.index(lora_id), {name for name, _ in lora_slots(manager).values()}
    named: dict[str, torch.Tensor] = {}
    for name, layer in manager.modules.items():
        weights = manager._get_lora_layer_weights(lora, name)  # what activate_adapter copies into the slot
        if weights is None or name not in layers:
            continue
        subs = manager.packed_modules.get(name, [name])
        for sub, (a, b) in zip(subs, slot_tensors(layer, slot, weights.lora_a, weights.lora_b)):
            if a is not None and sub in sent:
                named[f"{sent[sub]}.lora_A.weight"], named[f"{sent[sub]}.lora_B.weight"] = a, b
    return held_prints(named)


def slot_tensors(layer: Any, slot: int, lora_a: Any, lora_b: Any) -> list[tuple[Any, Any]]:
    """``[(A, B)]`` of each module of ``layer`` (its packed modules in order; None where the
    adapter has none) as the layer holds them in ``slot``. Where each element of the registered
    ``lora_a`` and ``lora_b`` lands in the slot (rank padding, tensor-parallel slices, packing) is
    found by vLLM's own ``set_lora`` replayed on a copy of the layer whose float64 buffers take
    element numbers instead of weights; the slot's values are read back from those places. An
    element no place of this worker holds keeps the registered value where another
    tensor-parallel worker holds it, and is NaN on a single worker (not applied); padding that
    is not zero (the kernels read it) or two places of one element that disagree (vLLM copies A
    into every slice of some packed layers) make the layer's tensors NaN: the check then fails."""
    packed = isinstance(lora_a, list)
    given = (lora_a + lora_b) if packed else [lora_a, lora_b]
    numbered: list[torch.Tensor | None] = []
    start = 1  # 0 marks a place no element lands on
    for t in given:
        numbered.append(None if t is None else torch.arange(start, start + t.numel(), dtype=torch.float64).view(t.shape))
        start += 0 if t is None else t.numel()
    shadow = copy.copy(layer)  # the same module, its buffers replaced on the copy only
    shadow.lora_a_stacked = tuple(torch.zeros((1, *w.shape[1:]), dtype=torch.float64) for w in layer.lora_a_stacked)
    shadow.lora_b_stacked = tuple(torch.zeros((1, *w.shape[1:]), dtype=torch.float64) for w in layer.lora_b_stacked)
    half = len(given) // 2
    shadow.set_lora(0, numbered[:half] if packed else numbered[0], numbered[half:] if packed else numbered[1])
    flat = torch.cat([t.reshape(-1).double() for t in given if t is not None])
    if layer.tp_size == 1:
        flat.fill_(float("nan"))
    places = [(w[slot, 0].cpu().double(), n[0, 0]) for w, n in
              zip(layer.lora_a_stacked + layer.lora_b_stacked, shadow.lora_a_stacked + shadow.lora_b_stacked)]
    for held, number in places:
        flat[number[number > 0].long() - 1] = held[number > 0]
    if any((held[number == 0] != 0).any() or (flat[number[number > 0].long() - 1] != held[number > 0]).any()
           for held, number in places):
        flat.fill_(float("nan"))
    out, parts = [], iter(flat.split([t.numel() for t in given if t is not None]))
    for t in given:
        out.append(None if t is None else next(parts).view(t.shape).to(t.dtype))
    return list(zip(out[:half], out[half:]))
