"""The policy's tensors as its checkpoint lays them out: what an inference engine loads.

transformers 5 changes some models on load (``conversion_mapping.py``, 5.19): Mixture-of-experts
layers keep their experts fused into 3-D tensors (``mlp.experts.gate_up_proj [E, 2I, h]``,
``down_proj [E, h, I]``) where the checkpoint has one matrix per expert and projection, and
modules are renamed (Mixtral's ``block_sparse_moe`` is ``mlp``). ``save_pretrained`` undoes this
(``revert_weight_conversion``, ``core_model_loading.py``): the weight sync must too, or vLLM,
which loads checkpoints, is sent names it does not have (Mixtral: ``There is no module or parameter
named 'layers.0.mlp'``) or fused experts it does not recognise (Qwen2-MoE: the experts kept their
old values, and the run stopped on the log-prob guard). One tensor at a time: the reverse of
every conversion these models use is a split or a rename of one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def _conversions(model: torch.nn.Module) -> list | None:
    """The model's load-time conversions (None: its tensors are the checkpoint's)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    found = getattr(model, "_weight_conversions", None)
    if found is None:  # built without from_pretrained: transformers' defaults for the class, as on save
        found = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return found or None


def checkpoint_tensors(model: PreTrainedModel | PeftModel,
                       stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` (``(name, tensor)`` under the model's own names, e.g. ``full_tensors``) under the
    checkpoint's names and layout; passed through unchanged for a model without conversions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the model under it
    if _conversions(base) is None:
        yield from stream
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in stream:
        yield from revert_weight_conversion(base, {name: tensor}).items()
