"""Partial rollouts (``rollout.partial_tokens``): the bookkeeping of responses that span generator calls.

In asynchronous mode a generator call samples at most ``partial_tokens`` tokens of each response;
a response cut by that budget (finish reason ``partial``) waits in its generator's *carry* and
is continued by the next call, with the weights the generator holds then. A batch trains the
groups whose every row has finished; the finished rows of an unfinished group wait with it. So a
row may hold tokens of several policy versions (``Rollout.token_versions``), and its
``policy_version`` is that of its first, oldest, token: the staleness window applies to that one.

The carry lives on the driver, so a generator that dies mid-continuation loses nothing: its
replacement is handed the same rows. Checkpoints save it (``carry_to_json``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rayppo.data.rollout import Rollout

PARTIAL = "partial"
"""The finish reason of a response the call's token budget cut before it ended."""


def unfinished(rollout: Rollout) -> list[int]:
    """Rows still to be continued (finish reason ``partial``)."""
    return [i for i, reason in enumerate(rollout.finish_reason) if reason == PARTIAL]


def split_finished_groups(rollout: Rollout) -> tuple[Rollout, Rollout]:
    """``(ready, waiting)``: the rows of groups that have all finished, and the rest (every row of a
    group with an unfinished member), each in the rollout's order."""
    open_groups = {rollout.group_id[i] for i in unfinished(rollout)}
    ready = [i for i, g in enumerate(rollout.group_id) if g not in open_groups]
    waiting = [i for i, g in enumerate(rollout.group_id) if g in open_groups]
    return rollout.select(ready), rollout.select(waiting)


def with_unique_groups(group_ids: list[int], batch: int, stride: int) -> list[int]:
    """Batch ``batch``'s group ids made unique across batches (``batch * stride + id``, ``stride``
    above every id of a batch): a group carried into a later batch keeps an id of its own."""
    return [batch * stride + g for g in group_ids]


def renumber_groups(rollout: Rollout) -> Rollout:
    """The rollout with its group ids renumbered 0..G-1 in ascending order of the old ids (what the
    learner's group statistics index with)."""
    index = {g: i for i, g in enumerate(sorted(set(rollout.group_id)))}
    return dataclasses.replace(rollout, group_id=[index[g] for g in rollout.group_id])


def oldest_versions(rollout: Rollout) -> list[int]:
    """[B] the version of each row's oldest token (its ``policy_version`` when none are recorded)."""
    if not rollout.token_versions:
        return list(rollout.policy_version)
    return [min(v) if v else p for v, p in zip(rollout.token_versions, rollout.policy_version)]


def deal(rollout: Rollout, parts: int) -> list[Rollout]:
    """The rows as ``parts`` carries, whole groups dealt round-robin in order of their ids (a
    resumed run with another generator count still continues every row once)."""
    groups = sorted(set(rollout.group_id))
    owner = {g: i % parts for i, g in enumerate(groups)}
    return [rollout.select([r for r, g in enumerate(rollout.group_id) if owner[g] == p]) for p in range(parts)]


def carry_to_json(carries: list[Rollout]) -> dict[str, list[Any]]:
    """Every generator's carry as one JSON-able table of columns (the checkpoint's ``partial_rows``).
    Python floats print their shortest exact form, so the float32 log-probs come back bit for bit."""
    return dataclasses.asdict(Rollout.concat(carries))


def carry_from_json(columns: dict[str, list[Any]] | None, parts: int) -> list[Rollout]:
    """Inverse of ``carry_to_json``, dealt to ``parts`` generators; None (no partial rows saved): empty carries."""
    if not columns:
        return [Rollout.concat([]) for _ in range(parts)]
    names = {f.name for f in dataclasses.fields(Rollout)}
    unknown = sorted(set(columns) - names)
    if unknown:
        raise ValueError(f"partial_rows: unknown columns {unknown}")
    return deal(Rollout(**{name: columns.get(name, []) for name in names}), parts)


def carried_by(carry: list[Rollout], fleet: list[int]) -> list[Rollout]:
    """Each generator's partial-rollout carry, those of generators outside ``fleet`` moved to the
    first one in it (their rows continue there: no row is lost)."""
    away = [c for g, c in enumerate(carry) if g not in fleet and len(c)]
    if not away:
        return carry
    carry = [c if g in fleet else c.select([]) for g, c in enumerate(carry)]
    carry[fleet[0]] = Rollout.concat([carry[fleet[0]], *away])
    return carry
