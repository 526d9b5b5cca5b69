"""The PPO update: M epochs x minibatches of the clipped policy loss and the value loss.

``ppo_update`` runs on the ``Experience`` that ``experience.make_experience`` built, calling only
the functions of ``rayppo.learner.ppo``. A rank holds a contiguous shard of the rollout's rows;
``local_minibatches`` gives it its part of each global minibatch with the shares that make the
ranks' averaged gradients the gradient of the global token mean. Before the first optimiser
step the sync check ``logprob_mismatch`` runs (``guard`` stops the update there when it fails):
on the first minibatch when pi_prox is pi_old, else (asynchronous mode, rollout correction: pi_prox
recomputed for every row) on the tokens of the learner's own version (``same_version_mismatch``).
When the update is one pass before one step (``proximal.fused_proximal``), pi_prox is that pass's
own log-probs, detached: ``fill_proximal`` makes what the experience pass left out of them (the
geometric-mean mask and the shares it changes, the off-policy and reference-KL figures, the check)
between the forward and the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rayppo.config.schema import PPOConfig
from rayppo.data.micro_batches import token_batches
from rayppo.learner import ppo
from rayppo.learner.collective import Collective, LocalCollective
from rayppo.learner.experience import Experience
from rayppo.learner.experience_stats import proximal_terms
from rayppo.learner.guard import MismatchGuard
from rayppo.models.packing import cut_layout
from rayppo.models.sequences import critic_forward, policy_forward


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


def local_minibatches(
    plan: list[list[torch.Tensor]], owned: torch.Tensor, lengths: tuple[list[int], list[int]], collective: Collective,
    micro_batch_tokens: int = 0, layout: str = "padded", trained: list[int] | None = None,
    keep: list[float] | None = None,
) -> list[Minibatch]:
    """This rank's part of each planned minibatch, cut into micro-batches of at most
    ``micro_batch_tokens`` tokens as ``layout`` lays a pass out (``data.micro_batches.token_batches``;
    0: one per minibatch); ``owned``: the global rows this rank holds, in local order; ``lengths``:
    (prompt, response) tokens of its rows; ``trained``: the tokens of each row the loss counts
    (``Rollout.trained_tokens``: a multi-turn episode's action tokens; default its response), which
    the token shares weigh; ``keep``: 0.0 for rows the update does not train on
    (``Experience.row_keep``), which then count in neither share. The rows and micro-batches do not
    depend on ``trained`` or ``keep``, only the shares.

    Every rank runs as many micro-batches of a minibatch as the rank with the most (under ZeRO-2/3
    a backward is a collective): one that has fewer, or none of the minibatch's rows, runs
    placeholder passes (row 0, share 0)."""
    prompt, response = lengths
    counted = response if trained is None else trained
    local_of = local_index(owned, sum(len(rows) for rows in plan[0]))
    parts = [_local_rows(rows, local_of) for epoch in plan for rows in epoch]
    cuts = [[mine[torch.tensor(b, dtype=torch.long)] for b in token_batches([prompt[i] for i in mine.tolist()],
             [response[i] for i in mine.tolist()], micro_batch_tokens, layout)] for mine in parts]
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
    answer everywhere: counts are aligned): the experience pass keeps their value forward's graph
    for it (``Experience.first_values``). None when it is cut: each micro-batch runs its own."""
    return minibatches[0][0].rows if len(minibatches[0]) == 1 else None


def policy_objective(
    policy: torch.nn.Module, part: Experience, mb: MicroBatch, cfg: PPOConfig, temperature: float, max_length: int = 0,
    forward: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``(objective, stats, drift)`` of the policy on this rank's part of a minibatch; ``drift``
    [b, T] is log pi - log pi_old per token (0 on padding), the log-prob check of the synchronous
    iteration. With ``part.prox_logprobs`` (asynchronous mode, rollout correction) the policy loss
    is the decoupled one: trust region around pi_prox, tokens weighted by min(pi_prox / mu,
    is_clip), rows outside the geometric-mean band (``part.row_keep``) not trained on. ``max_length``
    is ``rollout.max_new_tokens``, the constant of ``loss_agg=seq-mean-token-sum-norm``. ``forward``:
    ``policy_pass``'s ``(logprobs, entropy)`` [b, T] of these rows when already run."""
    mask = part.trained_mask  # rows the geometric-mean mask dropped are in no term and no metric
    logprobs, entropy = policy_pass(policy, part, cfg, temperature) if forward is None else forward
    if part.prox_logprobs is None or not part.truncated_is:
        pg_loss, pg_stats = ppo.policy_loss(logprobs, part.old_logprobs, part.advantages, mask, clip_eps=cfg.clip_eps,
                                            agg=cfg.loss_agg, clip_eps_high=cfg.clip_eps_high, max_length=max_length)
    else:
        pg_loss, pg_stats = ppo.decoupled_policy_loss(logprobs, part.prox_logprobs, part.old_logprobs, part.advantages,
                                                      mask, is_clip=cfg.is_clip, clip_eps=cfg.clip_eps, agg=cfg.loss_agg,
                                                      clip_eps_high=cfg.clip_eps_high, max_length=max_length)
    entropy_mean = ppo.masked_mean(entropy, mask)  # the figure shown; the bonus is aggregated as the loss is
    entropy_bonus = ppo.aggregate(entropy, mask, cfg.loss_agg, max_length) if cfg.entropy_coef else entropy_mean
    drift = (logprobs.detach() - part.old_logprobs) * part.batch.mask  # the check sees every row
    stats = {f"policy/{k}": v for k, v in pg_stats.items()}
    stats |= {"policy/loss": pg_loss.detach(), "entropy": entropy_mean.detach()}
    if part.loss_kl_coef:  # kl_mode=loss: beta agg(k3), aggregated as the policy loss is
        kl_loss = ppo.aggregate(ppo.kl_penalty(logprobs, part.ref_logprobs, "k3"), mask, cfg.loss_agg, max_length)
        pg_loss = pg_loss + part.loss_kl_coef * kl_loss
        stats["policy/kl_loss"] = kl_loss.detach()
    # token-mean weighs the minibatch's tokens; the two sequence aggregations weigh its rows.
    pg_share = mb.token_share if cfg.loss_agg == "token-mean" else mb.row_share
    return pg_share * (pg_loss - cfg.entropy_coef * entropy_bonus), stats, drift


def policy_pass(policy: torch.nn.Module, part: Experience, cfg: PPOConfig,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` [b, T] of the policy on ``part``'s rows, with their graph (the
    entropy's only when its bonus is trained)."""
    logprobs, entropy = policy_forward(policy, part.batch, temperature, with_entropy=True,
                                       entropy_grad=cfg.entropy_coef != 0)
    assert entropy is not None  # asked for (with_entropy=True)
    return logprobs, entropy


def value_objective(critic: torch.nn.Module, part: Experience, mb: MicroBatch, cfg: PPOConfig,
                    values: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(objective, stats)`` of the critic on this rank's part of a minibatch; ``values`` [b, T]
    is its forward when already done (the experience pass's, ``Experience.first_values``)."""
    if values is None:
        values, _ = critic_forward(critic, part.batch)
    vf_loss = ppo.value_loss(values, part.old_values, part.returns, part.trained_mask, cfg.value_clip)
    return mb.token_share * cfg.vf_coef * vf_loss, {"value/loss": vf_loss.detach()}


ROW_AGGREGATED = ("policy/loss", "policy/kl_loss")
"""Stats reduced by ``ppo.loss_agg``: under a sequence aggregation a rank's value is a mean over its
rows, so ranks are weighed by rows (the other stats are token means, weighed by tokens)."""


@dataclass
class Steps:
    """How policy and critic learn from a minibatch: torch optimisers or DeepSpeed engines.

    The policy's backward runs before the critic's forward, so the two models' activations are
    never alive at once (the peak is one model's, not both)."""

    policy_backward: Callable[[torch.Tensor], None]
    """Gradients of the policy objective (accumulated until ``step``)."""
    critic_backward: Callable[[torch.Tensor], None] | None
    """Gradients of the value objective; None without a critic."""
    step: Callable[[], None]
    """One optimiser step of both models (gradient clipping included), then zeroed gradients."""


def ppo_update(
    policy: torch.nn.Module,
    critic: torch.nn.Module | None,
    exp: Experience,
    minibatches: list[Minibatch],
    cfg: PPOConfig,
    temperature: float,
    steps: Steps,
    collective: Collective = LocalCollective(),
    guard: MismatchGuard | None = None,
    max_length: int = 0,
    fused: InUpdateProximal | None = None,
) -> dict[str, float]:
    """M epochs x minibatches of clipped PPO + value loss (none when ``critic`` is None: a
    critic-free estimator); returns stats averaged over ranks. ``max_length``: ``rollout.max_new_tokens``.

    Each minibatch's micro-batches accumulate their gradients into one optimiser step; their
    shares make that the gradient of the global minibatch (token-mean and row-mean alike). The first
    minibatch runs before any weight change, so its log-probs against the generator's old log-probs
    are the sync check ``logprob_mismatch``; ``guard`` stops the update there, before the first
    step, when the check fails. In asynchronous mode and under rollout correction (``exp.prox_logprobs``
    set: pi_prox was recomputed for every row) the check is
    ``same_version_mismatch``'s instead, also before the first step. With ``fused``
    (``proximal.fused_proximal``: one minibatch of one micro-batch) pi_prox is the update's own
    forward: ``exp``'s pi_prox part is filled in from it (``fill_proximal``), then the loss.
    """
    weighted: dict[str, torch.Tensor] = {}
    # pi_prox recomputed for every row (asynchronous mode, or rollout correction in a synchronous
    # bf16 run), or the update's own: the check compares mu with it, not with the first minibatch's log-probs.
    prox_recomputed = exp.prox_logprobs is not None or fused is not None
    # The check's figures (fused: with those of pi_prox the experience pass left out).
    mismatch = same_version_mismatch(exp, collective, guard) if exp.prox_logprobs is not None else {}
    if fused is not None and (len(minibatches), len(minibatches[0])) != (1, 1):
        raise ValueError(f"pi_prox from the update's forward needs one pass: {len(minibatches)} minibatches")
    drifts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # the first minibatch's (drift, mask, generator)
    first = torch.zeros(2, dtype=torch.float64, device=exp.batch.mask.device)  # its share-weighted mean |d| and k3
    processed, real = 0, torch.zeros((), dtype=torch.float64, device=exp.batch.mask.device)  # the policy's passes
    for i, micro_batches in enumerate(minibatches):
        for mb in micro_batches:
            # The first minibatch's value forward is the experience pass's (kept graph) when it is one
            # micro-batch: its backward goes first, which frees that graph before the policy's forward.
            part = exp.micro(mb.rows)
            kept = exp.first_values[:, : part.batch.mask.shape[1]] if i == 0 and exp.first_values is not None else None
            processed += part.batch.processed_tokens  # padding included; real tokens stay on the device (no sync)
            real = real + part.batch.attention_mask.sum()
            value_stats = None if kept is None or critic is None else _critic_backward(critic, part, mb, cfg, steps, kept)
            forward = policy_pass(policy, part, cfg, temperature)
            if fused is not None:  # the only pass, before any step: its log-probs are pi_prox's
                mb, mismatch = fill_proximal(exp, mb, forward[0], cfg, fused, collective, guard)
                part = exp.micro(mb.rows)
            objective, stats, drift = policy_objective(policy, part, mb, cfg, temperature, max_length, forward)
            if i == 0 and not prox_recomputed:
                width = exp.batch.mask.shape[1]  # micro-batches are cut to their own widths: pad back to one
                drifts.append((_widen(drift, width), _widen(part.batch.mask, width), part.generator_ids))
                token_means = [ppo.masked_mean(x, part.batch.mask) for x in (drift.abs(), _k3(drift))]
                first = first + torch.stack(token_means).double() * mb.token_share
            steps.policy_backward(objective)
            if critic is not None:
                stats |= value_stats or _critic_backward(critic, part, mb, cfg, steps)
            for key, value in stats.items():  # each stat averaged with the weights of its own aggregation
                share = mb.row_share if key in ROW_AGGREGATED and cfg.loss_agg != "token-mean" else mb.token_share
                weighted[key] = weighted.get(key, 0.0) + value.double() * share
        if i == 0 and not prox_recomputed and guard is not None:
            drift, mask, generators = (torch.cat(column) for column in zip(*drifts))
            guard.check(drift, generators, collective, mask)
        steps.step()
    keys = list(weighted)
    stacked = torch.cat([torch.stack([weighted[k] for k in keys]), first if drifts else first[:0]])
    summed = collective.sum(torch.cat([stacked, stacked.new_tensor([float(processed)]), real.to(stacked)[None]]))
    denominator = collective.world_size * len(minibatches)
    out = {k: float(summed[i] / denominator) for i, k in enumerate(keys)}
    # Every rank's passes over the whole update (all epochs): what padding costs the learner.
    out["tokens/learn_processed"], out["tokens/learn_real"] = float(summed[-2]), float(summed[-1])
    out["tokens/learn_packed"] = float(cut_layout(exp.batch.pack_mode) == "packed")
    out["tokens/learn_right_padded"] = float(exp.batch.pack_mode == "right_padded")
    summed = summed[:-2]
    if prox_recomputed:
        return out | mismatch
    out["logprob_mismatch/mean"] = float(summed[-2] / collective.world_size)
    out["logprob_mismatch/kl"] = float(summed[-1] / collective.world_size)
    out["logprob_mismatch/max"] = float(collective.max(torch.cat([d.abs().amax()[None] for d, _, _ in drifts]).max().double()))
    return out


@dataclass(frozen=True)
class InUpdateProximal:
    """pi_prox from the update's one forward (``proximal.fused_proximal``): what ``fill_proximal``
    needs to make the part of the experience that ``make_experience(fused=True)`` left out."""

    geo_mask: bool
    """Rollout correction's geometric-mean mask is on (``Correction.geo_mask``)."""
    has_reference: bool
    """A reference was loaded: ``kl/ref_mean`` is KL(pi_prox || pi_ref)."""
    reshare: Callable[[list[float]], list[Minibatch]]
    """The step's ``local_minibatches`` with ``keep``: the same rows, shares without the dropped rows."""


def fill_proximal(exp: Experience, mb: MicroBatch, logprobs: torch.Tensor, cfg: PPOConfig, fused: InUpdateProximal,
                  collective: Collective, guard: MismatchGuard | None) -> tuple[MicroBatch, dict[str, float]]:
    """Sets ``exp.prox_logprobs`` [B, T] to ``logprobs`` [b, t] (the update's forward of ``mb.rows``:
    every row of this rank, weights not moved yet), detached, in ``exp``'s row order, and what the
    experience pass derives from it (``proximal_terms``: ``row_keep``, ``kl_ref``; without a reference
    ``ref_logprobs`` is the policy's own, as there); runs the mismatch check (``guard``). Returns
    ``mb`` with the shares of the kept rows, and the figures the separate pass would have given.
    Collective: every rank calls it."""
    if sorted(mb.rows.tolist()) != list(range(exp.batch.mask.shape[0])):
        raise ValueError("pi_prox from the update's forward needs this rank's every row in its one pass")
    prox = logprobs.detach().new_zeros(exp.batch.mask.shape)  # 0 on padding, as proximal_logprobs gives
    prox[mb.rows, : logprobs.shape[1]] = logprobs.detach()
    exp.prox_logprobs = prox
    if not fused.has_reference:
        exp.ref_logprobs = prox
    terms = proximal_terms(prox, exp.old_logprobs, exp.ref_logprobs if fused.has_reference else None,
                           exp.batch.mask, cfg, fused.geo_mask, True, collective)
    exp.row_keep, exp.kl_ref = terms.row_keep, None if terms.kl is None else terms.kl.mean
    stats = terms.stats | same_version_mismatch(exp, collective, guard)
    if terms.row_keep is not None:  # the dropped rows count in no share: the same rows, new shares
        mb = fused.reshare(terms.row_keep.tolist())[0][0]
    return mb, stats


def _critic_backward(critic: torch.nn.Module, part: Experience, mb: MicroBatch, cfg: PPOConfig, steps: Steps,
                     values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    if steps.critic_backward is None:
        raise ValueError("a critic's objective needs Steps.critic_backward")
    objective, stats = value_objective(critic, part, mb, cfg, values)
    steps.critic_backward(objective)
    return stats


def _k3(drift: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - 1 - d per token, d = log pi - log mu: the guard's estimate of KL(mu || pi)
    (``MismatchGuard``), ``ppo.kl_penalty``'s k3 with mu in the place of the policy."""
    return ppo.kl_penalty(torch.zeros_like(drift), drift, "k3")


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[b, t]`` zero-padded on the right to ``[b, width]``."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def same_version_mismatch(exp: Experience, collective: Collective, guard: MismatchGuard | None) -> dict[str, float]:
    """``logprob_mismatch/mean|max|kl|rows`` of asynchronous mode and rollout correction, checked by ``guard``.

    mu = pi_prox only on the tokens sampled by the learner's own version (``exp.same_version``):
    there |log mu - log pi_prox| is rounding, elsewhere it is staleness (``async/staleness_*``
    measures that), so the other tokens enter with gap 0 and never trip the guard. Call before the
    first optimiser step. Collective: every rank calls it, with or without such rows. Mean and max
    are over the compared tokens of all ranks (NaN when no rank compared any); rows counts the
    rows with a compared token.
    """
    if exp.prox_logprobs is None or exp.same_version is None:
        raise ValueError("same_version_mismatch compares pi_prox with mu: the experience has no prox_logprobs")
    mask = exp.batch.mask * exp.same_version.to(exp.batch.mask.dtype)
    drift = (exp.prox_logprobs - exp.old_logprobs) * mask
    gap = drift.abs()
    if guard is not None:
        guard.check(drift, exp.generator_ids, collective, mask)
    local = torch.stack([mask.double().sum(), gap.double().sum(), (mask.sum(-1) > 0).double().sum(),
                         (_k3(drift) * mask).double().sum()])
    tokens, gap_sum, rows, k3_sum = collective.sum(local).tolist()
    # gap >= 0 and is 0 off the compared tokens, so a rank that compared none adds a harmless 0.
    worst = float(collective.max(gap.max().double()))
    return {"logprob_mismatch/mean": gap_sum / tokens if tokens else math.nan,
            "logprob_mismatch/kl": k3_sum / tokens if tokens else math.nan,
            "logprob_mismatch/max": worst if tokens else math.nan,
            "logprob_mismatch/rows": rows}
