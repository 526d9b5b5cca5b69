"""The rollout record: one typed batch of responses that crosses processes as an Arrow table.

One row per response. The generator fills the ids, the old log-probs, the finish reason and the
policy version, and copies the prompt row (its conversation and other columns, as JSON text) for
the reward; the scorers add ``ref_logprobs``, ``teacher_logprobs`` and ``score`` (``Rollout.scored``). The learner's
tensors never leave it (``learner/rollout_tensors.py``), except the advantages and returns it
trained on when ``output.save_rollouts`` asks for them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def _column(arrow: pa.DataType, default: bool = True) -> Any:
    """A field of ``Rollout`` and its Arrow type (the schema is read off the fields)."""
    if default:
        return field(default_factory=list, metadata={"arrow": arrow})
    return field(metadata={"arrow": arrow})


INT32S, INT64S, FLOAT32S = pa.list_(pa.int32()), pa.list_(pa.int64()), pa.list_(pa.float32())


@dataclass
class Rollout:
    """A batch of B responses, column by column; each column is described once, here, and its
    Arrow type is the ``ROLLOUT_SCHEMA`` the batch crosses processes and is saved with.

    A column that is not filled is empty (``[]``, null in Arrow): one its writer has not run for
    yet (the scorers' before scoring), or one that does not apply (no groups, single-turn rows)."""

    # Positional order is the record's first layout (callers build it so); each docstring names
    # the role that writes the column: the generator, the reference or reward scorer, the learner.
    prompt_ids: list[list[int]] = _column(INT32S, default=False)
    """(generator) [B][P_b] x, the prompt's token ids (unpadded)."""
    response_ids: list[list[int]] = _column(INT32S, default=False)
    """(generator) [B][T_b] y_1..y_T, the response's token ids, EOS included when the response stopped."""
    logprobs: list[list[float]] = _column(FLOAT32S, default=False)
    """(generator) [B][T_b] log pi_old(y_t | S_{t-1}) under the sampling distribution (the sampler's)."""
    finish_reason: list[str] = _column(pa.string(), default=False)
    """(generator) [B] ``stop`` (EOS emitted: true termination) or ``length`` (cut: truncation)."""
    prompt_text: list[str] = _column(pa.string(), default=False)
    """(generator) [B] prompt text, for reward functions and logs."""
    response_text: list[str] = _column(pa.string(), default=False)
    """(generator) [B] response text without special tokens."""
    policy_version: list[int] = _column(pa.int64())
    """(generator) [B] version of the policy weights that generated the row; of its first (oldest) token when
    the row was continued across generator calls (``token_versions``)."""
    generator_id: list[int] = _column(pa.int32())
    """(generator) [B] index of the generator that produced the row."""
    group_id: list[int] = _column(pa.int32())
    """(generator) [B] g: which of the batch's prompt draws the row answers; the n rows of one draw
    (``rollout.samples_per_prompt``) are a group, even when two draws have the same text. Every
    group statistic keys on it, never on a row's position or its prompt."""
    ref_logprobs: list[list[float]] = _column(FLOAT32S)
    """(reference scorer) [B][T_b] log pi_ref(y_t | S_{t-1}); empty before the reference pass, and at
    ``ppo.kl_coef`` = 0 (no reference runs)."""
    score: list[float] = _column(pa.float32())
    """(reward scorer) [B] r_phi(x, y); empty before the reward pass."""
    gold_score: list[float] = _column(pa.float32())
    """(reward scorer) [B] the gold scorer's score of the row (``reward.gold_function``), recorded beside
    r_phi and never trained on; empty without one."""
    prompt_messages: list[str] = _column(pa.string())
    """(generator) [B] the chat conversation (a JSON list of ``{role, content}``) the prompt text was rendered
    from, ``""`` for a plain-text prompt; empty: every prompt is plain."""
    prompt_fields: list[str] = _column(pa.string())
    """(generator) [B] the prompt row's other columns (e.g. ``answer``) as a JSON object text, ``"{}"`` when
    none; empty: no row has any. Read by the reward."""
    advantages: list[list[float]] = _column(FLOAT32S)
    """(learner) [B][T_b] A_t the learner trained on (after whitening; a group estimator's A_i on every token),
    so users can check the estimator."""
    returns: list[list[float]] = _column(FLOAT32S)
    """(learner) [B][T_b] the critic's value targets (``ppo.advantage=gae`` only; else empty), as ``advantages``."""
    token_versions: list[list[int]] = _column(INT64S)
    """(generator) [B][T_b] the version that sampled each token. Filled only with partial rollouts
    (``rollout.partial_tokens``), where a response continued by a later call holds tokens of several
    versions; empty: every token has its row's ``policy_version``."""
    action_mask: list[list[int]] = _column(pa.list_(pa.int8()))
    """(generator) [B][T_b] multi-turn episodes (``rollout.environment``): 1 on the tokens the policy sampled
    (actions), 0 on the tokens an observation added through the chat template. The response is
    the whole episode after the prompt; ``logprobs`` are 0 on environment tokens. Empty: every
    response token is an action (single-turn)."""
    turn_ends: list[list[int]] = _column(INT32S)
    """(generator) [B][K_b] multi-turn: the response index of each of the episode's K_b turns' last action
    token, in order; the last one is the episode's last token."""
    turn_rewards: list[list[float]] = _column(FLOAT32S)
    """(generator) [B][K_b] multi-turn: the environment's reward for each turn, placed on that turn's last
    action token (``score`` adds the reward function's r_phi on the episode's last)."""
    environment_seconds: list[float] = _column(pa.float32())
    """(generator) [B] multi-turn: seconds the episode's environment steps took, in its processes."""
    teacher_logprobs: list[list[float]] = _column(FLOAT32S)
    """(teacher scorer) [B][T_b] log pi_T(y_t | S_{t-1}) under the distillation teacher
    (``distill.teacher``); empty before the teacher pass, and without a teacher."""
    teacher_top_ids: list[list[list[int]]] = _column(pa.list_(INT32S))
    """(teacher scorer) [B][T_b][k] the teacher's k most likely tokens j at each response position,
    most likely first (``distill.topk`` = k > 0; else empty)."""
    teacher_top_logprobs: list[list[list[float]]] = _column(pa.list_(FLOAT32S))
    """(teacher scorer) [B][T_b][k] log pi_T(j | S_{t-1}) of those tokens (``distill.topk`` > 0; else empty)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def scored(self, score: list[float], ref_logprobs: list[list[float]] | None = None,
               gold_score: list[float] | None = None, teacher: TeacherScores | None = None) -> Rollout:
        """A new record with the scorers' columns filled (this one is left as it is)."""
        teacher = teacher or TeacherScores(self.teacher_logprobs, self.teacher_top_ids, self.teacher_top_logprobs)
        return dataclasses.replace(
            self, score=list(score), ref_logprobs=self.ref_logprobs if ref_logprobs is None else list(ref_logprobs),
            gold_score=self.gold_score if gold_score is None else list(gold_score),
            teacher_logprobs=list(teacher.logprobs), teacher_top_ids=list(teacher.top_ids),
            teacher_top_logprobs=list(teacher.top_logprobs))

    def trained(self, advantages: list[list[float]], returns: list[list[float]]) -> Rollout:
        """A new record with the learner's columns filled (``output.save_rollouts``)."""
        return dataclasses.replace(self, advantages=list(advantages), returns=list(returns))

    def __reduce__(self):
        # Crossing a process boundary (Ray's object store) the rollout travels as an Arrow table.
        return (Rollout.from_arrow, (self.to_arrow(),))

    def select(self, rows: list[int] | range) -> Rollout:
        """A new rollout with the given rows, in that order (empty columns stay empty)."""
        picked = {}
        for f in dataclasses.fields(self):
            column = getattr(self, f.name)
            picked[f.name] = [column[i] for i in rows] if column else []
        return Rollout(**picked)

    def lengths(self) -> tuple[list[int], list[int]]:
        """``(prompt lengths, response lengths)`` of the rows, in tokens."""
        return [len(p) for p in self.prompt_ids], [len(r) for r in self.response_ids]

    def trained_tokens(self) -> list[int]:
        """[B] the tokens of each row the loss counts: its actions (multi-turn), else its response."""
        if self.action_mask:
            return [sum(mask) for mask in self.action_mask]
        return [len(r) for r in self.response_ids]

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """Rows of several rollouts, one after the other. A column one part left empty that another
        filled takes its neutral value there when it has one (plain prompts, no extra fields, the
        row's version on every token); any other such mix is an error."""
        parts = [p for p in parts if len(p)]
        merged: dict[str, list[Any]] = {f.name: [] for f in dataclasses.fields(Rollout)}
        for name, column in merged.items():
            filled = any(getattr(p, name) for p in parts)
            for part in parts:
                values = getattr(part, name)
                if filled and not values:
                    values = _neutral(part, name)
                column.extend(values)
        return Rollout(**merged)

    def versions(self) -> list[list[int]]:
        """[B][T_b] the policy version that sampled each token (``token_versions``, else the row's)."""
        if self.token_versions:
            return self.token_versions
        return [[v] * len(ids) for v, ids in zip(self.policy_version, self.response_ids)]

    def total_rewards(self) -> list[float]:
        """[B] each row's whole reward: r_phi (0 before the reward pass) plus, for an episode, the sum
        of its turn rewards."""
        if not self.turn_rewards:
            return list(self.score)
        return [s + sum(turns) for s, turns in zip(self.score or [0.0] * len(self), self.turn_rewards)]

    # -- the prompt rows, decoded ----------------------------------------------------------------
    def conversations(self) -> list[list[dict[str, Any]] | None]:
        """[B] each row's chat conversation, or None for a plain-text prompt."""
        if not self.prompt_messages:
            return [None] * len(self)
        return [json.loads(text) if text else None for text in self.prompt_messages]

    def row_fields(self) -> list[dict[str, Any]]:
        """[B] each prompt row's other columns (``{}`` when none)."""
        if not self.prompt_fields:
            return [{} for _ in range(len(self))]
        return [json.loads(text) if text else {} for text in self.prompt_fields]

    # -- Arrow / Parquet ---------------------------------------------------------------------
    def to_arrow(self) -> pa.Table:
        """The rollout as an Arrow table with ``ROLLOUT_SCHEMA`` (missing columns are null)."""
        n = len(self)
        columns = {}
        for f in ROLLOUT_SCHEMA:
            values = getattr(self, f.name)
            columns[f.name] = pa.array(values if values else [None] * n, type=f.type)
        return pa.table(columns, schema=ROLLOUT_SCHEMA)

    @staticmethod
    def from_arrow(table: pa.Table) -> Rollout:
        """Inverse of ``to_arrow``; all-null columns, and columns a table written by an older
        rayppo lacks, come back empty."""
        data: dict[str, Any] = {}
        for f in ROLLOUT_SCHEMA:
            if f.name not in table.column_names:
                data[f.name] = []
                continue
            column = table.column(f.name)
            data[f.name] = [] if column.null_count == len(column) else column.to_pylist()
        return Rollout(**data)

    def write_parquet(self, path: str | Path) -> None:
        """Write the rollout (for audit and replay)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(self.to_arrow(), str(path))


@dataclass
class TeacherScores:
    """What a distillation teacher's pass returns for B rows: the ``Rollout.teacher_*`` columns."""

    logprobs: list[list[float]]
    """[B][T_b] log pi_T(y_t | S_{t-1}) of the sampled tokens (0 on an episode's observation tokens)."""
    top_ids: list[list[list[int]]] = field(default_factory=list)
    """[B][T_b][k] the teacher's k most likely tokens per position; empty at ``distill.topk`` = 0."""
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    """[B][T_b][k] their log-probs under the teacher; empty at ``distill.topk`` = 0."""

    @staticmethod
    def concat(parts: list[TeacherScores]) -> TeacherScores:
        """The rows of several passes' shares, one after the other."""
        return TeacherScores([r for p in parts for r in p.logprobs], [r for p in parts for r in p.top_ids],
                             [r for p in parts for r in p.top_logprobs])


ROLLOUT_SCHEMA = pa.schema([pa.field(f.name, f.metadata["arrow"]) for f in dataclasses.fields(Rollout)])
"""The Arrow schema of a rollout: one column per ``Rollout`` field, in the fields' order."""


def _neutral(part: Rollout, name: str) -> list:
    """``part``'s empty column ``name`` as its neutral values (``Rollout.concat``)."""
    if name == "prompt_messages":
        return [""] * len(part)
    if name == "prompt_fields":
        return ["{}"] * len(part)
    if name == "token_versions":
        return part.versions()
    if name == "action_mask":  # a single-turn row: every token an action, one turn
        return [[1] * len(ids) for ids in part.response_ids]
    if name == "turn_ends":
        return [[len(ids) - 1] for ids in part.response_ids]
    if name == "turn_rewards":
        return [[0.0] for _ in part.response_ids]
    if name == "environment_seconds":
        return [0.0] * len(part)
    raise ValueError(f"Rollout.concat: column {name!r} is filled in some parts and empty in others")


def split_evenly(n: int, parts: int) -> list[range]:
    """Contiguous ranges covering 0..n-1, sizes differing by at most one: how a batch's rows (or
    prompts) are shared among actors."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out
