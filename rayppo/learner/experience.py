"""The learner's half of an iteration, first part: a scored rollout -> the tensors PPO needs.

``make_experience`` computes values, shaped rewards, advantages and returns, and whitens the
advantages over the global batch, calling only the functions of ``rayppo.learner.ppo``,
``group_math`` and ``rewards``; the PPO
epochs that follow are ``rayppo.learner.update``.

Asynchronous mode (``rollout.max_staleness`` = k > 0, docs/async.md, "Off-policy corrections"): rows
may come from a behaviour policy mu up to k versions older than the learner. ``make_experience``
then recomputes log pi_prox once with the learner's weights at the start of the update, shapes
the reward's KL term with it, and computes V-trace targets; the update uses the decoupled
policy loss and measures ``logprob_mismatch`` only on the rows sampled by the learner's version.
With k = 0 both run exactly the synchronous iteration. The pi_prox pass is skipped when the update
is one pass before one step and nothing here reads pi_prox (``proximal.fused_proximal``): the
update's forward gives it, and ``ppo_update`` fills in what depends on it.

The learn step (``step.py``) calls it in the in-process trainer and on every learner rank, on the
rollout made tensors once (``RolloutTensors``) and the config's choices read once
(``ExperienceSettings``). A rank holds a shard of the rollout's rows; a ``Collective`` sums across ranks, so that
advantage whitening uses the global batch and each minibatch's loss is the global token mean:
with N ranks the update is the one a single process would make.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rayppo.choices import GroupEstimator, KLEstimator, Truncation
from rayppo.config.derived import NO_CORRECTION, Correction, rollout_correction, truncation_mode
from rayppo.config.schema import Config, PPOConfig
from rayppo.data.micro_batches import token_batches
from rayppo.learner import group_math, ppo
from rayppo.learner.collective import Collective, LocalCollective
from rayppo.learner.experience_stats import ProximalTerms, proximal_terms, value_stats
from rayppo.learner.rewards import discounted_returns, overlong_penalty
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.models.packing import cut_layout
from rayppo.models.sequences import PackedBatch, critic_forward, policy_forward


@dataclass(frozen=True)
class TruncationRule:
    """How a response's length enters its reward: rows cut at the limit (``rollout.truncation``)
    and DAPO's overlong shaping (``rollout.overlong_buffer``)."""

    mode: Truncation = "bootstrap"
    """``bootstrap``: no score, GAE bootstrapped with V(S_T). ``terminal``: score, bootstrap 0."""
    missing_eos_penalty: float = 0.0
    """Subtracted from a cut row's score under ``terminal``."""
    max_new_tokens: int = 0
    """L_max, the response length limit (``rollout.max_new_tokens``)."""
    overlong_buffer: int = 0
    """L: the last tokens before L_max over which the score ramps down to -``overlong_penalty`` (0: off)."""
    overlong_penalty: float = 1.0
    """The score lost at L_max under ``overlong_buffer``."""

    @staticmethod
    def of(cfg: Config) -> TruncationRule:
        r = cfg.rollout
        return TruncationRule(mode=truncation_mode(cfg), missing_eos_penalty=r.missing_eos_penalty,
                              max_new_tokens=r.max_new_tokens, overlong_buffer=r.overlong_buffer,
                              overlong_penalty=r.overlong_penalty)


