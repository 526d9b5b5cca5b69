"""Preference pairs for training a reward model r_φ: read, checked row by row, tokenised.

A pair file is what ``data/prompts.py`` reads (``.jsonl``, ``.parquet`` or a folder written by
``datasets``' ``save_to_disk``) with two more columns: ``chosen`` and ``rejected``, the preferred
and the dispreferred response to the row's ``prompt`` (a string, or a list of ``{role, content}``
messages). A bad row is refused with one line naming the file, the row and the field; nothing is
trained on a file with one.

Imports neither torch nor transformers: the tokenizer comes in as an argument.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayppo.data.prompts import Prompt, PromptDataError, read_prompt_rows
from rayppo.data.reward_texts import reward_text, templated

RESPONSES = ("chosen", "rejected")
"""The two response columns of a pair file, preferred first."""


@dataclass
class PreferencePairs:
    """The pairs of one file, as read and checked."""

    source: str
    """The file or folder errors name."""
    prompts: list[Prompt]
    """[P] each pair's prompt x."""
    chosen: list[str]
    """[P] the preferred response y_w."""
    rejected: list[str]
    """[P] the dispreferred response y_l."""

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class PairTokens:
    """Token ids of each pair's two texts (``data/reward_texts.py``) in the reward model's vocabulary."""

    chosen: list[list[int]]
    """[P][L_w] ids of (x, y_w)."""
    rejected: list[list[int]]
    """[P][L_l] ids of (x, y_l)."""

    def select(self, rows: list[int]) -> PairTokens:
        return PairTokens([self.chosen[i] for i in rows], [self.rejected[i] for i in rows])

    def __len__(self) -> int:
        return len(self.chosen)


def read_pairs(path: str | Path, split: str = "train") -> PreferencePairs:
    """The checked pairs of ``path``: every row has a prompt and two non-empty responses that
    differ (a pair of equal responses says nothing about r_φ and would train it toward a tie)."""
    rows = read_prompt_rows(path, "prompt", split)
    chosen, rejected = [], []
    for row, fields in enumerate(rows.fields, start=1):
        for column in RESPONSES:
            value = fields.get(column)
            if column not in fields:
                raise PromptDataError(f"{rows.source}: row {row}: missing field {column!r} (a pair file has prompt, "
                                      "chosen and rejected)")
            if not isinstance(value, str) or not value.strip():
                got = f"got {type(value).__name__}" if not isinstance(value, str) else "got an empty string"
                raise PromptDataError(f"{rows.source}: row {row}: field {column!r} must be a non-empty response ({got})")
        if fields["chosen"].strip() == fields["rejected"].strip():
            raise PromptDataError(f"{rows.source}: row {row}: 'chosen' and 'rejected' are the same response: the pair "
                                  "prefers nothing; drop the row")
        chosen.append(fields["chosen"])
        rejected.append(fields["rejected"])
    return PreferencePairs(rows.source, rows.prompts, chosen, rejected)


def tokenize_pairs(pairs: PreferencePairs, tokenizer: Any, max_tokens: int) -> PairTokens:
    """Each pair's two texts in ``tokenizer``'s ids. A text over ``max_tokens`` (the prompt's
    tokens with its response's) is refused naming its row: a truncated text would be scored at a
    token that is not the end of the response."""
    ids: dict[str, list[list[int]]] = {}
    special = not templated(tokenizer)
    for column in RESPONSES:
        texts = []
        for row, (prompt, response) in enumerate(zip(pairs.prompts, getattr(pairs, column)), start=1):
            try:
                texts.append(reward_text(tokenizer, prompt, response))
            except Exception as exc:  # noqa: BLE001 - the template is the model folder's Jinja code: any failure
                raise PromptDataError(f"{pairs.source}: row {row}: the reward model's chat template failed on the "
                                      f"prompt: {type(exc).__name__}: {exc}") from None
        ids[column] = [list(x) for x in tokenizer(texts, add_special_tokens=special)["input_ids"]]
    for row, lengths in enumerate(zip(*(map(len, ids[c]) for c in RESPONSES)), start=1):
        for column, length in zip(RESPONSES, lengths):
            if length > max_tokens:
                raise PromptDataError(f"{pairs.source}: row {row}: the prompt with its {column!r} response is "
                                      f"{length} tokens, over preference.max_tokens={max_tokens}; raise it or "
                                      "drop the row")
    return PairTokens(ids["chosen"], ids["rejected"])


def held_out_split(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(training rows, held-out rows)``: a seeded shuffle of ``count`` pairs, ``fraction`` of
    them (at least one when ``fraction`` > 0) held out; each part in file order."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = min(count - 1, max(1, round(fraction * count))) if fraction > 0 else 0
    return sorted(order[held:]), sorted(order[:held])


def epoch_order(rows: list[int], epoch: int, seed: int) -> list[int]:
    """The training rows in the order of ``epoch``: a shuffle seeded by (seed, epoch), so a
    resumed run walks the same order."""
    order = list(rows)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
