"""A group's prompt packed once: rows that share their prompt share its columns in the packed row.

GRPO samples k responses per prompt, and every pass over the rollout (the learner's policy and
critic, the reference) runs each row's prompt again: on the real-model workload (16 prompts of ~47
tokens x 4 samples of 32 tokens) 3,008 of a pass's 5,056 tokens are prompts, three quarters of them
repeats. A transformer's output at a prompt position depends on the prompt alone (causal
attention), so those positions are the same numbers in every row of the group; here they are
computed once.

The layout (``varlen`` packing, one row, ``models/varlen_attention.py``): for each group, its prompt's
p tokens at positions 0..p-1, then each row's response tokens at positions p, p+1, ... Each row is a
*sequence of columns* (the shared prompt's, then its own); attention gathers those columns per
sequence, so a response attends to its prompt and its own earlier tokens, never to a sibling's. The
padded layout's index map (``RowPacking.index``) points each row's prompt columns at the shared ones:
unpacking is the same gather, and its backward adds every row's gradient into the prompt's one
forward, which is the gradient of the unshared computation (a sum over the rows that read it).

Where no two rows share a prompt this is ``packing.pack_sequences(mode="varlen")`` itself.
"""

from __future__ import annotations

import torch

from rayppo.models.packing import RowPacking, pack_sequences
from rayppo.models.varlen_attention import sequence_segments


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> list[list[int]]:
    """Rows with the same prompt (the real tokens left of column ``prompt_width``), in order of
    first appearance; each group's rows in row order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(input_ids.shape[0]):
        prompt = input_ids[row, :prompt_width][attention_mask[row, :prompt_width].bool()]
        groups.setdefault(tuple(prompt.tolist()), []).append(row)
    return list(groups.values())


def pack_shared(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> RowPacking:
    """``varlen`` packing of ``input_ids`` [B, L] (left-padded prompts ending at column
    ``prompt_width``, then right-padded responses; ``attention_mask`` 1 on real tokens) with each
    group's prompt laid out once (module docstring)."""
    groups = prompt_groups(input_ids, attention_mask, prompt_width)
    if len(groups) == input_ids.shape[0]:  # nothing shared: the plain layout
        return pack_sequences(input_ids, attention_mask, "varlen")
    lengths = attention_mask.sum(dim=1).tolist()
    starts = attention_mask.argmax(dim=1).tolist()  # the first real column of each row
    tokens: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    sequences: list[list[int]] = []
    index = torch.zeros(attention_mask.shape, dtype=torch.long)
    width = 0
    for rows in groups:
        first = starts[rows[0]]
        p = prompt_width - first  # the group's prompt length (left-padded to prompt_width)
        prompt_columns = list(range(width, width + p))
        tokens.append(input_ids[rows[0], first:prompt_width])
        positions.append(torch.arange(p))
        width += p
        for row in rows:
            n = lengths[row] - p  # the row's tokens after its prompt
            tokens.append(input_ids[row, prompt_width : prompt_width + n])
            positions.append(torch.arange(p, p + n))
            columns = prompt_columns + list(range(width, width + n))
            width += n
            sequences.append(columns)
            index[row] = columns[0]  # padding columns: the row's first token (never read)
            index[row, starts[row] : starts[row] + lengths[row]] = torch.tensor(columns)
    return RowPacking(torch.cat(tokens).unsqueeze(0), torch.cat(positions).unsqueeze(0), index,
                      sequence_segments(sequences, width)).to(input_ids.device)
