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

Short buckets with gradients on a CPU in bf16/fp16 run as plain matmuls (``math_attention``): torch
2.13's fused CPU kernel pays a fixed cost per block in its backward, 48 ms against 15-26 ms for a
layer's fwd+bwd over 60 sequences of 43 tokens on 2 cores, and on the real model's ~80-token rows
attention was a tenth of the learner's step (docs/benchmarks.md, "Kernels").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Defined beside the model shape, which imports no torch, so that the plan reads the same two facts.
from rayppo.models.shape import MATH_ATTENTION_MAX_LENGTH, VARLEN_MODELS  # noqa: F401 - re-exported

VARLEN_SDPA = "rayppo_varlen_sdpa"
"""The attention implementation's name in transformers' registry."""


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
    """The ``Segments`` of sequences of ``lengths`` laid end to end (in that order) in one row."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return sequence_segments([list(range(starts[i], starts[i + 1])) for i in range(len(lengths))], starts[-1])


def sequence_segments(sequences: list[list[int]], width: int) -> Segments:
    """The ``Segments`` of sequences given as their columns of a row of ``width`` (in order; a column
    may belong to several sequences, as a shared prompt's do: ``models/shared_prompts.py``, and every
    column to one at least). A column's output is taken from the first sequence that holds it.

    Sequences are bucketed by length so that no row of a bucket is under 1/sqrt(2) of its longest:
    a bucket's attention does at most twice the real work (the quadratic part), in about
    2·log2(longest / shortest) SDPA calls per layer."""
    groups: dict[int, list[int]] = {}
    for i, columns in enumerate(sequences):
        if columns:
            groups.setdefault(math.floor(2 * math.log2(len(columns))), []).append(i)
    buckets: list[torch.Tensor] = []
    restore = torch.full((width,), -1, dtype=torch.long)
    offset = 0
    for key in sorted(groups, reverse=True):
        rows = groups[key]
        longest = max(len(sequences[i]) for i in rows)
        # each sequence padded to the bucket's longest by repeating its last column (read by no real query)
        buckets.append(torch.tensor([sequences[i] + sequences[i][-1:] * (longest - len(sequences[i])) for i in rows]))
        for r, i in enumerate(rows):
            held = torch.tensor(sequences[i])
            unset = restore[held] < 0
            restore[held[unset]] = offset + r * longest + torch.arange(len(held))[unset]
        offset += len(rows) * longest
    if (restore < 0).any():
        raise ValueError(f"column {int((restore < 0).nonzero()[0])} of the packed row belongs to no sequence")
    return Segments(buckets, restore)



def math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
                   ) -> torch.Tensor:
    """Causal attention ``[S, H, L, D]`` of ``query`` [S, H, L, D] over ``key``/``value`` [S, H_kv, L, D]
    (H a multiple of H_kv: grouped queries share a key head) as three plain ops: scores
    ``q k^T * scale`` formed in fp32 from the inputs' values, the masked softmax in fp32, and its
    probabilities rounded to the input dtype for ``p v``, as the fused kernel does."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    length = query.shape[2]
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2))
    scores = scores * (query.shape[-1] ** -0.5 if scale is None else scale)
    future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.matmul(probs.to(query.dtype), value)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
                     scale: float | None) -> torch.Tensor:
    """SDPA with ``is_causal=True`` over ``[S, H, L, D]`` batches, or ``math_attention`` where it is
    faster (short, reduced precision, CPU, gradients on, no dropout)."""
    if (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0
            and torch.is_grad_enabled() and query.shape[2] <= MATH_ATTENTION_MAX_LENGTH):
        return math_attention(query, key, value, scale)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=key.shape[1] != query.shape[1])


# transformers' attention-function signature: its attention layers call the registered function
# with these arguments by these names, so they stay as they are.
def varlen_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # noqa: PLR0913
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
    outputs = []
    for columns in layout.buckets:
        # [H, N, D] -> [H, S_b, L_b, D] -> [S_b, H, L_b, D]
        q, k, v = (t[0][:, columns].transpose(0, 1) for t in (query, key, value))
        out = causal_attention(q, k, v, dropout if module.training else 0.0, scaling)
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
