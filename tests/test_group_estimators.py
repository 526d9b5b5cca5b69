"""The critic-free estimators of ``rayppo/learner/group_math.py`` (and REINFORCE++'s returns and the
overlong ramp of ``rewards.py``) on hand-computed groups, and their group statistics over a batch
split across ranks (docs/estimators.md, "Correct across ranks").

Hand values are exact decimals or simple surds; the comparisons allow float64 rounding of a few
operations on numbers of order 1 (1e-12) unless stated."""

from __future__ import annotations

import math

import pytest
import torch

from rayppo.learner import ppo
from rayppo.learner.advantages import batch_group_advantages
from rayppo.learner.collective import LocalCollective
from rayppo.learner.rewards import discounted_returns, overlong_penalty

EXACT = 1e-12
"""A few float64 operations on O(1) values: rounding is ~1e-16 each."""


def _advantages(scores: list[float], groups: list[int], estimator: str, std_floor: float = 1e-6) -> list[float]:
    """The estimator's A_i of one batch in one process."""
    s = torch.tensor(scores, dtype=torch.float64)
    g = torch.tensor(groups)
    return batch_group_advantages(s, g, max(groups) + 1, estimator, std_floor, LocalCollective()).tolist()


def test_grpo_normalises_by_the_unbiased_group_std():
    # Group 0: [1, 0, 0, 1] mean 0.5, unbiased std sqrt(1/3); group 1: [0.2, 0.8] mean 0.5, std 0.3 sqrt(2).
    a = _advantages([1, 0, 0, 1, 0.2, 0.8], [0, 0, 0, 0, 1, 1], "grpo")
    s0, s1 = math.sqrt(1 / 3), 0.3 * math.sqrt(2)
    assert a == pytest.approx([0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -0.3 / s1, 0.3 / s1], abs=EXACT)
    assert a[4] == pytest.approx(-1 / math.sqrt(2), abs=EXACT)  # n = 2: +-1/sqrt(2) whatever the gap


def test_a_group_of_equal_rewards_gets_zero_advantage_under_every_estimator():
    # 0.1 x 3 sums to 0.30000000000000004 in float64: the mean is not exactly 0.1, yet A must be 0.
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        a = _advantages([0.1, 0.1, 0.1, 1.0, 0.0], [0, 0, 0, 1, 1], estimator)
        assert a[:3] == [0.0, 0.0, 0.0], estimator
        assert a[3] > 0 > a[4], estimator


def test_the_std_floor_bounds_a_group_that_differs_by_rounding_only():
    # Two rewards 1e-9 apart: without the floor GRPO would give +-1/sqrt(2) (a 7e8x blow-up of the gap).
    a = _advantages([0.5, 0.5 + 1e-9], [0, 0], "grpo", std_floor=1e-6)
    assert abs(a[0]) <= 0.5e-9 / 1e-6 * (1 + 1e-6) and a[0] < 0 < a[1]


def test_one_outlier_in_a_group():
    # [0, 0, 0, 1]: mean 0.25; RLOO's baseline for the outlier is 0 (A = 1), for the others 1/3.
    scores, groups = [0, 0, 0, 1], [0, 0, 0, 0]
    assert _advantages(scores, groups, "rloo") == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 1.0], abs=EXACT)
    assert _advantages(scores, groups, "dr_grpo") == pytest.approx([-0.25, -0.25, -0.25, 0.75], abs=EXACT)
    std = math.sqrt((3 * 0.25 ** 2 + 0.75 ** 2) / 3)  # 0.5
    assert _advantages(scores, groups, "grpo") == pytest.approx([-0.25 / std] * 3 + [0.75 / std], abs=EXACT)


