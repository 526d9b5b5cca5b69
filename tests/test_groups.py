"""Groups of samples per prompt and the critic-free estimators through the whole system: the
config's checks, a group's rows on one generator with their ids, and the distributed trainer
(2 DeepSpeed ranks, a group split across them) equal to the in-process one for each estimator,
with no critic and, at kl_coef = 0, no reference anywhere."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayppo.cluster.group import get
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.data.prompts import PromptBatch
from rayppo.models.weights import unpack_weights
from rayppo.plan.footprint import estimate_roles
from rayppo.trainers.distributed import DistributedTrainer
from rayppo.trainers.inprocess import InProcessTrainer
from rayppo.trainers.iteration import group_shares


def test_group_settings_that_do_not_fit_are_refused_naming_the_fields():
    with pytest.raises(ConfigError, match=r"ppo.minibatches: must divide the batch's rows, rollout.batch_size x "
                                          r"rollout.samples_per_prompt = 6 x 3"):
        load_config(None, ["rollout.batch_size=6", "rollout.samples_per_prompt=3", "ppo.minibatches=4"])
    with pytest.raises(ConfigError, match=r"rollout.samples_per_prompt: must be >= 2 with ppo.advantage=grpo"):
        load_config(None, ["ppo.advantage=grpo"])
    with pytest.raises(ConfigError, match=r"ppo.advantage: must be one of gae, grpo, dr_grpo, rloo"):
        load_config(None, ["ppo.advantage=ppo"])
    with pytest.raises(ConfigError, match=r"ppo.kl_mode: must be reward or loss"):
        load_config(None, ["ppo.kl_mode=both"])
    with pytest.raises(ConfigError, match=r"rollout.overlong_buffer: must be in \[0, rollout.max_new_tokens=12\]"):
        load_config(None, ["rollout.overlong_buffer=13"])
    # reinforce_pp needs no group; 3 x 4 rows split into 4 minibatches of 3.
    cfg = load_config(None, ["ppo.advantage=reinforce_pp", "rollout.batch_size=3", "rollout.samples_per_prompt=4",
                             "ppo.minibatches=4", "learner.num_ranks=2", "generators.num=2"])
    assert cfg.ppo.advantage == "reinforce_pp"


def test_a_prompts_group_goes_to_one_generator_and_carries_the_prompts_place_as_its_id():
    # Five prompts, two of them the same text, three generators, n = 3.
    texts = ["say 1 :", "say 2 :", "say 1 :", "give 3 :", "write 4 :"]
    prompts = PromptBatch(texts, [[1, 10 + i] for i in range(5)])
    shares = group_shares(prompts, 3, 3)
    assert [len(s) for s in shares] == [6, 6, 3]  # prompts 0-1 | 2-3 | 4, three rows each
    assert [s.groups for s in shares] == [[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3], [4, 4, 4]]
    assert shares[1].texts[:3] == ["say 1 :"] * 3  # the repeated text is group 2, not group 0's
    assert all(s.ids[i] == prompts.ids[g] for s in shares for i, g in enumerate(s.groups))
    # n = 1 is today's split: one row per prompt, in order.
    assert [s.texts for s in group_shares(prompts, 2, 1)] == [texts[:3], texts[3:]]


GROUP_RUN = ["generators.backend=hf", "generators.num=1", "rollout.batch_size=5", "rollout.samples_per_prompt=4",
             "ppo.epochs=2", "ppo.minibatches=2", "rollout.max_new_tokens=6", "learner.zero_stage=2",
             "output.save_rollouts=true"]
"""5 prompts x 4 samples = 20 rows; with 2 ranks of 10, group 2 (rows 8-11) is split 2 + 2."""
ESTIMATORS = {
    # The ranks cut their minibatches by tokens (the in-process reference does not): row shares too.
    "grpo": ["ppo.advantage=grpo", "ppo.kl_mode=loss", "ppo.loss_agg=seq-mean-token-sum-norm",
             "learner.micro_batch_tokens=20"],
    "rloo": ["ppo.advantage=rloo", "ppo.kl_coef=0", "ppo.clip_eps_high=0.28", "rollout.dynamic_sampling_rounds=2"],
    "reinforce_pp_baseline": ["ppo.advantage=reinforce_pp_baseline", "rollout.overlong_buffer=3"],
}
COMPARED = ("policy/loss", "policy/clipfrac", "policy/approx_kl", "entropy")
BULK_GAP = 1e-2
"""|w_ref - w_dist| / |w_ref - w_init|, as in test_distributed.py's equivalence test (fp32
reductions in another order; a grouping or normalisation error changes the whole update)."""


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_critic_free_estimators_distributed_equal_in_process_with_no_critic(estimator, embedded_dir, tmp_path):
    """Two iterations (8 optimiser steps, a sync): 2 DeepSpeed ranks take the in-process trainer's
    update, with a group split across the ranks (its statistics are all-reduced). No critic is
    built (no critic/ in a checkpoint or the outputs, none in the plan) and at kl_coef = 0 no
    reference actor starts."""
    overrides = GROUP_RUN + ESTIMATORS[estimator]
    reference = InProcessTrainer(load_config(None, overrides + ["trainer=reference", "learner.num_ranks=1",
                                                                "learner.micro_batch_tokens=0"]))
    assert reference.critic is None
    ref_stats = [reference.iteration() for _ in range(2)]
    groups = reference.last_rollout.group_id  # all 5 groups (dynamic sampling: the informative ones)
    assert groups == [i // 4 for i in range(len(groups))] and len(groups) == 20 - 4 * (5 - len(set(groups)))
    initial = AutoModelForCausalLM.from_pretrained(embedded_dir).state_dict()
    ref_weights = reference.policy.state_dict()
    update = _norm({k: ref_weights[k] - initial[k] for k in ref_weights})
    assert update > 1e-3 and all(ref_stats[1][k] != 0 for k in COMPARED)
    assert not any(k.startswith("value/") for k in ref_stats[1])
    cfg = load_config(None, overrides + ["learner.num_ranks=2", f"output.dir={tmp_path / 'run'}"])
    trainer = DistributedTrainer(cfg)
    try:
        stats = [trainer.iteration() for _ in range(2)]
        weights = unpack_weights(get(trainer.learner.policy_weights()))
        assert trainer.last_rollout.response_ids == reference.last_rollout.response_ids  # same seed, same samples
        rows = trainer.last_rollout
        trainer.checkpoint(tmp_path / "ckpt")
        trainer.save(tmp_path / "final")
        assert len(trainer.reference) == (0 if estimator == "rloo" else 1)
    finally:
        trainer.close()
    for it in (0, 1):
        for key in COMPARED + (("kl/ref_mean",) if estimator != "rloo" else ()):
            assert stats[it][key] == pytest.approx(ref_stats[it][key], abs=1e-5, rel=1e-4), (estimator, it, key)
    assert _norm({k: ref_weights[k] - weights[k] for k in ref_weights}) / update < BULK_GAP
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["learner.json", "policy"]  # no critic/
    assert not (tmp_path / "final" / "critic").exists() and (tmp_path / "final" / "policy").is_dir()
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert bool(placement["roles"]["reference"]) == (estimator != "rloo")  # no node holds a reference actor
    if estimator == "rloo":
        assert "kl/ref_mean" not in stats[1]  # no reference, no KL: nothing is made up
    # What the update trained on comes back per row (output.save_rollouts), equal to the
    # in-process trainer's, one A_i on every token of row i; no returns without a critic.
    assert rows.returns == [] and [len(a) for a in rows.advantages] == [len(r) for r in rows.response_ids]
    for mine, theirs in zip(rows.advantages, reference.last_rollout.advantages):
        assert mine == pytest.approx(theirs, abs=1e-6)
    if estimator == "grpo":  # kl_mode=loss: the grouped score is r_i itself, cut rows keep theirs
        for g in range(5):
            r = torch.tensor(rows.score[4 * g: 4 * g + 4], dtype=torch.float64)
            want = torch.zeros(4) if r.max() == r.min() else (r - r.mean()) / r.std().clamp(min=1e-6)
            got = [rows.advantages[i][0] for i in range(4 * g, 4 * g + 4)]
            assert got == pytest.approx(want.tolist(), abs=1e-5)  # float32 columns
            assert all(len(set(rows.advantages[i])) == 1 for i in range(4 * g, 4 * g + 4))


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_the_asynchronous_pipeline_trains_groups_sampled_by_one_policy_version_and_closes_its_stages(tmp_path):
    """rollout.max_staleness = 1 with GRPO and LoRA: the pipeline's generators sample ahead, and
    every group's rows carry one policy version (a group is one generator's call), so the
    off-policy loss weighs a group's rows alike; three iterations complete with no critic.
    ``close`` ends the stage threads (sampling ahead when it is called) before it returns: one
    left calling Ray after ``ray.shutdown`` ends the whole process with exit 1."""
    cfg = load_config(None, ["generators.backend=hf", "generators.num=2", "rollout.batch_size=4",
                             "rollout.samples_per_prompt=4", "ppo.advantage=grpo", "ppo.minibatches=2",
                             "rollout.max_new_tokens=6", "learner.num_ranks=1", "rollout.max_staleness=1",
                             "learner.weight_sync=object_store", "learner.lora_rank=4",
                             f"output.dir={tmp_path / 'run'}"])
    from rayppo.trainers.choice import make_trainer

    trainer = make_trainer(cfg)
    try:
        for _ in range(3):
            stats = trainer.iteration()
            rows = trainer.last_rollout
            versions = {g: {v for v, k in zip(rows.policy_version, rows.group_id) if k == g} for g in set(rows.group_id)}
            assert all(len(v) == 1 for v in versions.values()), versions
            assert len(rows) == 4 * len(versions)  # whole groups only (a stale share drops whole groups)
            assert "value/loss" not in stats and stats["policy/version"] >= 1
    finally:
        trainer.close()
    assert stats["async/staleness_max"] <= 1
    assert [t.name for t in trainer.source._stages.threads if t.is_alive()] == []
    assert trainer.supervisor.restarts == 0  # the actors close killed under calls in flight were not replaced


def test_the_plan_counts_no_critic_and_no_reference():
    """The learner's estimate drops the critic's ZeRO states and buckets, and kl_coef = 0 the
    reference actors (the plan's per-role counts)."""
    gae = estimate_roles(load_config(None, ["rollout.samples_per_prompt=2"]))["learner"]
    free = estimate_roles(load_config(None, ["rollout.samples_per_prompt=2", "ppo.advantage=grpo"]))["learner"]
    assert free.peak < gae.peak
    assert any("critic" in k for k in gae.parts) and not any("critic" in k for k in free.parts)
    from rayppo.plan.fit import _counts

    assert _counts(load_config(None, ["ppo.kl_coef=0"]))["reference"] == 0
    assert _counts(load_config(None, []))["reference"] == 1


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors.values()) ** 0.5
