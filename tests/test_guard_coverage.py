"""The log-prob check sees every generator every iteration.

The check compares the learner's log-probs with the generators' on the first minibatch, the only
one trained before the weights move (when pi_prox is pi_old: fp32, or ``ppo.rollout_correction=none``).
Its rows were a seeded shuffle's first eighth at 8 minibatches, so at 8 generators a generator had
no row there in a third of the iterations and went unchecked; the plan now gives the first
minibatch a row of every generator (``minibatches.every_source_first``). One learn step in-process on
the embedded model, as the in-process trainer runs it.
"""

# ruff: noqa: F811 (the tests take the imported fixture ``models`` as a parameter)
from __future__ import annotations

import copy

import pytest
import torch
from test_async_learner import TEMPERATURE, _rollout, models  # noqa: F401
from test_fused_proximal import _stepper

from rayppo.config.load import load_config
from rayppo.learner.collective import LocalCollective
from rayppo.learner.experience_passes import ProximalPolicy, proximal_logprobs
from rayppo.learner.guard import LogprobMismatchError
from rayppo.learner.minibatches import every_source_first, minibatch_plan
from rayppo.learner.step import BatchShard, LearnerModels, LearnSettings, StepInputs, learn
from rayppo.models.sequences import pack

GENERATORS, MINIBATCHES, ROWS = 8, 8, 64
ODD = 5
"""The generator that samples at another temperature than the learner's (not 0, nor the last)."""


def test_the_first_minibatch_holds_a_row_of_every_generator_and_other_plans_stay_as_they_were():
    sources = [i // (ROWS // GENERATORS) for i in range(ROWS)]
    missed = 0
    for seed in range(200):
        plain = minibatch_plan(ROWS, 2, MINIBATCHES, seed)
        plan = minibatch_plan(ROWS, 2, MINIBATCHES, seed, sources)
        missed += len({sources[i] for i in plain[0][0].tolist()}) < GENERATORS
        assert {sources[i] for i in plan[0][0].tolist()} == set(range(GENERATORS))
        assert sorted(torch.cat(plan[0]).tolist()) == list(range(ROWS))  # still each row once
        assert all(torch.equal(a, b) for a, b in zip(plan[1], plain[1]))  # later epochs untouched
        if len({sources[i] for i in plain[0][0].tolist()}) == GENERATORS:
            assert all(torch.equal(a, b) for a, b in zip(plan[0], plain[0]))  # nothing to mend: as it was
    assert missed > 100  # the shuffle alone leaves a generator out of most first minibatches at 8 x 8


def test_more_generators_than_first_minibatch_rows_get_as_many_as_fit():
    order = every_source_first(torch.arange(12), 3, [i // 2 for i in range(12)])
    assert len({i // 2 for i in order[:3].tolist()}) == 3


def test_a_generator_at_the_wrong_temperature_is_stopped_at_its_first_iteration_on_every_seed(models, tokenizer):
    """8 generators x 8 rows, 8 minibatches, fp32 without rollout correction: generator 5 samples at
    0.9 T; the learner's first learn step stops on it, naming it, for 20 iterations' plans in a row."""
    cfg = load_config(None, ["ppo.epochs=1", f"ppo.minibatches={MINIBATCHES}", "ppo.advantage=grpo", "ppo.kl_coef=0.0",
                             "rollout.samples_per_prompt=2", "ppo.rollout_correction=none",
                             f"rollout.temperature={TEMPERATURE}"])
    rollout = _rollout(tokenizer, [0] * ROWS)
    rollout.group_id = [i // 2 for i in range(ROWS)]
    rollout.generator_id = [i // (ROWS // GENERATORS) for i in range(ROWS)]
    batch = pack(rollout.prompt_ids, rollout.response_ids, tokenizer.pad_token_id)
    healthy, odd = (proximal_logprobs(ProximalPolicy(models[0], t, 0), batch, 1) for t in (TEMPERATURE, 0.9 * TEMPERATURE))
    mu = torch.where(torch.tensor(rollout.generator_id)[:, None] == ODD, odd, healthy)
    rollout.logprobs = [mu[i, : len(r)].tolist() for i, r in enumerate(rollout.response_ids)]
    settings = LearnSettings.of(cfg)
    for iteration in range(20):
        policy = copy.deepcopy(models[0])
        lm = LearnerModels(policy, None, _stepper(policy, None, LocalCollective()), LocalCollective(), "cpu",
                           tokenizer.pad_token_id)
        with pytest.raises(LogprobMismatchError, match=rf"iteration {iteration}: .* on generator {ODD}:"):
            learn(lm, BatchShard.whole(rollout), StepInputs(iteration=iteration, version=0, kl_coef=0.0), settings)


def test_the_bf16_limit_stops_no_healthy_generator_of_few_tokens_on_the_real_model():
    """``benchmarks/real_mismatch.py --spread`` (SmolLM2-135M in bf16, vLLM against the learner, the
    responses cut into generators of one prompt's 4 samples, ~96 tokens): the default
    ``checks.max_logprob_kl`` must sit above every healthy generator's figure with room for other
    models (4x over the largest here, ~mean + 24 sigma) and below the mean of a generator at 0.9 T."""
    import json
    from pathlib import Path

    from rayppo.config.derived import kl_limit
    from rayppo.config.system import ChecksConfig

    rows = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / "real_mismatch_spread.json").read_text())
    healthy, gap = (next(r for r in rows if r["generator_temperature"] == t) for t in (None, 0.9))
    limit = kl_limit(ChecksConfig(), "bfloat16")
    assert healthy["limit"] == gap["limit"] == limit  # measured against today's default
    assert healthy["generators"] >= 64 and healthy["generator_tokens_mean"] < 128  # few tokens each
    assert healthy["generators_over_limit"] == 0 and 4 * healthy["generator_kl_max"] <= limit
    assert healthy["generator_kl_mean"] + 20 * healthy["generator_kl_std"] < limit
    assert gap["generator_kl_mean"] > limit
