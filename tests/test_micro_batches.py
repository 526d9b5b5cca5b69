"""Micro-batches by token budget: the cut (every row once, each pass within budget, padding kept
small on long-tailed lengths), rows dealt to ranks by tokens, and the update of a minibatch cut into
micro-batches equal to the update of the whole minibatch for every loss normalisation.

The distributed half (2 DeepSpeed ranks at ZeRO-2 and 1 at ZeRO-3 cutting by 24 tokens, against the
in-process trainer taking minibatches whole) is ``test_distributed.py``'s equivalence test and the
GRPO case of ``test_groups.py``."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from rayppo.config.schema import PPOConfig
from rayppo.data.micro_batches import balanced_parts, balanced_shards, padded_tokens, token_batches
from rayppo.data.rollout import Rollout
from rayppo.learner.collective import LocalCollective
from rayppo.learner.experience import make_experience
from rayppo.learner.learn_settings import ExperienceSettings, LearnSettings, StepInputs
from rayppo.learner.lr_schedule import lr_scaler
from rayppo.learner.minibatches import ShardPlan, first_rows_kept, local_minibatches, minibatch_plan
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.learner.update import LearnerModels, OptimiserSteps, ppo_update
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.loading import Critic, load_causal_lm, prepare_for_training
from rayppo.models.sequences import pack, policy_forward


def _long_tail(n: int, seed: int = 0, cap: int = 128) -> list[int]:
    """Response lengths of a geometric law (mean ~34) cut at ``cap``: a reasoning batch's shape."""
    draw = random.Random(seed)
    return [min(cap, 1 + int(draw.expovariate(1 / 33))) for _ in range(n)]


def test_token_batches_cover_every_row_once_within_budget_and_cut_the_padding():
    response = _long_tail(256)
    prompt = [4 + i % 8 for i in range(256)]
    budget = 2048
    batches = token_batches(prompt, response, budget)
    assert sorted(i for b in batches for i in b) == list(range(256))
    for b in batches:  # within budget, or one row alone that is longer than the budget
        width = max(prompt[i] for i in b) + max(response[i] for i in b)
        assert len(b) * width <= budget or len(b) == 1
    real = sum(prompt) + sum(response)
    bucketed = padded_tokens(prompt, response, batches)
    unbucketed = padded_tokens(prompt, response, [list(range(i, i + 64)) for i in range(0, 256, 64)])
    # Fixed runs of 64 pay for each run's longest row (~2.5x the real tokens here); sorted cuts keep
    # rows of like length together (what remains: a pass spans a range of short lengths).
    print(f"real {real}, bucketed {bucketed}, unbucketed {unbucketed}")
    assert bucketed < 0.6 * unbucketed and bucketed < 1.5 * real
    assert token_batches(prompt, response, 0) == [list(range(256))]
    assert token_batches([3, 3], [500, 2], 100) == [[0], [1]]  # a row past the budget: its own pass


def test_rows_are_dealt_to_ranks_by_tokens_minibatch_by_minibatch():
    lengths = [130, 5, 6, 7, 120, 8, 9, 10]
    assert balanced_parts(lengths, 2) == [[0, 1, 2, 6], [3, 4, 5, 7]]  # 146 and 145 tokens; by rows: 148 and 147
    # Minibatch by minibatch: the long row alone on one rank, the three short ones on the other
    # (contiguous halves would put both long rows on rank 0: 143 + 137 against 21 + 27).
    assert balanced_shards(lengths, [[0, 1, 2, 3], [4, 5, 6, 7]], 2) == [[0, 4], [1, 2, 3, 5, 6, 7]]
    assert balanced_shards([5] * 4, [[3, 1, 0, 2]], 2) == [[0, 3], [1, 2]]  # equal lengths: dealt in turn


def test_micro_batch_counts_and_shares_add_up_to_the_minibatch():
    prompt, response = [3] * 6, [10, 1, 1, 1, 1, 10]
    plan = [[torch.tensor([0, 1, 2, 3, 4, 5])]]
    (micro,) = local_minibatches(ShardPlan(plan, torch.arange(6), (prompt, response), micro_batch_tokens=26),
                                 LocalCollective())
    # 2 rows x 13 columns, then 4 x 4: each share is of the whole minibatch (24 tokens, 6 rows).
    assert [m.rows.tolist() for m in micro] == [[0, 5], [1, 2, 3, 4]] and first_rows_kept([micro]) is None
    assert [m.token_share for m in micro] == [20 / 24, 4 / 24] and [m.row_share for m in micro] == [2 / 6, 4 / 6]
    (whole,) = local_minibatches(ShardPlan(plan, torch.arange(6), (prompt, response), micro_batch_tokens=0),
                                 LocalCollective())
    assert [m.rows.tolist() for m in whole] == [list(range(6))] and first_rows_kept([whole]).tolist() == list(range(6))


