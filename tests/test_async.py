"""The asynchronous pipeline (``rollout.max_staleness``): its bookkeeping as pure functions, and
real runs on a local Ray (vLLM generator, DeepSpeed learner) that show the overlap, the
staleness bound, and a checkpoint + resume that redraws the batches that were in flight."""

from __future__ import annotations

import json
import os
import signal

import pyarrow.parquet as pq
import pytest

from rayppo.cluster.group import get
from rayppo.config.load import load_config
from rayppo.data.rollout import Rollout
from rayppo.learner.guard import WeightSyncError
from rayppo.machine.role_resources import Engine
from rayppo.run.checkpoint import resume_config
from rayppo.train import run
from rayppo.trainers import pipeline_stages
from rayppo.trainers.choice import trainer_class
from rayppo.trainers.distributed import DistributedTrainer, source_class
from rayppo.trainers.pipeline import PipelinedSource
from rayppo.trainers.pipeline_stages import BusyClock
from rayppo.trainers.staleness import drop_stale, staleness_stats


def _rollout(versions: list[int]) -> Rollout:
    n = len(versions)
    return Rollout(prompt_ids=[[1, 2]] * n, response_ids=[[3]] * n, logprobs=[[-0.5]] * n, finish_reason=["stop"] * n,
                   prompt_text=[f"p{i}" for i in range(n)], response_text=["r"] * n, policy_version=list(versions),
                   generator_id=[0] * n)


def test_rows_older_than_k_versions_are_dropped_and_counted():
    kept, dropped = drop_stale(_rollout([3, 2, 1, 0, 3]), version=3, max_staleness=1)
    assert kept.prompt_text == ["p0", "p1", "p4"] and dropped == 2
    same, none = drop_stale(_rollout([2, 1]), version=3, max_staleness=2)
    assert none == 0 and same.prompt_text == ["p0", "p1"]


def test_staleness_stats_are_versions_behind_the_learner():
    assert staleness_stats(_rollout([3, 2, 2, 0]), 3) == {"async/staleness_mean": 1.25, "async/staleness_max": 3.0,
                                                          "async/token_staleness_mean": 1.25}


