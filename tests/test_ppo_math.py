"""The PPO math contract of docs/algorithm.md ("Tensor conventions"), with its worked problems."""

import math

import pytest
import torch

from rayppo.learner import ppo


def gae_reference(rewards, values, length, gamma, lam, bootstrap):
    """GAE for one row, written straight from the formula: A_t = sum_l (gamma lam)^l delta_{t+l}."""
    def v(t):
        return values[t] if t < length else bootstrap

    deltas = [rewards[t] + gamma * v(t + 1) - values[t] for t in range(length)]
    adv = [sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t)) for t in range(length)]
    return adv, [a + values[t] for t, a in enumerate(adv)]


# ---------------------------------------------------------------------------- worked problems (docs/algorithm.md)
def test_worked_problem_1_shaped_rewards_and_returns_to_go():
    log_ratio = torch.tensor([[0.5, -0.2, 1.0, 0.0]])
    ref = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    rewards = ppo.shape_rewards(torch.tensor([1.0]), log_ratio, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.02, -0.10, 1.00]]))
    adv, returns = ppo.compute_gae(rewards, torch.zeros(1, 4), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.87, 0.92, 0.90, 1.00]]))
    torch.testing.assert_close(returns, adv)


def test_worked_problem_2_without_a_baseline_every_advantage_is_one():
    n = 500
    mask = torch.ones(1, n)
    logprobs = torch.randn(1, n)
    # Ignore the KL term (beta = 0): only the terminal 1.0.
    rewards = ppo.shape_rewards(torch.tensor([1.0]), logprobs, logprobs.clone(), mask, kl_coef=0.0)
    adv, _ = ppo.compute_gae(rewards, torch.zeros(1, n), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.ones(1, n))


