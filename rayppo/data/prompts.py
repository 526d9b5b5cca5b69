"""Prompt datasets: JSON Lines, Parquet or a Hugging Face ``datasets`` folder (or the embedded
task), validated row by row, rendered and tokenised.

A row's prompt column holds a string, or a chat conversation (a list of ``{role, content}``
messages) that the policy tokenizer's chat template renders into the prompt text. The row's other
columns ("fields", e.g. ``answer`` or ``tests``) travel with it to the reward.

Every problem is reported with the file, the row (1-based, as an editor shows it) and the
field, before any training starts, so a bad file never costs a half-finished run. This module
imports neither torch nor transformers (``rayppo.plan.inputs`` reads prompts before they load), and
never imports ``datasets``: its folders are Arrow IPC streams that pyarrow reads directly.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rayppo.errors import RayppoError, new_path

Message = dict[str, Any]
"""One chat turn: ``{"role": str, "content": str}`` (other keys kept for the chat template)."""
Prompt = str | list[Message]
"""What a row's prompt column holds: text, or a conversation."""


class PromptDataError(RayppoError, ValueError):
    """A prompt file that cannot be used; the message names the file, row and field."""


@dataclass
class PromptRows:
    """A prompt source as read and validated, before rendering: one entry per row."""

    source: str
    """The file or folder (a ``DatasetDict`` split's sub-folder) that errors name."""
    column: str
    """The prompt column."""
    prompts: list[Prompt]
    """[N] each row's prompt: a non-empty string or a non-empty conversation."""
    fields: list[dict[str, Any]]
    """[N] each row's other columns, JSON-serialisable."""


def read_prompt_rows(path: str | Path, column: str = "prompt", split: str = "train") -> PromptRows:
    """The validated rows of a ``.jsonl`` / ``.json`` (JSON Lines) or ``.parquet`` file, or of a
    folder written by ``datasets``' ``save_to_disk`` (``split`` picks a ``DatasetDict``'s split)."""
    path = Path(path)
    if path.is_dir():
        table, source = _read_datasets_folder(path, split)
        records = _table_records(table, column, source)
    elif not path.is_file():
        raise PromptDataError(f"{path}: prompt file not found")
    elif path.suffix.lower() == ".parquet":
        try:
            table = pq.read_table(str(path))
        except (pa.ArrowException, OSError) as exc:
            raise PromptDataError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
        source, records = str(path), _table_records(table, column, str(path))
    elif path.suffix.lower() in (".jsonl", ".json"):
        source, records = str(path), _read_json_lines(path, column)
    else:
        raise PromptDataError(f"{path}: unsupported prompt file type {path.suffix.lower()!r} (use .jsonl, "
                              ".parquet or a folder written by datasets' save_to_disk)")
    if not records:
        raise PromptDataError(f"{source}: no prompts")
    prompts = [_check_prompt(record[column], source, row, column) for row, record in enumerate(records, start=1)]
    fields = [_check_fields(record, source, row, column) for row, record in enumerate(records, start=1)]
    return PromptRows(source, column, prompts, fields)


