"""log pi_prox from the update's own forward (``rayppo.learner.proximal``): the separate pass is
skipped exactly when ``fused_proximal`` says, and the update is then the one the pass would give.

One learn step (``step.learn``) in-process on the embedded model, as the in-process trainer runs
it; two ranks as threads (``ThreadCollective``) whose optimiser steps average their gradients, as
DeepSpeed's do.
"""

# ruff: noqa: F811 (the tests take the imported fixture ``models`` as a parameter)
from __future__ import annotations

import collections
import copy
import threading

import pytest
import torch

# ``models`` is test_async_learner's fixture (policy, critic), imported to be shared: pytest finds it by name.
from test_async_learner import TEMPERATURE, ThreadCollective, _learner_logprobs, _params, _rollout, models  # noqa: F401

import rayppo.learner.experience as experience
import rayppo.learner.step as step_module
from rayppo.config.load import load_config
from rayppo.learner.collective import Collective, LocalCollective
from rayppo.learner.guard import LogprobMismatchError
from rayppo.learner.lr_schedule import lr_scaler
from rayppo.learner.proximal import fused_proximal
from rayppo.learner.step import BatchShard, LearnerModels, LearnSettings, StepInputs, learn
from rayppo.learner.update import OptimiserSteps

VERSION = 3
BASE = ["ppo.epochs=1", "rollout.samples_per_prompt=2", "ppo.minibatches=1", "ppo.advantage=grpo", "ppo.kl_coef=0.0",
        "ppo.rollout_correction=tis+geo_mask", f"rollout.temperature={TEMPERATURE}", "ppo.entropy_coef=0.01"]


def _stepper(policy, critic, collective: Collective) -> OptimiserSteps:
    """Backward + AdamW step of each model, the gradients first averaged over the ranks."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (policy, critic) if m is not None]

    def step() -> None:
        for opt in opts:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = collective.sum(p.grad) / collective.world_size
            opt.step()
            opt.zero_grad(set_to_none=True)

    return OptimiserSteps(torch.Tensor.backward, torch.Tensor.backward if critic is not None else None, step,
                          lr_scaler(opts[0], 1e-3, opts[1] if len(opts) > 1 else None, 1e-3))


def _scenario(tokenizer, models, overrides: list[str], versions: list[int] | None = None, mu_shift: dict | None = None):
    """(config, rollout): six ragged rows in groups of two, whose mu is the learner's own log-probs (fp32: equal to
    rounding), shifted by ``mu_shift`` {(row, token) or row: nats}; a reference 0.3 nats off."""
    cfg = load_config(None, BASE + overrides)
    rollout = _rollout(tokenizer, versions or [VERSION] * 6)
    rollout.group_id = [i // 2 for i in range(len(rollout))]  # prompts of two samples (grpo)
    mu = _learner_logprobs(models[0], rollout, tokenizer.pad_token_id, 1)
    for where, shift in (mu_shift or {}).items():
        row, token = where if isinstance(where, tuple) else (where, slice(None))
        mu[row, token] += shift
    rollout.logprobs = [mu[i, : len(r)].tolist() for i, r in enumerate(rollout.response_ids)]
    rollout.ref_logprobs = [[x - 0.3 for x in row] for row in rollout.logprobs]
    return cfg, rollout


def _learn(models, tokenizer, cfg, rollout, kl_coef=0.0, rows=None, collective: Collective = LocalCollective(),
           copies: list | None = None):
    """One learn step on copies of ``models`` (this rank's ``rows``, default all; the copies also
    appended to ``copies``); returns (result, experience, policy, critic, policy forwards, log
    pi_prox passes)."""
    policy = copy.deepcopy(models[0])
    critic = copy.deepcopy(models[1]) if cfg.ppo.advantage == "gae" else None
    if copies is not None:
        copies += [policy, critic]
    forwards, before = [0], PASSES[threading.get_ident()]
    policy.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    rows = list(range(len(rollout))) if rows is None else rows
    shard = BatchShard(rollout.select(rows) if len(rows) < len(rollout) else rollout, rows, len(rollout))
    lm = LearnerModels(policy, critic, _stepper(policy, critic, collective), collective, "cpu", tokenizer.pad_token_id)
    result, exp = learn(lm, shard, StepInputs(iteration=0, version=VERSION, kl_coef=kl_coef), LearnSettings.of(cfg))
    return result, exp, policy, critic, forwards[0], PASSES[threading.get_ident()] - before


PASSES: collections.Counter[int] = collections.Counter()
"""Calls of ``experience.proximal_logprobs`` (the separate pass) by each thread (a rank)."""


@pytest.fixture(autouse=True)
def count_passes(monkeypatch):
    real = experience.proximal_logprobs

    def counted(*args, **kwargs):
        PASSES[threading.get_ident()] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(experience, "proximal_logprobs", counted)


def _separate(monkeypatch):
    """From now on the learn step never fuses: the separate pass, today's path."""
    monkeypatch.setattr(step_module, "fused_proximal", lambda *args: False)


