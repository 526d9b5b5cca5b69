"""The experience pass's forwards: the critic's values and log pi_prox, in aligned passes.

Both run over every row of this rank before the update, in micro-batches of
``learner.micro_batch_tokens`` padded tokens (``forward_batches``), or in ``ppo.minibatches`` runs
of consecutive rows without a budget, so that they take one minibatch's memory as the update's own
passes do. Every rank runs as many passes as the rank with the most (``batched_forward``): under
ZeRO-3 a forward is a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rayppo.data.micro_batches import token_batches
from rayppo.learner.collective import Collective, LocalCollective
from rayppo.models.packing import cut_layout
from rayppo.models.sequences import PackedBatch, critic_forward, policy_forward


@dataclass(frozen=True)
class ProximalPolicy:
    """pi_prox of asynchronous mode: the learner's policy as it is at the start of the update."""

    module: torch.nn.Module
    """The policy being trained (only read here)."""
    temperature: float
    """The sampling temperature: log-probs are log_softmax(logits / T), as the generator's."""
    version: int
    """The policy version these weights are: rows of this version have mu = pi_prox."""


def forward_batches(batch: PackedBatch, budget: int, chunks: int) -> list[torch.Tensor]:
    """Row indices of the forward passes over ``batch``: micro-batches of at most ``budget`` padded
    tokens (``data.micro_batches.token_batches``; real tokens when the batch packs its passes), or with ``budget`` 0 ``chunks`` runs of consecutive
    rows (the unbucketed passes)."""
    if budget > 0:
        return [torch.tensor(rows, dtype=torch.long)
                for rows in token_batches(*batch.lengths(), budget, cut_layout(batch.pack_mode))]
    return list(torch.arange(batch.mask.shape[0]).tensor_split(chunks))  # an empty run: a placeholder pass


def batched_forward(
    fn: Callable[[PackedBatch], tuple[torch.Tensor, ...]], batch: PackedBatch, passes: list[torch.Tensor],
    collective: Collective, trim: bool,
) -> list[torch.Tensor]:
    """``fn`` over ``batch`` one pass of rows at a time (with ``trim``, each cut to its own widths,
    ``PackedBatch.trimmed``; else at the batch's widths, as the unbucketed passes are), its outputs
    (``[b, T_b]`` or ``[b]`` tensors) put back in place as ``[B, T]`` (0 past a row's pass) or ``[B]``.

    Every rank runs as many passes as the rank with the most: under ZeRO-3 a forward is a
    collective, so a rank with fewer (or an empty pass) runs placeholder passes (its row 0) and
    discards them.
    """
    count = int(collective.max(torch.tensor(float(len(passes)), dtype=torch.float64)))
    cut = PackedBatch.trimmed if trim else (lambda b: b)
    out: list[torch.Tensor] = []
    for i in range(count):
        if i >= len(passes) or len(passes[i]) == 0:
            fn(cut(batch.rows(slice(0, 1))))  # keeps this rank in step with the others' gathers
            continue
        results = fn(cut(batch.rows(passes[i])))
        if not out:
            out = [r.new_zeros(batch.mask.shape if r.dim() == 2 else batch.mask.shape[:1]) for r in results]
        for whole, part in zip(out, results):
            if part.dim() == 2:
                whole[passes[i], : part.shape[1]] = part
            else:
                whole[passes[i]] = part
    return out


def proximal_logprobs(proximal: ProximalPolicy, batch: PackedBatch, chunks: int, budget: int = 0,
                      collective: Collective | None = None) -> torch.Tensor:
    """``[B, T]`` log pi_prox(y_t | S_{t-1}) of the response tokens (0 on padding), no gradient.

    In micro-batches of ``budget`` padded tokens, or with ``budget`` 0 in ``chunks`` forward passes of
    consecutive rows, so that the logits take one minibatch's memory as in ``ppo_update``. ``chunks``
    must be the same on every rank (``ppo.minibatches``); the pass counts are aligned across ranks
    (``batched_forward``).
    """
    with torch.no_grad():
        (out,) = batched_forward(lambda b: policy_forward(proximal.module, b, proximal.temperature)[:1], batch,
                                 forward_batches(batch, budget, chunks), collective or LocalCollective(), budget > 0)
    return out


class CriticValues(NamedTuple):
    """The critic's forward over this rank's rows, before the update."""

    values: torch.Tensor
    """[B, T] V(S_{t-1}), no graph (0 without a critic)."""
    last_values: torch.Tensor
    """[B] V(S_T), the bootstrap of a row cut at the length limit."""
    first_values: torch.Tensor | None
    """[b, T] V(S_{t-1}) of the first minibatch's rows (``UpdatePlan.first_rows``), in that order,
    *with* the autograd graph: the critic's weights have not moved yet, so this is that minibatch's
    value forward, which the update takes instead of running its own (its backward frees the
    graph). None: no rows were given, or no critic."""


def critic_values(critic: torch.nn.Module | None, batch: PackedBatch, first_rows: torch.Tensor | None, budget: int,
                  collective: Collective) -> CriticValues:
    """The experience pass's values (``CriticValues``).

    With ``first_rows`` the other rows go first without gradient, then those rows with it (the
    last forward before that graph's backward, as DeepSpeed expects); the graph is kept in
    ``first_values`` so the first minibatch needs no value forward of its own. The rows without
    gradient run in micro-batches of ``budget`` padded tokens (0: one pass). Without a critic
    (a critic-free estimator) the values are 0 and nothing runs."""
    if critic is None:
        return CriticValues(torch.zeros_like(batch.mask), torch.zeros_like(batch.mask[:, 0]), None)
    rest = torch.ones(batch.mask.shape[0], dtype=torch.bool, device=batch.mask.device)
    if first_rows is not None:
        rest[first_rows] = False
    # Every rank runs the passes of the rest (under ZeRO-3 a forward is a collective): a rank whose
    # rows are all in the first minibatch runs a placeholder row and discards it.
    others = batch.rows(rest if rest.any() else slice(0, 1))
    values, last_values = batched_forward(lambda b: critic_forward(critic, b), others,
                                          forward_batches(others, budget, 1), collective, budget > 0)
    if first_rows is None:
        return CriticValues(values, last_values, None)
    with torch.enable_grad():  # at the rows' own widths (and packed, by pack_mode), as the update's pass would be
        first_values, first_last = critic_forward(critic, batch.rows(first_rows).trimmed())
        first_values = torch.nn.functional.pad(first_values, (0, batch.mask.shape[1] - first_values.shape[1]))
    all_values, all_last = first_values.new_zeros(batch.mask.shape), first_last.new_zeros(batch.mask.shape[0])
    if rest.any():
        all_values[rest], all_last[rest] = values, last_values
    all_values[first_rows], all_last[first_rows] = first_values.detach(), first_last.detach()
    return CriticValues(all_values, all_last, first_values)
