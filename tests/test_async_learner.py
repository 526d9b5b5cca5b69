"""The learner's side of asynchronous mode (docs/async.md, "Off-policy corrections"), in this process.

Real models (the embedded tiny Llama as policy and critic) and real tensors; rollouts are built
by hand so that the behaviour log-probs mu can be set exactly: equal to the learner's own
recomputation (mu = pi_prox), or shifted on chosen tokens (a stale behaviour policy). No Ray,
no DeepSpeed: ``make_experience`` + ``ppo_update`` with a torch AdamW step, as the reference
trainer runs them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading

import pytest
import torch

from rayppo.config.derived import Correction, rollout_correction
from rayppo.config.schema import PPOConfig
from rayppo.data.rollout import Rollout
from rayppo.learner import ppo
from rayppo.learner.collective import LocalCollective
from rayppo.learner.experience import Experience, check_staleness, make_experience
from rayppo.learner.experience_passes import ProximalPolicy, proximal_logprobs
from rayppo.learner.guard import LogprobMismatchError, MismatchGuard
from rayppo.learner.learn_settings import ExperienceSettings, LearnSettings, StepInputs
from rayppo.learner.lr_schedule import lr_scaler
from rayppo.learner.minibatches import Minibatch, ShardPlan, first_rows_kept, local_minibatches, minibatch_plan
from rayppo.learner.rollout_tensors import RolloutTensors, padded, truncated
from rayppo.learner.update import LearnerModels, OptimiserSteps, ppo_update, same_version_mismatch
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.loading import Critic, load_causal_lm, prepare_for_training
from rayppo.models.sequences import PackedBatch, critic_forward, pack, policy_forward

TEMPERATURE = 0.8  # not 1, so a pass that forgot the temperature would not match the sampler's
KL_COEF = 0.1
LENGTHS = [5, 2, 7, 4, 6, 3]  # ragged responses: padding in every batch


@pytest.fixture(scope="module")
def models(embedded_dir):
    """(policy, critic) in train mode, dropout off, as the learner holds them; tests copy them."""
    policy = prepare_for_training(load_causal_lm(embedded_dir), gradient_checkpointing=False)
    critic = prepare_for_training(Critic.from_pretrained(embedded_dir), gradient_checkpointing=False)
    return policy, critic


def _copies(models) -> tuple[torch.nn.Module, torch.nn.Module]:
    return copy.deepcopy(models[0]), copy.deepcopy(models[1])


def _rollout(tokenizer, versions: list[int], seed: int = 0) -> Rollout:
    """Rows with random prompts and responses: even rows end with EOS (``stop``), odd rows are cut
    (``length``, bootstrapped); log-probs are filled in by ``_set_logprobs``."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = len(versions), len(tokenizer)
    prompts = [torch.randint(4, vocab, (3 + i % 3,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(4, vocab, (LENGTHS[i % 6],), generator=g).tolist() for i in range(n)]
    for i in range(0, n, 2):
        responses[i][-1] = tokenizer.eos_token_id
    reasons = ["stop" if i % 2 == 0 else "length" for i in range(n)]
    rollout = Rollout(prompts, responses, [[0.0] * len(r) for r in responses], reasons, [""] * n, [""] * n,
                      list(versions), [i % 2 for i in range(n)])
    rollout.score = torch.randn(n, generator=g).tolist()
    return rollout


def _learner_logprobs(policy, rollout: Rollout, pad_id: int, chunks: int) -> torch.Tensor:
    """[B, T] the learner's recomputation, by the same pass (and chunking) ``make_experience`` runs."""
    batch = pack(rollout.prompt_ids, rollout.response_ids, pad_id)
    return proximal_logprobs(ProximalPolicy(policy, TEMPERATURE, 0), batch, chunks)


def _set_logprobs(rollout: Rollout, mu: torch.Tensor, ref_shift: float = 0.3) -> None:
    """The generator's (behaviour) log-probs := ``mu`` row by row; ref = mu - ref_shift (KL != 0)."""
    rollout.logprobs = [mu[i, : len(r)].tolist() for i, r in enumerate(rollout.response_ids)]
    rollout.ref_logprobs = [[x - ref_shift for x in row] for row in rollout.logprobs]


def _stepper(policy, critic):
    """Backward + AdamW step of policy and critic, as the reference trainer's ``_step``."""
    popt, copt = torch.optim.AdamW(policy.parameters(), lr=1e-3), torch.optim.AdamW(critic.parameters(), lr=1e-3)

    def step() -> None:
        popt.step()
        copt.step()
        popt.zero_grad(set_to_none=True)
        copt.zero_grad(set_to_none=True)

    return OptimiserSteps(torch.Tensor.backward, torch.Tensor.backward, step, lr_scaler(popt, 1e-3, copt, 1e-3))


def _minibatches(exp: Experience, cfg: PPOConfig) -> list[Minibatch]:
    plan = minibatch_plan(exp.batch.mask.shape[0], cfg.epochs, cfg.minibatches, seed=3)
    return local_minibatches(ShardPlan(plan, torch.arange(exp.batch.mask.shape[0]), exp.batch.lengths()),
                             LocalCollective())


def _learner(policy, critic) -> LearnerModels:
    """``policy`` and ``critic`` stepped by ``_stepper``, in this process."""
    return LearnerModels(policy, critic, _stepper(policy, critic), LocalCollective(), "cpu", 0)


def _params(*modules: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def _forward_counter(module: torch.nn.Module) -> list[int]:
    """A list whose one element counts ``module``'s forward passes from now on."""
    count = [0]
    module.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def _auto(max_staleness: int) -> Correction:
    """The rollout correction ``auto`` resolves to in float32: ``tis`` in asynchronous mode, else none."""
    return rollout_correction(PPOConfig(), "float32", max_staleness)


def _plan(settings: ExperienceSettings, rows: RolloutTensors, guard: MismatchGuard | None = None,
          first_rows: torch.Tensor | None = None) -> UpdatePlan:
    """The learn step's plan for ``rows`` at T = ``TEMPERATURE`` and beta = ``KL_COEF``, checked by
    ``guard``; the critic forward of the first minibatch's ``first_rows`` kept."""
    step = StepInputs(iteration=0, version=0, kl_coef=KL_COEF)
    plan = UpdatePlan.decide(LearnSettings(settings, temperature=TEMPERATURE), step, rows, first_rows)
    return dataclasses.replace(plan, guard=guard)


def _train(models, rollout, pad_id, cfg, max_staleness, version=0, guard=None):
    """One ``make_experience`` + ``ppo_update`` on copies of ``models``; returns
    (experience, stats, policy, critic, policy forwards during make_experience)."""
    policy, critic = _copies(models)
    forwards = _forward_counter(policy)
    tensors = RolloutTensors.of(rollout, pad_id)
    plan = _plan(ExperienceSettings(cfg, max_staleness=max_staleness, correction=_auto(max_staleness)), tensors,
                 guard)
    exp, stats, _ = make_experience(tensors, critic, plan, proximal=ProximalPolicy(policy, TEMPERATURE, version))
    prox_forwards = forwards[0]
    stats |= ppo_update(_learner(policy, critic), exp, _minibatches(exp, cfg), plan)
    return exp, stats, policy, critic, prox_forwards


# ------------------------------------------------------------------------------------------
# (a) k = 0: exactly the synchronous iteration
# ------------------------------------------------------------------------------------------
def _hand_written_sync_update(policy, critic, rollout: Rollout, pad_id: int, cfg: PPOConfig, minibatches):
    """Today's synchronous iteration, written out with the functions of ppo.py: KL and ratios
    against the generator's log-probs, GAE, whitening, the clipped loss per minibatch."""
    batch = pack(rollout.prompt_ids, rollout.response_ids, pad_id)
    mask, old_logprobs, ref_logprobs = batch.mask, padded(rollout.logprobs), padded(rollout.ref_logprobs)
    with torch.no_grad():
        values, last_values = critic_forward(critic, batch)
    returned, bootstrap = ppo.truncation_targets(torch.tensor(rollout.score), last_values, truncated(rollout),
                                                 "bootstrap")
    rewards = ppo.shape_rewards(returned, old_logprobs, ref_logprobs, mask, KL_COEF, cfg.kl_estimator)
    advantages, returns = ppo.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam, bootstrap)
    advantages = ppo.masked_whiten(advantages, mask)
    step, first_gap = _stepper(policy, critic), None
    for (mb,) in minibatches:  # one micro-batch each, cut to its own widths as ppo_update does
        part, rows = batch.rows(mb.rows).trimmed(), mb.rows
        width = part.mask.shape[1]
        old, adv = old_logprobs[rows][:, :width], advantages[rows][:, :width]
        logprobs, entropy = policy_forward(policy, part, TEMPERATURE, with_entropy=True, entropy_grad=False)
        pg_loss, _ = ppo.policy_loss(logprobs, old, adv, part.mask, ppo.Surrogate(cfg.clip_eps))
        if first_gap is None:
            first_gap = (logprobs.detach() - old).abs() * part.mask
        (mb.token_share * pg_loss - mb.token_share * cfg.entropy_coef * ppo.masked_mean(entropy, part.mask)).backward()
        new_values, _ = critic_forward(critic, part)
        vf_loss = ppo.value_loss(new_values, values[rows][:, :width], returns[rows][:, :width], part.mask,
                                 cfg.value_clip)
        (mb.token_share * cfg.vf_coef * vf_loss).backward()
        step.step()
    return rewards, advantages, returns, first_gap


def test_synchronous_path_is_todays_iteration_bit_for_bit(models, tokenizer):
    """max_staleness = 0, even with a proximal policy at hand: no log pi_prox pass, KL and ratios
    against the generator's log-probs, GAE, the first minibatch's mismatch: the same parameters,
    to the bit, as the iteration written out by hand."""
    cfg = PPOConfig(epochs=2, minibatches=2)
    rollout = _rollout(tokenizer, versions=[0] * 6)
    # A behaviour policy slightly off the learner, so that ratios and KL are not trivially 1 and 0.
    mu = _learner_logprobs(models[0], rollout, tokenizer.pad_token_id, 1)
    _set_logprobs(rollout, mu - 0.05 * torch.rand(mu.shape, generator=torch.Generator().manual_seed(1)))
    exp, stats, policy, critic, prox_forwards = _train(models, rollout, tokenizer.pad_token_id, cfg, max_staleness=0)
    assert prox_forwards == 0 and exp.prox_logprobs is None and exp.same_version is None
    assert not any(k.startswith("offpolicy/") for k in stats) and "logprob_mismatch/rows" not in stats

    hand_policy, hand_critic = _copies(models)
    rewards, advantages, returns, first_gap = _hand_written_sync_update(
        hand_policy, hand_critic, rollout, tokenizer.pad_token_id, cfg, _minibatches(exp, cfg))
    assert torch.equal(exp.rewards, rewards) and torch.equal(exp.advantages, advantages)
    assert torch.equal(exp.returns, returns)
    assert all(torch.equal(a, b) for a, b in zip(_params(policy, critic), _params(hand_policy, hand_critic)))
    assert not all(torch.equal(a, b) for a, b in zip(_params(policy), _params(models[0])))  # it did train
    assert stats["logprob_mismatch/max"] == float(first_gap.max())


# ------------------------------------------------------------------------------------------
# (b) asynchronous mode with no stale row and mu = pi_prox: the synchronous update
# ------------------------------------------------------------------------------------------
def test_async_update_with_fresh_rows_and_mu_equal_to_prox_is_the_synchronous_update(models, tokenizer):
    """Every row of the learner's version and mu = the learner's recomputation (the same pass, so
    the same floats): log pi_prox - log mu = 0 exactly, hence w = exp(0) = 1 and q = 1 exactly.
    Multiplying by 1.0 is exact in fp32, V-trace with q = 1 runs GAE's operations on the same
    numbers (tests/test_offpolicy.py), and the KL term reads equal tensors: the update is the
    synchronous one to the bit, so the parameters are compared with torch.equal, no tolerance."""
    cfg = PPOConfig(epochs=2, minibatches=2)
    rollout = _rollout(tokenizer, versions=[4] * 6)
    _set_logprobs(rollout, _learner_logprobs(models[0], rollout, tokenizer.pad_token_id, cfg.minibatches))
    sync_exp, sync_stats, sync_policy, sync_critic, _ = _train(models, rollout, tokenizer.pad_token_id, cfg, 0)
    exp, stats, policy, critic, prox_forwards = _train(models, rollout, tokenizer.pad_token_id, cfg, 1, version=4)
    assert prox_forwards == cfg.minibatches  # log pi_prox computed once, in ppo.minibatches chunks
    assert torch.equal(exp.advantages, sync_exp.advantages) and torch.equal(exp.returns, sync_exp.returns)
    assert torch.equal(exp.rewards, sync_exp.rewards)
    assert all(torch.equal(a, b) for a, b in zip(_params(policy, critic), _params(sync_policy, sync_critic)))
    for key in ("policy/clipfrac", "policy/approx_kl", "policy/loss", "value/loss", "kl/ref_mean"):
        assert stats[key] == sync_stats[key], key
    assert stats["policy/is_weight_mean"] == 1.0 and stats["policy/is_clipfrac"] == 0.0
    assert stats["offpolicy/is_ratio_mean"] == 1.0 and stats["offpolicy/is_ratio_max"] == 1.0
    assert stats["logprob_mismatch/max"] == 0.0 and stats["logprob_mismatch/rows"] == 6


# ------------------------------------------------------------------------------------------
# (c) stale rows: V-trace targets, the KL of pi_prox, truncated importance weights
# ------------------------------------------------------------------------------------------
def _stale_behaviour(prox: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
    """mu on stale rows: log pi_prox + 0.5 on even tokens (q = e^-0.5 < 1: V-trace cuts the trace)
    and - 1.0 on odd tokens (q = e > is_clip = 2: the loss's weight is truncated to 2)."""
    odd = torch.arange(prox.shape[1]) % 2 == 1
    shift = torch.where(odd, -1.0, 0.5)[None, :] * stale[:, None]
    return prox + shift


@pytest.mark.parametrize("value_targets, advantages", [("vtrace", "gae"), ("vtrace", "retrace"), ("gae", "gae")])
def test_stale_rows_get_offpolicy_targets_prox_kl_and_truncated_weights(models, tokenizer, value_targets, advantages):
    # One minibatch: the pi_prox pass is one forward over the batch, and the loss's weights are
    # those of every token at the start (w does not depend on theta).
    cfg = PPOConfig(epochs=1, minibatches=1, whiten_advantages=False, value_targets=value_targets,
                    offpolicy_advantages=advantages)
    versions = [3, 2, 3, 1, 2, 3]
    rollout = _rollout(tokenizer, versions)
    prox = _learner_logprobs(models[0], rollout, tokenizer.pad_token_id, cfg.minibatches)
    stale = torch.tensor([v != 3 for v in versions], dtype=torch.float32)
    _set_logprobs(rollout, _stale_behaviour(prox, stale))
    policy, critic = _copies(models)
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    plan = _plan(ExperienceSettings(cfg, max_staleness=2, correction=_auto(2)), tensors)
    exp, stats, _ = make_experience(tensors, critic, plan, proximal=ProximalPolicy(policy, TEMPERATURE, 3))
    batch, mask = exp.batch, exp.batch.mask
    assert torch.equal(exp.prox_logprobs, policy_forward(policy, batch, TEMPERATURE)[0])  # the learner's weights
    # Per token, on the response tokens only: a row sampled by version 3 has all of them.
    assert torch.equal(exp.same_version, mask.bool() & torch.tensor([v == 3 for v in versions])[:, None])

    _, last_values = critic_forward(critic, batch)
    returned, bootstrap = ppo.truncation_targets(exp.scores, last_values, truncated(rollout), "bootstrap")
    rewards = ppo.shape_rewards(returned, exp.prox_logprobs, exp.ref_logprobs, mask, KL_COEF)
    assert torch.equal(exp.rewards, rewards)  # the KL term of pi_prox ...
    assert not torch.equal(rewards, ppo.shape_rewards(returned, exp.old_logprobs, exp.ref_logprobs, mask, KL_COEF))
    log_ratio = (exp.prox_logprobs - exp.old_logprobs) * mask
    vtrace = ppo.compute_offpolicy_targets(rewards, exp.old_values, mask, log_ratio,
                                           ppo.VTrace(cfg.gamma, cfg.lam, cfg.vtrace_rho_clip, cfg.vtrace_c_clip),
                                           bootstrap)
    gae = ppo.compute_gae(rewards, exp.old_values, mask, cfg.gamma, cfg.lam, bootstrap)
    expected, other = (vtrace, gae) if value_targets == "vtrace" else (gae, vtrace)
    assert torch.equal(exp.returns, expected[1])
    assert not torch.allclose(exp.returns, other[1])  # ... and the two kinds of target really differ here
    # V-trace's critic targets with GAE's or the Retrace-style advantages (which differ here too).
    assert torch.equal(exp.advantages, vtrace[0] if (value_targets, advantages) == ("vtrace", "retrace") else gae[0])
    assert not torch.allclose(vtrace[0], gae[0])
    # kl/ref_mean is pi_prox's k1 KL per response; two float64 roundings (x B, / B) in experience_stats.global_means.
    kl_prox = ppo.masked_sum_per_row(exp.prox_logprobs - exp.ref_logprobs, mask).mean()
    assert stats["kl/ref_mean"] == pytest.approx(float(kl_prox), rel=2 * 2**-53, abs=0)
    assert stats["offpolicy/is_ratio_max"] == float(torch.exp(log_ratio).max())  # e, on an odd stale token

    mb = _minibatches(exp, cfg)
    stats |= ppo_update(_learner(policy, critic), exp, mb, plan)
    rows = mb[0][0].rows  # the loss saw the rows in this order; the same order gives the same float sums
    weights = torch.clamp(torch.exp(exp.prox_logprobs - exp.old_logprobs), max=cfg.is_clip)
    assert stats["policy/is_weight_mean"] == float(ppo.masked_mean(weights[rows], mask[rows]))
    assert stats["policy/is_weight_mean"] != 1.0
    odd_stale = float(((torch.arange(mask.shape[1]) % 2 == 1)[None, :] * stale[:, None] * mask).sum())
    # One fp32 rounding of count / tokens, then exact conversion to float64.
    assert stats["policy/is_clipfrac"] == pytest.approx(odd_stale / float(mask.sum()), rel=2**-24, abs=0)


# ------------------------------------------------------------------------------------------
# (d) logprob_mismatch and the guard: rows of the learner's own version only
# ------------------------------------------------------------------------------------------
def _mixed_rollout(tokenizer, models, cfg, versions, learner_version):
    """Rows of the learner's version sampled with mu = pi_prox exactly; stale rows 3 nats off."""
    rollout = _rollout(tokenizer, versions, seed=5)
    prox = _learner_logprobs(models[0], rollout, tokenizer.pad_token_id, cfg.minibatches)
    stale = torch.tensor([v != learner_version for v in versions], dtype=torch.float32)
    _set_logprobs(rollout, prox - 3.0 * stale[:, None])
    return rollout


def test_mismatch_compares_only_rows_of_the_learners_version(models, tokenizer):
    cfg = PPOConfig(epochs=1, minibatches=2)
    guard = MismatchGuard(limit=1e-3, iteration=7)
    rollout = _mixed_rollout(tokenizer, models, cfg, versions=[5, 4, 5, 4, 4, 5], learner_version=5)
    exp, stats, policy, *_ = _train(models, rollout, tokenizer.pad_token_id, cfg, 1, version=5, guard=guard)
    # The stale rows are 3 nats off and neither trip the guard nor enter the figures.
    assert stats["logprob_mismatch/max"] == 0.0 and stats["logprob_mismatch/mean"] == 0.0
    assert stats["logprob_mismatch/rows"] == 3

    # No row of the learner's version: nothing compared, NaN figures, no verdict.
    stale_only = _mixed_rollout(tokenizer, models, cfg, versions=[4] * 6, learner_version=5)
    _, stats, *_ = _train(models, stale_only, tokenizer.pad_token_id, cfg, 1, version=5, guard=guard)
    assert math.isnan(stats["logprob_mismatch/max"]) and math.isnan(stats["logprob_mismatch/mean"])
    assert stats["logprob_mismatch/rows"] == 0

    # A row of the learner's version 0.01 nats off on one token: the guard stops the update
    # before the first step, naming that row's generator.
    rollout.logprobs[2][1] += 0.01
    policy, critic = _copies(models)
    before = _params(policy, critic)
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    plan = _plan(ExperienceSettings(cfg, max_staleness=1), tensors, guard)
    exp, _, _ = make_experience(tensors, critic, plan, proximal=ProximalPolicy(policy, TEMPERATURE, 5))
    with pytest.raises(LogprobMismatchError, match=r"iteration 7: logprob_mismatch/max = 0\.01 .* on generator 0"):
        ppo_update(_learner(policy, critic), exp, _minibatches(exp, cfg), plan)
    assert all(torch.equal(a, b) for a, b in zip(_params(policy, critic), before))


class ThreadCollective:
    """``world_size`` ranks as threads of this process: every rank contributes its tensor, then
    reads the reduction of all (a barrier on each side), as an all-reduce does."""

    def __init__(self, world_size: int, rank: int, board: dict, barrier: threading.Barrier):
        self.world_size, self.rank, self.board, self.barrier = world_size, rank, board, barrier

    def _reduce(self, x: torch.Tensor, op) -> torch.Tensor:
        self.board[self.rank] = x.detach().clone()
        self.barrier.wait()
        out = op(torch.stack([self.board[r] for r in range(self.world_size)]))
        self.barrier.wait()  # nobody overwrites the board before every rank has read it
        return out

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, lambda s: s.sum(dim=0))

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, lambda s: s.amax(dim=0))


def test_a_row_continued_with_newer_weights_is_compared_on_its_newer_tokens_only(models, tokenizer):
    """Partial rollouts: a row whose first tokens came from version 4 and the rest from 5 (the
    learner's) is compared on the version-5 tokens; the version-4 ones are 3 nats off and neither
    trip the guard nor enter the figures, and a 2e-4 gap on a version-5 token does."""
    cfg = PPOConfig(epochs=1, minibatches=1)
    rollout = _mixed_rollout(tokenizer, models, cfg, versions=[5, 5, 5, 5], learner_version=5)
    cut = 2
    rollout.token_versions = [[4] * cut + [5] * (len(ids) - cut) for ids in rollout.response_ids]
    rollout.policy_version = [4] * 4  # the oldest token's
    for row in rollout.logprobs:
        row[:cut] = [x - 3.0 for x in row[:cut]]
    rollout.logprobs[2][cut] += 2e-4  # row 2 has 7 tokens
    guard = MismatchGuard(limit=1e-3, iteration=0)
    _, stats, *_ = _train(models, rollout, tokenizer.pad_token_id, cfg, 1, version=5, guard=guard)
    assert stats["logprob_mismatch/rows"] == 3  # row 1 has 2 tokens, both of version 4
    assert 1.5e-4 < stats["logprob_mismatch/max"] < 3e-4  # the 2e-4 gap, plus rounding (~1e-6)


def test_mismatch_is_global_over_ranks_when_a_rank_compares_no_row(models, tokenizer):
    """Rank 0 holds only stale rows, rank 1 the learner's-version rows (a few 1e-4 off): the
    figures over the two ranks are those of one process holding every row."""
    cfg = PPOConfig(epochs=1, minibatches=2)
    rollout = _mixed_rollout(tokenizer, models, cfg, versions=[4, 4, 4, 5, 4, 5], learner_version=5)
    rollout.logprobs[3][0] -= 1e-4
    rollout.logprobs[5][2] += 2e-4
    policy, critic = _copies(models)
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    plan = _plan(ExperienceSettings(cfg, max_staleness=1), tensors)
    exp, _, _ = make_experience(tensors, critic, plan, proximal=ProximalPolicy(policy, TEMPERATURE, 5))
    guard = MismatchGuard(limit=1e-3, iteration=0)
    whole = same_version_mismatch(exp, LocalCollective(), guard)
    shards, results, barrier, board = [torch.arange(0, 3), torch.arange(3, 6)], {}, threading.Barrier(2), {}

    def rank(r: int) -> None:
        results[r] = same_version_mismatch(exp.rows(shards[r]), ThreadCollective(2, r, board, barrier), guard)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results[0] == results[1]
    assert results[0]["logprob_mismatch/rows"] == whole["logprob_mismatch/rows"] == 2
    assert results[0]["logprob_mismatch/max"] == whole["logprob_mismatch/max"] > 0
    # Sums in float64 of a few float32 gaps: adding rank 0's exact 0 changes no bit.
    assert results[0]["logprob_mismatch/mean"] == whole["logprob_mismatch/mean"] > 0


# ------------------------------------------------------------------------------------------
# The pi_prox pass and the learner's version rule
# ------------------------------------------------------------------------------------------
def test_proximal_pass_runs_one_forward_per_chunk_even_on_a_short_shard(models, tokenizer):
    """Under ZeRO-3 a forward pass is a collective: a rank with fewer rows than chunks must still
    run as many passes as every other rank; the placeholder passes change no result."""
    rollout = _rollout(tokenizer, versions=[0] * 3)
    policy = copy.deepcopy(models[0])
    batch: PackedBatch = pack(rollout.prompt_ids, rollout.response_ids, tokenizer.pad_token_id)
    forwards = _forward_counter(policy)
    five = proximal_logprobs(ProximalPolicy(policy, TEMPERATURE, 0), batch, chunks=5)
    assert forwards[0] == 5
    # With 3 or 5 chunks each row is alone in its pass: the same floats.
    assert torch.equal(five, proximal_logprobs(ProximalPolicy(policy, TEMPERATURE, 0), batch, chunks=3))
    assert torch.equal(five * (1 - batch.mask), torch.zeros_like(five)) and not five.requires_grad


def test_check_staleness_accepts_exactly_the_window_of_max_staleness():
    check_staleness([3, 3], learner_version=3, max_staleness=0)
    with pytest.raises(RuntimeError, match=r"stale rollout: generated by policy version\(s\) \[2\], learner is at "
                                           r"version 3"):
        check_staleness([3, 2], learner_version=3, max_staleness=0)
    check_staleness([5, 4, 3], learner_version=5, max_staleness=2)
    with pytest.raises(RuntimeError, match=r"accepts rows of versions 3\.\.5 \(rollout.max_staleness=2\); this "
                                           r"rollout has rows of version\(s\) \[1, 2\] older than"):
        check_staleness([5, 2, 1, 3], learner_version=5, max_staleness=2)
    with pytest.raises(RuntimeError, match=r"version\(s\) \[6\] newer than the learner"):
        check_staleness([6, 5], learner_version=5, max_staleness=2)


# ------------------------------------------------------------------------------------------
# (f) no wasted pass: the first minibatch's value forward is the experience pass's
# ------------------------------------------------------------------------------------------
def _rows_counter(module: torch.nn.Module) -> list[int]:
    """A list whose one element counts the rows ``module``'s forward passes see from now on."""
    count = [0]
    module.register_forward_hook(lambda _m, args, _out: count.__setitem__(0, count[0] + args[0].shape[0]))
    return count


def test_first_minibatch_reuses_the_experience_value_pass(models, tokenizer):
    """With ``first_rows`` the critic sees B rows for the experience and B - b for the update
    (b = the first minibatch's rows), not 2B; and the update is the same one, in fp64 (rounding
    ~1e-16 relative, so 1e-9 leaves room only for rounding): values, every parameter after it."""
    cfg = PPOConfig(epochs=2, minibatches=3)
    rollout = _rollout(tokenizer, versions=[0] * 6)
    policy, critic = (m.double() for m in _copies(models))
    _set_logprobs(rollout, _learner_logprobs(policy, rollout, tokenizer.pad_token_id, 1).float())
    results = {}
    for reuse in (False, True):
        p, c = copy.deepcopy(policy), copy.deepcopy(critic)
        plan = minibatch_plan(6, cfg.epochs, cfg.minibatches, seed=3)
        rows = _rows_counter(c)
        minibatches = local_minibatches(ShardPlan(plan, torch.arange(6), rollout.lengths()), LocalCollective())
        first = first_rows_kept(minibatches) if reuse else None
        tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
        step_plan = _plan(ExperienceSettings(cfg), tensors, first_rows=first)
        exp, _, first_values = make_experience(tensors, c, step_plan)
        assert (first_values is not None) == reuse
        experience_rows = rows[0]
        ppo_update(_learner(p, c), exp, minibatches, step_plan, first_values)
        results[reuse] = (exp.old_values, _params(p, c), experience_rows, rows[0] - experience_rows)
    first_size = len(minibatch_plan(6, cfg.epochs, cfg.minibatches, seed=3)[0][0])
    assert results[False][2] == results[True][2] == 6
    assert results[False][3] == 2 * 6 and results[True][3] == 2 * 6 - first_size
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-9, atol=1e-12)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_kept_first_minibatch_runs_at_its_own_width(models, tokenizer):
    """The experience pass's kept value forward of the first minibatch, and the update's policy
    pass over those rows, are cut to the rows' own widths like every other pass (they ran at the
    whole batch's widths: on long-tailed lengths a first minibatch padded to the longest row)."""
    cfg = PPOConfig(epochs=1, minibatches=3)
    rollout = _rollout(tokenizer, versions=[0] * 6)
    policy, critic = _copies(models)
    _set_logprobs(rollout, _learner_logprobs(policy, rollout, tokenizer.pad_token_id, 1).float())
    plan = minibatch_plan(6, cfg.epochs, cfg.minibatches, seed=3)
    minibatches = local_minibatches(ShardPlan(plan, torch.arange(6), rollout.lengths()), LocalCollective())
    first = first_rows_kept(minibatches)
    prompt, response = rollout.lengths()
    own = max(prompt[i] for i in first.tolist()) + max(response[i] for i in first.tolist())
    assert own < max(prompt) + max(response)  # the first minibatch lacks the longest row: the test can fail
    shapes: dict[str, list[tuple[int, ...]]] = {"critic": [], "policy": []}
    for name, model in (("critic", critic), ("policy", policy)):
        model.register_forward_pre_hook(lambda _m, args, kwargs, name=name: shapes[name].append(
            tuple((args[0] if args else kwargs["input_ids"]).shape)), with_kwargs=True)
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    step_plan = _plan(ExperienceSettings(cfg), tensors, first_rows=first)
    exp, _, first_values = make_experience(tensors, critic, step_plan)
    assert shapes["critic"][-1] == (len(first), own)  # the kept forward, the experience pass's last
    ppo_update(_learner(policy, critic), exp, minibatches, step_plan, first_values)
    assert shapes["policy"][0] == (len(first), own)


