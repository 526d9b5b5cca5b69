"""DAPO's dynamic sampling (``rayppo/trainers/dynamic_sampling.py``): groups of equal rewards are
dropped, more prompts are drawn until the batch is full, within the round limit; and the
in-process trainer's iteration with it."""

from __future__ import annotations

import pytest

from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.data.rollout import Rollout
from rayppo.trainers.dynamic_sampling import fill_batch, informative_groups
from rayppo.trainers.inprocess import InProcessTrainer


def _batch(scores: list[list[float]], tag: str) -> Rollout:
    """One rollout of len(scores) groups; row text ``tag:group:sample`` to follow rows around."""
    rows = [(g, i, s) for g, group in enumerate(scores) for i, s in enumerate(group)]
    n = len(rows)
    return Rollout([[1]] * n, [[2]] * n, [[-1.0]] * n, ["stop"] * n, [f"{tag}:{g}:{i}" for g, i, _ in rows],
                   [""] * n, group_id=[g for g, _, _ in rows], score=[s for _, _, s in rows])


def test_equal_groups_are_dropped_and_more_prompts_fill_the_batch():
    first = _batch([[1, 1], [0, 1], [0, 0], [1, 0]], "a")  # groups 1 and 3 informative
    draws = {1: _batch([[0, 0], [0.5, 0], [1, 1], [1, 1]], "b"), 2: _batch([[0, 1]] * 4, "c")}
    asked = []

    def draw(k: int) -> Rollout:
        asked.append(k)
        return draws[k]

    batch, stats = fill_batch(first, draw, wanted=4, max_rounds=3)
    assert asked == [1, 2]  # 2 informative, then 1 more, then 4 more: stops once 4 are in hand
    assert [t.rsplit(":", 1)[0] for t in batch.prompt_text[::2]] == ["a:1", "a:3", "b:1", "c:0"]
    assert batch.group_id == [0, 0, 1, 1, 2, 2, 3, 3]  # renumbered in order, unique across rounds
    assert stats == {"dynamic/rounds": 2.0, "dynamic/dropped_groups": 5.0, "dynamic/kept_groups": 4.0}


def test_the_round_limit_bounds_the_draws_and_an_uninformative_run_keeps_its_batch():
    calls = []

    def never(k: int) -> Rollout:
        calls.append(k)
        return _batch([[1, 1], [0, 0]], f"r{k}")

    first = _batch([[0, 0], [0.3, 0.3]], "a")
    batch, stats = fill_batch(first, never, wanted=2, max_rounds=2)
    assert calls == [1, 2] and batch is first
    assert stats == {"dynamic/rounds": 2.0, "dynamic/dropped_groups": 6.0, "dynamic/kept_groups": 0.0}
    # Short of groups after the last round: trains on the informative ones it has.
    partial, stats = fill_batch(_batch([[0, 1], [0, 0]], "a"), never, wanted=2, max_rounds=1)
    assert partial.group_id == [0, 0] and stats["dynamic/kept_groups"] == 1.0


def test_informative_groups_key_on_group_ids_not_positions():
    r = _batch([[0, 1]], "a")
    r.group_id, r.score = [4, 7, 4, 7], [1.0, 0.5, 0.0, 0.5]
    assert informative_groups(r) == [4]


def test_dynamic_sampling_needs_a_group_estimator_and_the_synchronous_iteration():
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling_rounds: drops groups of equal rewards"):
        load_config(None, ["rollout.dynamic_sampling_rounds=2"])
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling_rounds: runs in the synchronous iteration only"):
        load_config(None, ["rollout.dynamic_sampling_rounds=2", "ppo.advantage=grpo", "rollout.samples_per_prompt=2",
                           "rollout.max_staleness=1", "learner.weight_sync=object_store"])


def test_an_iteration_with_dynamic_sampling_trains_only_informative_groups():
    cfg = load_config(None, ["trainer=reference", "ppo.advantage=grpo", "rollout.samples_per_prompt=4",
                             "rollout.batch_size=8", "ppo.minibatches=1", "rollout.dynamic_sampling_rounds=3",
                             "output.save_rollouts=true"])
    trainer = InProcessTrainer(cfg)
    stats = trainer.iteration()
    rollout = trainer.last_rollout
    groups = sorted(set(rollout.group_id))
    assert groups == list(range(len(groups))) and len(rollout) == 4 * len(groups)
    assert all(len({s for s, g in zip(rollout.score, rollout.group_id) if g == k}) > 1 for k in groups)
    assert stats["dynamic/kept_groups"] == len(groups) <= 8
    assert stats["dynamic/kept_groups"] == 8 or stats["dynamic/rounds"] == 3  # full, or out of rounds
    for k in groups:  # no zero-signal group trained: each has a row with A_i != 0
        assert any(rollout.advantages[i][0] != 0 for i, g in enumerate(rollout.group_id) if g == k)