@dataclass(frozen=True)
class ExperienceSettings:
    """What the experience pass reads from the config, gathered once (``of``)."""

    ppo: PPOConfig
    """Estimator, KL mode and estimator, discount, whitening, off-policy targets, ``minibatches``
    (the chunks of the log pi_prox pass without a token budget)."""
    truncation: TruncationRule = TruncationRule()
    """How a response's length enters its reward."""
    max_staleness: int = 0
    """k: how many versions a row may lag the learner (``rollout.max_staleness``; 0: lock-step)."""
    micro_batch_tokens: int = 0
    """Padded tokens per forward pass without gradient (``learner.micro_batch_tokens``; 0: unbucketed)."""
    correction: Correction = NO_CORRECTION
    """Rollout correction in force (``config.derived.rollout_correction``)."""

    @staticmethod
    def of(cfg: Config) -> ExperienceSettings:
        return ExperienceSettings(ppo=cfg.ppo, truncation=TruncationRule.of(cfg),
                                  max_staleness=cfg.rollout.max_staleness,
                                  micro_batch_tokens=cfg.learner.micro_batch_tokens,
                                  correction=rollout_correction(cfg.ppo, cfg.model.dtype, cfg.rollout.max_staleness))


@dataclass
class Experience:
    """Everything one PPO update needs, for B responses of up to T tokens."""

    batch: PackedBatch
    """Token tensors: prompt | response layout, ``batch.mask`` [B, T]."""
    old_logprobs: torch.Tensor
    """[B, T] log pi_old(y_t | S_{t-1}) reported by the generator: the behaviour policy mu that
    sampled the row (in asynchronous mode possibly older than the learner's weights)."""
    ref_logprobs: torch.Tensor
    """[B, T] log pi_ref(y_t | S_{t-1})."""
    old_values: torch.Tensor
    """[B, T] V_old(S_{t-1}) before the update."""
    rewards: torch.Tensor
    """[B, T] shaped rewards r_t = -beta KL_t (+ r_phi on the last token of rows that earned it)."""
    advantages: torch.Tensor
    """[B, T] A_t of ``ppo.advantage``: GAE (whitened when configured), or a group estimator's
    sequence advantage A_i on every valid token of row i, or REINFORCE++'s whitened returns."""
    returns: torch.Tensor
    """[B, T] value targets A_t + V_old(S_{t-1}) (before whitening); 0 without a critic."""
    scores: torch.Tensor
    """[B] r_phi(x, y) (logged whole; a cut row's enters ``rewards`` only under ``terminal``)."""
    generator_ids: torch.Tensor
    """[B] long: the generator that sampled each row (named by the correctness guard)."""
    prox_logprobs: torch.Tensor | None = None
    """[B, T] log pi_prox(y_t | S_{t-1}): the learner's weights at the start of this update,
    recomputed once without gradient (0 on padding). Asynchronous mode only; None in the
    synchronous iteration, where pi_prox is pi_old."""
    same_version: torch.Tensor | None = None
    """[B, T] bool: the token was sampled by pi_prox's version, so mu = pi_prox and their log-probs
    must agree up to rounding (the tokens ``logprob_mismatch`` compares; a row continued across
    generator calls can have both kinds). Asynchronous mode only."""
    first_values: torch.Tensor | None = None
    """[b, T] V(S_{t-1}) of the first minibatch's rows (``RolloutTensors.first_rows``), in
    that order, with the autograd graph of the critic's experience pass: the critic's weights
    have not moved yet, so this *is* that minibatch's value forward (``ppo_update`` reuses it)."""
    loss_kl_coef: float = 0.0
    """beta of the loss's KL term (``ppo.kl_mode=loss``): the update adds beta agg(k3(log pi_theta,
    log pi_ref)); 0 when the KL shapes the reward instead, or without a reference."""
    row_keep: torch.Tensor | None = None
    """[B] 1.0 for rows the update trains on, 0.0 for rows the geometric-mean mask of rollout
    correction dropped (``ppo.geometric_mean_mask``); None: every row. A dropped row is out of every
    term (policy, entropy, KL loss, critic) and every normaliser and metric: ``trained_mask``."""
    truncated_is: bool = False
    """The policy loss is the decoupled one with truncated importance weights min(pi_prox / mu,
    is_clip) (rollout correction ``tis``/``tis+geo_mask``); False: the plain clipped loss against
    mu = pi_old, also in asynchronous mode under ``rollout_correction=none``."""
    kl_ref: float | None = None
    """Mean KL(pi || pi_ref) per response over the global batch (``ReferenceKL.mean``, logged as
    ``kl/ref_mean``), pi being the policy improved (pi_old, or pi_prox); None without a reference."""

    @property
    def trained_mask(self) -> torch.Tensor:
        """[B, T] the valid tokens of the rows the update trains on (``batch.mask`` without the rows
        ``row_keep`` dropped): the mask every loss term, normaliser and metric of the update reads."""
        mask = self.batch.mask
        return mask if self.row_keep is None else mask * self.row_keep.to(mask.dtype).unsqueeze(-1)

    def trained_targets(self, with_returns: bool) -> tuple[list[list[float]], list[list[float]]]:
        """``(advantages, returns)`` per row over its valid tokens (``Rollout.advantages``, ``.returns``);
        returns empty when ``with_returns`` is False (no critic)."""
        lengths = self.batch.token_mask.sum(-1).long().tolist()
        advantages = [row[:n].tolist() for row, n in zip(self.advantages.float().cpu(), lengths)]
        returns = [row[:n].tolist() for row, n in zip(self.returns.float().cpu(), lengths)] if with_returns else []
        return advantages, returns

    def rows(self, index: torch.Tensor) -> Experience:
        """The sub-experience of the given rows (without ``first_values``)."""
        picked: dict[str, Any] = {name: getattr(self, name) for name in TOKEN_FIELDS + ROW_FIELDS}
        cut: dict[str, Any] = {name: None if t is None else t[index] for name, t in picked.items()}
        return dataclasses.replace(self, batch=self.batch.rows(index), first_values=None, **cut)

    def micro(self, index: torch.Tensor) -> Experience:
        """The rows of one micro-batch, cut to their own widths (``PackedBatch.trimmed``): the
        forward pass then processes their tokens, not the padding of the batch's longest row."""
        part = self.rows(index)
        batch = part.batch.trimmed()
        width = batch.mask.shape[1]
        cut = {name: getattr(part, name)[:, :width] for name in TOKEN_FIELDS if getattr(part, name) is not None}
        return dataclasses.replace(part, batch=batch, **cut)


TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "old_values", "rewards", "advantages", "returns", "prox_logprobs",
                "same_version")
"""The ``[B, T]`` fields of an ``Experience`` (cut with the response columns)."""

ROW_FIELDS = ("scores", "generator_ids", "row_keep")
"""The ``[B]`` fields of an ``Experience``."""


def check_staleness(versions: Sequence[int], learner_version: int, max_staleness: int) -> None:
    """Refuse rows the learner must not train on: ``RuntimeError`` naming their policy versions.

    A row sampled by version v is trainable when ``learner_version - max_staleness <= v <=
    learner_version``: with k = 0 (the synchronous iteration) only the learner's own version; in
    asynchronous mode up to k versions older. A newer row cannot come from this learner at all. The
    driver drops rows staler than k before sending (``async/dropped_rows``): this is the defensive check.
    """
    if max_staleness == 0:
        stale = {v for v in versions if v != learner_version}
        if stale:
            raise RuntimeError(f"on-policy PPO refuses a stale rollout: generated by policy version(s) "
                               f"{sorted(stale)}, learner is at version {learner_version}")
        return
    newer = sorted({v for v in versions if v > learner_version})
    older = sorted({v for v in versions if v < learner_version - max_staleness})
    if newer or older:
        what = [f"version(s) {newer} newer than the learner" if newer else "",
                f"version(s) {older} older than rollout.max_staleness={max_staleness} allows" if older else ""]
        raise RuntimeError(f"the learner at policy version {learner_version} accepts rows of versions "
                           f"{learner_version - max_staleness}..{learner_version} (rollout.max_staleness="
                           f"{max_staleness}); this rollout has rows of " + " and ".join(w for w in what if w))


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