def test_leave_one_out_identities_sum_to_zero_within_each_group():
    torch.manual_seed(0)
    scores = torch.rand(24, dtype=torch.float64).tolist()
    groups = [i // 6 for i in range(24)]
    for estimator in ("rloo", "dr_grpo"):
        a = torch.tensor(_advantages(scores, groups, estimator), dtype=torch.float64)
        for g in range(4):
            assert abs(float(a[g * 6:(g + 1) * 6].sum())) < EXACT, (estimator, g)
    # RLOO's definition term by term: r_i minus the mean of the other five.
    a = _advantages(scores, groups, "rloo")
    for i in range(24):
        others = [scores[j] for j in range(24) if groups[j] == groups[i] and j != i]
        assert a[i] == pytest.approx(scores[i] - sum(others) / len(others), abs=EXACT)


def test_groups_of_the_same_prompt_text_are_separate_groups():
    # Rows 0-1 and 2-3 answer two draws of one prompt (ids 0 and 1): pooling them by text would give
    # the mean 0.5 to all four; by id, each pair is centred on its own mean.
    a = _advantages([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], "dr_grpo")
    assert a == [0.5, -0.5, 0.0, 0.0]
    # The rows of a group need not be adjacent: statistics key on the id, not the position.
    b = _advantages([1.0, 1.0, 0.0, 1.0], [0, 1, 0, 1], "dr_grpo")
    assert b == [0.5, 0.0, -0.5, 0.0]


def _rank_advantages(rank: int, init_file: str, scores: torch.Tensor, groups: torch.Tensor, out: dict) -> None:
    """One of two gloo ranks: the advantages of its contiguous half of the batch."""
    import torch.distributed as dist

    from rayppo.learner.learner_engine import TorchCollective

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        half = slice(rank * 10, (rank + 1) * 10)
        collective = TorchCollective(2, torch.device("cpu"))
        out[rank] = {e: batch_group_advantages(scores[half], groups[half], 20, e, 1e-6, collective)
                     for e in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")}
    finally:
        dist.destroy_process_group()


def test_group_statistics_over_two_ranks_equal_the_whole_batch_even_when_a_group_is_split(tmp_path):
    """Two real gloo ranks (the learner's all-reduce): 5 groups of 4 rows, 10 rows per rank, so
    group 2 (rows 8-11) is split 2 + 2. Each rank's advantages equal the single-process batch's:
    counts, sums, centred squares and extremes are all-reduced, never computed from a partial group."""
    import torch.multiprocessing as mp

    torch.manual_seed(1)
    scores = torch.rand(20, dtype=torch.float64)
    groups = torch.arange(20) // 4
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_advantages, args=(str(tmp_path / "rendezvous"), scores, groups, out), nprocs=2)
        ranks = dict(out)
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        whole = batch_group_advantages(scores, groups, 20, estimator, 1e-6, LocalCollective())
        split = torch.cat([ranks[0][estimator], ranks[1][estimator]])
        # Sums of 4 terms in another order: a few ulps of O(1) values.
        assert torch.allclose(split, whole, rtol=0, atol=EXACT), estimator
    # The test can tell: rank 0's half of group 2 centred on its own mean is off by ~0.06.
    partial = batch_group_advantages(scores[8:10], groups[8:10], 20, "dr_grpo", 1e-6, LocalCollective())
    whole = batch_group_advantages(scores, groups, 20, "dr_grpo", 1e-6, LocalCollective())
    assert (partial - whole[8:10]).abs().max() > 1e-2


def test_reinforce_pp_returns_are_gae_with_zero_values_and_lambda_one():
    torch.manual_seed(2)
    rewards = torch.randn(4, 7, dtype=torch.float64)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 1 + [0] * 6, [1] * 3 + [0] * 4], dtype=torch.float64)
    rewards = rewards * mask
    returns = discounted_returns(rewards, mask, gamma=0.9)
    gae, _ = ppo.compute_gae(rewards, torch.zeros_like(rewards), mask, gamma=0.9, lam=1.0)
    assert torch.allclose(returns, gae, rtol=0, atol=EXACT)
    # By hand for row 3: G_2 = r_2, G_1 = r_1 + 0.9 r_2, G_0 = r_0 + 0.9 r_1 + 0.81 r_2.
    r = rewards[3].tolist()
    assert returns[3, :3].tolist() == pytest.approx([r[0] + 0.9 * r[1] + 0.81 * r[2], r[1] + 0.9 * r[2], r[2]],
                                                    abs=EXACT)
    assert returns[3, 3:].abs().sum() == 0


def test_overlong_penalty_ramps_over_the_last_buffer_tokens():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # L_max 20, buffer 8: free up to 12, then -(|y| - 12) / 8 down to -1 at 20.
    assert overlong_penalty(lengths, 20, 8, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 8, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 20, 0).tolist() == [0.0] * 5


def test_seq_mean_token_sum_norm_divides_by_rows_times_the_length_limit():
    x = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # (1 + 2 + 3 + 4) / (2 rows x 8): a long and a short response weigh their tokens alike.
    assert ppo.aggregate(x, mask, "seq-mean-token-sum-norm", max_length=8).item() == 10 / 16
    assert ppo.aggregate(x, mask, "token-mean").item() == 10 / 4
    assert ppo.aggregate(x, mask, "seq-mean-token-mean").item() == (2 + 4) / 2
    with pytest.raises(ValueError, match="max_length"):
        ppo.aggregate(x, mask, "seq-mean-token-sum-norm")


def test_clip_eps_high_lets_a_positive_advantage_grow_further():
    # rho = 1.25 on one token with A = 1: clipped at 1.2 symmetrically (no gradient), free under 0.28.
    old = torch.zeros(1, 1)
    logprobs = torch.full((1, 1), math.log(1.25), requires_grad=True)
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    loss, stats = ppo.policy_loss(logprobs, old, adv, mask, ppo.Surrogate(clip_eps=0.2))
    assert stats["clipfrac"].item() == 1.0 and loss.item() == pytest.approx(-1.2)
    loss, stats = ppo.policy_loss(logprobs, old, adv, mask, ppo.Surrogate(clip_eps=0.2, clip_eps_high=0.28))
    assert stats["clipfrac"].item() == 0.0 and loss.item() == pytest.approx(-1.25)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-1.25)  # d(-rho A)/d log pi = -rho A
    # The lower side is still 1 - clip_eps: rho = 0.75 with A = -1 is clipped at 0.8.
    low = torch.full((1, 1), math.log(0.75))
    _, stats = ppo.policy_loss(low, old, -adv, mask, ppo.Surrogate(clip_eps=0.2, clip_eps_high=0.28))
    assert stats["clipfrac"].item() == 1.0
