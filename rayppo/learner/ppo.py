"""The PPO math of rayppo: pure functions over tensors, named after the equations of docs/algorithm.md.

Every role that does PPO arithmetic (the in-process reference trainer, the DeepSpeed learner
ranks, the tests) calls these functions; nothing else re-implements them. They take tensors and
plain scalars (or the small records of them defined here: ``Surrogate``, ``Decoupled``, ``VTrace``),
never config objects, and import only ``torch``.

Shapes (docs/algorithm.md, "Tensor conventions"): per-token tensors are ``[B, T]`` over *response*
positions. ``mask[b, t] = 1`` for a real response token (EOS included when emitted) and 0 for the
padding after the end; in a single-turn row the valid tokens are a prefix. In a multi-turn
episode (docs/multi-turn.md, "The MDP on that record") ``mask`` is the *action* mask: 1 on the tokens the
policy sampled, 0 on the environment's observation tokens between its turns and on the padding;
``action_tokens.gather_actions`` lays such rows out as action tokens only, where every recursion
below applies unchanged (an observation carries it through: no discount step, no value read there).

- ``logprobs[b, t] = log pi(y_t | x, y_<t)``; ``ref_logprobs`` likewise under pi_ref.
- ``values[b, t] = V(S_{t-1})``: the value of the state *before* action ``y_t``.
- ``bootstrap[b]``: the value after the last valid token; 0 on EOS, ``V(S_T)`` on truncation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayppo.choices import KLEstimator, LossAgg, Truncation

# The per-token helpers live below the models, which use them too; callers of the math reach them here.
from rayppo.token_math import entropy_from_logits, logprobs_from_logits, masked_mean, masked_sum_per_row  # noqa: F401


# --------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------
def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: LossAgg = "token-mean", max_length: int = 0) -> torch.Tensor:
    """Reduce a per-token ``[B, T]`` quantity to a scalar.

    ``token-mean``: the mean over every valid token of the batch, so long responses weigh more.
    ``seq-mean-token-mean``: each row's mean over its own tokens (the 1/T form), then the
    mean over rows, so every response weighs the same. A row with no valid token counts in that
    mean's denominator with a 0 (veRL's mean runs over rows with at least one token); rayppo never
    trains on such a row (every response has at least one token; a placeholder row of an empty
    micro-batch has a share of 0), so the two agree wherever rayppo calls it.
    ``seq-mean-token-sum-norm`` (Dr. GRPO, Liu et al. 2025): sum over every valid token divided by
    the constant B x ``max_length`` (``rollout.max_new_tokens``), so no response's weight depends
    on its own length (a per-length mean shrinks a long wrong answer's gradient per token).
    """
    mask = mask.to(x.dtype)
    if agg == "token-mean":
        return masked_mean(x, mask)
    if agg == "seq-mean-token-mean":
        per_row = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_row.mean()
    if agg == "seq-mean-token-sum-norm":
        if max_length < 1:
            raise ValueError(f"seq-mean-token-sum-norm needs max_length >= 1, got {max_length}")
        return (x * mask).sum() / (x.shape[0] * max_length)
    raise ValueError(f"agg must be 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm', got {agg!r}")


# --------------------------------------------------------------------------------------------
# KL penalty and reward shaping (docs/algorithm.md, "The per-token reward"; Ziegler et al. 2019)
# --------------------------------------------------------------------------------------------
def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k1"
) -> torch.Tensor:
    """Per-token single-sample estimate of KL(pi || pi_ref), same shape as the inputs.

    k1 = lp - ref                        (KL_t; unbiased, can be negative)
    k2 = 0.5 (lp - ref)^2                (low variance, biased)
    k3 = exp(ref - lp) - (ref - lp) - 1  (unbiased and >= 0; Schulman's estimator)
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B]``: the index of each row's last valid token (-1 for an empty row); the
    last action token of an episode, whose mask has gaps."""
    if mask.shape[-1] == 0:
        return torch.full(mask.shape[:-1], -1, dtype=torch.long, device=mask.device)
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return (mask.bool() * positions).amax(dim=-1) - 1


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """The shaped reward ``[B, T]`` (docs/algorithm.md, "The per-token reward").

    r_t = -beta KL_t                   for t < T
    r_T = r_phi(x, y) - beta KL_T      on the last valid token
    and 0 on padding. ``scores`` is ``[B]``; ``kl_coef`` is beta.
    """
    mask_f = mask.to(logprobs.dtype)
    rewards = -kl_coef * kl_penalty(logprobs, ref_logprobs, estimator) * mask_f
    last = last_token_index(mask)
    has_tokens = last >= 0
    rows = torch.arange(rewards.shape[0], device=rewards.device)[has_tokens]
    rewards[rows, last[has_tokens]] += scores.to(rewards.dtype)[has_tokens]
    return rewards


# --------------------------------------------------------------------------------------------
# On-policy distillation (docs/distillation.md; Agarwal et al. 2024, GKD; Lu 2025, "On-Policy
# Distillation", Thinking Machines)
# --------------------------------------------------------------------------------------------
def distill_rewards(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """Per-token distillation rewards ``[B, T]``, 0 on padding:

    d_t = -lambda_T k(log pi(y_t | S_{t-1}), log pi_T(y_t | S_{t-1}))

    With k1, d_t = lambda_T (log pi_T - log pi): the teacher's verdict on the student's own token,
    whose score-function gradient E[d_t grad log pi] is -lambda_T grad KL(pi || pi_T) at S_{t-1}.
    ``coef`` is lambda_T, ``logprobs`` the policy being improved (pi_old, or pi_prox).
    """
    return -coef * kl_penalty(logprobs, teacher_logprobs, estimator) * mask.to(logprobs.dtype)


def distill_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 0.0) -> torch.Tensor:
    """``[B, T]`` D_t = sum_{k >= t} gamma^(k - t) d_k over a row's valid tokens: the distillation
    rewards' discounted reward-to-go, with no baseline (GAE at V = 0, lambda = 1). gamma = 0: D_t = d_t,
    each token answers for its own KL only; gamma = 1: for every later token's too."""
    advantages, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, lam=1.0)
    return advantages


