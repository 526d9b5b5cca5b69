"""What a vLLM worker holds, under the names the learner sent (``checks.verify_sync``).

These functions run inside a vLLM worker (through ``LLM.collective_rpc``) and read the engine's
model as vLLM laid it out: fused parameters (q/k/v, gate/up, the experts' ``w13``/``w2``), names
its loader mapped (``hf_to_vllm_mapper``), parameters shared between modules (a tied head), CPU
MoE experts repacked by vLLM (their probes as loaded, ``cpu_moe.py``). Only ``torch`` and rayppo's
fingerprint math are imported; the vLLM objects come in as arguments.
"""

from __future__ import annotations

from typing import Any

import torch

from rayppo.actors.cpu_moe import expert_probes
from rayppo.models.fingerprint import kernel_rows, matrix_shape, probe_rows, split_rows


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameters ``model`` shares between modules (a tied LM head), as ``{second name: first name}``.

    Modules count once: one module reachable under two names (vLLM's Qwen2-MoE registers its
    ``shared_expert_gate`` also inside ``shared_expert``; vllm/model_executor/models/qwen2_moe.py,
    0.32) is not a tie, and loading it twice would hit the emptied weight of a CPU linear layer
    that the first load already repacked."""
    first: dict[int, str] = {}
    aliases = {}
    for module_name, module in model.named_modules():  # each module once
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in first:
                aliases[name] = first[id(param)]
            else:
                first[id(param)] = name
    return aliases


def worker_tied_aliases(worker) -> dict[str, str]:
    """Runs inside a vLLM worker: ``tied_aliases`` of the engine's model."""
    return tied_aliases(worker.get_model())


@torch.no_grad()
def worker_held_prints(worker, shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """Runs inside a vLLM worker: fingerprints of the weights the engine holds, under the sent
    (Hugging Face) names. Fused parameters (``packed_modules_mapping``, e.g. qkv_proj ->
    q/k/v_proj) split back by row blocks; a CPU linear layer whose weight vLLM moved into a
    oneDNN/SGL/zentorch kernel (its parameter left empty; vllm/model_executor/layers/utils.py,
    ``dispatch_cpu_unquantized_gemm``, vLLM 0.32) is read back exactly through that kernel
    (``kernel_rows``)."""
    model = worker.get_model()
    packed = getattr(model, "packed_modules_mapping", {})
    renamed = engine_names(model, shapes)
    out: dict[str, tuple[float, float]] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            experts = expert_names(module_name, param_name, shapes, param.shape[0]) if param.dim() == 3 else None
            if experts is not None:  # one expert's fused matrices at a time
                loaded = expert_probes(module, param_name)  # repacked on CPU: its probes as loaded
                for e, names in enumerate(experts):
                    out.update(split_rows(loaded[e] if loaded is not None else probe_rows(param[e]), names, shapes))
                continue
            full = f"{module_name}.{param_name}" if module_name else param_name
            names = next(([full.replace(f".{fused}.", f".{part}.") for part in parts]
                          for fused, parts in packed.items() if f".{fused}." in full), [full])
            names = [sent for name in names for sent in renamed.get(name, [name])]
            if not all(name in shapes for name in names):
                continue
            k = matrix_shape(shapes[names[0]])[1]
            if param.numel() == 0 and hasattr(module, "cpu_linear"):  # read back exactly through its kernel
                def linear(x: torch.Tensor, m: Any = module, w: torch.Tensor = param) -> torch.Tensor:
                    return m.cpu_linear(x, w, None)  # vLLM's layer: its cpu_linear is untyped

                rows = kernel_rows(linear, k, param.dtype)
            else:
                rows = probe_rows(param.reshape(-1, k))  # padded vocabulary rows are ignored by split_rows
            out.update(split_rows(rows, names, shapes))
    return out


def engine_names(model, shapes: dict[str, list[int]]) -> dict[str, list[str]]:
    """``{the engine's name: the sent names it holds, in row order}`` for the sent tensors the
    engine's model renames on load (its ``hf_to_vllm_mapper``: vLLM's transformers fallback, e.g.
    for GPT-NeoX, keeps ``gpt_neox.layers.0...`` as ``model.layers.0...``; StableLM stacks
    ``q/k/v_proj`` into ``qkv_proj`` there rather than through ``packed_modules_mapping``, so one
    engine parameter holds three sent tensors, split by rows in shard order;
    ``WeightsMapper._map_name_with_shard``, vllm/model_executor/models/utils.py, 0.32). Empty for
    a model that loads names as they are."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return {}
    parts: dict[str, list[tuple[int | str, str]]] = {}
    for sent in shapes:
        mapped = mapper._map_name_with_shard(sent)
        if mapped is not None and mapped[0] != sent:
            parts.setdefault(mapped[0], []).append((_shard_order(mapped[1]), sent))
    return {engine: [sent for _, sent in sorted(held)] for engine, held in parts.items()}


def _shard_order(shard) -> int | str:  # noqa: ANN001 - vLLM's ShardIds: None, an int, "q"/"k"/"v", or a list
    """Where a stacked shard's rows sit in the engine's parameter: q, k, v in that order; an int
    is its own position (another string, unknown here, is returned as it is)."""
    first = shard[0] if isinstance(shard, (list, tuple)) and shard else shard
    return {"q": 0, "k": 1, "v": 2}.get(first, first) if isinstance(first, str) else int(first or 0)


EXPERT_PROJECTIONS = {"w13_weight": (("gate_proj", "up_proj"), ("w1", "w3")), "w2_weight": (("down_proj",), ("w2",))}
"""vLLM's fused expert parameters (``FusedMoE``: ``w13_weight [E, 2I, h]`` stacks each expert's gate
and up projections, ``w2_weight [E, h, I]`` its down projection; vllm/model_executor/layers/
fused_moe/layer.py, 0.32) -> the per-expert checkpoint projections in each, Qwen/DeepSeek names
first, then Mixtral's."""


def expert_names(module_name: str, param_name: str, shapes: dict[str, list[int]],
                  experts: int) -> list[list[str]] | None:
    """For a fused expert parameter of module ``...mlp.experts[.routed_experts]``, the sent names of
    each expert's rows in order (``[[gate_e, up_e], ...]`` or ``[[down_e], ...]``); None otherwise."""
    if param_name not in EXPERT_PROJECTIONS:
        return None
    prefix = module_name.removesuffix(".routed_experts").removesuffix(".experts")
    for projections in EXPERT_PROJECTIONS[param_name]:
        names = [[f"{prefix}.experts.{e}.{p}.weight" for p in projections] for e in range(experts)]
        if all(name in shapes for row in names for name in row):
            return names
    return None
