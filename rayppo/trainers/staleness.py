"""The staleness rules of the asynchronous pipeline (``pipeline.py``): how far a generator may
sample ahead of the learner, which rows are too old to train on, and how stale a batch was.

A row sampled with policy version w and trained at version v is v - w versions stale; the
pipeline keeps it within ``rollout.max_staleness`` = k (docs/async.md).
"""

from __future__ import annotations

from rayppo.data.partial_rollouts import oldest_versions, renumber_groups
from rayppo.data.rollout import Rollout


def drop_stale(rollout: Rollout, version: int, max_staleness: int) -> tuple[Rollout, int]:
    """``(rows at most max_staleness versions behind version, rows dropped)``. A row's lag is its
    oldest token's (partial rollouts continue a row with newer weights); a group goes whole, so a
    group estimator never sees part of one, and the groups left are numbered 0..G'-1 again: the
    learner sizes its group tables by the rows it trains on."""
    oldest = oldest_versions(rollout)
    stale = {i for i, v in enumerate(oldest) if version - v > max_staleness}
    if rollout.group_id:
        stale_groups = {rollout.group_id[i] for i in stale}
        stale = {i for i, g in enumerate(rollout.group_id) if g in stale_groups}
    keep = [i for i in range(len(rollout)) if i not in stale]
    if len(keep) == len(rollout):
        return rollout, 0
    kept = rollout.select(keep)
    return (renumber_groups(kept) if kept.group_id else kept), len(rollout) - len(keep)


def staleness_stats(rollout: Rollout, version: int) -> dict[str, float]:
    """``async/staleness_mean|max``: versions between each row's (oldest token's) sampler and the
    learner; ``async/token_staleness_mean``: the same per token."""
    lags = [version - v for v in oldest_versions(rollout)] or [0]
    token_lags = [version - v for row in rollout.versions() for v in row] or [0]
    return {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags)),
            "async/token_staleness_mean": sum(token_lags) / len(token_lags)}


def generator_lead(max_staleness: int, partial_tokens: int, max_new_tokens: int) -> int:
    """How many batches a generator may sample ahead of the learner's published version.

    k without partial rollouts. With them a response spans up to R = ceil(max_new_tokens /
    partial_tokens) calls, one per batch, so a row started with version w >= b - lead in batch b
    is trained by version <= b + R - 1: lead = k - (R - 1) keeps every row within the window
    (none dropped), and the lead stays at least 1 (with k < R the longest rows may be dropped,
    counted in ``async/dropped_rows``)."""
    if not partial_tokens:
        return max_staleness
    calls = -(-max_new_tokens // partial_tokens)
    return max(1, max_staleness - (calls - 1))
