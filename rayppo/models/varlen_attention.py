"""Packed rows on SDPA without a block mask: the linear layers run on real tokens only, attention
runs per sequence.

A packed row (``models/packing.py``, mode ``varlen``) holds every sequence of a pass end to end,
so the projections and the MLP, nearly all of a layer's arithmetic, process no padding. Under
torch's SDPA, transformers would give such a row an explicit ``[N, N]`` block-diagonal mask, which
costs N² memory and leaves the fused causal kernel (measured slower than padding on the CPU,
docs/benchmarks.md). Here attention instead gathers each sequence's queries, keys and values into
a ``[sequences, heads, longest, head_dim]`` batch, in buckets of like lengths, and runs SDPA's
fused kernel with ``is_causal=True``: a bucket's filler comes after every real token of its row,
which causal attention never reads, and only the attention's few percent of the arithmetic is
padded. This is what flash-attention's varlen kernel does on a GPU, in plain torch.

Registered with transformers' ``AttentionInterface`` as ``VARLEN_SDPA`` (the mask function is
SDPA's, so the model's other calls, padded and masked, run exactly as under ``sdpa``); a forward
takes the layout as the keyword ``rayppo_segments`` (``Segments``), which transformers passes down
to every attention call. Without it the function is transformers' own ``sdpa_attention_forward``.
Read from transformers 5.19 ``integrations/sdpa_attention.py`` (the function's signature and its
``[B, N, H, D]`` output) and ``masking_utils.py`` (``_ignore_causal_mask_sdpa``: a 2-D all-ones
mask and equal query/key lengths give no mask at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

VARLEN_SDPA = "rayppo_varlen_sdpa"
"""The attention implementation's name in transformers' registry."""

VARLEN_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2"})
"""Model types whose transformers 5.19 attention is plain causal SDPA over ``ALL_ATTENTION_FUNCTIONS``
with the keyword arguments passed through every layer (no soft-capping, no attention sinks; the only
other keyword is ``sliding_window``): ``learner.packing=auto`` runs these in one packed row on SDPA
when their config sets no sliding window (``models.packing.pack_mode``). Not Qwen2-MoE: it builds a
sliding-window mask over the row even with the window off (``sliding_window=0``)."""


@dataclass
class Segments:
    """Where each sequence of one packed row ``[1, N]`` sits, bucketed by length."""

    buckets: list[torch.Tensor]
    """Per bucket, ``[S_b, L_b]`` long: the packed columns of its S_b sequences, each padded to the
    bucket's longest L_b by repeating the sequence's last column (read by no real query)."""
    restore: torch.Tensor
    """``[N]`` long: where each packed column's output sits in the buckets' outputs, flattened in
    bucket order (``[sum_b S_b * L_b]``)."""

    def to(self, device: torch.device | str) -> Segments:
        return Segments([b.to(device) for b in self.buckets], self.restore.to(device))


def segments(lengths: list[int]) -> Segments:
    """The ``Segments`` of sequences of ``lengths`` laid end to end (in that order) in one row.

    Sequences are bucketed by length so that no row of a bucket is under 1/sqrt(2) of its longest:
    a bucket's attention does at most twice the real work (the quadratic part), in about
    2·log2(longest / shortest) SDPA calls per layer."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            groups.setdefault(math.floor(2 * math.log2(n)), []).append(i)
    buckets: list[torch.Tensor] = []
    restore = torch.zeros(starts[-1], dtype=torch.long)
    offset = 0
    for key in sorted(groups, reverse=True):
        rows = groups[key]
        width = max(lengths[i] for i in rows)
        steps = torch.arange(width)
        first = torch.tensor([starts[i] for i in rows])
        last = torch.tensor([starts[i] + lengths[i] - 1 for i in rows])
        buckets.append(torch.minimum(first[:, None] + steps, last[:, None]))
        for r, i in enumerate(rows):
            restore[starts[i] : starts[i] + lengths[i]] = offset + r * width + torch.arange(lengths[i])
        offset += len(rows) * width
    return Segments(buckets, restore)


def varlen_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [1, H, N, D], ``key``/``value``
    [1, H_kv, N, D] -> ``[1, N, H, D]``. Causal attention within each sequence of
    ``kwargs["rayppo_segments"]``; without it, transformers' SDPA attention."""
    layout: Segments | None = kwargs.pop("rayppo_segments", None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("varlen attention takes one packed row and no attention mask")
    window = kwargs.get("sliding_window")
    if window is not None and max(columns.shape[1] for columns in layout.buckets) > window:
        raise ValueError(f"varlen attention has no sliding window: a sequence is longer than the model's {window}")
    gqa = key.shape[1] != query.shape[1]
    outputs = []
    for columns in layout.buckets:
        # [H, N, D] -> [H, S_b, L_b, D] -> [S_b, H, L_b, D]
        q, k, v = (t[0][:, columns].transpose(0, 1) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling, enable_gqa=gqa)
        outputs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))  # [S_b * L_b, H, D]
    return torch.cat(outputs)[layout.restore].unsqueeze(0), None


def register() -> None:
    """Add ``VARLEN_SDPA`` to transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model (or a PEFT wrapper's, or a critic's ``backbone``) to
    ``VARLEN_SDPA``: its padded and masked calls are unchanged."""
    register()
    wrapped: Any = model  # PEFT's wrapper, transformers' model and the critic's backbone: untyped here
    inner = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else wrapped
    getattr(inner, "backbone", inner).set_attn_implementation(VARLEN_SDPA)
