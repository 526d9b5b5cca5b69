"""A sequence classifier's scores (the reward model r_phi) with each group's shared prefix run once.

The reward model reads each (prompt, response) as one text; the k responses of a GRPO group share
the text's whole prompt part (the chat template's turns up to the assistant's). Tokenised whole,
the rows' token lists share a prefix; split there, they are (prefix, rest) pairs that
``models/shared_prompts.py`` packs with the prefix once, exactly the token sequences of the padded
pass. The backbone runs on that packed row, and the classifier's head reads the hidden state of
the token transformers' ``*ForSequenceClassification`` reads: the last one that is not the pad token
(transformers 5.19, ``modeling_llama.py`` ``LlamaForSequenceClassification.forward``:
``last_non_pad_token = (token_indices * non_pad_mask).argmax(-1)``, the rightmost non-pad token).

Only for the families whose classifier is ``score`` (a linear layer) over a ``VARLEN_MODELS``
backbone, under SDPA (``shared_scoring``); others keep the padded pass.
"""

from __future__ import annotations

from typing import Any

import torch

from rayppo.models.packing import scoring_layout
from rayppo.models.sequences import pack
from rayppo.models.varlen_attention import use_varlen_attention


def shared_scoring(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a transformers sequence classifier) can score packed rows here; switches
    its attention to the per-sequence kernel when it can (its padded calls are unchanged)."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear) or scoring_layout(model.config) != "varlen":
        return False
    use_varlen_attention(model)
    return True


def common_prefix(rows: list[list[int]]) -> int:
    """The length of the longest prefix every token list of ``rows`` starts with."""
    shortest = min(len(r) for r in rows)
    for i in range(shortest):
        if any(r[i] != rows[0][i] for r in rows[1:]):
            return i
    return shortest


def last_scored(ids: list[int], pad_id: int | None) -> int:
    """The position transformers' classifier reads: the last token that is not ``pad_id`` (the
    last token when every one is, or with no pad token)."""
    kept = [i for i, t in enumerate(ids) if t != pad_id]  # every position when pad_id is None
    return kept[-1] if kept else len(ids) - 1


@torch.no_grad()
def shared_prefix_scores(model: torch.nn.Module, token_rows: list[list[int]], groups: list[list[int]],
                         pad_id: int | None) -> list[float]:
    """``[len(token_rows)]`` scores of the classifier ``model`` (one label) on each token list, in
    one forward pass; rows of each group of ``groups`` (indices into ``token_rows``; every row in one
    group) share their common prefix's columns."""
    prefix = [0] * len(token_rows)
    for rows in groups:
        cut = common_prefix([token_rows[i] for i in rows]) if len(rows) > 1 else len(token_rows[rows[0]])
        for i in rows:
            prefix[i] = cut
    batch = pack([r[:n] for r, n in zip(token_rows, prefix)], [r[n:] for r, n in zip(token_rows, prefix)],
                 0 if pad_id is None else pad_id).packed("varlen")
    device = next(model.parameters()).device
    backbone: Any = getattr(model, "base_model")  # noqa: B009 - transformers' trunk, untyped for mypy
    hidden = batch.unpacked(backbone(**batch.to(device).model_inputs()).last_hidden_state)  # [B, P + T, H]
    # each row's text starts at column prompt_width - its prefix (prompts are left-padded)
    columns = torch.tensor([batch.prompt_width - n + last_scored(r, pad_id) for r, n in zip(token_rows, prefix)])
    read = hidden[torch.arange(len(token_rows)), columns.to(hidden.device)]  # [B, H]
    head: torch.nn.Module = getattr(model, "score")  # noqa: B009 - a Linear (shared_scoring checked it)
    return head(read)[:, 0].float().tolist()
