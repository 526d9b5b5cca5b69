"""vLLM's CPU LoRA products as one matrix product per adapter, not one matrix per token.

vLLM 0.32 serves LoRA on CPU with the torch ops of ``vllm/lora/ops/torch_ops/lora_ops.py``
(through ``lora/punica_wrapper/punica_cpu.py``). Each of ``bgmv_shrink``, ``bgmv_expand`` and
``bgmv_expand_slice`` gathers a copy of the adapter matrix for every token,
``lora_weights[lora_indices_tensor]`` ([tokens, out, in]), then multiplies token by token
(``einsum("bi, boi -> bo")``): for SmolLM2-135M at r = 16 a prefill of 3,000 tokens copies
~150 MB per layer and projection. Generation with the adapter served took 47.8 s per iteration
against 8.4 s with the same weights merged (docs/lora.md). Here the tokens are grouped by
adapter slot and each group is one matrix product with its slot's matrix, the rest of each
function (casts, padding, slices, accumulation) as vLLM has it. A slot index is used as vLLM
uses it, negative ones included (Python indexing of the slots).

``patch`` replaces the three functions in the two modules that call them (``sgmv_*`` call them
from ``lora_ops``; ``punica_cpu`` imported them by name). Only ``torch`` is imported here; vLLM
in ``patch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grouped_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, out]``: row t is ``weights[indices[t]] @ inputs[t]`` in ``dtype``, one matrix
    product per slot used (``weights`` ``[slots, out, in]`` or ``[slots, 1, out, in]``)."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    slots = indices.unique().tolist()
    if len(slots) == 1:  # every token served by one adapter: one product, no gather
        return x @ w[slots[0]].to(dtype).T
    out = x.new_empty((x.shape[0], w.shape[1]))
    for slot in slots:
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = x[rows] @ w[slot].to(dtype).T
    return out


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    """vLLM's ``bgmv_shrink`` (x A^T per token, scaled, into ``output_tensor``), grouped."""
    outputs = grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    """vLLM's ``bgmv_expand`` (h B^T per token, set or added), grouped."""
    outputs = grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])  # the adapter and the model may pad differently
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


# vLLM's own signature: its callers pass these seven positionally, in place of its function.
def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,  # noqa: PLR0913
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    """vLLM's ``bgmv_expand_slice`` (h B^T into columns ``slice_offset`` ...), grouped."""
    outputs = grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


SLOT = "_rayppo_single_slot"
"""The punica wrapper's attribute: the adapter slot every token of this step uses, or None."""


def single_slot(token_lora_indices: torch.Tensor) -> int | None:
    """The one adapter slot all tokens are served by (rayppo's synchronous generators name one
    adapter in every request), or None: several slots, or tokens without an adapter (-1)."""
    slots = token_lora_indices.unique()
    return int(slots[0]) if slots.numel() == 1 and int(slots[0]) >= 0 else None


@dataclass(frozen=True)
class PackedLoRA:
    """The adapters of a packed layer (q/k/v, gate/up), as vLLM's ``add_lora_linear`` is handed them."""

    a: tuple[torch.Tensor, ...]
    """Each slice's A of every slot, ``[slots, 1, r, in]``."""
    b: tuple[torch.Tensor, ...]
    """Each slice's B of every slot, ``[slots, 1, out_i, r]``."""
    scale: float
    """s, the adapters' scaling."""
    output_slices: tuple[int, ...]
    """Each slice's width out_i: its columns of y, in order."""


def one_slot_lora_linear(y: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, slot: int) -> None:
    """``y[:, slice i] += (s x A_i^T) B_i^T`` for every slice of a packed layer (q/k/v, gate/up),
    every token served by adapter ``slot``: what vLLM 0.32's ``PunicaWrapperCPU.add_lora_linear``
    computes (``lora/punica_wrapper/punica_cpu.py``), in its dtypes — the shrink in fp32 into
    its fp32 buffer, the expand in ``y``'s dtype, added to ``y`` — with one shrink product for
    all slices and one expand product per slice instead of two gathered ops per slice (the
    decode step's cost on CPU is the count of small ops, ~14 per decoder layer here)."""
    x = x.reshape(-1, x.shape[-1])
    a = torch.cat([w[slot].reshape(-1, w.shape[-1]) for w in lora.a])  # [slices * r, in]
    if lora.scale == 1 and x.dtype == a.dtype == y.dtype:
        # vLLM's fp32 buffer is read in y's dtype by the expand: a product in that dtype (fp32
        # accumulation, one rounding: ATen's and oneDNN's CPU GEMMs) is the same value rounded once.
        h = x @ a.T
    else:
        h = (x.float() @ a.float().T).mul_(lora.scale).to(y.dtype)  # [tokens, slices * r]
    out = y.view(-1, y.shape[-1])
    rank, offset = lora.a[0].shape[-2], 0
    for i, (b, size) in enumerate(zip(lora.b, lora.output_slices)):
        out[:, offset: offset + size] += h[:, i * rank: (i + 1) * rank] @ b[slot].reshape(size, rank).to(y.dtype).T
        offset += size


def patch() -> None:
    """Use the grouped products in vLLM's CPU LoRA path, and one product per packed layer when
    every token uses one adapter (idempotent; nothing where vLLM's LoRA is absent)."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return
    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink = bgmv_shrink
        module.bgmv_expand = bgmv_expand
        module.bgmv_expand_slice = bgmv_expand_slice
    wrapper = punica_cpu.PunicaWrapperCPU
    if getattr(wrapper, "_rayppo_patched", False):
        return
    vllm_update, vllm_linear = wrapper.update_metadata, wrapper.add_lora_linear

    def update_metadata(self, *args, **kwargs):
        vllm_update(self, *args, **kwargs)
        setattr(self, SLOT, single_slot(self.token_lora_indices))

    # vLLM's method signature: the punica wrapper is called with these, and the rest by keyword.
    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *,  # noqa: PLR0913
                        buffer=None, **kwargs):
        slot = getattr(self, SLOT, None)
        if slot is None or buffer is not None or not kwargs.get("add_inputs", True):
            return vllm_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs)
        one_slot_lora_linear(y, x, PackedLoRA(lora_a_stacked, lora_b_stacked, scale, output_slices), slot)
        return None

    wrapper.update_metadata, wrapper.add_lora_linear = update_metadata, add_lora_linear
    wrapper._rayppo_patched = True
