"""The PPO update: M epochs x minibatches of the clipped policy loss and the value loss.

``ppo_update`` runs on the ``Experience`` that ``experience.make_experience`` built, the passes
``minibatches.local_minibatches`` cut, and the step's ``UpdatePlan``; the loss of each pass is
``objectives``'. Each minibatch's micro-batches accumulate their gradients into one optimiser step.
Before the first step the sync check ``logprob_mismatch`` runs (the plan's ``guard`` stops the
update there when it fails): on the first minibatch's log-probs where pi_prox is pi_old, else
(asynchronous mode, rollout correction: pi_prox recomputed for every row) on the tokens of the
learner's own version (``same_version_mismatch``).

Where pi_prox is the update's own forward (``UpdatePlan.proximal == "update"``: one pass before one
step, ``proximal.fused_proximal``) the update is ``one_forward_update``: between the forward and the
loss it makes a new, completed experience from that forward's log-probs, detached (the
geometric-mean mask and the shares it changes, the off-policy and reference-KL figures, the check).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rayppo.learner import ppo
from rayppo.learner.collective import Collective
from rayppo.learner.experience import Experience
from rayppo.learner.experience_stats import PolicyTokens, proximal_terms
from rayppo.learner.guard import MismatchGuard
from rayppo.learner.minibatches import MicroBatch, Minibatch, ShardPlan, local_minibatches
from rayppo.learner.objectives import policy_objective, policy_pass, value_objective
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.packing import cut_layout
from rayppo.models.sequences import PackedBatch


@dataclass
class OptimiserSteps:
    """How policy and critic learn from a minibatch: torch optimisers or DeepSpeed engines.

    The policy's backward runs before the critic's forward, so the two models' activations are
    never alive at once (the peak is one model's, not both)."""

    policy_backward: Callable[[torch.Tensor], None]
    """Gradients of the policy objective (accumulated until ``step``)."""
    critic_backward: Callable[[torch.Tensor], None] | None
    """Gradients of the value objective; None without a critic."""
    step: Callable[[], None]
    """One optimiser step of both models (gradient clipping included), then zeroed gradients."""
    scale_lr: Callable[[float], float]
    """Both models' learning rates at this factor of ``ppo.lr`` and ``ppo.critic_lr``
    (``lr_schedule.lr_factor``), for the steps that follow; returns the policy optimiser's rate
    read back (``policy/lr``)."""


@dataclass
class LearnerModels:
    """The trained models of one process and how to step them."""

    policy: torch.nn.Module
    """pi_theta (a DeepSpeed engine on a learner rank, the plain module in-process)."""
    critic: torch.nn.Module | None
    """V_w, or None under a critic-free estimator."""
    steps: OptimiserSteps
    """Backward of each model, then the optimiser step of both."""
    collective: Collective
    """All-reduces across the learner ranks (``LocalCollective`` in one process)."""
    device: torch.device | str
    pad_id: int
    """The tokenizer's padding id."""
    pack_mode: str = ""
    """Sequence packing of the learner's forward passes (``models/packing.py``; "": padded rows)."""


ROW_AGGREGATED = ("policy/loss", "policy/kl_loss")
"""Stats reduced by ``ppo.loss_agg``: under a sequence aggregation a rank's value is a mean over its
rows, so ranks are weighed by rows (the other stats are token means, weighed by tokens)."""


def ppo_update(models: LearnerModels, exp: Experience, minibatches: list[Minibatch], plan: UpdatePlan,
               first_values: torch.Tensor | None = None) -> dict[str, float]:
    """M epochs x minibatches of clipped PPO + value loss (none without a critic: a critic-free
    estimator) on this rank's part of each minibatch (``minibatches``, shares of the kept rows);
    returns stats averaged over ranks. ``first_values``: the experience pass's critic forward of the
    first minibatch's rows, with its graph (``ExperiencePass.first_values``), taken as that
    minibatch's value forward. Collective: every rank calls it.

    The micro-batches' shares make each step's gradient that of the global minibatch (token-mean
    and row-mean alike). The first minibatch runs before any weight change, so where pi_prox is
    pi_old its log-probs against the generator's are the sync check ``logprob_mismatch``; elsewhere
    (pi_prox recomputed for every row) the check is ``same_version_mismatch``'s, also before the
    first step. pi_prox from the update's forward is ``one_forward_update``'s."""
    if plan.proximal == "update":
        raise ValueError("pi_prox from the update's forward: that update is one_forward_update")
    checks_first = plan.proximal == "behaviour"  # pi_prox = pi_old: the first minibatch's log-probs are the check
    mismatch = {} if checks_first else same_version_mismatch(exp, models.collective, plan.guard)
    tally = _Tally(exp.batch.mask.device)
    for i, micro_batches in enumerate(minibatches):
        for mb in micro_batches:
            part = exp.micro(mb.rows)
            # The first minibatch's value forward is the experience pass's (kept graph) when it is one
            # micro-batch: its backward goes first, which frees that graph before the policy's forward.
            kept = first_values[:, : part.batch.mask.shape[1]] if i == 0 and first_values is not None else None
            tally.count(part)
            value_stats = _kept_value_backward(models, part, mb, plan, kept)
            objective, stats, drift = policy_objective(models.policy, part, mb, plan,
                                                       policy_pass(models.policy, part, plan))
            if i == 0 and checks_first:
                tally.add_drift(drift, part, mb, exp.batch.mask.shape[1])
            stats |= _learn(models, part, mb, plan, objective, value_stats)
            tally.add(stats, mb, plan.surrogate.agg)
        if i == 0 and checks_first and plan.guard is not None:
            tally.check_first(plan.guard, models.collective)
        models.steps.step()
    return tally.figures(models.collective, len(minibatches), exp.batch) | mismatch


def one_forward_update(models: LearnerModels, exp: Experience, minibatches: list[Minibatch], shard: ShardPlan,
                       plan: UpdatePlan, first_values: torch.Tensor | None = None) -> tuple[Experience, dict[str, float]]:
    """The update of one pass before one step, pi_prox being that pass's log-probs, detached
    (``UpdatePlan.proximal == "update"``): ``ppo_update``'s one micro-batch, with the part of the
    experience that depends on pi_prox made from the forward (``with_update_proximal``) between it
    and the loss, and its shares remade (``shard``) when the geometric-mean mask drops rows. Returns
    the completed experience it trained on and the figures the separate pass would have given.
    Collective: every rank calls it."""
    if (len(minibatches), len(minibatches[0])) != (1, 1):
        raise ValueError(f"pi_prox from the update's forward needs one pass: {len(minibatches)} minibatches of "
                         f"{len(minibatches[0])} micro-batches")
    (mb,) = minibatches[0]
    tally = _Tally(exp.batch.mask.device)
    part = exp.micro(mb.rows)
    tally.count(part)
    kept = None if first_values is None else first_values[:, : part.batch.mask.shape[1]]
    value_stats = _kept_value_backward(models, part, mb, plan, kept)
    forward = policy_pass(models.policy, part, plan)  # the only pass, before any step: its log-probs are pi_prox's
    exp, proximal_figures = with_update_proximal(exp, mb.rows, forward[0], plan, models.collective)
    if exp.row_keep is not None:  # the dropped rows count in no share: the same rows, new shares
        mb = local_minibatches(shard, models.collective, exp.row_keep.tolist())[0][0]
    part = exp.micro(mb.rows)
    objective, stats, _ = policy_objective(models.policy, part, mb, plan, forward)
    stats |= _learn(models, part, mb, plan, objective, value_stats)
    tally.add(stats, mb, plan.surrogate.agg)
    models.steps.step()
    return exp, tally.figures(models.collective, 1, exp.batch) | proximal_figures


def with_update_proximal(exp: Experience, rows: torch.Tensor, logprobs: torch.Tensor, plan: UpdatePlan,
                         collective: Collective) -> tuple[Experience, dict[str, float]]:
    """``exp`` completed from ``logprobs`` [b, t], the update's forward of ``rows`` (every row of this
    rank, weights not moved yet): a new experience whose ``prox_logprobs`` [B, T] are those log-probs,
    detached, in ``exp``'s row order, with what the experience pass derives from them
    (``proximal_terms``: ``row_keep``, ``kl_ref``; without a reference ``ref_logprobs`` is pi_prox's
    own, as there); and the figures the separate pass would have given, the mismatch check's
    included (``plan.guard``). Collective: every rank calls it."""
    if sorted(rows.tolist()) != list(range(exp.batch.mask.shape[0])):
        raise ValueError("pi_prox from the update's forward needs this rank's every row in its one pass")
    prox = logprobs.detach().new_zeros(exp.batch.mask.shape)  # 0 on padding, as proximal_logprobs gives
    prox[rows, : logprobs.shape[1]] = logprobs.detach()
    ref = exp.ref_logprobs if plan.has_reference else prox
    terms = proximal_terms(PolicyTokens(prox, exp.old_logprobs, ref if plan.has_reference else None, exp.batch.mask),
                           plan, collective)
    done = dataclasses.replace(exp, prox_logprobs=prox, ref_logprobs=ref, row_keep=terms.row_keep,
                               kl_ref=None if terms.kl is None else terms.kl.mean)
    return done, terms.stats | same_version_mismatch(done, collective, plan.guard)


def _kept_value_backward(models: LearnerModels, part: Experience, mb: MicroBatch, plan: UpdatePlan,
                         kept: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
    """The critic's backward on the experience pass's kept forward ``kept`` [b, t] of ``part``'s rows,
    before the policy's forward (which frees that graph first); None when none was kept."""
    return None if kept is None or models.critic is None else _critic_backward(models, part, mb, plan, kept)


def _learn(models: LearnerModels, part: Experience, mb: MicroBatch, plan: UpdatePlan, objective: torch.Tensor,
           value_stats: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The policy's backward of ``objective``, then the critic's (a forward of its own unless the
    kept pass's backward already ran: ``value_stats``); returns the critic's stats."""
    models.steps.policy_backward(objective)
    if models.critic is None:
        return {}
    return value_stats or _critic_backward(models, part, mb, plan)


def _critic_backward(models: LearnerModels, part: Experience, mb: MicroBatch, plan: UpdatePlan,
                     values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    if models.critic is None or models.steps.critic_backward is None:
        raise ValueError("a critic's objective needs the critic and OptimiserSteps.critic_backward")
    objective, stats = value_objective(models.critic, part, mb, plan, values)
    models.steps.critic_backward(objective)
    return stats


class _Tally:
    """What this rank's passes of an update add up, all-reduced at the end (``figures``): each
    stat weighed by its share, the tokens the passes processed, and the first minibatch's drift
    log pi - log mu where it is the sync check (pi_prox = pi_old)."""

    def __init__(self, device: torch.device):
        self.weighted: dict[str, torch.Tensor] = {}
        self.processed = 0  # padding included; the real tokens stay on the device (no sync)
        self.real = torch.zeros((), dtype=torch.float64, device=device)
        self.drifts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (drift, mask, generator) per pass
        self.first = torch.zeros(2, dtype=torch.float64, device=device)  # share-weighted mean |d| and k3

    def count(self, part: Experience) -> None:
        self.processed += part.batch.processed_tokens
        self.real = self.real + part.batch.attention_mask.sum()

    def add(self, stats: dict[str, torch.Tensor], mb: MicroBatch, agg: str) -> None:
        """Each stat averaged with the weights of its own aggregation."""
        for key, value in stats.items():
            share = mb.row_share if key in ROW_AGGREGATED and agg != "token-mean" else mb.token_share
            self.weighted[key] = self.weighted.get(key, 0.0) + value.double() * share

    def add_drift(self, drift: torch.Tensor, part: Experience, mb: MicroBatch, width: int) -> None:
        """A pass of the first minibatch: micro-batches are cut to their own widths, padded back to one."""
        self.drifts.append((_pad_right(drift, width), _pad_right(part.batch.mask, width), part.generator_ids))
        token_means = [ppo.masked_mean(x, part.batch.mask) for x in (drift.abs(), _k3(drift))]
        self.first = self.first + torch.stack(token_means).double() * mb.token_share

    def check_first(self, guard: MismatchGuard, collective: Collective) -> None:
        drift, mask, generators = (torch.cat(column) for column in zip(*self.drifts))
        guard.check(drift, generators, collective, mask)

    def figures(self, collective: Collective, minibatches: int, batch: PackedBatch) -> dict[str, float]:
        """The stats averaged over ranks and minibatches, the tokens of every rank's passes over the
        whole update (all epochs: what padding costs the learner), and the first minibatch's
        ``logprob_mismatch/*`` when it was the check. Collective: every rank calls it."""
        keys = list(self.weighted)
        first = self.first if self.drifts else self.first[:0]
        stacked = torch.cat([torch.stack([self.weighted[k] for k in keys]), first])
        summed = collective.sum(torch.cat([stacked, stacked.new_tensor([float(self.processed)]),
                                           self.real.to(stacked)[None]]))
        out = {k: float(summed[i] / (collective.world_size * minibatches)) for i, k in enumerate(keys)}
        out["tokens/learn_processed"], out["tokens/learn_real"] = float(summed[-2]), float(summed[-1])
        out["tokens/learn_packed"] = float(cut_layout(batch.pack_mode) == "packed")
        out["tokens/learn_right_padded"] = float(batch.pack_mode == "right_padded")
        if not self.drifts:
            return out
        summed = summed[:-2]
        out["logprob_mismatch/mean"] = float(summed[-2] / collective.world_size)
        out["logprob_mismatch/kl"] = float(summed[-1] / collective.world_size)
        worst = torch.cat([d.abs().amax()[None] for d, _, _ in self.drifts]).max().double()
        out["logprob_mismatch/max"] = float(collective.max(worst))
        return out


def _k3(drift: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - 1 - d per token, d = log pi - log mu: the guard's estimate of KL(mu || pi)
    (``MismatchGuard``), ``ppo.kl_penalty``'s k3 with mu in the place of the policy."""
    return ppo.kl_penalty(torch.zeros_like(drift), drift, "k3")


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
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
