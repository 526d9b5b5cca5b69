"""Actors that die or hang mid-run: real SIGKILL / SIGSTOP of the actor's process on a local Ray.

The driver replaces the actor, brings a generator to the current weights, redoes only the lost
share, and the iteration completes with exactly the prompts it drew."""

from __future__ import annotations

import copy
import os
import signal

import pytest

from rayppo.actors.base import Engine
from rayppo.cluster.driver import DistributedTrainer
from rayppo.cluster.group import get
from rayppo.config import load_config
from rayppo.errors import ActorFailedError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("local_ray")]

BASE = ["generators.num=2", "generators.cpus_per_worker=0.25", "learner.num_ranks=1", "rollout.batch_size=16",
        "ppo.lr=0.003"]


def _signal(group, i: int, sig: int) -> None:
    pid, _ = get(group.call_at(i, Engine.process_id, ()))
    os.kill(pid, sig)


def _iteration_with_expected_prompts(trainer: DistributedTrainer) -> tuple[dict[str, float], list[str]]:
    expected = copy.deepcopy(trainer.prompts).next_batch().texts  # what this iteration draws
    record = trainer.iteration()
    return record, expected


def test_killed_actors_of_every_role_are_replaced_and_the_iteration_completes(tmp_path):
    trainer = DistributedTrainer(load_config(None, BASE + ["cluster.max_actor_restarts=4", f"output.dir={tmp_path}"]))
    try:
        trainer.iteration()
        kills = [("generators", trainer.generators, 0), ("reference", trainer.reference, 0),
                 ("reward", trainer.rewards, 0), ("generators", trainer.generators, 1)]
        for n, (role, group, i) in enumerate(kills, start=1):
            _signal(group, i, signal.SIGKILL)
            record, expected = _iteration_with_expected_prompts(trainer)
            # No prompt lost or duplicated, in order; every row scored.
            assert trainer.last_rollout.prompt_text == list(expected), role
            assert len(trainer.last_rollout.score) == len(expected) == len(trainer.last_rollout.ref_logprobs)
            assert record["faults/actor_restarts"] == n
            # A replacement generator samples with the current weights: the guard would stop the
            # run above 1e-3; a healthy fp32 sync measures ~1e-5.
            assert record["logprob_mismatch/max"] < 1e-4, role
            assert record["sync/verified"] == 1.0
    finally:
        trainer.close()


def test_an_actor_that_stops_answering_is_replaced_after_the_deadline(tmp_path):
    """SIGSTOP the reward actor: past cluster.call_timeout_s it is dumped, killed, replaced."""
    trainer = DistributedTrainer(load_config(None, BASE + ["cluster.call_timeout_s=15", f"output.dir={tmp_path}"]))
    try:
        trainer.iteration()
        _signal(trainer.rewards, 0, signal.SIGSTOP)
        record, expected = _iteration_with_expected_prompts(trainer)
        assert record["faults/actor_restarts"] == 1
        assert trainer.last_rollout.prompt_text == list(expected)
        assert record["time/reward"] >= 15  # it waited the deadline out, once
    finally:
        trainer.close()


def test_past_the_restart_budget_the_run_stops_naming_role_actor_and_cause(tmp_path):
    trainer = DistributedTrainer(load_config(None, BASE + ["cluster.max_actor_restarts=0", f"output.dir={tmp_path}"]))
    try:
        trainer.iteration()
        _signal(trainer.reference, 0, signal.SIGKILL)
        with pytest.raises(ActorFailedError, match=r"^reference actor 0 died \(.*cluster.max_actor_restarts=0"):
            trainer.iteration()
    finally:
        trainer.close()