def _proximal_inputs(
    rows: RolloutTensors, settings: ExperienceSettings, proximal: ProximalPolicy | None, collective: Collective,
    fused: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(prox_logprobs [B, T], same_version [B, T] bool)`` in asynchronous mode (k > 0) and under
    rollout correction (``correction.truncated_is``: every row is of the learner's version, mu its
    generator's numerics); ``(None, None)`` in the synchronous iteration without it. ``fused``: the
    update's forward gives pi_prox (``proximal.fused_proximal``), so no pass runs and
    ``prox_logprobs`` is None."""
    if settings.max_staleness == 0 and not settings.correction.truncated_is:
        return None, None
    batch, chunks, budget = rows.batch, settings.ppo.minibatches, settings.micro_batch_tokens
    if proximal is None:
        raise ValueError("asynchronous mode and rollout correction need the proximal policy pi_prox")
    if settings.max_staleness == 0:
        same_version = batch.mask.bool()
    elif rows.versions is None:
        raise ValueError(f"asynchronous mode needs every row's policy_version ({len(rows)} rows)")
    else:  # per token: a partial rollout's row holds tokens of several versions (Rollout.token_versions)
        same_version = (rows.versions == proximal.version) & batch.mask.bool()
    return None if fused else proximal_logprobs(proximal, batch, chunks, budget, collective), same_version


def _gae_targets(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, bootstrap: torch.Tensor, cfg: PPOConfig,
    log_ratio: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` [B, T]: GAE; or, when ``log_ratio`` = log pi_prox - log mu is
    given (asynchronous mode) and ``cfg.value_targets`` is ``vtrace``, the V-trace returns of
    ``ppo.compute_offpolicy_targets`` with its Retrace-style advantages
    (``offpolicy_advantages=retrace``) or GAE's (``gae``, over the same values)."""
    if log_ratio is None or cfg.value_targets == "gae":
        return ppo.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam, bootstrap)
    advantages, returns = ppo.compute_offpolicy_targets(rewards, values, mask, log_ratio, cfg.gamma, cfg.lam,
                                                        cfg.vtrace_rho_clip, cfg.vtrace_c_clip, bootstrap)
    if cfg.offpolicy_advantages == "gae":
        advantages, _ = ppo.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam, bootstrap)
    return advantages, returns


def batch_group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int, estimator: GroupEstimator, std_floor: float,
    collective: Collective,
) -> torch.Tensor:
    """``[B]`` the group estimator's A_i of this rank's rows, from the statistics of each group's
    rows on *every* rank (all-reduced), so a group split across ranks is still one group.
    ``group_ids`` [B] index the batch's groups, all below ``num_groups``."""
    counts = collective.sum(group_math.group_sums(torch.ones_like(scores), group_ids, num_groups))
    means = collective.sum(group_math.group_sums(scores, group_ids, num_groups)) / counts.clamp(min=1.0)
    # Centred in a second pass (not E[r^2] - E[r]^2, which cancels catastrophically).
    deviations = (scores.to(torch.float64) - means[group_ids]).square()
    squared = collective.sum(group_math.group_sums(deviations, group_ids, num_groups))
    extremes = collective.max(group_math.group_extremes(scores, group_ids, num_groups))
    return group_math.group_advantages(scores, group_ids, counts, means, squared, extremes, estimator, std_floor)


