"""The ``distill`` section: on-policy distillation from a frozen teacher pi_T (docs/distillation.md).

The student (the policy) samples; a teacher actor group scores the student's own tokens with
log pi_T; the learner lowers the reverse KL(pi || pi_T) on the states the student visits, a
per-token signal beside (or instead of) the task reward. The teacher role has the scorers'
resource fields (``num``, ``cpus``, ``gpus``, ``threads``, ``resources``, ``cores``,
``micro_batch_tokens``), as the reference has.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayppo.choices import DistillEstimator, DistillMode
from rayppo.config.system import ScorerConfig


@dataclass
class DistillConfig(ScorerConfig):
    teacher: str | None = None
    """The teacher pi_T: a Hugging Face causal-LM folder, a built-in model name, or a rayppo run
    (its folder, or the ``policy/`` it saved). Its tokenizer must be the policy's (checked before
    anything starts). Null: no distillation, no teacher actor."""
    mode: DistillMode = "reward"
    """Where the reverse KL enters. ``reward``: token t's advantage gains
    d_t = -coef k(log pi_old(y_t), log pi_T(y_t)) (discounted by ``gamma``), trained through the
    clipped loss with the task's advantages (Thinking Machines' on-policy distillation, 2025).
    ``loss``: coef x agg(k(log pi_theta, log pi_T)) is added to the policy loss, aggregated as it is
    (GKD's reverse-KL setting, Agarwal et al. 2024, on the sampled token)."""
    coef: float = 1.0
    """lambda_T: the weight of the distillation term (per token, in nats) beside the task's
    advantage, which is in the estimator's units (about 1 after GRPO's or GAE's normalisation)."""
    task_reward: float = 1.0
    """w: the task's advantage enters as w A_t + D_t (A_t: the estimator's, from the reward, the
    turn rewards and the reference's KL shaping). 0: pure distillation, while the reward still
    scores every batch and the held-out answers (``reward/mean``, ``eval/*``: how far the student
    got). With no reward at all (``reward.function: null``, allowed with a teacher) the run is pure
    distillation with no score to watch."""
    gamma: float = 0.0
    """``mode=reward``: the discount of the distillation rewards summed into token t's advantage,
    D_t = sum_{k >= t} gamma^(k - t) d_k. 0 (the published recipe): each token's own reverse KL,
    low variance, ignoring how a token changes the later states' KL; 1: the whole reward-to-go,
    the unbiased gradient of the sequence's reverse KL (docs/distillation.md)."""
    center: bool = False
    """``mode=reward``: subtract the batch's mean D_t (over every valid token of the global batch)
    from the distillation advantages: a constant baseline, so the gradient's expectation is
    unchanged, while the term no longer pushes down every sampled token on average (its mean is
    -KL < 0). False: the published recipe, D_t as it is."""
    topk: int = 0
    """k > 0 (``mode=loss``): the loss term is the reverse KL over the teacher's k most likely tokens
    at each state the student visits plus one outcome for all other tokens
    (``ppo.topk_reverse_kl``): the teacher's next-token distribution, not only its verdict on the
    sampled token, as GKD and TRL's ``DistillationTrainer`` match it. The teacher returns k ids and
    log-probs per response token (8 k bytes); the learner takes the student's log-probs at them from
    the same head pass. 0: the sampled token's estimate (``estimator``)."""
    estimator: DistillEstimator = "auto"
    """The per-token estimate k of KL(pi || pi_T). ``auto``: ``k1`` in ``mode=reward`` (log pi -
    log pi_T, whose score-function gradient is the reverse KL's) and ``k2`` in ``mode=loss``
    (0.5 (log pi - log pi_T)^2, whose gradient through log pi is the reverse KL's). ``k3`` as a
    loss has the *forward* KL's gradient; ``k1`` as a loss is refused (its gradient is grad log pi
    whatever the teacher says: zero in expectation). As a reward, only k1's score-function
    gradient is the reverse KL's (k2 and k3 are >= 0 everywhere: biased)."""