def topk_reverse_kl(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """``[...]`` KL(pi || pi_T) at each state over k + 1 outcomes: the teacher's k most likely tokens
    j, one by one, and every other token as one outcome, the tail. ``logprobs`` and
    ``teacher_logprobs`` ``[..., k]`` are log pi(j) and log pi_T(j) at those tokens:

        q_j = exp(log pi(j)),  q_rest = 1 - sum_j q_j    (p_j, p_rest alike for pi_T)
        KL_k = sum_j q_j (log q_j - log p_j) + q_rest (log q_rest - log p_rest)

    Merging outcomes cannot raise a KL (the data-processing inequality), so KL_k <= KL(pi || pi_T)
    over the whole vocabulary, with equality when the tail holds the same share of both
    distributions' mass per token or none; k = V gives the exact reverse KL. Its gradient through
    log pi is the gradient of the reverse KL between the coarsened distributions (the generalised
    JSD at beta = 1 of GKD, Agarwal et al. 2024, eq. 5, on the student's own states; Lu 2025 names
    the full-distribution variant). The tails are 1 - a sum of k rounded probabilities, exact to about
    k ulp(1): below that floor a tail is rounding, and is held at it (so two empty tails add 0).
    """
    floor = logprobs.shape[-1] * torch.finfo(logprobs.dtype).eps
    q, p = logprobs.exp(), teacher_logprobs.exp()
    q_rest = (1 - q.sum(-1)).clamp_min(floor)
    p_rest = (1 - p.sum(-1)).clamp_min(floor)
    return (q * (logprobs - teacher_logprobs)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())


def truncation_targets(
    scores: torch.Tensor,
    last_values: torch.Tensor,
    truncated: torch.Tensor,
    truncation: Truncation = "bootstrap",
    missing_eos_penalty: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores to put in the shaped reward [B], bootstrap [B])`` by the truncation rule.

    A row that ended with EOS is a true termination: its score r_phi and bootstrap 0 in both modes.
    A row cut at the length limit (``truncated[b]``), seed 000 "The Value Function":
    - ``bootstrap``: the episode was ended artificially; V(S_T) (``last_values``) stands in for
      everything still to come, the terminal score included, so the score is *not* added
      (adding both would count the terminal reward twice): score 0, bootstrap V(S_T).
    - ``terminal``: the cut is treated as the end: score r_phi - ``missing_eos_penalty``,
      bootstrap 0.
    """
    truncated = truncated.to(torch.bool)
    zeros = torch.zeros_like(last_values)
    if truncation == "bootstrap":
        return torch.where(truncated, torch.zeros_like(scores), scores), torch.where(truncated, last_values, zeros)
    if truncation == "terminal":
        return scores - missing_eos_penalty * truncated.to(scores.dtype), zeros
    raise ValueError(f"truncation must be 'bootstrap' or 'terminal', got {truncation!r}")


# --------------------------------------------------------------------------------------------
# Generalised advantage estimation (Schulman et al. 2016; docs/algorithm.md)
# --------------------------------------------------------------------------------------------
def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns, both ``[B, T]`` and 0 on padding.

    delta_t = r_t + gamma V_next - V_t, with V_next = values[:, t+1] inside the response and
    ``bootstrap[b]`` (default 0, i.e. true termination) after the last valid token.
    A_t = sum_l (gamma lam)^l delta_{t+l}, computed backwards: A_t = delta_t + gamma lam A_{t+1}.
    returns = A + values (the critic's regression target V^target).
    The loop runs over T only; every step is vectorised over the batch.
    """
    batch, length = rewards.shape
    mask_f = mask.to(values.dtype)
    deltas, next_valid = _td_errors(rewards, values, mask_f, gamma, bootstrap)
    advantages = torch.zeros_like(values)
    running = torch.zeros(batch, dtype=values.dtype, device=values.device)
    for t in reversed(range(length)):
        running = deltas[:, t] + gamma * lam * next_valid[:, t] * running
        advantages[:, t] = running
    returns = (advantages + values) * mask_f
    return advantages, returns


def _td_errors(rewards: torch.Tensor, values: torch.Tensor, mask_f: torch.Tensor, gamma: float,
               bootstrap: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, next_valid)``, both ``[B, T]``: delta_t = r_t + gamma V_{t+1} - V_t (0 on padding),
    V_{t+1} being the bootstrap after the last valid token; next_valid_t = whether y_{t+1} is real."""
    if bootstrap is None:
        bootstrap = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    # Shift left by one: column t holds V(S_t) and whether y_{t+1} is a real token.
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    next_valid = torch.cat([mask_f[:, 1:], torch.zeros_like(mask_f[:, :1])], dim=1)
    # After the last valid token the next value is the bootstrap (0 on EOS, V(S_T) if cut).
    next_values = next_valid * next_values + (1 - next_valid) * bootstrap.to(values.dtype)[:, None]
    return (rewards + gamma * next_values - values) * mask_f, next_valid


class VTrace(NamedTuple):
    """The constants of ``compute_offpolicy_targets`` (V-trace, Espeholt et al. 2018)."""

    gamma: float = 1.0
    """gamma, the discount (``compute_gae``'s)."""
    lam: float = 0.95
    """lambda, the trace decay (``compute_gae``'s)."""
    rho_bar: float = 1.0
    """rho_bar: the cap of the ratio that weighs a token's own TD error in the value target."""
    c_bar: float = 1.0
    """c_bar: the cap of the ratios that carry the trace to earlier tokens."""


DEFAULT_VTRACE = VTrace()
"""gamma = 1, lambda = 0.95, rho_bar = c_bar = 1 (IMPALA's clips)."""


def compute_offpolicy_targets(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    log_ratio: torch.Tensor,
    trace: VTrace = DEFAULT_VTRACE,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and value targets of rows sampled by a stale behaviour policy mu, both
    ``[B, T]`` and 0 on padding (docs/async.md, "Off-policy corrections").

    ``log_ratio[b, t] = log pi_prox(y_t) - log mu(y_t)``, q_t = exp(log_ratio), delta_t as in
    ``compute_gae``, and gamma, lam, rho_bar, c_bar those of ``trace``. Backwards over t:

    - value target (V-trace with lambda, Espeholt et al. 2018):
      v_t - V_t = min(rho_bar, q_t) delta_t + gamma lam min(c_bar, q_t) (v_{t+1} - V_{t+1}),
      v_{T+1} = V_{T+1}. The token's own ratio weighs its TD error, so v estimates V^{pi_prox}.
    - advantage (Retrace-style trace): A_t = delta_t + gamma lam min(c_bar, q_{t+1}) A_{t+1}; the
      token's own sampling is corrected in the policy loss (``decoupled_policy_loss``'s w_t).

    With log_ratio = 0 both are ``compute_gae``'s (advantages, returns) exactly.
    """
    gamma, lam, rho_bar, c_bar = trace
    batch, length = rewards.shape
    mask_f = mask.to(values.dtype)
    deltas, next_valid = _td_errors(rewards, values, mask_f, gamma, bootstrap)
    q = torch.exp(log_ratio.to(values.dtype)) * mask_f
    rho, trace_t = torch.clamp(q, max=rho_bar), torch.clamp(q, max=c_bar)
    next_trace = torch.cat([trace_t[:, 1:], torch.zeros_like(trace_t[:, :1])], dim=1)  # min(c_bar, q_{t+1})
    advantages, target_gap = torch.zeros_like(values), torch.zeros_like(values)
    run_a = torch.zeros(batch, dtype=values.dtype, device=values.device)
    run_v = torch.zeros_like(run_a)
    for t in reversed(range(length)):
        run_a = deltas[:, t] + gamma * lam * next_valid[:, t] * next_trace[:, t] * run_a
        run_v = rho[:, t] * deltas[:, t] + gamma * lam * trace_t[:, t] * next_valid[:, t] * run_v
        advantages[:, t], target_gap[:, t] = run_a, run_v
    return advantages * mask_f, (target_gap + values) * mask_f


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[3]``: (count, sum, sum of squares) of ``x`` over the valid entries.

    These add across ranks, so an all-reduce of them gives the global statistics that
    ``whiten_from_moments`` needs for a whitening that does not depend on the rank count.
    """
    mask_f = mask.to(torch.float64)
    x64 = x.to(torch.float64) * mask_f
    return torch.stack([mask_f.sum(), x64.sum(), (x64 * x64).sum()])


def whiten_from_moments(
    x: torch.Tensor,
    mask: torch.Tensor,
    moments: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` with the (count, sum, sum of squares) of ``masked_moments`` (local or global).

    x <- (x - mu) / (sigma + eps), as PPO implementations do; with ``shift_mean=False`` the mean is added
    back, so only the scale changes. sigma is the population standard deviation. Padding stays 0.
    """
    count, total, total_sq = moments.unbind()
    count = count.clamp(min=1.0)
    mean = total / count
    var = (total_sq / count - mean * mean).clamp(min=0.0)
    whitened = (x.to(torch.float64) - mean) / (var.sqrt() + eps)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * mask.to(torch.float64)).to(x.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Zero mean, unit variance over the valid entries of ``x`` only; padding stays 0."""
    return whiten_from_moments(x, mask, masked_moments(x, mask), shift_mean=shift_mean, eps=eps)


# --------------------------------------------------------------------------------------------
# The PPO objective (Schulman et al. 2017; docs/algorithm.md)
# --------------------------------------------------------------------------------------------
class Surrogate(NamedTuple):
    """The constants of the clipped surrogate (``policy_loss``, ``decoupled_policy_loss``): its
    trust region and how its per-token terms reduce to the loss."""

    clip_eps: float = 0.2
    """eps: the ratio rho is clipped below at 1 - eps (and above at 1 + eps, unless ``clip_eps_high``)."""
    clip_eps_high: float | None = None
    """eps_high, DAPO's clip-higher (Yu et al. 2025): rho is clipped above at 1 + eps_high, so rare
    tokens with A > 0 are not clipped first (None: eps, symmetric)."""
    agg: LossAgg = "token-mean"
    """How the per-token terms reduce to a scalar (``aggregate``)."""
    max_length: int = 0
    """L_max, the constant of ``agg=seq-mean-token-sum-norm`` (``rollout.max_new_tokens``)."""


DEFAULT_SURROGATE = Surrogate()
"""PPO's own: rho clipped to [0.8, 1.2], token-mean."""


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    surrogate: Surrogate = DEFAULT_SURROGATE,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss ``-agg(min(rho A, clip(rho, 1-eps, 1+eps_high) A))``, rho = exp(lp - old),
    all inputs ``[B, T]``; eps, eps_high and agg are ``surrogate``'s.

    Returns ``(loss, stats)``; stats are detached scalars:
    ``clipfrac`` (share of valid tokens where the clipped term is the active, gradient-free one),
    ``approx_kl`` (k3 estimate of KL(pi_old || pi), the trust-region KL, token mean),
    ``ratio_mean``.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    high = surrogate.clip_eps if surrogate.clip_eps_high is None else surrogate.clip_eps_high
    clipped = torch.clamp(ratio, 1.0 - surrogate.clip_eps, 1.0 + high) * advantages
    loss = -aggregate(torch.minimum(unclipped, clipped), mask, surrogate.agg, surrogate.max_length)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped < unclipped).to(logprobs.dtype), mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def geometric_mean_mask(log_ratio: torch.Tensor, mask: torch.Tensor, bound: float) -> torch.Tensor:
    """``[B]`` 1.0 for the rows to keep, 0.0 for those whose geometric-mean importance ratio leaves
    the band: |(1/|y|) sum_t log(pi_prox / mu)_t| > ``bound`` (in nats).

    The sequence-level ratio prod_t pi_prox / mu drifts with the length; its per-token geometric
    mean does not, so one band serves short and long rows alike (veRL's "Rollout Correction"
    docs, geometric-mean rejection; "When Speed Kills Stability", Liu et al. 2025, for masking
    rows by their sequence ratio). ``log_ratio`` ``[B, T]`` (0 on padding); a row without a valid
    token is kept (it weighs nothing anyway)."""
    per_row = masked_sum_per_row(log_ratio, mask) / mask.sum(-1).clamp(min=1)
    return (per_row.abs() <= bound).to(log_ratio.dtype)


class Decoupled(NamedTuple):
    """The two old policies the decoupled loss keeps apart (``decoupled_policy_loss``): pi_prox,
    the centre of the trust region, and mu, the behaviour policy that sampled the tokens."""

    prox_logprobs: torch.Tensor
    """[B, T] log pi_prox(y_t | S_{t-1}): the learner's weights at the start of the update."""
    behaviour_logprobs: torch.Tensor
    """[B, T] log mu(y_t | S_{t-1}): the generator's (stale, or of other numerics)."""
    row_keep: torch.Tensor | None = None
    """[B] 1.0 for the rows to train on, 0.0 for those ``geometric_mean_mask`` dropped; None: every row."""


def decoupled_policy_loss(
    logprobs: torch.Tensor,
    policies: Decoupled,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    surrogate: Surrogate = DEFAULT_SURROGATE,
    is_clip: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO loss for rows sampled by a behaviour policy mu other than the learner's
    pi_prox (``docs/async.md``, "Off-policy corrections"; Hilton et al. 2022, "Batch size-invariance
    for policy optimization"): the trust region is around pi_prox, the learner's weights at the start
    of the update, and each token is reweighted by the truncated importance ratio
    w_t = min(pi_prox / mu, is_clip) (TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"):

        L = -agg(w_t * min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)),  rho_t = pi_theta / pi_prox

    mu is stale (asynchronous mode) or the generator's numerics (bf16 kernels; rollout correction).
    pi_prox and mu are ``policies``'; its ``row_keep`` ``[B]`` (``geometric_mean_mask``) zeroes the
    weights of masked rows, whose tokens stay in the aggregation's denominator, as every other row's
    do. eps and agg are ``surrogate``'s; ``logprobs``, ``advantages``, ``mask``: ``[B, T]``. With
    pi_prox = mu and every row kept (w = 1) it is ``policy_loss(logprobs, prox_logprobs, ...)``
    exactly. Stats: ``policy_loss``'s plus ``is_weight_mean`` and ``is_clipfrac`` (share of valid
    tokens whose weight was truncated)."""
    prox_logprobs, behaviour_logprobs, row_keep = policies
    with torch.no_grad():
        raw = torch.exp((prox_logprobs - behaviour_logprobs).to(torch.float32)).to(advantages.dtype)
        weights = torch.clamp(raw, max=is_clip)
        if row_keep is not None:
            weights = weights * row_keep.to(weights.dtype).unsqueeze(-1)
    loss, stats = policy_loss(logprobs, prox_logprobs, weights * advantages, mask, surrogate)
    with torch.no_grad():
        stats |= {"is_weight_mean": masked_mean(weights, mask),
                  "is_clipfrac": masked_mean((raw > is_clip).to(advantages.dtype), mask)}
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.2,
) -> torch.Tensor:
    """Clipped value loss, token mean: ``max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    ``clip_range=None`` turns clipping off. There is no hidden 0.5: the weight of this term in
    the total loss is the config's ``vf_coef`` (c1 of docs/algorithm.md).
    """
    unclipped = (values - returns).square()
    if clip_range is None:
        return masked_mean(unclipped, mask)
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    clipped = (clipped_values - returns).square()
    return masked_mean(torch.maximum(unclipped, clipped), mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens: 1 is a perfect critic, <= 0 a useless one."""
    return explained_variance_from_moments(masked_moments(returns, mask), masked_moments(returns - values, mask))


def explained_variance_from_moments(returns_moments: torch.Tensor, residual_moments: torch.Tensor) -> torch.Tensor:
    """``explained_variance`` from the ``masked_moments`` of R and of R - V (local or summed over
    ranks: the ranks' moments add, their explained variances do not)."""

    def variance(moments: torch.Tensor) -> torch.Tensor:
        count, total, total_sq = moments.unbind()
        mean = total / count.clamp(min=1.0)
        return (total_sq / count.clamp(min=1.0) - mean * mean).clamp(min=0.0)

    return 1.0 - variance(residual_moments) / variance(returns_moments).clamp(min=1e-12)


# --------------------------------------------------------------------------------------------
# KL coefficient controllers (Ziegler et al. 2019)
# --------------------------------------------------------------------------------------------
class FixedKLController:
    """A constant beta."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt: beta stays fixed."""


class AdaptiveKLController:
    """Proportional control of beta towards a target KL (nats per response).

    e = clip(current_kl / target - 1, -0.2, 0.2);  beta <- beta (1 + e n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
