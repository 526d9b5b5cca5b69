"""Padding-free rows: several sequences end to end in one row, each with positions from 0.

The padded layout of ``models/sequences.py`` processes rows x (longest prompt + longest response)
tokens; packed, a pass processes little more than the real tokens. transformers 5.19 reads
packing from the position ids alone when no attention mask is given
(``masking_utils._preprocess_mask_arguments`` -> ``find_packed_sequence_indices``: a new sequence
starts wherever the position does not grow by 1): SDPA and eager attention then get a
block-diagonal causal mask, and flash-attention 2 its varlen kernel with ``cu_seqlens``
(``modeling_flash_attention_utils._is_packed_sequence``, which takes a single packed row only).
No sequence sees another's tokens, and rotary embeddings see each sequence's own positions, so a
packed row's outputs are the padded rows' outputs: only the order of floating-point sums changes.

The model's outputs are put back in the padded layout (``unpack``), so everything after the
model's trunk (the vocabulary head, the value head, the losses) is the padded path's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from rayppo.models.varlen_attention import VARLEN_MODELS, VARLEN_SDPA, Segments, segments

PACKING_MODELS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3",
                            "gemma", "gemma2", "gemma3_text", "olmo2", "gpt2"})
"""Model types whose transformers 5.19 forward builds its attention mask with ``masking_utils``
(``create_causal_mask`` and its sliding-window sibling), which reads packing from the position ids;
``learner.packing=auto`` packs these only."""


def pack_mode(setting: str, config: Any) -> str:
    """``PackedBatch.pack_mode`` for ``learner.packing`` (``auto``, ``packed``, ``right_padded``,
    ``padded``) and a model's transformers config: ``one_row`` under flash-attention 2 (its varlen
    kernel takes one packed row, ``_is_packed_sequence``), ``varlen`` under SDPA for the families of
    ``VARLEN_MODELS`` without a sliding window (one packed row, attention per sequence:
    ``models/varlen_attention.py``), ``rows`` for other packed attention (a block mask),
    ``right_padded`` for one sequence per row, ``""`` for the padded layout.

    ``auto`` packs wherever the kernels do no masked work: ``one_row`` or ``varlen``, else
    ``right_padded`` for ``PACKING_MODELS``, else padded. A block mask (``rows``) leaves torch's
    fused causal kernel on the CPU and measured no faster than the padded micro-batches on
    ``small-varlen`` (docs/benchmarks.md), so ``auto`` never picks it. One sequence per row needs
    no mask (the filler is after every real token) but is as wide as the pass's longest sequence."""
    implementation = getattr(config, "_attn_implementation", None)
    model_type = getattr(config, "model_type", None)
    flash = implementation == "flash_attention_2"
    varlen = implementation in ("sdpa", VARLEN_SDPA) and model_type in VARLEN_MODELS and not _sliding_window(config)
    if setting == "padded" or (setting == "auto" and model_type not in PACKING_MODELS):
        return ""
    if setting == "right_padded" or (setting == "auto" and not (flash or varlen)):
        return "right_padded"
    return "one_row" if flash else "varlen" if varlen else "rows"


def _sliding_window(config: Any) -> bool:
    """Whether the config sets a sliding window at all. Any window rules out ``varlen``: transformers
    builds the sliding mask over the whole packed row, whose length is the pass's tokens, not one
    sequence's (``masking_utils._ignore_causal_mask_sdpa`` keeps the mask once the row reaches the
    window). Qwen 2/3 set ``sliding_window`` None unless ``use_sliding_window``; Qwen2-MoE sets 0 and
    builds that mask regardless (so it is not in ``VARLEN_MODELS``)."""
    return getattr(config, "sliding_window", None) is not None


def scoring_layout(config: Any) -> str:
    """How a scorer without gradients (the reference) lays out its passes: ``auto``'s choice for
    its model (``pack_mode``), taking an unset attention implementation as SDPA (transformers'
    default where torch has it: a ``config.json`` read before loading)."""
    if getattr(config, "_attn_implementation", None) is None:
        config = SimpleNamespace(**{**vars(config), "_attn_implementation": "sdpa"})
    return pack_mode("auto", config)


def cut_layout(mode: str) -> str:
    """The ``data.micro_batches.token_batches`` layout whose token count prices a pass of ``mode``."""
    return {"": "padded", "right_padded": "right_padded"}.get(mode, "packed")