def _read_json_lines(path: Path, column: str) -> list[dict[str, Any]]:
    """One JSON object per non-blank line, each holding ``column``."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptDataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if text.lstrip().startswith("["):
        # A common export (pandas, many dataset hubs): one array, not one object per line.
        raise PromptDataError(f"{path}: expected JSON Lines (one object per line), found a JSON array; convert "
                              f"it with: jq -c '.[]' {path.name} > {new_path(path, '.lines.jsonl').name}")
    records = []
    for row, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptDataError(f"{path}: row {row}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise PromptDataError(f"{path}: row {row}: expected a JSON object, found {type(record).__name__}")
        if column not in record:
            raise PromptDataError(f"{path}: row {row}: missing field {column!r}")
        records.append(record)
    return records


def _read_datasets_folder(path: Path, split: str) -> tuple[pa.Table, str]:
    """The table of a ``Dataset`` folder, or of ``split`` in a ``DatasetDict`` folder, and the
    folder errors name."""
    if (path / "dataset_dict.json").is_file():
        splits = _read_json_file(path / "dataset_dict.json").get("splits")
        if not isinstance(splits, list):
            raise PromptDataError(f"{path / 'dataset_dict.json'}: no 'splits' list")
        if split not in splits:
            raise PromptDataError(f"{path}: no split {split!r} (splits: {', '.join(map(str, splits))}); set "
                                  "data.split (or eval.split)")
        path = path / split
    if not (path / "state.json").is_file():
        raise PromptDataError(f"{path}: not a datasets folder (no state.json or dataset_dict.json; write one "
                              "with Dataset.save_to_disk, or give a .jsonl or .parquet file)")
    return _read_arrow_shards(path), str(path)


def _read_arrow_shards(folder: Path) -> pa.Table:
    """The rows of the Arrow IPC stream files listed in ``state.json``, in order."""
    state = _read_json_file(folder / "state.json")
    try:
        names = [entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError):
        raise PromptDataError(f"{folder / 'state.json'}: no '_data_files' list of {{filename}}") from None
    tables = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name:  # a data file sits in the folder itself
            raise PromptDataError(f"{folder / 'state.json'}: data file {name!r} is not a file name in the folder")
        try:
            with pa.memory_map(str(folder / name)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except (pa.ArrowException, OSError) as exc:
            raise PromptDataError(f"{folder / name}: not an Arrow stream file ({str(exc).splitlines()[0]})") from None
    if not tables:
        raise PromptDataError(f"{folder}: no prompts (state.json lists no data files)")
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as exc:
        raise PromptDataError(f"{folder}: its data files disagree on columns ({exc})") from None


def _read_json_file(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PromptDataError(f"{file}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise PromptDataError(f"{file}: expected a JSON object")
    return data


def _table_records(table: pa.Table, column: str, source: str) -> list[dict[str, Any]]:
    if column not in table.column_names:
        raise PromptDataError(f"{source}: no column {column!r} (columns: {', '.join(table.column_names)})")
    return table.to_pylist()


def _check_prompt(value: Any, source: str, row: int, column: str) -> Prompt:
    """A non-empty string, or a conversation whose messages are checked one by one."""
    where = f"{source}: row {row}: field {column!r}"
    if isinstance(value, str) and value.strip():
        return value
    if not isinstance(value, (list, tuple)):
        shown = "" if isinstance(value, str) else f"; got {type(value).__name__}"
        raise PromptDataError(f"{where} is empty or not a string (a prompt is a non-empty string or a list of "
                              f"{{role, content}} messages{shown})")
    if not value:
        raise PromptDataError(f"{where} is an empty conversation (no messages)")
    messages = []
    for index, message in enumerate(value, start=1):
        at = f"{where}: message {index}"
        if not isinstance(message, dict):
            raise PromptDataError(f"{at} must be a {{role, content}} object, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message or message[key] is None:
                raise PromptDataError(f"{at} has no {key!r}")
            if not isinstance(message[key], str):
                raise PromptDataError(f"{at}: {key!r} must be a string, got {type(message[key]).__name__}")
        if not message["role"].strip():
            raise PromptDataError(f"{at}: 'role' is empty")
        # Arrow fills keys that only some messages have with None: they are absent, not null.
        kept = {key: item for key, item in message.items() if item is not None}
        _check_json(kept, f"{at}")
        messages.append(kept)
    return messages


def _check_fields(record: dict[str, Any], source: str, row: int, column: str) -> dict[str, Any]:
    """The row's other columns; each must be JSON (it reaches the reward as JSON)."""
    fields = {key: value for key, value in record.items() if key != column}
    for key, value in fields.items():
        _check_json(value, f"{source}: row {row}: column {key!r}")
    return fields