# ---------------------------------------------------------------------------- KL and shaping
def test_kl_estimators():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = lp - ref
    torch.testing.assert_close(ppo.kl_penalty(lp, ref, "k1"), d)
    torch.testing.assert_close(ppo.kl_penalty(lp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(ppo.kl_penalty(lp, ref, "k3"), torch.exp(-d) + d - 1)
    assert (ppo.kl_penalty(lp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="estimator"):
        ppo.kl_penalty(lp, ref, "k4")


def test_reference_kl_reports_the_k3_sum_beside_k1():
    """``kl/ref_k3_mean`` (what plot.png draws KL with): the k3 sum per response, >= 0 in every
    response, padding left out, beside the k1 sum, whose batch mean here is below 0."""
    from rayppo.learner.collective import LocalCollective
    from rayppo.learner.experience_stats import kl_stats

    lp = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, -0.3, 0.0]])
    ref = torch.tensor([[-0.5, -1.5, 0.0], [-0.5, -0.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column is padding (d = 5 there)
    kl = kl_stats(lp, ref, mask, "k1", LocalCollective())
    d = (lp - ref)[:, :2].double()  # by hand in float64: rows d = (-0.5, -0.5) and (0, -0.2)
    # float32 in the code: a few roundings of terms under 2 in magnitude, each at most 2 x 2^-24 = 1.2e-7.
    assert kl.mean == pytest.approx(float(d.sum(1).mean()), abs=1e-6)  # -0.6
    assert kl.k3_mean == pytest.approx(float((torch.exp(-d) + d - 1).sum(1).mean()), abs=1e-6)  # 0.1594
    assert kl.mean < 0 < kl.k3_mean
    assert kl.metrics() == {"kl/ref_mean": kl.mean, "kl/penalty_mean": kl.mean, "kl/ref_k3_mean": kl.k3_mean}


def test_shape_rewards_puts_score_on_last_valid_token_and_zero_on_padding():
    lp = torch.tensor([[0.3, 0.1, 0.2, 0.9], [0.2, 0.4, 0.0, 0.0]])
    ref = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    rewards = ppo.shape_rewards(torch.tensor([2.0, -1.0]), lp, ref, mask, kl_coef=0.5)
    expected = torch.tensor([[-0.15, -0.05, -0.10, 2.0 - 0.45], [-0.10, -1.0 - 0.20, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


# ---------------------------------------------------------------------------- GAE
def test_gae_ragged_batch_matches_the_formula_with_truncation_bootstrap():
    torch.manual_seed(0)
    lengths = [5, 3, 1, 4]
    mask = torch.zeros(4, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rewards = torch.randn(4, 5) * mask
    values = torch.randn(4, 5) * mask
    # Rows 1 and 3 were truncated: they bootstrap from V(S_T); rows 0 and 2 ended with EOS.
    bootstrap = torch.tensor([0.0, 0.7, 0.0, -0.4])
    gamma, lam = 0.9, 0.8
    adv, returns = ppo.compute_gae(rewards, values, mask, gamma, lam, bootstrap)
    for i, n in enumerate(lengths):
        ref_adv, ref_ret = gae_reference(rewards[i].tolist(), values[i].tolist(), n, gamma, lam, bootstrap[i].item())
        torch.testing.assert_close(adv[i, :n], torch.tensor(ref_adv), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(returns[i, :n], torch.tensor(ref_ret), atol=1e-6, rtol=1e-6)
        assert (adv[i, n:] == 0).all() and (returns[i, n:] == 0).all()


def test_gae_padding_does_not_leak():
    """Garbage in the padded positions of rewards and values must not change anything."""
    mask = torch.tensor([[1.0, 1, 1, 0, 0]])
    rewards = torch.tensor([[0.1, 0.2, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.3, 0.5, 0.4, 0.0, 0.0]])
    clean = ppo.compute_gae(rewards, values, mask, 1.0, 0.95)
    dirty = ppo.compute_gae(rewards + (1 - mask) * 50, values + (1 - mask) * 9, mask, 1.0, 0.95)
    torch.testing.assert_close(clean[0], dirty[0])
    torch.testing.assert_close(clean[1], dirty[1])


def test_gae_truncated_row_uses_bootstrap_eos_row_uses_zero():
    mask = torch.ones(1, 2)
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5]])
    eos_adv, _ = ppo.compute_gae(rewards, values, mask, 1.0, 1.0)
    cut_adv, _ = ppo.compute_gae(rewards, values, mask, 1.0, 1.0, bootstrap=torch.tensor([2.0]))
    # delta_1 = 1 + V_next - 0.5, with V_next = 0 (EOS) or 2 (truncated)
    torch.testing.assert_close(eos_adv, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(cut_adv, torch.tensor([[2.5, 2.5]]))


# ---------------------------------------------------------------------------- whitening
def test_masked_whiten_ignores_padding():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    w = ppo.masked_whiten(x, mask)
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    expected = (valid - valid.mean()) / (valid.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(w[mask.bool()], expected)
    assert (w[~mask.bool()] == 0).all()
    kept = ppo.masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(kept[mask.bool()].mean(), valid.mean())
    torch.testing.assert_close(kept[mask.bool()].std(unbiased=False), torch.tensor(1.0), atol=1e-5, rtol=0)


def test_whitening_from_summed_moments_equals_whole_batch():
    """Two 'ranks' adding their moments whiten exactly like one process with all rows."""
    torch.manual_seed(1)
    x = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    whole = ppo.masked_whiten(x, mask)
    moments = ppo.masked_moments(x[:3], mask[:3]) + ppo.masked_moments(x[3:], mask[3:])
    parts = torch.cat([ppo.whiten_from_moments(x[:3], mask[:3], moments),
                       ppo.whiten_from_moments(x[3:], mask[3:], moments)])
    torch.testing.assert_close(parts, whole)


# ---------------------------------------------------------------------------- policy loss
def _pg_grad(lp_value, adv_value, clip_eps=0.2):
    lp = torch.tensor([[lp_value]], requires_grad=True)
    loss, stats = ppo.policy_loss(lp, torch.zeros(1, 1), torch.tensor([[adv_value]]), torch.ones(1, 1),
                                  ppo.Surrogate(clip_eps))
    loss.backward()
    return lp.grad.item(), stats


def test_clip_zero_gradient_when_ratio_above_1_plus_eps_and_positive_advantage():
    grad, stats = _pg_grad(math.log(1.5), 1.0)
    assert grad == 0.0 and stats["clipfrac"].item() == 1.0


def test_clip_zero_gradient_when_ratio_below_1_minus_eps_and_negative_advantage():
    grad, stats = _pg_grad(math.log(0.5), -1.0)
    assert grad == 0.0 and stats["clipfrac"].item() == 1.0


def test_no_clip_inside_trust_region_or_on_the_pessimistic_side():
    # rho = 1.5 with A < 0: the unclipped term is the minimum, gradient flows: d/dlp (-rho A) = -rho A
    grad, stats = _pg_grad(math.log(1.5), -1.0)
    assert grad == pytest.approx(1.5) and stats["clipfrac"].item() == 0.0
    grad, stats = _pg_grad(math.log(1.1), 2.0)
    assert grad == pytest.approx(-2.2) and stats["clipfrac"].item() == 0.0


def test_policy_loss_value_clipfrac_and_approx_kl():
    lp = torch.log(torch.tensor([[1.5, 1.0, 0.9, 7.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -2.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    loss, stats = ppo.policy_loss(lp, old, adv, mask, ppo.Surrogate(clip_eps=0.2))
    # min(rho A, clip A): 1.2, -2.0, 0.9 -> mean over 3 valid tokens
    assert loss.item() == pytest.approx(-(1.2 - 2.0 + 0.9) / 3)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    log_r = torch.log(torch.tensor([1.5, 1.0, 0.9]))
    assert stats["approx_kl"].item() == pytest.approx((torch.expm1(log_r) - log_r).mean().item())


def test_policy_loss_aggregations_differ_as_specified():
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    token_mean, _ = ppo.policy_loss(lp, lp, adv, mask, ppo.Surrogate(agg="token-mean"))
    seq_mean, _ = ppo.policy_loss(lp, lp, adv, mask, ppo.Surrogate(agg="seq-mean-token-mean"))
    assert token_mean.item() == pytest.approx(-(3 + 4) / 4)
    assert seq_mean.item() == pytest.approx(-(1 + 4) / 2)


# ---------------------------------------------------------------------------- value loss
def test_value_loss_clipped_and_unclipped():
    v = torch.tensor([[1.0, 0.0, 0.5]])
    old = torch.tensor([[0.5, 0.0, 0.5]])
    ret = torch.tensor([[2.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 0]])
    # token 0: unclipped (1-2)^2 = 1, clipped V = 0.7 -> (0.7-2)^2 = 1.69 -> max 1.69; token 1: 1
    assert ppo.value_loss(v, old, ret, mask, clip_range=0.2).item() == pytest.approx((1.69 + 1.0) / 2)
    assert ppo.value_loss(v, old, ret, mask, clip_range=None).item() == pytest.approx((1.0 + 1.0) / 2)


# ---------------------------------------------------------------------------- entropy
def test_entropy_from_logits():
    uniform = torch.zeros(2, 3, 8)
    torch.testing.assert_close(ppo.entropy_from_logits(uniform), torch.full((2, 3), math.log(8)))
    peaked = torch.tensor([[1000.0, 0.0, 0.0]])
    assert ppo.entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(4, 10)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ppo.entropy_from_logits(logits), -(p * p.log()).sum(-1))


# ---------------------------------------------------------------------------- KL controllers
def test_fixed_kl_controller_does_not_move():
    ctl = ppo.FixedKLController(0.1)
    ctl.update(100.0, 64)
    assert ctl.value == 0.1


def test_adaptive_kl_controller_moves_with_clipped_error():
    up = ppo.AdaptiveKLController(0.1, target=6.0, horizon=1000)
    up.update(7.5, n_steps=100)  # error 0.25 -> clipped to 0.2
    assert up.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    down = ppo.AdaptiveKLController(0.1, target=6.0, horizon=1000)
    down.update(5.4, n_steps=100)  # error -0.1, inside the clip
    assert down.value == pytest.approx(0.1 * (1 - 0.1 * 100 / 1000))
    far_below = ppo.AdaptiveKLController(0.1, target=6.0, horizon=1000)
    far_below.update(0.0, n_steps=100)  # error -1 -> clipped to -0.2
    assert far_below.value == pytest.approx(0.1 * (1 - 0.2 * 100 / 1000))


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert ppo.explained_variance(ret, ret, mask).item() == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full_like(ret, 2.5), ret, mask).item() == pytest.approx(0.0)


def test_explained_variance_from_rank_moments_equals_whole_batch():
    """Two ranks' halves: summed moments give the whole batch's explained variance, which the
    token-weighted mean of the halves' own values does not."""
    g = torch.Generator().manual_seed(3)
    returns, values = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = ppo.explained_variance(values, returns, mask)
    halves = [slice(0, 3), slice(3, 6)]
    summed = [sum(ppo.masked_moments(x[h], mask[h]) for h in halves) for x in (returns, returns - values)]
    torch.testing.assert_close(ppo.explained_variance_from_moments(*summed), whole.double())
    weighted = sum(ppo.explained_variance(values[h], returns[h], mask[h]) * mask[h].sum() for h in halves) / mask.sum()
    assert abs(float(weighted) - float(whole)) > 1e-3