def test_a_rank_without_first_minibatch_rows_still_runs_one_placeholder_row():
    """Under ZeRO-3 every rank must run the kept forward: a rank owning none of the first
    minibatch's rows keeps its row 0 (share 0), as ``local_minibatches`` does."""
    plan = [[torch.tensor([0, 1]), torch.tensor([2, 3])]]
    lengths = ([2, 2], [3, 3])
    first = local_minibatches(ShardPlan(plan, torch.tensor([0, 1]), lengths), LocalCollective())
    assert first_rows_kept(first).tolist() == [0, 1]
    second = local_minibatches(ShardPlan(plan, torch.tensor([2, 3]), lengths), LocalCollective())
    assert first_rows_kept(second).tolist() == [0]
    assert (second[0][0].token_share, second[0][0].row_share) == (0.0, 0.0)


def test_every_rank_runs_both_value_passes_even_when_all_its_rows_are_first(models, tokenizer):
    """Under ZeRO-3 a forward is a collective: a rank whose rows are all in the first minibatch
    still runs the other pass (a placeholder row, discarded), and its values are the one pass's."""
    cfg = PPOConfig(epochs=1, minibatches=1)
    rollout = _rollout(tokenizer, versions=[0] * 4)
    _set_logprobs(rollout, torch.zeros(4, max(LENGTHS)))
    critic = _copies(models)[1]
    calls = _forward_counter(critic)
    everything = torch.tensor([2, 0, 3, 1])
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    exp, _, first_values = make_experience(tensors, critic, _plan(ExperienceSettings(cfg), tensors,
                                                                  first_rows=everything))
    assert calls[0] == 2
    with torch.no_grad():
        values, _ = critic_forward(critic, exp.batch.rows(everything))
    torch.testing.assert_close(first_values.detach(), values)
    torch.testing.assert_close(exp.old_values[everything], values)
