"""The policy's full tensors, one module at a time: what a weight sync sends.

Under ZeRO-3 every rank holds a 1/N partition of each parameter; a sync must gather them. Gathering
the whole model at once needs a whole model of free memory on every rank at the peak of the
sync (the reason a 70B ZeRO-3 run goes out of memory at its first sync). ``full_tensors`` gathers
the parameters of one module (one linear layer, one norm, the embedding; one LoRA layer with its
adapters), yields its tensors, and releases them before the next: peak extra memory is the
largest module. With LoRA the adapters are merged into the base weight per layer,
W' = W + (alpha / r) B A, under the base model's names, so the generators never see peft.

Only ``torch`` is imported: the gather is passed in (DeepSpeed's ``GatheredParameters`` from the
learner engine, nothing when parameters are whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

Gather = Callable[[list[torch.nn.Parameter]], AbstractContextManager]
"""``gather(params)``: a context in which ``params`` hold their full values (collective)."""

PEFT_PREFIX = "base_model.model."


def _is_lora_layer(module: torch.nn.Module) -> bool:
    # peft's LoraLayer (peft/tuners/lora/layer.py): a wrapped ``base_layer`` plus ``lora_A``/``lora_B``.
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "get_delta_weight")


def _clean(name: str) -> str:
    """A peft name under the base model's naming (what ``state_dict`` of the plain model says)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _units(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, bool]]:
    """``(name, module, is_lora)`` for every module that owns tensors, LoRA layers as one unit.
    A module whose parameters all belong to an earlier one (a tied LM head: the embedding's
    matrix) is left out: the tensor goes once, under the embedding's name, which every engine
    loads (vLLM ties the head itself, and Gemma 2's has no ``lm_head`` parameter at all)."""
    skip: set[str] = set()
    seen: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        own = [id(p) for p in module.parameters(recurse=False)]
        if own and all(i in seen for i in own):
            continue
        seen.update(own)
        if _is_lora_layer(module):
            skip.add(name)
            yield name, module, True
        elif own or _persistent_buffers(module):
            yield name, module, False


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in module.named_buffers(recurse=False)
            if b is not None and n not in module._non_persistent_buffers_set]


def _unit_tensors(name: str, module: torch.nn.Module, is_lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
    prefix = f"{name}." if name else ""
    if is_lora:
        lora: Any = module  # a peft LoraLayer: its attributes are not declared on nn.Module
        base = lora.base_layer
        weight = base.weight.detach()
        for adapter in lora.active_adapters:
            if adapter in lora.lora_A:
                weight = weight + lora.get_delta_weight(adapter).to(weight.dtype)
        yield _clean(prefix + "weight"), weight
        if getattr(base, "bias", None) is not None:
            yield _clean(prefix + "bias"), base.bias.detach()
        return
    for pname, tensor in [*module.named_parameters(recurse=False), *_persistent_buffers(module)]:
        if "lora_" not in pname:
            yield _clean(prefix + pname), tensor.detach()


def full_tensors(model: torch.nn.Module, gather: Gather | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` in ``state_dict`` order, gathering one module at a time.

    A tensor is valid only until the next one is requested (its partition may be released):
    copy it if you keep it. Collective under ZeRO-3: every rank must drain the iterator.
    """
    for name, module, is_lora in _units(model):
        params = list(module.parameters(recurse=is_lora))
        with gather(params) if gather is not None and params else _nothing():
            yield from _unit_tensors(name, module, is_lora)


class _nothing(AbstractContextManager):
    def __exit__(self, *exc) -> None:
        return None
