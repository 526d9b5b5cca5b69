"""Rollout correction and the log-prob guard under bf16 numerics (docs/real-model.md).

The generator's log-probs mu and the learner's pi_prox differ at identical weights by the kernels'
rounding (bf16 on SmolLM2-135M: mean |d| 0.03 nats per token, a heavy tail to 0.5). The update
treats mu as a behaviour policy (truncated importance weights, a geometric-mean row mask), and the
guard watches the k3 mean per token, which that noise leaves near 1e-3, instead of the max.
"""

from __future__ import annotations

import math

import pytest
import torch

from rayppo.config.derived import NO_CORRECTION, Correction, rollout_correction
from rayppo.config.load import load_config
from rayppo.learner import ppo
from rayppo.learner.collective import LocalCollective
from rayppo.learner.guard import GuardBounds, LogprobMismatchError, MismatchGuard

BF16_RMS = 0.047
"""RMS of the per-token log-prob gap measured on SmolLM2-135M in bf16 with the fp32 head
(k3 mean 1.2e-3 ~ RMS^2 / 2; benchmarks/results/real_mismatch.json)."""


def test_geometric_mean_mask_keeps_rows_by_their_mean_log_ratio():
    log_ratio = torch.tensor([[0.05, 0.11, 0.0], [0.25, -0.1, 0.0], [0.5, 0.5, 0.4], [0.0, 0.0, 0.0]],
                             dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    # Row means over valid tokens: 0.08, 0.075, 0.467; a row without tokens is kept.
    assert ppo.geometric_mean_mask(log_ratio, mask, 0.1).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert ppo.geometric_mean_mask(-log_ratio, mask, 0.1).tolist() == [1.0, 1.0, 0.0, 1.0]  # both sides of 1
    assert ppo.geometric_mean_mask(log_ratio, mask, 0.078).tolist() == [0.0, 1.0, 0.0, 1.0]
    assert ppo.geometric_mean_mask(log_ratio, mask, 0.07).tolist() == [0.0, 0.0, 0.0, 1.0]


def test_decoupled_loss_trains_nothing_on_a_masked_row_and_is_unchanged_elsewhere():
    torch.manual_seed(0)
    old = -torch.rand(3, 4) - 0.1
    prox = old + 0.01 * torch.randn(3, 4)
    advantages, mask = torch.randn(3, 4), torch.ones(3, 4)
    grads = []
    for keep in (None, torch.tensor([1.0, 0.0, 1.0])):
        logprobs = (prox + 0.05 * torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, _ = ppo.decoupled_policy_loss(logprobs, ppo.Decoupled(prox, old, keep), advantages, mask)
        loss.backward()
        grads.append(logprobs.grad)
    assert torch.equal(grads[1][1], torch.zeros(4))  # the masked row
    assert torch.equal(grads[1][[0, 2]], grads[0][[0, 2]])  # the others: the same tokens, the same denominator


def test_correction_defaults_by_dtype_and_mode():
    cfg = load_config(None, [])
    assert rollout_correction(cfg.ppo, "float32", 0) == NO_CORRECTION
    assert rollout_correction(cfg.ppo, "bfloat16", 0) == Correction(truncated_is=True, geo_mask=True)
    # staleness would leave the band by design
    assert rollout_correction(cfg.ppo, "bfloat16", 2) == Correction(truncated_is=True, geo_mask=False)
    assert rollout_correction(load_config(None, ["ppo.rollout_correction=tis"]).ppo, "float32", 0) == Correction(True)
    assert rollout_correction(load_config(None, ["ppo.rollout_correction=none"]).ppo, "bfloat16", 2) == NO_CORRECTION


def _sampled_drift(temperature: float, tokens: int = 4096, vocab: int = 512) -> torch.Tensor:
    """log pi(y) - log mu(y) for tokens sampled from mu = softmax(z / temperature) while the learner's
    pi = softmax(z): the sampling distribution the guard exists to catch. Logits of std 3, as a
    trained model's spread."""
    g = torch.Generator().manual_seed(0)
    z = 3.0 * torch.randn(tokens, vocab, generator=g, dtype=torch.float64)
    mu = torch.log_softmax(z / temperature, -1)
    y = torch.multinomial(mu.exp(), 1, generator=g)
    return (torch.log_softmax(z, -1).gather(1, y) - mu.gather(1, y)).reshape(64, -1)


def test_guard_passes_bf16_noise_that_the_max_would_stop_and_catches_a_wrong_temperature():
    bf16 = load_config(None, ["model.dtype=bfloat16"])
    guard = GuardBounds.of(bf16).at(iteration=3)
    noise = BF16_RMS * torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    assert float(noise.abs().max()) > 0.1  # the old bf16 bound (max |d| <= 0.1) would have stopped this
    guard.check(noise, torch.zeros(64, dtype=torch.long), LocalCollective())  # k3 ~ 1.1e-3: passes
    drift = _sampled_drift(0.7)
    with pytest.raises(LogprobMismatchError, match=r"iteration 3: logprob_mismatch/kl = .* exceeds "
                                                   r"checks.max_logprob_kl = 0.01 on generator 0: its weights matched") as err:
        guard.check(drift, torch.zeros(64, dtype=torch.long), LocalCollective())
    assert "not sampling from the learner's weights" not in str(err.value)
    unverified = MismatchGuard(math.inf, 3, 1e-2, weights_verified=False)
    with pytest.raises(LogprobMismatchError, match="verify_sync is off"):
        unverified.check(drift, torch.zeros(64, dtype=torch.long), LocalCollective())


def test_guard_in_fp32_still_stops_on_one_token():
    guard = GuardBounds.of(load_config(None, [])).at(iteration=0)
    drift = torch.zeros(4, 8)
    drift[2, 5] = 2e-3  # one token off by more than fp32 rounding can explain
    with pytest.raises(LogprobMismatchError, match=r"logprob_mismatch/max = 0.002 nats exceeds checks.max_logprob_mismatch = 0.001"):
        guard.check(drift, torch.tensor([0, 0, 1, 0]), LocalCollective())


@pytest.mark.slow
def test_in_process_correction_at_fp32_is_the_plain_update_up_to_the_measured_gap(tmp_path, small_overrides):
    """With mu = pi_prox up to fp32 rounding, the corrected update (weights w = pi_prox / mu, every
    row inside the band) is the uncorrected one: the per-token weights differ from 1 by at most
    exp(max |d|) - 1, so the loss differs by at most that share of its size."""
    from rayppo.trainers.inprocess import InProcessTrainer

    stats = {}
    for mode in ("none", "tis+geo_mask"):
        cfg = load_config(None, [*small_overrides, f"ppo.rollout_correction={mode}", f"output.dir={tmp_path / mode}"])
        trainer = InProcessTrainer(cfg)
        try:
            stats[mode] = trainer.iteration()
        finally:
            trainer.close()
    plain, corrected = stats["none"], stats["tis+geo_mask"]
    assert corrected["correction/masked_rows"] == 0.0 and "correction/masked_rows" not in plain
    gap = max(plain["logprob_mismatch/max"], corrected["logprob_mismatch/max"])
    assert gap < 1e-4  # fp32: the premise
    bound = math.expm1(gap) * abs(plain["policy/loss"]) + 1e-7  # + fp32 rounding of a loss of order 1
    assert abs(corrected["policy/loss"] - plain["policy/loss"]) <= bound
    assert abs(corrected["policy/is_weight_mean"] - 1.0) <= math.expm1(gap)
