"""The policy's LoRA adapter as a sync sends it: its A and B matrices alone (docs/lora.md).

With ``learner.lora_sync=adapter`` the generators hold the base model from its checkpoint, which
LoRA never changes, and each sync moves only the adapter: for SmolLM2-135M at r = 16 on every
linear layer 4.9M parameters instead of 135M. The tensors go under the names a peft checkpoint
gives them (``base_model.model.<module>.lora_A.weight``, the adapter's name dropped, as peft's
``get_peft_model_state_dict`` writes them), with the adapter's config as plain data, so that an
engine that loads peft adapters (vLLM's ``LoRAModel.from_lora_tensors``, peft itself) takes them
as they are.

The weight check compares the engine's copy with what was sent. vLLM keeps A as sent and folds
the scaling s = alpha / r into B once (``LoRALayerWeights.optimize``, ``lora/lora_weights.py``,
vLLM 0.32: ``lora_b *= scaling`` in the adapter's dtype), so the fingerprint sent for B is that of
``engine_form(B, s)``, the same rounding.

Only ``torch`` is imported; the LoRA layers are recognised by their attributes (peft's
``LoraLayer``, ``peft/tuners/lora/layer.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rayppo.learner.full_weights import Gather, _is_lora_layer, _nothing

ADAPTER = "default"
"""peft's name for the one adapter ``get_peft_model`` adds."""


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The adapter's peft config as plain data (what ``adapter_config.json`` holds): rank, alpha,
    target modules and the features an engine has to refuse (DoRA, rsLoRA, modules_to_save)."""
    config: Any = model.peft_config[ADAPTER]  # type: ignore[index]
    targets = config.target_modules
    return {"r": int(config.r), "lora_alpha": float(config.lora_alpha), "peft_type": "LORA",
            "target_modules": sorted(targets) if isinstance(targets, set | list | tuple) else targets,
            "use_dora": bool(config.use_dora), "use_rslora": bool(config.use_rslora), "bias": config.bias,
            "modules_to_save": sorted(config.modules_to_save) if config.modules_to_save else None,
            "task_type": "CAUSAL_LM"}


def scaling(config: dict[str, Any]) -> float:
    """peft's s: alpha / r, or alpha / sqrt(r) under rsLoRA."""
    r = config["r"]
    return config["lora_alpha"] / (r ** 0.5 if config.get("use_rslora") else r)


def engine_form(name: str, tensor: torch.Tensor, s: float) -> torch.Tensor:
    """The tensor as a serving engine holds it: B times s in B's dtype (vLLM's ``optimize``); A as it is."""
    if s == 1 or ".lora_B." not in name:
        return tensor
    return (tensor.float() * s).to(tensor.dtype)


def adapter_tensors(model: torch.nn.Module, gather: Gather | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(peft checkpoint name, full tensor)`` of every LoRA A and B, one layer gathered at a time
    (ZeRO-3). A tensor is valid until the next is requested; collective under ZeRO-3."""
    for name, module in model.named_modules():
        if not _is_lora_layer(module):
            continue
        lora: Any = module  # a peft LoraLayer: its attributes are not declared on nn.Module
        if ADAPTER not in lora.lora_A:
            continue
        a, b = lora.lora_A[ADAPTER].weight, lora.lora_B[ADAPTER].weight
        with gather([a, b]) if gather is not None else _nothing():
            yield f"{name}.lora_A.weight", a.detach()
            yield f"{name}.lora_B.weight", b.detach()


def peft_param_name(name: str) -> str:
    """A checkpoint name as the parameter's in a peft model: ``...lora_A.weight`` ->
    ``...lora_A.default.weight``."""
    for part in (".lora_A.", ".lora_B."):
        name = name.replace(part, f"{part}{ADAPTER}.")
    return name


def lora_config(config: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` of ``adapter_config``'s data, dropout off (rayppo trains without it)."""
    from peft import LoraConfig

    return LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], target_modules=config["target_modules"],
                      use_rslora=config.get("use_rslora", False), use_dora=config.get("use_dora", False),
                      modules_to_save=config.get("modules_to_save"), lora_dropout=0.0, task_type="CAUSAL_LM")


def policy_lora(rank: int, alpha: float) -> dict[str, Any]:
    """The adapter rayppo puts on a policy (``learner.lora_rank``, ``learner.lora_alpha``): every
    linear layer of the decoder (peft's ``all-linear``: not the LM head)."""
    return {"r": rank, "lora_alpha": alpha, "target_modules": "all-linear"}


def wrap_lora(model: torch.nn.Module, config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """``model`` with LoRA layers of ``config`` (peft's ``get_peft_model``). peft draws A at
    random (Kaiming-uniform; B is 0): from ``seed`` here, whatever the process drew before, so
    every trainer starts from the same adapter (the in-process one and the learner ranks load
    different things before it)."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, lora_config(config))


def adapter_modules(model_path: str, rank: int) -> list[str]:
    """The modules ``policy_lora`` puts LoRA on, under the names their tensors are sent with
    (``base_model.model.<module>``): peft's own ``all-linear`` resolution, on the model built
    from its config on the meta device (no weight read, nothing allocated)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sorted({name.rsplit(".", 2)[0] for name, _ in adapter_tensors(wrap_lora(model, policy_lora(rank, rank)))})


ADAPTER_FOLDER = "policy-adapter"
"""The exported adapter's folder in the run's output (``output.lora_export``)."""


def save_adapter(named: dict[str, torch.Tensor], config: dict[str, Any], base: str, out: Path) -> None:
    """A peft adapter folder that ``PeftModel.from_pretrained(base model, out)`` loads:
    ``adapter_model.safetensors`` (the checkpoint names ``adapter_tensors`` gives) and
    ``adapter_config.json`` written by peft's own ``LoraConfig.save_pretrained``; ``base``, the
    base model's name as the run's config gave it, is recorded as peft records it."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().to("cpu").contiguous() for name, t in named.items()}, str(out / "adapter_model.safetensors"))
    peft_config = lora_config(config)
    peft_config.base_model_name_or_path = base
    peft_config.save_pretrained(str(out))


def unsupported(config: dict[str, Any], model_names: list[str]) -> str | None:
    """Why vLLM cannot serve this adapter as it is (None: it can): what vLLM 0.32's
    ``PEFTHelper.validate_legal`` and ``LoRAModel.from_lora_tensors`` refuse or would drop."""
    if config.get("use_dora"):
        return "DoRA adapters (vLLM serves plain LoRA only)"
    if config.get("modules_to_save"):
        return f"modules_to_save={config['modules_to_save']} (whole modules trained beside the adapter)"
    if config.get("bias", "none") != "none":
        return f"adapter bias={config['bias']!r}"
    if config["r"] > max(VLLM_RANKS):
        return f"rank {config['r']} (vLLM serves ranks up to {max(VLLM_RANKS)})"
    heads = [n for n in model_names if n.split(".")[-3] in ("embed_tokens", "lm_head", "wte")]
    if heads:
        return f"LoRA on the embedding or the head ({heads[0].rsplit('.', 2)[0]})"
    return None


VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``max_lora_rank`` values vLLM 0.32 accepts (``MaxLoRARanks``, ``vllm/config/lora.py``)."""


def vllm_max_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    return next(k for k in VLLM_RANKS if k >= r)
