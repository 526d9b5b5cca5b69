"""The in-process reference trainer: the golden path of one PPO iteration."""

import pytest
import torch

from rayppo.config.load import load_config
from rayppo.trainers.inprocess import InProcessTrainer


def test_one_iteration_reports_design_metrics_and_changes_the_policy(small_overrides):
    trainer = InProcessTrainer(load_config(None, small_overrides))
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    metrics = trainer.iteration()
    for key in ("reward/mean", "kl/ref_mean", "kl_coef", "entropy", "policy/clipfrac", "policy/approx_kl",
                "value/loss", "value/explained_variance", "response/length_mean", "response/truncated_frac",
                "logprob_mismatch/mean", "logprob_mismatch/max", "time/generate", "time/reference",
                "time/reward", "time/learn", "time/sync", "time/iteration", "throughput/tokens_per_s"):
        assert key in metrics, key
    # pi_old == pi_ref == pi_theta before the first update: the sync check and the KL are ~0.
    assert metrics["logprob_mismatch/max"] < 1e-4
    assert abs(metrics["kl/ref_mean"]) < 1e-4
    changed = [k for k, v in trainer.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the PPO update did not change the policy"
    rollout = trainer.last_rollout
    assert len(rollout.score) == len(rollout.ref_logprobs) == 16
    # The learner's useful FLOPs (perf/tflops/learn x time/learn; 4 float64 roundings between
    # them) are the hand count, and its MFU, over the matmul rate measured at the start, at most 1.
    flops = metrics["perf/tflops/learn"] * 1e12 * metrics["time/learn"]
    assert flops == pytest.approx(embedded_learn_flops(rollout), rel=4 * 2**-53, abs=0)
    assert 0 < metrics["perf/mfu/learn"] <= 1


def embedded_learn_flops(rollout) -> float:
    """The learner's useful FLOPs on the embedded model (2 layers; h = 128, 2 heads of 64, MLP
    256, V = 19) with a critic on the same backbone, one epoch of 2 minibatches, counted by hand:
    per layer and position the projections q, k, v, o (128 x 128), gate and up (128 x 256) and down
    (256 x 128), attention 2 x 2 x i x 128 at position i; 2 FLOPs a multiply-add. A prompt an
    earlier row has counts its positions once (its responses still attend to it)."""
    per_position = 2 * 2 * (4 * 128 * 128 + 2 * 128 * 256 + 256 * 128)
    positions = attention = responses = 0
    seen: set[tuple[int, ...]] = set()
    for prompt, response in zip(rollout.prompt_ids, rollout.response_ids):
        first = len(prompt) if tuple(prompt) in seen else 0  # positions before it are counted already
        seen.add(tuple(prompt))
        end = len(prompt) + len(response)
        positions += end - first
        attention += 2 * sum(2 * 2 * i * 128 for i in range(first + 1, end + 1))
        responses += len(response)
    policy = per_position * positions + attention + 2 * 128 * 19 * responses  # the head on responses only
    critic = per_position * positions + attention + 2 * 128 * positions  # the value head everywhere
    # The experience pass's values, then forward + backward (3 forwards) of both; the first of the
    # 2 minibatches reuses the experience pass's values: half a critic forward (rows of equal length).
    return critic + 3 * (policy + critic) - critic / 2


def test_truncated_responses_train_too(small_overrides):
    trainer = InProcessTrainer(load_config(None, small_overrides + ["rollout.max_new_tokens=4"]))
    metrics = trainer.iteration()
    assert 0 < metrics["response/truncated_frac"] <= 1
    assert all(len(r) <= 4 for r in trainer.last_rollout.response_ids)


def test_adaptive_kl_controller_moves_beta(small_overrides):
    trainer = InProcessTrainer(load_config(None, small_overrides + ["ppo.adaptive_kl=true", "ppo.kl_coef=0.05", "ppo.kl_horizon=100"]))
    first = trainer.iteration()
    assert first["kl_coef"] == 0.05
    # KL starts at 0 < target: the controller lowers beta by the clipped 20% x 16/100.
    assert trainer.kl_ctl.value == 0.05 * (1 - 0.2 * 16 / 100)


def test_reward_model_path_trains(small_overrides, reward_model_dir):
    overrides = small_overrides + ["reward.function=null", f"reward.model={reward_model_dir}"]
    trainer = InProcessTrainer(load_config(None, overrides))
    metrics = trainer.iteration()
    scores = trainer.last_rollout.score
    assert len(set(scores)) > 1 and metrics["reward/mean"] == sum(scores) / len(scores)


def test_embedded_default_learns(tmp_path):
    """Mean reward of the embedded task rises clearly within a short run (the default recipe)."""
    cfg = load_config(None, ["stop.iterations=20", f"output.dir={tmp_path}"])
    trainer = InProcessTrainer(cfg)
    rewards = [trainer.iteration()["reward/mean"] for _ in range(cfg.stop.iterations)]
    start, end = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert start < 0.5 and end > start + 0.2, rewards


def test_kl_penalty_mean_reports_the_configured_estimator(small_overrides):
    """kl/ref_mean is always k1; with the k3 estimator in the reward, kl/penalty_mean is k3's sum
    (never negative, and not the k1 figure once the policy has moved)."""
    trainer = InProcessTrainer(load_config(None, small_overrides + ["ppo.kl_estimator=k3", "ppo.lr=0.003"]))
    trainer.iteration()
    stats = trainer.iteration()
    assert stats["kl/penalty_mean"] >= 0
    assert abs(stats["kl/penalty_mean"] - stats["kl/ref_mean"]) > 1e-4
