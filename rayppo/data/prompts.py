"""Prompt datasets: JSONL or Parquet files (or the embedded task), validated row by row.

Every problem is reported with the file, the row (1-based, as an editor shows it) and the
field, before any training starts, so a bad file never costs a half-finished run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rayppo.errors import RayppoError


class PromptDataError(RayppoError, ValueError):
    """A prompt file that cannot be used; the message names the file, row and field."""


def read_prompt_texts(path: str | Path, column: str = "prompt") -> list[str]:
    """The prompt texts of a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        raise PromptDataError(f"{path}: prompt file not found")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            table = pq.read_table(str(path))
        except (pa.ArrowException, OSError) as exc:
            raise PromptDataError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
        if column not in table.column_names:
            raise PromptDataError(f"{path}: no column {column!r} (columns: {', '.join(table.column_names)})")
        texts = table.column(column).to_pylist()
    elif suffix in (".jsonl", ".json"):
        texts = []
        with path.open(encoding="utf-8") as f:
            for row, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptDataError(f"{path}: row {row}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or column not in record:
                    raise PromptDataError(f"{path}: row {row}: missing field {column!r}")
                texts.append(record[column])
    else:
        raise PromptDataError(f"{path}: unsupported prompt file type {suffix!r} (use .jsonl or .parquet)")
    for row, text in enumerate(texts, start=1):
        if not isinstance(text, str) or not text.strip():
            raise PromptDataError(f"{path}: row {row}: field {column!r} is empty or not a string")
    if not texts:
        raise PromptDataError(f"{path}: no prompts")
    return texts


def tokenize_prompts(texts: list[str], tokenizer, max_tokens: int, source: str) -> list[list[int]]:
    """Token ids of every prompt; a prompt over ``max_tokens`` is an error naming its row."""
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    for row, prompt_ids in enumerate(ids, start=1):
        if len(prompt_ids) > max_tokens:
            raise PromptDataError(
                f"{source}: row {row}: prompt is {len(prompt_ids)} tokens, longer than the "
                f"{max_tokens} the model allows with rollout.max_new_tokens reserved"
            )
    return ids


@dataclass
class PromptBatch:
    """The prompts of one iteration."""

    texts: list[str]
    ids: list[list[int]]


class PromptSampler:
    """Endless seeded batches over a prompt set, reshuffled each pass; its position is saveable."""

    def __init__(self, texts: list[str], ids: list[list[int]], batch_size: int, seed: int, shuffle: bool = True):
        self.texts, self.ids = texts, ids
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.texts)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> PromptBatch:
        rows: list[int] = []
        while len(rows) < self.batch_size:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(self.batch_size - len(rows), len(self._order) - self.cursor)
            rows.extend(self._order[self.cursor : self.cursor + take])
            self.cursor += take
        return PromptBatch([self.texts[i] for i in rows], [self.ids[i] for i in rows])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._make_order()


def load_prompt_set(spec: str, column: str, tokenizer, max_tokens: int) -> tuple[list[str], list[list[int]]]:
    """Texts and token ids of ``spec`` (a file, or ``embedded`` for the default task's prompts)."""
    if spec == "embedded":
        from rayppo.tasks import digits

        texts, source = digits.prompts(), "embedded prompts"
    else:
        texts, source = read_prompt_texts(spec, column), spec
    return texts, tokenize_prompts(texts, tokenizer, max_tokens, source)