def _advantages(
    rewards: torch.Tensor, kl_rewards: torch.Tensor, task_scores: torch.Tensor, values: torch.Tensor,
    mask: torch.Tensor, bootstrap: torch.Tensor, cfg: PPOConfig, log_ratio: torch.Tensor | None,
    group_ids: torch.Tensor | None, num_groups: int, collective: Collective,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` [B, T] of ``cfg.advantage`` (``docs/estimators.md``), whitened over
    the global batch where the estimator says so; ``returns`` are 0 without a critic.
    ``kl_rewards`` [B, T] is the KL part of ``rewards`` (-beta KL_t under ``kl_mode=reward``, else 0);
    ``task_scores`` [B] each row's r_i without it; ``log_ratio`` [B, T] log(pi_prox / mu) of stale
    tokens (0 elsewhere; None: no row is stale)."""
    if cfg.advantage == "gae":
        advantages, returns = _gae_targets(rewards, values, mask, bootstrap, cfg, log_ratio)
        whiten = cfg.whiten_advantages
    elif cfg.advantage == "reinforce_pp":
        advantages, returns, whiten = discounted_returns(rewards, mask, cfg.gamma), torch.zeros_like(values), True
    else:
        if group_ids is None:
            raise ValueError(f"ppo.advantage={cfg.advantage} needs each row's group id (Rollout.group_id)")
        # The group step sees the task score r_i itself: its std would turn the rounding noise of
        # beta sum_t KL_t (or of sum_t (r_t - r_KL,t), ~1e-8 in float32) into advantages of ~0.01
        # to 1 in a group of equal scores. The KL (kl_mode=reward) then enters each token as its
        # reward-to-go, -beta sum_{k>=t} KL_k (OpenRLHF's order).
        per_row = batch_group_advantages(task_scores, group_ids, num_groups, cfg.advantage, cfg.group_std_floor,
                                         collective)
        advantages = per_row[:, None] * mask.to(per_row.dtype) + discounted_returns(kl_rewards, mask, cfg.gamma)
        returns = torch.zeros_like(values)
        whiten = cfg.advantage == "reinforce_pp_baseline"
    if whiten:
        advantages = ppo.whiten_from_moments(advantages, mask, collective.sum(ppo.masked_moments(advantages, mask)))
    return advantages, returns


def _critic_values(critic: torch.nn.Module | None, batch: PackedBatch, first_rows: torch.Tensor | None, budget: int,
                   collective: Collective) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(values [B, T], last_values [B], first_values [b, T] or None)`` of the experience pass.

    With ``first_rows`` the other rows go first without gradient, then those rows with it (the
    last forward before that graph's backward, as DeepSpeed expects); the graph is kept in
    ``first_values`` so the first minibatch needs no value forward of its own. The rows without
    gradient run in micro-batches of ``budget`` padded tokens (0: one pass). Without a critic
    (a critic-free estimator) the values are 0 and nothing runs."""
    if critic is None:
        return torch.zeros_like(batch.mask), torch.zeros_like(batch.mask[:, 0]), None
    rest = torch.ones(batch.mask.shape[0], dtype=torch.bool, device=batch.mask.device)
    if first_rows is not None:
        rest[first_rows] = False
    # Every rank runs the passes of the rest (under ZeRO-3 a forward is a collective): a rank whose
    # rows are all in the first minibatch runs a placeholder row and discards it.
    others = batch.rows(rest if rest.any() else slice(0, 1))
    values, last_values = batched_forward(lambda b: critic_forward(critic, b), others,
                                          forward_batches(others, budget, 1), collective, budget > 0)
    if first_rows is None:
        return values, last_values, None
    with torch.enable_grad():  # at the rows' own widths (and packed, by pack_mode), as the update's pass would be
        first_values, first_last = critic_forward(critic, batch.rows(first_rows).trimmed())
        first_values = torch.nn.functional.pad(first_values, (0, batch.mask.shape[1] - first_values.shape[1]))
    all_values, all_last = first_values.new_zeros(batch.mask.shape), first_last.new_zeros(batch.mask.shape[0])
    if rest.any():
        all_values[rest], all_last[rest] = values, last_values
    all_values[first_rows], all_last[first_rows] = first_values.detach(), first_last.detach()
    return all_values, all_last, first_values


@torch.no_grad()
def make_experience(
    rows: RolloutTensors,
    critic: torch.nn.Module | None,
    kl_coef: float,
    settings: ExperienceSettings,
    collective: Collective = LocalCollective(),
    proximal: ProximalPolicy | None = None,
    fused: bool = False,
) -> tuple[Experience, dict[str, float]]:
    """Values, shaped rewards, advantages and returns, and (global) whitening for this rank's rows.

    ``critic`` None: a critic-free estimator (``settings.ppo.advantage``), values 0. ``kl_coef`` is
    beta, in the reward or the loss (``ppo.kl_mode``). ``settings.max_staleness`` = k > 0 is
    asynchronous mode: ``proximal`` (required then) gives log pi_prox, the policy being improved,
    which the reward's KL term uses instead of mu's; the targets are ``ppo.compute_offpolicy_targets``'s
    under ``value_targets=vtrace``. With k = 0 ``proximal`` is not used unless
    ``settings.correction.truncated_is``: then the generator's log-probs are mu, the behaviour
    policy, in the synchronous iteration too, and the update is the decoupled loss (rows outside the
    geometric-mean band masked under ``correction.geo_mask``, ``ppo.geo_mask_bound``). The critic
    forward of ``rows.first_rows`` is kept for the update (``Experience.first_values``); the group
    ids are below ``rows.num_groups`` on every rank. The forward passes without gradient (values,
    log pi_prox) run in micro-batches of ``settings.micro_batch_tokens`` padded tokens (0:
    unbucketed), packed as ``rows.batch.pack_mode`` says. A rollout without ``ref_logprobs``
    (kl_coef = 0: no reference was loaded) has no KL anywhere. ``fused`` (``proximal.fused_proximal``
    holds): the update's one forward gives log pi_prox, so no pass runs here; ``prox_logprobs``,
    ``row_keep``, ``kl_ref`` and the ``kl/*``, ``offpolicy/*`` figures are left for ``ppo_update``.
    """
    cfg, batch, mask, old_logprobs = settings.ppo, rows.batch, rows.batch.mask, rows.old_logprobs
    prox_logprobs, same_version = _proximal_inputs(rows, settings, proximal, collective, fused)
    # The KL term is of the policy being improved: pi_old (= mu) in lock-step, pi_prox otherwise
    # (fused: the reward has no KL term, and the figures of pi_prox's come after the update's forward).
    policy_logprobs = old_logprobs if prox_logprobs is None else prox_logprobs
    has_reference = rows.ref_logprobs is not None
    ref_logprobs = policy_logprobs if rows.ref_logprobs is None else rows.ref_logprobs
    values, last_values, first_values = _critic_values(critic, batch, rows.first_rows, settings.micro_batch_tokens,
                                                       collective)
    reward_kl_coef = kl_coef if cfg.kl_mode == "reward" else 0.0
    rewards, bootstrap, task_scores = _shaped_rewards(rows, last_values, policy_logprobs, ref_logprobs,
                                                      reward_kl_coef, cfg.kl_estimator, settings.truncation)
    # The KL part of r_t alone (-beta KL_t): the group estimators keep it out of their statistics.
    kl_rewards = ppo.shape_rewards(torch.zeros_like(rows.scores), policy_logprobs, ref_logprobs, mask, reward_kl_coef,
                                   cfg.kl_estimator)
    # The value targets correct for staleness only: on tokens pi_prox's own version sampled the
    # ratio is numerics (bf16), and V-trace's traces min(1, pi_prox / mu) would shrink the targets on
    # noise alone (0.06 instead of 1 at token 0 of a 200-token row at |log ratio| ~ 0.03). Fused: no
    # token is stale, so the ratio is 0 on every token, as the pass would have given.
    log_ratio = torch.zeros_like(old_logprobs) if prox_logprobs is None else (prox_logprobs - old_logprobs) * mask
    stale_ratio = (None if settings.max_staleness == 0 or same_version is None
                   else log_ratio.masked_fill(same_version, 0.0))
    advantages, returns = _episode_advantages(rewards, kl_rewards, task_scores, values, mask, bootstrap, cfg,
                                              stale_ratio, rows.group_ids, rows.num_groups, collective,
                                              rows.episodes)
    terms = (ProximalTerms(None, None, {}) if fused else
             proximal_terms(policy_logprobs, old_logprobs, rows.ref_logprobs, mask, cfg, settings.correction.geo_mask,
                            prox_logprobs is not None, collective))
    stats = dict(terms.stats)
    if critic is not None:
        stats |= value_stats(values, returns, mask, collective)
    exp = Experience(batch=batch, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, old_values=values,
                     rewards=rewards, advantages=advantages, returns=returns, scores=rows.scores,
                     generator_ids=rows.generator_ids, prox_logprobs=prox_logprobs, same_version=same_version,
                     first_values=first_values, row_keep=terms.row_keep, truncated_is=settings.correction.truncated_is,
                     loss_kl_coef=kl_coef if cfg.kl_mode == "loss" and has_reference else 0.0,
                     kl_ref=None if terms.kl is None else terms.kl.mean)
    return exp, stats


def _shaped_rewards(
    rows: RolloutTensors, last_values: torch.Tensor, policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
    kl_coef: float, kl_estimator: KLEstimator, rule: TruncationRule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards [B, T], bootstrap [B], task_scores [B])``: the shaped reward (docs/algorithm.md) of
    each row after the length rules (the overlong ramp, then the truncation rule) with -kl_coef KL_t
    on every action token; an episode's turn rewards on each turn's last action token (earned, so
    kept whatever the truncation rule does with the final score). ``task_scores`` is what the row
    earned without the KL: the score after the length rules plus its turn rewards (the group
    estimators' r_i)."""
    mask = rows.batch.mask
    # The overlong ramp counts the policy's own tokens (an episode's actions): a long tool output is
    # not the policy's length (single-turn rows: every response token is an action).
    lengths = mask.sum(-1)
    scores = rows.scores + overlong_penalty(lengths, rule.max_new_tokens, rule.overlong_buffer, rule.overlong_penalty)
    # A cut row: either V(S_T) stands in for its score (bootstrap) or the cut is final (terminal).
    returned, bootstrap = ppo.truncation_targets(scores, last_values, rows.truncated, rule.mode,
                                                 rule.missing_eos_penalty)
    rewards = ppo.shape_rewards(returned, policy_logprobs, ref_logprobs, mask, kl_coef, kl_estimator)
    task_scores = returned.to(rewards.dtype)
    if rows.turn_rewards is not None and rows.turn_ends is not None:  # set together (RolloutTensors.of)
        rewards = ppo.add_turn_rewards(rewards, rows.turn_ends, rows.turn_rewards)
        task_scores = task_scores + ppo.add_turn_rewards(torch.zeros_like(rewards), rows.turn_ends,
                                                         rows.turn_rewards).sum(dim=-1)
    return rewards, bootstrap, task_scores


def _episode_advantages(
    rewards: torch.Tensor, kl_rewards: torch.Tensor, task_scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
    bootstrap: torch.Tensor, cfg: PPOConfig,
    log_ratio: torch.Tensor | None, group_ids: torch.Tensor | None, num_groups: int, collective: Collective,
    multi_turn: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_advantages``; for multi-turn episodes over their action tokens only (``ppo.gather_actions``):
    the recursions step from a turn's last action to the next turn's first, through the observation."""
    if not multi_turn:
        return _advantages(rewards, kl_rewards, task_scores, values, mask, bootstrap, cfg, log_ratio, group_ids,
                           num_groups, collective)
    action_rewards, action_kl_rewards, action_values = (ppo.gather_actions(x, mask) for x in (rewards, kl_rewards, values))
    ratio = None if log_ratio is None else ppo.gather_actions(log_ratio, mask)
    advantages, returns = _advantages(action_rewards, action_kl_rewards, task_scores, action_values,
                                      ppo.gathered_mask(mask), bootstrap, cfg, ratio, group_ids, num_groups, collective)
    return ppo.scatter_actions(advantages, mask), ppo.scatter_actions(returns, mask)