@dataclass
class RowPacking:
    """One packed forward pass over the B rows of a padded ``[B, L]`` batch."""

    input_ids: torch.Tensor
    """[R, W] long: the rows' real tokens end to end (R packed rows of W tokens); the rest filler."""
    position_ids: torch.Tensor
    """[R, W] long: 0, 1, ... from each sequence's first token (and from each row's filler)."""
    index: torch.Tensor
    """[B, L] long: where each column of the padded layout sits in the flattened ``[R * W]`` packed
    rows; padding columns point at their row's first token (their outputs are never read)."""
    segments: Segments | None = None
    """``varlen`` mode: where each sequence of the one packed row sits, for the attention of
    ``models/varlen_attention.py`` (a forward's ``rayppo_segments``)."""

    def to(self, device: torch.device | str) -> RowPacking:
        return RowPacking(self.input_ids.to(device), self.position_ids.to(device), self.index.to(device),
                          None if self.segments is None else self.segments.to(device))

    def model_inputs(self) -> dict[str, Any]:
        """The keyword inputs of a forward over these rows. Packing is read from the position ids
        (no mask), or under ``varlen`` given as ``rayppo_segments`` with an all-ones mask (which
        transformers' SDPA mask reads as no mask: no block mask is built)."""
        if self.segments is None:
            return {"input_ids": self.input_ids, "attention_mask": None, "position_ids": self.position_ids}
        return {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids),
                "position_ids": self.position_ids, "rayppo_segments": self.segments}

    @property
    def processed_tokens(self) -> int:
        return self.input_ids.numel()


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, mode: str = "rows") -> RowPacking:
    """Pack the real tokens of each row of ``input_ids`` [B, L] (``attention_mask`` 1 on them, one
    contiguous run per row, as ``sequences.pack`` lays them out).

    ``mode``: ``one_row``, every sequence in one row (flash-attention's varlen kernel); ``varlen``,
    the same with its ``Segments`` (per-sequence SDPA, ``models/varlen_attention.py``); ``rows``,
    rows as wide as the longest sequence, filled first-fit longest first, so no packed row is
    wider than a padded one (attention over a packed row costs what the padded row's did) while
    the filler shrinks to what the fit leaves; ``right_padded``, each sequence alone in its row
    from column 0 with the filler after it *continuing* its positions, so transformers sees one
    plain sequence per row (no packing, no mask: causal attention never reads a later column).
    """
    if mode not in ("rows", "one_row", "varlen", "right_padded"):
        raise ValueError(f"pack mode must be rows, one_row, varlen or right_padded, got {mode!r}")
    lengths = attention_mask.sum(dim=1).tolist()
    starts = attention_mask.argmax(dim=1).tolist()  # the first real column of each row
    width = sum(lengths) if mode in ("one_row", "varlen") else max(max(lengths), 1)
    bins: list[list[int]] = [[row] for row in range(len(lengths))] if mode == "right_padded" else []
    room: list[int] = []
    for row in [] if bins else sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((j for j, free in enumerate(room) if free >= lengths[row]), None)
        if fit is None:
            bins.append([])
            room.append(width)
            fit = len(bins) - 1
        bins[fit].append(row)
        room[fit] -= lengths[row]
    packed = torch.zeros((len(bins), width), dtype=torch.long)
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    index = torch.zeros(attention_mask.shape, dtype=torch.long)
    for r, rows in enumerate(bins):
        offset = 0
        for row in rows:
            n, start = lengths[row], starts[row]
            packed[r, offset : offset + n] = input_ids[row, start : start + n]
            positions[r, offset : offset + n] = torch.arange(n)
            index[row] = r * width + offset  # padding columns: the row's first token
            index[row, start : start + n] = r * width + offset + torch.arange(n)
            offset += n
        # filler: a sequence of its own; right_padded: the row's sequence going on (no packing seen)
        first = offset if mode == "right_padded" else 0
        positions[r, offset:] = torch.arange(first, first + width - offset)
    # built on the CPU (Python loops), used where the batch lives (a GPU learner's micro-batches)
    varlen = segments([lengths[row] for row in bins[0]]) if mode == "varlen" else None
    return RowPacking(packed, positions, index, varlen).to(input_ids.device)


def unpack(outputs: torch.Tensor, packing: RowPacking) -> torch.Tensor:
    """``[R, W, ...]`` outputs of the packed rows -> ``[B, L, ...]`` in the padded layout
    (a gather: gradients flow back to the packed positions)."""
    flat = outputs.reshape(-1, *outputs.shape[2:])
    return flat[packing.index.reshape(-1)].reshape(*packing.index.shape, *outputs.shape[2:])