def test_busy_clock_counts_the_busy_seconds_inside_a_window(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(pipeline_stages.time, "perf_counter", lambda: now[0])
    clock = BusyClock()
    for start, end in ((1.0, 3.0), (5.0, 6.0)):
        now[0] = start
        clock.start()
        now[0] = end
        clock.stop()
    now[0] = 8.0
    clock.start()  # still running at the window's end: counts up to it
    assert clock.busy(2.0, 9.0) == pytest.approx(1.0 + 1.0 + 1.0)
    assert clock.busy(6.5, 7.5) == 0.0


def test_staleness_zero_is_the_synchronous_trainer_and_k_selects_the_pipeline():
    from rayppo.trainers.sync_source import SynchronousSource

    synchronous, pipelined = load_config(None, []), load_config(None, ["rollout.max_staleness=2"])
    assert trainer_class(synchronous) is DistributedTrainer and source_class(synchronous) is SynchronousSource
    assert trainer_class(pipelined) is DistributedTrainer and source_class(pipelined) is PipelinedSource


ASYNC = ["rollout.max_staleness=1", "rollout.batch_size=16", "learner.num_ranks=1", "ppo.minibatches=2",
         "output.save_rollouts=true", "output.checkpoint_every=2", "eval.every=0", "output.samples_every=0"]


def _prompt_batches(cfg, n: int) -> list[list[str]]:
    """The first n batches a fresh sampler draws (what the pipeline must train on, in order)."""
    from rayppo.data.prompts import PromptSampler, load_prompt_set
    from rayppo.models.loading import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(str(resolve_model_path(cfg.model.policy, cfg.model.cache_dir)))
    prompts = load_prompt_set(cfg.data.prompts, cfg.data.prompt_column, tokenizer, 10_000, cfg.data.split)
    sampler = PromptSampler(prompts, cfg.rollout.batch_size, cfg.seed, cfg.data.shuffle)
    return [list(sampler.next_batch().texts) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_pipeline_overlaps_with_staleness_one_and_resumes_from_the_batch_after_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, ASYNC + ["stop.iterations=3", f"output.dir={out}"])
    run(cfg, DistributedTrainer(cfg), progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # k = 1: batch 0 comes from the initial weights; every later batch was sampled while the
    # learner trained the one before, with the weights one version behind (never two).
    assert [r["async/staleness_mean"] for r in records] == [0.0, 1.0, 1.0]
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert all(r["async/dropped_rows"] == 0 for r in records)
    # Like with like: only batch 0's rows were sampled by the version the learner held.
    assert [r["logprob_mismatch/rows"] for r in records] == [16, 0, 0]
    assert records[0]["logprob_mismatch/max"] < 1e-4  # fp32, same weights: ~1e-5 when healthy
    expected = _prompt_batches(cfg, 4)
    for it in range(3):
        table = pq.read_table(out / "rollouts" / f"iter_{it:05d}.parquet").to_pydict()
        assert table["prompt_text"] == expected[it]  # no prompt lost, skipped or trained twice
        assert set(table["policy_version"]) == {max(it - 1, 0)}

    # The run ended with a checkpoint of iteration 3; batch 3 was in flight and is drawn again.
    resumed, checkpoint = resume_config(str(out), ["stop.iterations=4"])
    run(resumed, DistributedTrainer(resumed), progress=False, resume=checkpoint)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert records[3]["async/staleness_max"] == 0.0  # sampled with the restored weights
    table = pq.read_table(out / "rollouts" / "iter_00003.parquet").to_pydict()
    assert table["prompt_text"] == expected[3] and set(table["policy_version"]) == {3}


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_a_killed_generator_is_replaced_with_the_published_weights_and_no_prompt_is_lost(tmp_path):
    """SIGKILL generator 1 mid-pipeline, then generator 0 just before an evaluation: each is
    replaced once (the evaluation owns the actors alone: the stage threads are stopped during it),
    no prompt is lost, and the batches in flight at the evaluation are drawn again."""
    cfg = load_config(None, ["rollout.max_staleness=1", "rollout.batch_size=16", "learner.num_ranks=1",
                             "generators.num=2", "generators.cpus_per_worker=0.25", "eval.every=100",
                             f"output.dir={tmp_path}"])
    expected = _prompt_batches(cfg, 5)
    trainer = DistributedTrainer(cfg)
    try:
        records = [trainer.iteration()]
        pid, _ = get(trainer.generators.call_at(1, Engine.process_id, ()))
        os.kill(pid, signal.SIGKILL)  # mid-pipeline: it is sampling batch 2 or waiting to
        for it in range(1, 4):
            records.append(trainer.iteration())
            assert trainer.last_rollout.prompt_text == expected[it]  # its share redone, in order
            assert set(trainer.last_rollout.generator_id) == {0, 1}
        pid, _ = get(trainer.generators.call_at(0, Engine.process_id, ()))
        os.kill(pid, signal.SIGKILL)
        assert "eval/reward/mean" in trainer.evaluate()
        records.append(trainer.iteration())
        assert trainer.last_rollout.prompt_text == expected[4]
    finally:
        trainer.close()
    assert records[-1]["faults/actor_restarts"] == 2  # one replacement per death, none twice
    # The replacement took the published weights: still at most one version behind, and checked.
    assert all(r["async/staleness_max"] <= 1 and r["async/dropped_rows"] == 0 for r in records)
    assert all(r["sync/verified"] == 1.0 for r in records)


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_the_weight_check_runs_after_each_generators_own_sync(tmp_path):
    """A generator that skips one tensor of its update stops the run: the guard's weight check
    runs after every load, between that generator's batches, as after a synchronous sync."""
    cfg = load_config(None, ["rollout.max_staleness=1", "rollout.batch_size=16", "learner.num_ranks=1",
                             "checks.sync_fault=skip_tensor", "eval.every=0", f"output.dir={tmp_path}"])
    trainer = DistributedTrainer(cfg)
    try:
        with pytest.raises(WeightSyncError, match=r"weight sync to policy version 1 \(the update of iteration 0\): generator 0 does not hold the "
                                                  r"weights the learner sent: model.layers.0.mlp.down_proj.weight"):
            for _ in range(4):
                trainer.iteration()
        assert trainer.iteration_count == 2  # batch 2 is the first sampled after loading version 1
    finally:
        trainer.close()
