"""When pi_prox is the update's own forward: the separate log pi_prox pass skipped.

Under rollout correction and in asynchronous mode the update needs log pi_prox, the policy at the
learner's weights before the update (``experience_passes.proximal_logprobs``: one forward without
gradient over every row). When the update is one optimiser step over the whole batch, its one
forward runs at exactly those weights: log pi_prox *is* that forward's log-probs, detached, and
the pass would compute them twice (TRL and veRL skip it there too). ``fused_proximal`` says when;
the step's plan then takes pi_prox from the update (``UpdatePlan.proximal == "update"``):
``make_experience`` leaves out what depends on pi_prox, and ``update.one_forward_update`` makes it
from its forward, as a new experience, before the loss. The update is the same either way: same
loss, figures and new weights, up to the rounding of two forwards of the same rows.
"""

from __future__ import annotations

from rayppo.learner.collective import Collective
from rayppo.learner.learn_settings import ExperienceSettings
from rayppo.learner.rollout_tensors import RolloutTensors


def fused_proximal(settings: ExperienceSettings, reward_kl: bool, has_critic: bool, stale: bool,
                   micro_batches: int) -> bool:
    """Whether the update's first forward gives log pi_prox (no separate pass). Every condition is
    the same on every rank (each pass is a collective under ZeRO-3, so all ranks must agree):

    - pi_prox is used at all: asynchronous mode (``max_staleness`` > 0) or rollout correction
      (``correction.truncated_is``); else there is no pass to skip.
    - ``ppo.epochs`` = ``ppo.minibatches`` = 1: the update's forward is the only one, and it runs
      before any optimiser step, at pi_prox's weights. With more, the first minibatch's forward
      would give pi_prox for its rows only, and every later one runs at moved weights.
    - ``micro_batches`` = 1 (this rank's part of the minibatch is one pass on every rank,
      ``learner.micro_batch_tokens``): the shares of the micro-batches leave the rows of the
      geometric-mean mask out, and that mask needs every row's pi_prox, so a cut minibatch would
      have to keep each micro-batch's graph alive until the last forward (the memory the budget is
      there to bound). A second exact way would be a forward without gradient first: the pass.
    - not ``stale`` (no token of any rank sampled by another version than the learner's): a stale
      token's V-trace targets and truncated traces (``value_targets=vtrace``) read pi_prox / mu
      before the update, in the advantages.
    - not ``reward_kl`` (``kl_mode=reward`` with beta != 0 and a reference): the shaped rewards
      -beta KL(pi_prox || pi_ref) enter the advantages, before the update. (``kl_mode=loss``: the
      term is the update's; ``kl/ref_mean`` of pi_prox is computed after its forward.)
    - not (``has_critic`` and ``correction.geo_mask``): the first minibatch's value loss reuses the
      experience pass's graph (``UpdatePlan.first_rows``) and runs its backward *before* the
      policy's forward, to free it; that loss reads the geometric-mean mask, known only after the
      policy's forward. Keeping both graphs would double the peak; dropping the kept one would
      trade a critic forward for the policy's (no gain).
    """
    uses_prox = settings.max_staleness > 0 or settings.correction.truncated_is
    one_pass = settings.ppo.epochs == 1 and settings.ppo.minibatches == 1 and micro_batches == 1
    mask_before_critic = has_critic and settings.correction.geo_mask
    return uses_prox and one_pass and not stale and not reward_kl and not mask_before_critic


def any_stale(rows: RolloutTensors, version: int, max_staleness: int, collective: Collective) -> bool:
    """Whether a valid token of any rank's rows was sampled by a version other than ``version``
    (the learner's). With ``max_staleness`` 0 none is (``check_staleness`` refuses such rows), and
    no collective runs; else every rank must call it (one all-reduce)."""
    if max_staleness == 0:
        return False
    if rows.versions is None:
        raise ValueError(f"asynchronous mode needs every row's policy_version ({len(rows)} rows)")
    local = ((rows.versions != version) & rows.batch.mask.bool()).any()
    return bool(collective.max(local.double().reshape(1).cpu()) > 0)
