"""The learning-rate schedule (``learner/lr_schedule.py``): its factors against the formulas worked
by hand, and that the in-process trainer's optimiser trains at them. The distributed learner's
DeepSpeed engines follow the same schedule: ``test_distributed.py``'s distillation equivalence
test runs it on 2 ZeRO-2 ranks against the in-process trainer."""

from __future__ import annotations

import math

import pytest

from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.learner.lr_schedule import lr_factor


def test_the_factors_follow_the_formulas_worked_by_hand():
    # N = 6 iterations, w = 2 of warm-up: 1/3, 2/3, then p = (i - 2) / 4 = 0, 1/4, 1/2, 3/4.
    assert [lr_factor(i, 6, "constant", 2) for i in range(6)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])
    assert [lr_factor(i, 6, "linear", 2) for i in range(6)] == pytest.approx([1 / 3, 2 / 3, 1, 0.75, 0.5, 0.25])
    # linear to e = 0.2: 1 - 0.8 p
    assert [lr_factor(i, 6, "linear", 2, 0.2) for i in range(2, 6)] == pytest.approx([1, 0.8, 0.6, 0.4])
    # cosine, no warm-up, N = 4: (1 + cos(pi i / 4)) / 2
    cosine = [(1 + math.cos(math.pi * i / 4)) / 2 for i in range(4)]
    assert [lr_factor(i, 4, "cosine") for i in range(4)] == pytest.approx(cosine)
    assert cosine[1] == pytest.approx((2 + 2 ** 0.5) / 4)  # 0.854: the half cosine's shape, not a line
    # Past the horizon (a run resumed with more iterations computes on its new N; this holds e).
    assert [lr_factor(9, 6, "linear", 0, 0.1), lr_factor(6, 6, "cosine", 0, 0.1)] == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
        lr_factor(3, 6, "step")


def test_bad_schedule_settings_are_refused_by_field():
    with pytest.raises(ConfigError, match="ppo.lr_schedule: must be constant, linear or cosine.*did you mean linear"):
        load_config(None, ["ppo.lr_schedule=lnear"])
    with pytest.raises(ConfigError, match=r"ppo.lr_warmup: must be >= 0 and below stop.iterations \(5\), got 5"):
        load_config(None, ["ppo.lr_warmup=5", "stop.iterations=5"])
    with pytest.raises(ConfigError, match=r"ppo.lr_end: must be in \[0, 1\]"):
        load_config(None, ["ppo.lr_end=1.5"])


def test_the_in_process_trainer_trains_at_the_scheduled_rate():
    """Each update's AdamW groups hold ``ppo.lr`` x the factor (the rate of its steps) and the
    metric says so: cosine over 3 iterations after 1 of warm-up, 1/2, 1, 1/2."""
    from rayppo.trainers.inprocess import InProcessTrainer

    cfg = load_config(None, ["trainer=reference", "rollout.batch_size=4", "rollout.max_new_tokens=4",
                             "ppo.minibatches=1", "ppo.lr_schedule=cosine", "ppo.lr_warmup=1", "stop.iterations=3",
                             "eval.every=0"])
    trainer = InProcessTrainer(cfg)
    rates = []
    for _ in range(3):
        record = trainer.iteration()
        assert {g["lr"] for g in trainer.policy_opt.param_groups} == {record["policy/lr"]}
        rates.append(record["policy/lr"])
    assert rates == pytest.approx([cfg.ppo.lr / 2, cfg.ppo.lr, cfg.ppo.lr / 2])
