"""DAPO's dynamic sampling (Yu et al. 2025): a group whose rewards are all equal has every group
advantage 0, so it teaches nothing but still costs its share of the batch. With
``rollout.dynamic_sampling_rounds`` = R > 0 such groups are dropped and up to R extra batches of
prompts are sampled (and rewarded) until ``rollout.batch_size`` informative groups are in hand;
the batch is then cut to that many groups. Only the kept rows go on to the reference pass and the
learner. Both trainers' synchronous iteration call ``fill_batch``; the metrics say what it took."""

from __future__ import annotations

from collections.abc import Callable

from rayppo.data.rollout import Rollout


def informative_groups(rollout: Rollout) -> list[int]:
    """The group ids whose rows' scores are not all equal, in order of first appearance."""
    scores: dict[int, set[float]] = {}
    for g, score in zip(rollout.group_id, rollout.total_rewards()):
        scores.setdefault(g, set()).add(score)
    return [g for g, values in scores.items() if len(values) > 1]


def rows_of(rollout: Rollout, groups: list[int]) -> Rollout:
    """The rows of ``groups`` (in the rollout's order), their group ids renumbered 0, 1, ... in
    the order given: the learner's group statistics index groups below the batch's row count."""
    index = {g: i for i, g in enumerate(groups)}
    rows = [i for i, g in enumerate(rollout.group_id) if g in index]
    kept = rollout.select(rows)
    kept.group_id = [index[g] for g in kept.group_id]
    return kept


def fill_batch(first: Rollout, draw: Callable[[int], Rollout], wanted: int, max_rounds: int
               ) -> tuple[Rollout, dict[str, float]]:
    """``(batch, stats)``: the informative groups of ``first`` and of up to ``max_rounds`` more
    draws (``draw(k)`` samples and scores round k = 1, 2, ...), cut to ``wanted`` groups. When no
    group of any round is informative the first batch is kept whole (its group advantages are 0;
    the KL term still trains). ``stats``: ``dynamic/rounds`` (extra draws), ``dynamic/dropped_groups``
    (all-equal groups seen), ``dynamic/kept_groups``."""
    parts: list[Rollout] = [first]
    kept: list[tuple[int, int]] = []  # (round, group id within that round's batch)
    dropped = 0
    while True:
        good = informative_groups(parts[-1])
        dropped += len(set(parts[-1].group_id)) - len(good)
        kept += [(len(parts) - 1, g) for g in good]
        if len(kept) >= wanted or len(parts) > max_rounds:
            break
        parts.append(draw(len(parts)))
    rounds = len(parts) - 1
    stats = {"dynamic/rounds": float(rounds), "dynamic/dropped_groups": float(dropped)}
    if not kept:
        return first, stats | {"dynamic/kept_groups": 0.0}
    kept = kept[:wanted]
    batches, shift = [], 0
    for r, part in enumerate(parts):  # group ids continue across the rounds: 0..wanted-1 in all
        batch = rows_of(part, [g for k, g in kept if k == r])
        batch.group_id = [g + shift for g in batch.group_id]
        shift += len({g for k, g in kept if k == r})
        batches.append(batch)
    return Rollout.concat(batches), stats | {"dynamic/kept_groups": float(len(kept))}