# ------------------------------------------------------------------------------------------
# (1) the pass is skipped exactly when the predicate says
# ------------------------------------------------------------------------------------------
CASES = {  # name: (overrides, versions, kl_coef, fused)
    "one step, critic-free, tis+geo_mask": ([], None, 0.0, True),
    "one step, kl_mode=loss with a reference": (["ppo.kl_mode=loss"], None, 0.1, True),
    "one step, critic, tis only": (["ppo.advantage=gae", "ppo.rollout_correction=tis"], None, 0.0, True),
    "asynchronous, every row fresh": (["rollout.max_staleness=1", "ppo.rollout_correction=none"], None, 0.0, True),
    "two epochs": (["ppo.epochs=2"], None, 0.0, False),
    "two minibatches": (["ppo.minibatches=2"], None, 0.0, False),
    "a stale row": (["rollout.max_staleness=1", "ppo.rollout_correction=tis"], [VERSION - 1] + [VERSION] * 5, 0.0,
                    False),
    "kl_mode=reward, beta > 0": ([], None, 0.1, False),
    "critic with the geometric-mean mask": (["ppo.advantage=gae"], None, 0.0, False),
    "a minibatch cut into micro-batches": (["learner.micro_batch_tokens=24"], None, 0.0, False),
    "fp32 without correction: no pi_prox at all": (["ppo.rollout_correction=none"], None, 0.0, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_proximal_pass_is_skipped_exactly_when_the_predicate_says(name, models, tokenizer):
    """The predicate's answer for the case, and what the learn step ran: the separate pass (one
    call of ``proximal_logprobs``) exactly where pi_prox is used and the predicate says no."""
    overrides, versions, kl_coef, fused = CASES[name]
    cfg, rollout = _scenario(tokenizer, models, overrides, versions)
    settings = LearnSettings.of(cfg).experience
    cut = "learner.micro_batch_tokens=24" in overrides  # 24 tokens hold at most two of these rows: several passes
    reward_kl = cfg.ppo.kl_mode == "reward" and kl_coef != 0
    assert fused_proximal(settings, reward_kl, cfg.ppo.advantage == "gae", versions is not None, 2 if cut else 1) == fused
    _, _, _, _, forwards, passes = _learn(models, tokenizer, cfg, rollout, kl_coef)
    uses_prox = cfg.rollout.max_staleness > 0 or settings.correction.truncated_is
    assert passes == (1 if uses_prox and not fused else 0)
    if not cut:  # one forward per minibatch and epoch, plus the pass's (learner.micro_batch_tokens holds all rows)
        assert forwards == cfg.ppo.epochs * cfg.ppo.minibatches + passes


# ------------------------------------------------------------------------------------------
# (2) the fused update is the separate pass's
# ------------------------------------------------------------------------------------------
EQUAL = {  # name: (overrides, mu shifts, kl_coef)
    # Row 1's mu 0.1 nats above pi_prox on every token: outside geo_mask_bound = 0.04, dropped; row 3
    # is 0.1 off on one token of four, a mean of 0.025: kept, with an importance weight != 1.
    "critic-free, tis+geo_mask, a row dropped, kl_mode=loss": (["ppo.kl_mode=loss"], {1: 0.1, (3, 0): -0.1}, 0.1),
    "critic, tis": (["ppo.advantage=gae", "ppo.rollout_correction=tis"], {(2, 1): 0.3}, 0.0),
    "asynchronous, fresh rows, vtrace": (["rollout.max_staleness=1", "ppo.advantage=gae", "ppo.value_targets=vtrace",
                                          "ppo.rollout_correction=tis"], {(4, 2): -0.2}, 0.0),
}
LOOSE = ["checks.max_logprob_mismatch=10", "checks.max_logprob_kl=10"]  # the shifts above are on purpose


def _compare(fused, separate) -> None:
    """Same figures, experience and new weights, exactly. The two paths run the same ops on the
    same inputs: the pass (``learner.micro_batch_tokens`` holds every row: one pass) and the
    update's forward see the same rows, trimmed to the same width, only in another order (local vs
    the plan's shuffle). A CPU fp32 matmul reduces each output element over its inner dimension in
    an order that does not depend on the row's position in the batch, so the log-probs agree bit for
    bit (measured), and so does all that follows (the same functions on equal tensors). A kernel
    whose reduction order depended on the batch's layout (split-K on a GPU) would leave a few ulp
    (~1e-7 relative) in pi_prox, hence in the ratios and weights: then compare with that bound."""
    (r_f, exp_f, *models_f), (r_s, exp_s, *models_s) = fused, separate
    assert r_f.metrics.keys() == r_s.metrics.keys()
    for key, value in r_s.metrics.items():
        assert r_f.metrics[key] == value or (value != value and r_f.metrics[key] != r_f.metrics[key]), key
    assert r_f.kl_ref == r_s.kl_ref
    for name in ("prox_logprobs", "ref_logprobs", "row_keep", "advantages", "returns", "rewards"):
        a, b = getattr(exp_f, name), getattr(exp_s, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    for a, b in zip(_params(*(m for m in models_f if m is not None)), _params(*(m for m in models_s if m is not None))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(EQUAL))
def test_the_fused_update_is_the_separate_pass_update(name, models, tokenizer, monkeypatch):
    overrides, shifts, kl_coef = EQUAL[name]
    cfg, rollout = _scenario(tokenizer, models, overrides + LOOSE, mu_shift=shifts)
    fused = _learn(models, tokenizer, cfg, rollout, kl_coef)
    assert fused[-1] == 0  # no separate pass
    _separate(monkeypatch)
    separate = _learn(models, tokenizer, cfg, rollout, kl_coef)
    assert separate[-1] == 1
    if 1 in shifts:
        assert separate[1].row_keep.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        assert separate[0].metrics["correction/masked_rows"] == pytest.approx(1 / 6)
    _compare(fused[:-2], separate[:-2])


def _two_ranks(models, tokenizer, cfg, rollout, kl_coef):
    """The learn step on two thread ranks holding rows 0-2 and 3-5; returns rank 0's outputs
    (rank 1's weights are checked equal to them: the averaged gradients keep the ranks in step)."""
    results, barrier, board = {}, threading.Barrier(2), {}

    def rank(r: int) -> None:
        results[r] = _learn(models, tokenizer, cfg, rollout, kl_coef, rows=[3 * r, 3 * r + 1, 3 * r + 2],
                            collective=ThreadCollective(2, r, board, barrier))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[0][0].metrics == results[1][0].metrics
    assert all(torch.equal(a, b) for a, b in zip(_params(results[0][2]), _params(results[1][2])))
    return results[0]


def test_two_ranks_fuse_to_the_separate_pass_update(models, tokenizer, monkeypatch):
    """The dropped row (1) on rank 0: the shares of both ranks leave it out, through the global sums."""
    overrides, shifts, kl_coef = EQUAL["critic-free, tis+geo_mask, a row dropped, kl_mode=loss"]
    cfg, rollout = _scenario(tokenizer, models, overrides + LOOSE, mu_shift=shifts)
    fused = _two_ranks(models, tokenizer, cfg, rollout, kl_coef)
    assert fused[-1] == 0
    _separate(monkeypatch)
    separate = _two_ranks(models, tokenizer, cfg, rollout, kl_coef)
    assert separate[-1] == 1
    _compare(fused[:-2], separate[:-2])


# ------------------------------------------------------------------------------------------
# (3) the mismatch guard still stops a fused update
# ------------------------------------------------------------------------------------------
def test_the_guard_stops_a_fused_update_on_a_big_mismatch(models, tokenizer):
    """One token of mu 1 nat off pi_prox (fp32 bounds), the pass skipped: the update stops before its step."""
    cfg, rollout = _scenario(tokenizer, models, [], mu_shift={(2, 3): 1.0})
    copies, passes = [], PASSES[threading.get_ident()]
    with pytest.raises(LogprobMismatchError, match="logprob_mismatch/max = 1 nats"):
        _learn(models, tokenizer, cfg, rollout, copies=copies)
    assert PASSES[threading.get_ident()] == passes  # the check ran on the update's forward
    assert all(torch.equal(a, b) for a, b in zip(_params(copies[0]), _params(models[0])))
