"""The update's objectives on one micro-batch: the policy's (clipped or decoupled surrogate, entropy
bonus, KL loss, distillation loss) and the critic's (clipped value loss), each scaled by its share of the global
minibatch. The plan says which loss and where the KL enters (``UpdatePlan``); the arithmetic is
``rayppo.learner.ppo``'s. This is the module to read before changing the loss.
"""

from __future__ import annotations

import torch

from rayppo.learner import ppo
from rayppo.learner.experience import Experience
from rayppo.learner.minibatches import MicroBatch
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.sequences import ResponseLogprobs, critic_forward, policy_forward_at


def policy_objective(
    policy: torch.nn.Module, part: Experience, mb: MicroBatch, plan: UpdatePlan,
    forward: ResponseLogprobs | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``(objective, stats, drift)`` of the policy on this rank's part of a minibatch (``part``: its
    rows, ``mb``: their shares); ``drift`` [b, T] is log pi - log pi_old per token (0 on padding),
    the log-prob check of the synchronous iteration, on every row. Under ``plan.decoupled`` (rollout correction) the policy loss is the
    decoupled one: trust region around pi_prox, tokens weighted by min(pi_prox / mu, is_clip); else
    the clipped loss against mu = pi_old. Rows outside the geometric-mean band (``part.row_keep``)
    are in no term and no figure. ``forward``: ``policy_pass``'s forward of these rows when already run."""
    cfg, surrogate = plan.ppo, plan.surrogate
    mask = part.trained_mask  # rows the geometric-mean mask dropped are in no term and no metric
    forward = policy_pass(policy, part, plan) if forward is None else forward
    logprobs, entropy = forward.logprobs, forward.entropy
    assert entropy is not None  # policy_pass asks for it
    if plan.decoupled:
        if part.prox_logprobs is None:
            raise ValueError("the decoupled policy loss needs log pi_prox: the experience has none")
        pg_loss, pg_stats = ppo.decoupled_policy_loss(logprobs, ppo.Decoupled(part.prox_logprobs, part.old_logprobs),
                                                      part.advantages, mask, surrogate, cfg.is_clip)
    else:
        pg_loss, pg_stats = ppo.policy_loss(logprobs, part.old_logprobs, part.advantages, mask, surrogate)
    entropy_mean = ppo.masked_mean(entropy, mask)  # the figure shown; the bonus is aggregated as the loss is
    entropy_bonus = (ppo.aggregate(entropy, mask, surrogate.agg, surrogate.max_length) if cfg.entropy_coef
                     else entropy_mean)
    drift = (logprobs.detach() - part.old_logprobs) * part.batch.mask  # the check sees every row
    stats = {f"policy/{k}": v for k, v in pg_stats.items()}
    stats |= {"policy/loss": pg_loss.detach(), "entropy": entropy_mean.detach()}
    for name, coef, per_token in _kl_losses(part, plan, forward):  # aggregated as the policy loss is
        kl_loss = ppo.aggregate(per_token, mask, surrogate.agg, surrogate.max_length)
        pg_loss = pg_loss + coef * kl_loss
        stats[f"policy/{name}"] = kl_loss.detach()
    # token-mean weighs the minibatch's tokens; the two sequence aggregations weigh its rows.
    pg_share = mb.token_share if surrogate.agg == "token-mean" else mb.row_share
    return pg_share * (pg_loss - cfg.entropy_coef * entropy_bonus), stats, drift


def _kl_losses(part: Experience, plan: UpdatePlan, forward: ResponseLogprobs) -> list[tuple[str, float, torch.Tensor]]:
    """``(figure, coefficient, per-token KL [b, T])`` of each KL term of the loss: to the reference
    (``kl_mode=loss``: beta k3, whose gradient is the KL's) and to the teacher (``distill.mode=loss``:
    lambda_T k, k2 by default, whose gradient through log pi_theta is the reverse KL's; with
    ``distill.topk`` the reverse KL over the teacher's top k tokens and the rest, ``ppo.topk_reverse_kl``)."""
    terms: list[tuple[str, float, torch.Tensor]] = []
    if plan.loss_kl_coef:
        terms.append(("kl_loss", plan.loss_kl_coef, ppo.kl_penalty(forward.logprobs, part.ref_logprobs, "k3")))
    if plan.distill_loss_coef and forward.at_ids is not None and part.teacher_top_logprobs is not None:
        terms.append(("distill_loss", plan.distill_loss_coef,
                      ppo.topk_reverse_kl(forward.at_ids, part.teacher_top_logprobs)))
    elif plan.distill_loss_coef and part.teacher_logprobs is not None:
        terms.append(("distill_loss", plan.distill_loss_coef,
                      ppo.kl_penalty(forward.logprobs, part.teacher_logprobs, plan.settings.experience.distill.estimator)))
    return terms


def policy_pass(policy: torch.nn.Module, part: Experience, plan: UpdatePlan) -> ResponseLogprobs:
    """The policy's forward on ``part``'s rows, with its graph: ``logprobs`` and ``entropy`` [b, T] (the
    entropy's graph only when its bonus is trained), and log pi at the teacher's top ids [b, T, k]
    when the top-k distillation term reads them."""
    ids = part.teacher_top_ids if plan.distill_loss_coef else None
    forward = policy_forward_at(policy, part.batch, ids, plan.settings.temperature, with_entropy=True,
                                entropy_grad=plan.ppo.entropy_coef != 0)
    assert forward.entropy is not None  # asked for (with_entropy=True)
    return forward


def value_objective(critic: torch.nn.Module, part: Experience, mb: MicroBatch, plan: UpdatePlan,
                    values: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(objective, stats)`` of the critic on this rank's part of a minibatch; ``values`` [b, T]
    is its forward when already done (the experience pass's, ``ExperiencePass.first_values``)."""
    if values is None:
        values, _ = critic_forward(critic, part.batch)
    cfg = plan.ppo
    vf_loss = ppo.value_loss(values, part.old_values, part.returns, part.trained_mask, cfg.value_clip)
    return mb.token_share * cfg.vf_coef * vf_loss, {"value/loss": vf_loss.detach()}
