"""No seed of a run repeats (``rayppo/data/seeds.py``): every draw of noise is derived by one hash
of a tuple naming its use. Arithmetic seeds had repeats: a partial-rollout extra round of batch b
sampled with ``seed + 1``, batch b + 1's seed; at seed 0, dynamic sampling's round k of iteration 0
was iteration k's seed."""

from __future__ import annotations

import itertools
import random

import torch

from rayppo.config.load import load_config
from rayppo.data import seeds as seeds_module
from rayppo.data.seeds import eval_seed, minibatch_seed, rollout_seed, row_seeds, turn_seed
from rayppo.trainers.inprocess import InProcessTrainer


def test_the_calls_of_a_run_never_share_a_seed():
    """A run of 30 iterations: each with up to 4 rounds (dynamic sampling, or a pipelined
    generator's partial-rollout rounds), evaluation, 3 turns of each call's episodes, minibatch
    plans; run seeds 0..2. Every call's seed differs from every other."""
    calls = [rollout_seed(s, i, r) for s, i, r in itertools.product(range(3), range(30), range(4))]
    calls += [eval_seed(s) for s in range(3)]
    calls += [turn_seed(c, t) for c, t in itertools.product(list(calls), range(3))]
    calls += [minibatch_seed(s, i) for s, i in itertools.product(range(3), range(30))]
    assert len(set(calls)) == len(calls)
    assert rollout_seed(0, 4, 1) != rollout_seed(0, 5, 0)  # the partial round against the next batch
    assert rollout_seed(0, 0, 3) != rollout_seed(0, 3, 0)  # dynamic round k of iteration 0 against iteration k


def test_the_rows_of_a_run_never_share_a_seed():
    """Rows: 64 groups x 8 places in each of 120 calls (30 iterations x 4 rounds), a carried row
    continued in every later call under its old group and place, and the evaluation's rows. Row
    seeds are 32 bits: two groups' runs of 8 consecutive seeds overlap at 15 / 2^32 a pair, 0.1
    overlaps expected among these 7744 groups (none at these fixed seeds); what this guards is that
    no round, carried row or evaluation takes another's (call, group, place)."""
    calls = [rollout_seed(0, i, r) for i, r in itertools.product(range(30), range(4))] + [eval_seed(0)]
    groups = [g for g in range(64) for _ in range(8)]
    rows = [seed for call in calls for seed in row_seeds(call, groups)]
    assert len(set(rows)) == len(rows) == 121 * 512


def test_an_in_process_run_draws_no_seed_twice(monkeypatch, tmp_path):
    """Every seed the generator is handed in a real run (in-process: dynamic sampling rounds, a
    sampled evaluation) is recorded at the backend: none repeats. (Evaluations repeat their own
    seeds on purpose, ``eval_seed``: common noise, so that two evaluations compare policies.) At
    temperature 0.05 the 4 samples of a prompt are its near-greedy answer, every group's rewards
    are equal and dropped, so each iteration runs all 3 extra rounds: the rounds' seeds are drawn."""
    from rayppo.actors.hf_backend import HFBackend

    calls: list[list[int]] = []
    sample = HFBackend._sample

    def recording(self, prompt_ids, s, seeds, limits):
        calls.append(list(seeds))
        return sample(self, prompt_ids, s, seeds, limits)

    monkeypatch.setattr(HFBackend, "_sample", recording)
    cfg = load_config(None, ["trainer=reference", "ppo.advantage=grpo", "rollout.samples_per_prompt=4",
                             "rollout.batch_size=8", "ppo.minibatches=1", "rollout.dynamic_sampling_rounds=3",
                             "eval.samples=2", "rollout.temperature=0.05", f"output.dir={tmp_path}"])
    trainer = InProcessTrainer(cfg)
    rounds = [trainer.iteration()["dynamic/rounds"] for _ in range(3)]
    trainer.evaluate()
    assert rounds == [3.0, 3.0, 3.0]
    assert trainer.eval_prompts is not None and len(trainer.eval_prompts) == 8
    # The warm-up's 2 rows; per iteration its first call and 3 rounds of 8 prompts x 4 samples; the
    # evaluation's 8 prompts x 2 samples.
    assert [len(seeds) for seeds in calls] == [2] + [8 * 4] * (3 * (1 + 3)) + [8 * 2]
    drawn = [seed for seeds in calls for seed in seeds]
    assert len(drawn) == 2 + 12 * 32 + 16
    assert len(set(drawn)) == len(drawn)
    assert all(0 <= seed < 2**32 for seed in drawn)  # what torch's CPU generator keeps of a seed


def test_a_seed_is_what_cpu_and_gpu_generators_both_keep():
    """torch's CPU generator keeps a seed's low 32 bits: s and s + 2^32 draw one stream (vLLM's
    GPU sampler hashes all 64 bits and draws two). So every seed a generator is handed, a row's or
    a minibatch plan's, is below 2^32; the old 63-bit seeds were not, and two of them 2^32 apart
    shared their noise on CPU only."""
    s = 12345
    one, other = (torch.rand(8, generator=torch.Generator().manual_seed(x)) for x in (s, s + 2**32))
    assert torch.equal(one, other)
    calls = [rollout_seed(0, i, r) for i, r in itertools.product(range(30), range(4))] + [eval_seed(0)]
    calls += [turn_seed(c, t) for c, t in itertools.product(calls[:8], range(3))]
    rows = [seed for call in calls for seed in row_seeds(call, [g for g in range(64) for _ in range(8)])]
    plans = [minibatch_seed(run, i) for run, i in itertools.product(range(3), range(1000))]
    assert all(0 <= seed < 2**32 for seed in rows + plans)
    assert len(set(plans)) == len(plans)  # 3000 seeds: a shared one at 3000^2 / 2^33 = 0.001


def test_the_places_of_a_group_never_share_a_seed():
    """10,000 groups of 64 places in one call, their rows interleaved (a carried row beside new
    ones): a group's places take consecutive seeds from one base, so no group holds a seed twice.
    Independent 32-bit seeds per place would repeat one within a group at 64 * 63 / 2 / 2^32 per
    group, once in ~200 calls of this size; consecutive seeds never do."""
    groups = [g for g in range(10_000) for _ in range(64)]
    random.Random(0).shuffle(groups)
    places: dict[int, list[int]] = {}
    for group, seed in zip(groups, row_seeds(rollout_seed(0, 0), groups)):
        places.setdefault(group, []).append(seed)
    assert len(places) == 10_000
    for seeds in places.values():
        assert seeds == [(seeds[0] + p) % 2**32 for p in range(64)]
        assert len(set(seeds)) == 64


def test_a_group_at_the_top_of_the_seed_range_wraps_around(monkeypatch):
    """A base within a group's size of 2^32 continues from 0: every seed stays below 2^32 and the
    group's seeds stay distinct."""
    monkeypatch.setattr(seeds_module, "derive", lambda *use: 2**32 - 3)
    assert row_seeds(0, [7] * 5) == [2**32 - 3, 2**32 - 2, 2**32 - 1, 0, 1]