def _check_json(value: Any, where: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PromptDataError(f"{where} is not JSON-serialisable ({exc}); the row's columns reach the reward "
                              "as JSON") from None


def render_prompts(rows: PromptRows, tokenizer, max_tokens: int) -> tuple[list[str], list[list[int]]]:
    """``([N] prompt texts, [N][P_n] token ids)``. A string is tokenised with the tokenizer's special
    tokens; a conversation is rendered by the tokenizer's chat template with its generation
    prompt and tokenised without them (the template writes its own). A prompt over
    ``max_tokens``, or one that encodes to special tokens only, is an error naming its row."""
    texts = [p if isinstance(p, str) else "" for p in rows.prompts]
    chats = [i for i, p in enumerate(rows.prompts) if not isinstance(p, str)]
    if chats and not getattr(tokenizer, "chat_template", None):
        raise PromptDataError(f"{rows.source}: row {chats[0] + 1}: field {rows.column!r} is a chat conversation, "
                              "but the policy tokenizer has no chat template (add chat_template to its "
                              "tokenizer_config.json, or give plain string prompts)")
    for i in chats:
        try:
            texts[i] = tokenizer.apply_chat_template(rows.prompts[i], add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - the template is the model folder's Jinja code: any failure
            raise PromptDataError(f"{rows.source}: row {i + 1}: the policy's chat template failed on field "
                                  f"{rows.column!r}: {type(exc).__name__}: {exc}") from None
    plain = [i for i, p in enumerate(rows.prompts) if isinstance(p, str)]
    ids: list[list[int]] = [[] for _ in texts]
    for group, add_special in ((plain, True), (chats, False)):
        if group:
            encoded = tokenizer([texts[i] for i in group], add_special_tokens=add_special)["input_ids"]
            for i, prompt_ids in zip(group, encoded):
                ids[i] = list(prompt_ids)
    # <unk> is a token the model reads (a prompt of unknown words still reaches it); BOS, EOS, pad are not text.
    special = set(getattr(tokenizer, "all_special_ids", [])) - {getattr(tokenizer, "unk_token_id", None)}
    for row, prompt_ids in enumerate(ids, start=1):
        if not any(i not in special for i in prompt_ids):
            # vLLM would refuse it deep in a generator ("The decoder prompt cannot be empty"); the usual
            # cause is a tokenizer loaded as another class than it was saved as (transformers picks
            # the class from tokenizer_config.json, else from config.json's model_type).
            raise PromptDataError(
                f"{rows.source}: row {row}: prompt encodes to no tokens (only special ones: {prompt_ids}) with the "
                f"policy's tokenizer {type(tokenizer).__name__} from {getattr(tokenizer, 'name_or_path', '?')}; "
                "check that its tokenizer_config.json names the tokenizer_class it was saved with")
        if len(prompt_ids) > max_tokens:
            raise PromptDataError(
                f"{rows.source}: row {row}: prompt is {len(prompt_ids)} tokens, longer than the "
                f"{max_tokens} the model allows with rollout.max_new_tokens reserved"
            )
    return texts, ids


@dataclass
class PromptBatch:
    """Prompts, row by row: B of them for one iteration (or, as ``PromptSet``, a whole dataset)."""

    texts: list[str]
    """[B] prompt text as the policy sees it (a conversation rendered by the chat template)."""
    ids: list[list[int]]
    """[B][P_b] prompt token ids (unpadded)."""
    messages: list[list[Message] | None] = field(default_factory=list)
    """[B] the conversation a chat prompt came from, None for a plain prompt; empty: all plain."""
    fields: list[dict[str, Any]] = field(default_factory=list)
    """[B] the prompt row's other columns; empty: none."""
    groups: list[int] = field(default_factory=list)
    """[B] the group each row samples for (``Rollout.group_id``, set by ``groups_of``); empty: none."""

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, rows: list[int] | range) -> PromptBatch:
        """A batch of the given rows, in that order (empty columns stay empty)."""
        return PromptBatch([self.texts[i] for i in rows], [self.ids[i] for i in rows],
                           [self.messages[i] for i in rows] if self.messages else [],
                           [self.fields[i] for i in rows] if self.fields else [],
                           [self.groups[i] for i in rows] if self.groups else [])

    def whole_groups(self, parts: int) -> list[PromptBatch]:
        """This batch cut into at most ``parts`` contiguous batches of whole groups (counts of groups
        differing by at most one; a row without a group is a group of its own), none empty: how a
        lost generator's share is taken over by the generators left, each group by one engine."""
        starts = [i for i in range(len(self)) if i == 0 or not self.groups or self.groups[i] != self.groups[i - 1]]
        bounds = [*starts, len(self)]
        base, extra = divmod(len(starts), parts)
        out, first = [], 0
        for k in range(parts):
            last = first + base + (1 if k < extra else 0)
            if last > first:
                out.append(self.select(range(bounds[first], bounds[last])))
            first = last
        return out

    def groups_of(self, n: int, first_group: int = 0) -> PromptBatch:
        """Each prompt ``n`` times in a row, the copies of prompt i forming group ``first_group + i``
        (two draws of the same text are two groups)."""
        batch = PromptBatch.select(self, [i for i in range(len(self)) for _ in range(n)])
        batch.groups = [first_group + i for i in range(len(self)) for _ in range(n)]
        return batch

    def messages_json(self) -> list[str]:
        """[B] each conversation as JSON text, ``""`` for a plain prompt (``Rollout.prompt_messages``)."""
        messages = self.messages or [None] * len(self)
        return [json.dumps(m, ensure_ascii=False) if m else "" for m in messages]

    def fields_json(self) -> list[str]:
        """[B] each row's other columns as a JSON object text (``Rollout.prompt_fields``)."""
        fields = self.fields or [{}] * len(self)
        return [json.dumps(f, ensure_ascii=False) for f in fields]


@dataclass
class PromptSet(PromptBatch):
    """A whole prompt dataset, rendered and tokenised (what ``load_prompt_set`` returns)."""

    source: str = ""
    """Where the prompts came from (a file, a folder, ``embedded prompts``)."""


class PromptSampler:
    """Endless seeded batches over a prompt set, reshuffled each pass; its position is saveable."""

    def __init__(self, prompts: PromptBatch, batch_size: int, seed: int, shuffle: bool = True):
        self.prompts = prompts
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> PromptBatch:
        """The next ``batch_size`` prompts; a pass over the set ends before any repeats."""
        rows: list[int] = []
        while len(rows) < self.batch_size:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(self.batch_size - len(rows), len(self._order) - self.cursor)
            rows.extend(self._order[self.cursor : self.cursor + take])
            self.cursor += take
        return self.prompts.select(rows)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._make_order()


EMBEDDED_PROMPTS = ("embedded", "embedded-guess", "arithmetic")
"""Prompt sets rayppo writes itself: the default "say a digit" task, the multi-turn guessing
game (``rayppo.tasks.guess``: one conversation, each row's hidden digit in its ``secret`` column),
and two-digit arithmetic for a real chat model (``rayppo.tasks.arithmetic``: one user message,
the exact result in its ``answer`` column)."""


def embedded_rows(spec: str, column: str, split: str = "train") -> PromptRows:
    """The rows of an embedded prompt set (``split`` ``test``: its held-out pass)."""
    if spec == "embedded-guess":
        from rayppo.tasks import guess

        secrets = guess.eval_secrets() if split == "test" else guess.prompt_rows()
        return PromptRows("embedded guessing game", column, [guess.conversation() for _ in secrets],
                          [{"secret": s} for s in secrets])
    if spec == "arithmetic":
        from rayppo.tasks import arithmetic

        rows = [arithmetic.row(*problem) for problem in arithmetic.problems(split)]
        return PromptRows("arithmetic problems", column, [m for m, _ in rows], [f for _, f in rows])
    from rayppo.tasks import digits

    texts = digits.eval_prompts() if split == "test" else digits.prompts()  # "test": the held-out split
    return PromptRows("embedded prompts", column, list(texts), [{} for _ in texts])


def load_prompt_set(spec: str, column: str, tokenizer, max_tokens: int, split: str = "train") -> PromptSet:
    """The prompts of ``spec`` (a file, a ``datasets`` folder with ``split``, or one of
    ``EMBEDDED_PROMPTS``), rendered and tokenised by the policy's ``tokenizer``."""
    if spec in EMBEDDED_PROMPTS:
        rows = embedded_rows(spec, column, split)
    else:
        rows = read_prompt_rows(spec, column, split)
    texts, ids = render_prompts(rows, tokenizer, max_tokens)
    messages = [None if isinstance(p, str) else p for p in rows.prompts]
    return PromptSet(texts, ids, messages, rows.fields, source=rows.source)
