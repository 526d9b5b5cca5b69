"""Each row's sampling noise is a function of (call seed, group, place in the group): not of which
generator draws the row, nor of the rows batched with it (``hf_backend.sample_seeds``, ``RowNoise``)."""

from __future__ import annotations

import math

import pytest
import torch

from rayppo.actors.generator import GeneratorEngine, SamplingSettings
from rayppo.actors.hf_backend import RowNoise, sample_seeds
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.trainers.iteration import group_shares

PROMPTS = ["say 7 :", "write 3 :", "give 1 :", "repeat 5 :", "say 12 :", "write 40 :"]


def _batch(tokenizer) -> PromptBatch:
    return PromptBatch(list(PROMPTS), [tokenizer(t)["input_ids"] for t in PROMPTS])


def test_a_rows_seed_follows_from_its_group_and_place_not_from_its_share(tokenizer):
    batch = _batch(tokenizer)
    whole = sample_seeds(5, group_shares(batch, 1, 4)[0].groups)
    for generators in (2, 3, 6):
        shares = group_shares(batch, generators, 4)
        assert [s for share in shares for s in sample_seeds(5, share.groups)] == whole
    assert len(set(whole)) == len(whole)  # every row of the batch draws its own noise
    seeds = {s for call in range(50) for s in sample_seeds(call, [g for g in range(64) for _ in range(8)])}
    # No two (call, group, place) share a seed here: within a group none can (``row_seeds``), and
    # 3200 groups' runs of 8 overlap at 15 / 2^32 a pair, 0.02 overlaps expected.
    assert len(seeds) == 50 * 64 * 8


@pytest.mark.parametrize("one_group", [False, True], ids=["a-group-each", "one-group"])
def test_gumbel_max_noise_samples_the_tempered_softmax(one_group):
    """argmax(logits / T + Gumbel) over N rows with their own seeds: each token's frequency is its
    probability under softmax(logits / T) within 5 binomial standard deviations (a one-in-a-million
    miss for a correct sampler, at these fixed seeds a fixed outcome); a -inf logit is never drawn.
    The same for N places of one group, whose seeds are consecutive (``row_seeds``)."""
    rows, temperature = 20_000, 0.7
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    groups = [0] * rows if one_group else range(rows)
    noise = RowNoise(sample_seeds(0, groups), temperature)
    drawn = noise(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, -1)).argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    for token, p in enumerate(probs.tolist()):
        share = float((drawn == token).float().mean())
        assert abs(share - p) <= 5 * math.sqrt(p * (1 - p) / rows) + 1e-12, (token, share, p)
    again = RowNoise(sample_seeds(0, groups), temperature)(torch.zeros(rows, 1, dtype=torch.long),
                                                                  logits.expand(rows, -1)).argmax(-1)
    assert torch.equal(drawn, again)  # the same seeds draw the same tokens


def test_the_places_of_a_group_draw_uncorrelated_noise():
    """A group's places have consecutive seeds; their Gumbel noise (zero logits, T = 1) over a
    4096-token vocabulary is uncorrelated: for independent rows a Pearson r is ~N(0, 1/4096), so
    5 / 64 is 5 standard deviations, passed by all 64 * 63 / 2 pairs but 1 in ~900 times."""
    places, vocab = 64, 4096
    noise = RowNoise(sample_seeds(0, [0] * places), 1.0)(torch.zeros(places, 1, dtype=torch.long),
                                                         torch.zeros(places, vocab))
    r = torch.corrcoef(noise.double())
    off = r[~torch.eye(places, dtype=torch.bool)]
    assert off.abs().max() <= 5 / 64, off.abs().max()


def test_the_transformers_generator_samples_a_row_alike_in_any_share(embedded_dir, tokenizer):
    """Two shares sampled in reverse order (other rows beside each row, another padding width)
    draw the tokens one call over the whole batch draws."""
    engine = GeneratorEngine(str(embedded_dir), SamplingSettings(max_new_tokens=12), backend="hf")
    batch = _batch(tokenizer)
    whole = engine.generate(group_shares(batch, 1, 4)[0], seed=3)
    parts = [engine.generate(share, seed=3) for share in reversed(group_shares(batch, 3, 4))]
    split = Rollout.concat(parts[::-1])
    assert split.response_ids == whole.response_ids
    # Left padding of another width changes which positions a row's attention sums over masked
    # keys (exact zeros), and the matmuls' blocking: a few ulp of log-probs below 10 in magnitude.
    gap = max(abs(a - b) for x, y in zip(whole.logprobs, split.logprobs) for a, b in zip(x, y))
    print(f"log-prob gap between splits: {gap:.2e}")
    assert gap <= 5e-6, gap
    assert len({tuple(r) for r in whole.response_ids}) > len(whole) // 2
    other = engine.generate(group_shares(batch, 1, 4)[0], seed=4)
    assert sum(a != b for a, b in zip(whole.response_ids, other.response_ids)) > len(whole) // 2