def _ragged_rollout(tokenizer, n: int = 12) -> Rollout:
    g = torch.Generator().manual_seed(5)
    vocab = len(tokenizer)
    lengths = [1, 9, 2, 3, 12, 2, 1, 7, 4, 2, 11, 3][:n]
    prompts = [torch.randint(4, vocab, (3 + i % 4,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(4, vocab, (lengths[i],), generator=g).tolist() for i in range(n)]
    reasons = ["stop" if i % 3 else "length" for i in range(n)]
    rollout = Rollout(prompts, responses, [[0.0] * len(r) for r in responses], reasons, [""] * n, [""] * n,
                      [0] * n, [0] * n, [i // 3 for i in range(n)])
    rollout.score = torch.randn(n, generator=g).tolist()
    return rollout


CASES = {
    "gae token-mean": dict(advantage="gae"),
    "gae seq-mean-token-mean": dict(advantage="gae", loss_agg="seq-mean-token-mean"),
    "grpo seq-mean-token-sum-norm, KL in the loss": dict(advantage="grpo", loss_agg="seq-mean-token-sum-norm",
                                                         kl_mode="loss"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_minibatch_in_micro_batches_takes_the_update_of_the_whole_minibatch(case, embedded_dir, tokenizer):
    """fp64, 2 epochs x 2 minibatches: cut into passes of 30 padded tokens (3-4 per minibatch) the
    update is the unsplit one. In fp64 the only differences are the order of the sums (relative
    ~1e-16 per operation, a few hundred operations deep, then 4 Adam steps that divide by the
    gradient's RMS): 1e-9 leaves room for rounding only, while a micro-batch normalised by its own
    counts (verl#5625) moves the weights by ~1e-3 relative."""
    cfg = PPOConfig(epochs=2, minibatches=2, entropy_coef=0.01, **CASES[case])
    rollout = _ragged_rollout(tokenizer)
    policy = prepare_for_training(load_causal_lm(embedded_dir), gradient_checkpointing=False).double()
    critic = prepare_for_training(Critic.from_pretrained(embedded_dir), False).double() if case.startswith("gae") else None
    batch = pack(rollout.prompt_ids, rollout.response_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        mu = policy_forward(policy, batch, 1.0)[0]
    rollout.logprobs = [mu[i, : len(r)].tolist() for i, r in enumerate(rollout.response_ids)]
    rollout.ref_logprobs = [[x - 0.2 for x in row] for row in rollout.logprobs]
    results, counts = {}, {}
    for budget in (0, 30):
        p, c = copy.deepcopy(policy), copy.deepcopy(critic)
        plan = minibatch_plan(len(rollout), cfg.epochs, cfg.minibatches, seed=1)
        shard = ShardPlan(plan, torch.arange(len(rollout)), rollout.lengths(), micro_batch_tokens=budget)
        minibatches = local_minibatches(shard, LocalCollective())
        rows = dataclasses.replace(RolloutTensors.of(rollout, tokenizer.pad_token_id), num_groups=4)
        settings = LearnSettings(ExperienceSettings(cfg, micro_batch_tokens=budget), max_new_tokens=12)
        step_plan = UpdatePlan.decide(settings, StepInputs(iteration=0, version=0, kl_coef=0.1), rows,
                                      first_rows_kept(minibatches))
        exp, _, first_values = make_experience(rows, c, step_plan)
        models = LearnerModels(p, c, _steps(p, c), LocalCollective(), "cpu", tokenizer.pad_token_id)
        stats = ppo_update(models, exp, minibatches, step_plan, first_values)
        results[budget], counts[budget] = (stats, [t.detach().clone() for t in _params(p, c)]), [len(m) for m in minibatches]
    assert counts[0] == [1] * 4 and min(counts[30]) >= 2
    for key in ("policy/loss", "policy/clipfrac", "entropy", "logprob_mismatch/mean"):
        assert results[30][0][key] == pytest.approx(results[0][0][key], rel=1e-9, abs=1e-12), key
    initial = [t.detach() for t in _params(policy, critic)]
    for a, b in zip(results[30][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert max(float((b - w).abs().max()) for b, w in zip(results[0][1], initial)) > 1e-4  # the update is real


def _params(*modules) -> list[torch.Tensor]:
    return [t for m in modules if m is not None for t in m.parameters()]


def _steps(policy, critic) -> OptimiserSteps:
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (policy, critic) if m is not None]

    def step() -> None:
        for opt in opts:
            opt.step()
            opt.zero_grad()

    return OptimiserSteps(lambda loss: loss.backward(), (lambda loss: loss.backward()) if critic is not None else None, step,
                          lr_scaler(opts[0], 1e-3, opts[1] if len(opts) > 1 else None, 1e-3))


def test_packed_passes_fill_the_budget_with_real_tokens():
    """Padding-free passes cost their real tokens: rows (longest first) fill each pass up to the budget,
    where the padded cut would split rows of unlike lengths apart."""
    prompt, response = [4] * 6, [100, 2, 3, 90, 1, 5]
    packed = token_batches(prompt, response, 200, "packed")
    assert packed == [[0, 3], [5, 2, 1, 4]]  # 104 + 94 = 198 tokens; then 9 + 7 + 6 + 5 = 27
    assert all(sum(prompt[i] + response[i] for i in b) <= 200 for b in packed)
    assert len(token_batches(prompt, response, 200)) > len(packed)  # padded: 2 x 104 > 200, so 0 and 3 apart
    assert token_batches([4], [500], 100, "packed") == [[0]]  # a row over the budget is a pass alone


def test_right_padded_passes_are_priced_by_their_longest_sequence():
    """One sequence per row: a pass costs rows x its longest prompt + response, not its longest
    prompt plus its longest response, so rows of like totals share a pass whatever their split."""
    prompt, response = [2, 30, 2, 30], [30, 2, 30, 2]  # four sequences of 32 tokens
    assert token_batches(prompt, response, 128, "right_padded") == [[0, 1, 2, 3]]  # 4 x 32 = 128
    padded = token_batches(prompt, response, 128)
    assert padded_tokens(prompt, response, padded) > 128 and len(padded) > 1  # 60 wide when mixed
    with pytest.raises(ValueError, match="layout must be one of padded, right_padded, packed, got 'rows'"):
        token_batches(prompt, response, 128, "rows")
