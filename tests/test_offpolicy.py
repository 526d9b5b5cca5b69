"""Off-policy corrections (docs/async.md): the reductions to the synchronous math when mu = pi, and,
on a small MDP whose values are known exactly, V-trace targets converging to V of the target
policy where plain GAE targets converge to V of the behaviour policy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rayppo.learner import ppo


def _ragged(batch: int = 4, length: int = 6, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 3, 1, 5])[:batch]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    bootstrap = torch.randn(batch, generator=g, dtype=torch.float64)
    return rewards * mask, values * mask, mask, bootstrap


def test_offpolicy_targets_reduce_to_gae_when_behaviour_is_the_policy():
    rewards, values, mask, bootstrap = _ragged()
    gae = ppo.compute_gae(rewards, values, mask, gamma=0.99, lam=0.9, bootstrap=bootstrap)
    off = ppo.compute_offpolicy_targets(rewards, values, mask, torch.zeros_like(values),
                                        ppo.VTrace(gamma=0.99, lam=0.9, rho_bar=1.0, c_bar=1.0), bootstrap=bootstrap)
    torch.testing.assert_close(off[0], gae[0], rtol=0, atol=0)  # the same operations on the same numbers
    torch.testing.assert_close(off[1], gae[1], rtol=0, atol=0)


def test_offpolicy_targets_weigh_each_token_by_its_truncated_ratios():
    """One row, two tokens, gamma = lam = 1, terminal: the recursions by hand."""
    rewards = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    q = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    adv, target = ppo.compute_offpolicy_targets(rewards, values, mask, q.log(),
                                                ppo.VTrace(gamma=1.0, lam=1.0, rho_bar=1.5, c_bar=1.0))
    delta0, delta1 = 0.0 + 0.25 - 0.5, 1.0 - 0.25
    assert adv[0, 1].item() == pytest.approx(delta1)
    assert adv[0, 0].item() == pytest.approx(delta0 + min(1.0, 0.5) * delta1)  # trace of the *next* token
    assert target[0, 1].item() == pytest.approx(0.25 + 0.5 * delta1)  # rho_1 = min(1.5, 0.5)
    assert target[0, 0].item() == pytest.approx(0.5 + 1.5 * delta0 + min(1.0, 2.0) * 0.5 * delta1)


def test_decoupled_loss_is_the_ppo_loss_when_behaviour_is_the_proximal_policy():
    g = torch.Generator().manual_seed(1)
    logprobs = torch.randn(3, 5, generator=g, requires_grad=True)
    prox = torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    loss, stats = ppo.decoupled_policy_loss(logprobs, ppo.Decoupled(prox, prox.clone()), adv, mask,
                                            ppo.Surrogate(clip_eps=0.2), is_clip=2.0)
    reference, _ = ppo.policy_loss(logprobs, prox, adv, mask, ppo.Surrogate(clip_eps=0.2))
    assert loss.item() == reference.item() and stats["is_weight_mean"].item() == 1.0
    (grad,) = torch.autograd.grad(loss, logprobs)
    (reference_grad,) = torch.autograd.grad(ppo.policy_loss(logprobs, prox, adv, mask, ppo.Surrogate(clip_eps=0.2))[0],
                                            logprobs)
    assert torch.equal(grad, reference_grad)


def test_decoupled_loss_truncates_the_importance_weight():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    prox = torch.zeros(1, 2)
    behaviour = torch.tensor([[math.log(0.25), math.log(2.0)]])  # pi_prox / mu = 4 and 0.5
    adv = torch.ones(1, 2)
    loss, stats = ppo.decoupled_policy_loss(logprobs, ppo.Decoupled(prox, behaviour), adv, torch.ones(1, 2), is_clip=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)  # rho = 1: -mean(w * A), w = (min(4, 2), 0.5)
    assert stats["is_clipfrac"].item() == 0.5


# ---------------------------------------------------------------------------- synthetic MDP
T, P_PI, P_MU = 3, 0.8, 0.3
"""A chain of T tokens, each 1 (reward 1) or 0 (reward 0); the target policy pi writes 1 with
probability P_PI, the behaviour policy mu with P_MU. Before token t, V^p = (T - t) * p exactly."""


def _per_token(paths: torch.Tensor, if_one: float, if_zero: float) -> torch.Tensor:
    """``if_one`` where the token is 1, else ``if_zero``, in float64 (torch.where of two Python
    floats would give float32, whose rounding the tolerance below does not allow)."""
    return torch.where(paths == 1, torch.tensor(if_one, dtype=torch.float64), torch.tensor(if_zero, dtype=torch.float64))


def _fixed_point(log_ratio_of, iterations: int = 12) -> torch.Tensor:
    """Iterate a tabular critic V[t] <- E_mu[target_t] to its fixed point. The expectation is
    exact: all 2^T action sequences are the batch, weighted by their probability under mu."""
    paths = torch.tensor(list(itertools.product([0.0, 1.0], repeat=T)), dtype=torch.float64)  # [8, T]
    weight = torch.prod(_per_token(paths, P_MU, 1 - P_MU), dim=1)  # mu(path)
    log_ratio = log_ratio_of(paths)
    mask = torch.ones_like(paths)
    table = torch.zeros(T, dtype=torch.float64)
    for _ in range(iterations):
        values = table.expand_as(paths).clone()
        _, targets = ppo.compute_offpolicy_targets(paths, values, mask, log_ratio,
                                                   ppo.VTrace(gamma=1.0, lam=0.95, rho_bar=3.0, c_bar=3.0))
        table = (weight[:, None] * targets).sum(0)
    return table


def test_vtrace_targets_converge_to_the_target_policys_values_gae_to_the_behaviours():
    def importance(paths: torch.Tensor) -> torch.Tensor:  # log pi(y_t) - log mu(y_t); max ratio 8/3 < 3
        return _per_token(paths, math.log(P_PI / P_MU), math.log((1 - P_PI) / (1 - P_MU)))

    v_pi = torch.tensor([(T - t) * P_PI for t in range(T)], dtype=torch.float64)
    v_mu = torch.tensor([(T - t) * P_MU for t in range(T)], dtype=torch.float64)
    vtrace = _fixed_point(importance)
    gae = _fixed_point(torch.zeros_like)  # no correction: GAE's returns, i.e. the behaviour's values
    print(f"\nV^pi {v_pi.tolist()}  V^mu {v_mu.tolist()}\nV-trace fixed point {vtrace.tolist()}\n"
          f"GAE fixed point {gae.tolist()}")
    # A finite horizon of T tokens: both iterations are exact after T rounds (backward
    # induction), so only float64 rounding of a few dozen operations remains.
    torch.testing.assert_close(vtrace, v_pi, rtol=0, atol=1e-12)
    torch.testing.assert_close(gae, v_mu, rtol=0, atol=1e-12)
    assert (vtrace - v_mu).abs().min() > 0.4  # the two answers are far apart: the weights matter
