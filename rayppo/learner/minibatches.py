"""Which rows each pass of the update trains, and how much each counts.

``minibatch_plan`` shuffles the batch's rows into M epochs x minibatches, the same on every rank
and for every rank count; ``local_minibatches`` gives a rank its part of each minibatch, cut into
micro-batches by a token budget, with the shares that make the ranks' averaged, accumulated
gradients the gradient of the global minibatch's token (or row) mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayppo.data.micro_batches import token_batches
from rayppo.learner.collective import Collective


@dataclass
class MicroBatch:
    """This rank's rows of one forward/backward pass of a global minibatch."""

    rows: torch.Tensor
    """Local row indices into this rank's experience."""
    token_share: float
    """N x (these rows' valid tokens) / (the global minibatch's tokens): rescales a token mean
    over these rows so that the micro-batches' accumulated, ranks' averaged gradients are the
    gradient of the global minibatch's token mean."""
    row_share: float
    """The same for rows (used by the sequence aggregations of ``ppo.loss_agg``)."""


Minibatch = list[MicroBatch]
"""This rank's part of one global minibatch: its micro-batches, whose gradients accumulate into
one optimiser step (one micro-batch when ``learner.micro_batch_tokens`` is 0 or the part fits)."""


def minibatch_plan(n_rows: int, epochs: int, minibatches: int, seed: int,
                   sources: Sequence[int] = ()) -> list[list[torch.Tensor]]:
    """Global row indices of every minibatch of every epoch: a fresh seeded shuffle per epoch, the
    first minibatch then given a row of every generator in ``sources`` (``[n_rows]``, each row's
    generator; ``every_source_first``).

    The plan depends only on the batch, never on the rank count.
    """
    generator = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(n_rows, generator=generator) for _ in range(epochs)]
    if sources and orders:
        orders[0] = every_source_first(orders[0], -(-n_rows // minibatches), sources)
    return [list(order.chunk(minibatches)) for order in orders]


def every_source_first(order: torch.Tensor, head: int, sources: Sequence[int]) -> torch.Tensor:
    """``order`` with rows swapped so that its first ``head`` rows hold at least one row of every
    generator in ``sources`` (while there are no more generators than ``head``).

    Why: the first minibatch is the only one trained before the weights move, so it is where the
    guard compares the learner's log-probs with the generators' (``MismatchGuard``, when pi_prox is
    pi_old); a generator with no row there went unchecked that iteration (a third of
    generator-iterations at 8 generators x 8 minibatches). For each missing generator in turn, its
    first row after the head swaps places with the last head row of a generator that has two or
    more there: deterministic (every rank and the driver get the same plan), and a plan whose first
    minibatch already sees every generator is left as it was.
    """
    order = order.clone()
    where: dict[int, list[int]] = {}
    for pos in range(min(head, len(order))):
        where.setdefault(sources[int(order[pos])], []).append(pos)
    for missing in sorted(set(sources) - set(where)):
        spare = [g for g in where if len(where[g]) > 1]
        if not spare:
            break
        donor = max(spare, key=lambda g: where[g][-1])
        into = where[donor].pop()
        out = next(pos for pos in range(head, len(order)) if sources[int(order[pos])] == missing)
        order[into], order[out] = order[out].clone(), order[into].clone()
        where[missing] = [into]
    return order


def _local_rows(rows: torch.Tensor, local_of: torch.Tensor) -> torch.Tensor:
    """The rows among global ``rows`` that this rank owns, as local indices (``local_of``: the
    local index of every global row, -1 where another rank owns it)."""
    local = local_of[rows]
    return local[local >= 0]


def local_index(owned: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``[n_rows]`` long: the local index of each global row this rank owns (``owned``, in local
    order), -1 elsewhere."""
    local_of = torch.full((n_rows,), -1, dtype=torch.long)
    local_of[owned] = torch.arange(len(owned))
    return local_of


PLACEHOLDER_ROW = torch.zeros(1, dtype=torch.long)
"""What a rank runs for a pass it owns no row of: its row 0, with share 0."""


@dataclass(frozen=True)
class ShardPlan:
    """This rank's view of the step's minibatch plan: what ``local_minibatches`` cuts and weighs."""

    plan: list[list[torch.Tensor]]
    """Global row indices of every minibatch of every epoch (``minibatch_plan``)."""
    owned: torch.Tensor
    """The global rows this rank holds, in local order."""
    lengths: tuple[list[int], list[int]]
    """(prompt, response) tokens of its rows."""
    trained: list[int] | None = None
    """The tokens of each of its rows the loss counts (``Rollout.trained_tokens``: a multi-turn
    episode's action tokens), which the token shares weigh; None: the response's."""
    micro_batch_tokens: int = 0
    """The most tokens of a micro-batch (``learner.micro_batch_tokens``; 0: one per minibatch)."""
    layout: str = "padded"
    """How a pass lays its rows out (``models.packing.cut_layout``): what the budget counts."""


def local_minibatches(shard: ShardPlan, collective: Collective, keep: list[float] | None = None) -> list[Minibatch]:
    """This rank's part of each planned minibatch, cut into micro-batches of at most
    ``shard.micro_batch_tokens`` tokens as ``shard.layout`` lays a pass out
    (``data.micro_batches.token_batches``); ``keep``: 0.0 for rows the update does not train on
    (``Experience.row_keep``), which then count in neither share. The rows and micro-batches do not
    depend on ``shard.trained`` or ``keep``, only the shares.

    Every rank runs as many micro-batches of a minibatch as the rank with the most (under ZeRO-2/3
    a backward is a collective): one that has fewer, or none of the minibatch's rows, runs
    placeholder passes (row 0, share 0)."""
    prompt, response = shard.lengths
    counted = response if shard.trained is None else shard.trained
    local_of = local_index(shard.owned, sum(len(rows) for rows in shard.plan[0]))
    parts = [_local_rows(rows, local_of) for epoch in shard.plan for rows in epoch]
    cuts = [[mine[torch.tensor(b, dtype=torch.long)] for b in token_batches([prompt[i] for i in mine.tolist()],
             [response[i] for i in mine.tolist()], shard.micro_batch_tokens, shard.layout)] for mine in parts]
    counts = collective.max(torch.tensor([float(max(len(c), 1)) for c in cuts], dtype=torch.float64))
    weight = [1.0] * len(counted) if keep is None else keep
    local = torch.tensor([[sum(counted[i] * weight[i] for i in m.tolist()), sum(weight[i] for i in m.tolist())]
                          for m in parts], dtype=torch.float64)
    total = collective.sum(local.clone())
    w = collective.world_size
    out = []
    for cut, count, (all_tokens, all_rows) in zip(cuts, counts.tolist(), total.tolist()):
        micro = [MicroBatch(rows, w * sum(counted[i] * weight[i] for i in rows.tolist()) / max(all_tokens, 1.0),
                            w * sum(weight[i] for i in rows.tolist()) / max(all_rows, 1.0)) for rows in cut]
        out.append(micro + [MicroBatch(PLACEHOLDER_ROW, 0.0, 0.0)] * (int(count) - len(micro)))
    return out


def first_rows_kept(minibatches: list[Minibatch]) -> torch.Tensor | None:
    """This rank's rows of the first minibatch when it is one micro-batch on every rank (the same
    answer everywhere: counts are aligned): the experience pass can keep their value forward's
    graph for it (``UpdatePlan.first_rows``). None when it is cut: each micro-batch runs its own."""
    return minibatches[0][0].rows if len(minibatches[0]) == 1 else None
