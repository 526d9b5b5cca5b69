"""No seed of a run repeats (``rayppo/data/seeds.py``): every draw of noise is derived by one hash
of a tuple naming its use. Arithmetic seeds had repeats: a partial-rollout extra round of batch b
sampled with ``seed + 1``, batch b + 1's seed; at seed 0, dynamic sampling's round k of iteration 0
was iteration k's seed."""

from __future__ import annotations

import itertools

from rayppo.config.load import load_config
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
    continued in every later call under its old group and place, and the evaluation's rows."""
    calls = [rollout_seed(0, i, r) for i, r in itertools.product(range(30), range(4))] + [eval_seed(0)]
    groups = [g for g in range(64) for _ in range(8)]
    rows = [seed for call in calls for seed in row_seeds(call, groups)]
    assert len(set(rows)) == len(rows) == 121 * 512


def test_an_in_process_run_draws_no_seed_twice(monkeypatch, tmp_path):
    """Every seed the generator is handed in a real run (in-process: dynamic sampling rounds, a
    sampled evaluation) is recorded at the backend: none repeats. (Evaluations repeat their own
    seeds on purpose, ``eval_seed``: common noise, so that two evaluations compare policies.)"""
    from rayppo.actors.hf_backend import HFBackend

    drawn: list[int] = []
    sample = HFBackend._sample

    def recording(self, prompt_ids, s, seeds, limits):
        drawn.extend(seeds)
        return sample(self, prompt_ids, s, seeds, limits)

    monkeypatch.setattr(HFBackend, "_sample", recording)
    cfg = load_config(None, ["trainer=reference", "ppo.advantage=grpo", "rollout.samples_per_prompt=4",
                             "rollout.batch_size=8", "ppo.minibatches=1", "rollout.dynamic_sampling_rounds=3",
                             "eval.samples=2", f"output.dir={tmp_path}"])
    trainer = InProcessTrainer(cfg)
    for _ in range(3):
        trainer.iteration()
    trainer.evaluate()
    assert len(drawn) > 3 * 32
    assert len(set(drawn)) == len(drawn)
