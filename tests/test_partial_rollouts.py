"""Partial rollouts (``rollout.partial_tokens``): the carry's bookkeeping as pure functions, a real
generator engine continuing responses across a weight update (each token's log-prob and version
those of the weights that sampled it), and the asynchronous pipeline on a local Ray with a
generator SIGKILLed mid-continuation and a checkpoint restored with rows in flight: every prompt
drawn is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest
import torch

from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.data.partial_rollouts import (
    carry_from_json,
    carry_to_json,
    deal,
    oldest_versions,
    renumber_groups,
    split_finished_groups,
    with_unique_groups,
)
from rayppo.data.rollout import Rollout
from rayppo.trainers.staleness import drop_stale, generator_lead, staleness_stats


def _rows(reasons: list[str], groups: list[int], versions: list[list[int]]) -> Rollout:
    n = len(reasons)
    return Rollout(prompt_ids=[[1, 2]] * n, response_ids=[[3] * len(v) for v in versions],
                   logprobs=[[-0.1 * (i + 1) / 3] * len(v) for i, v in enumerate(versions)], finish_reason=reasons,
                   prompt_text=[f"p{i}" for i in range(n)], response_text=["r"] * n,
                   policy_version=[v[0] for v in versions], generator_id=[0] * n, group_id=groups,
                   token_versions=versions)


def test_a_group_is_ready_only_when_every_row_has_finished():
    rows = _rows(["stop", "partial", "length", "stop", "stop"], [7, 7, 8, 9, 9], [[0], [0], [0], [1], [1]])
    ready, waiting = split_finished_groups(rows)
    assert ready.prompt_text == ["p2", "p3", "p4"] and waiting.prompt_text == ["p0", "p1"]  # p0 waits for p1


def test_group_ids_are_unique_across_batches_then_dense_within_one():
    carried, fresh = with_unique_groups([3, 3], 4, 16), with_unique_groups([0, 3], 5, 16)
    assert carried == [67, 67] and fresh == [80, 83]  # batch 4's group 3 is not batch 5's
    rows = _rows(["stop"] * 4, carried + fresh, [[4]] * 4)
    assert renumber_groups(rows).group_id == [0, 0, 1, 2]


def test_a_rows_staleness_is_its_oldest_tokens_and_its_group_goes_with_it():
    # Row 1 was started by version 1 and continued by 3: at learner version 3 with k = 1 it is
    # stale, and row 0 (same group, all version 3) is dropped with it.
    rows = _rows(["stop"] * 3, [0, 0, 1], [[3, 3], [1, 3, 3], [2, 3]])
    assert oldest_versions(rows) == [3, 1, 2]
    kept, dropped = drop_stale(rows, version=3, max_staleness=1)
    assert kept.prompt_text == ["p2"] and dropped == 2
    stats = staleness_stats(rows, 3)
    assert stats["async/staleness_max"] == 2.0 and stats["async/staleness_mean"] == pytest.approx(1.0)
    assert stats["async/token_staleness_mean"] == pytest.approx((0 + 0 + 2 + 0 + 0 + 1 + 0) / 7)


def test_the_carry_survives_json_bit_for_bit_and_is_dealt_by_whole_groups():
    rows = _rows(["partial", "stop", "partial", "partial"], [5, 5, 6, 9], [[0, 1], [1], [1, 1, 2], [2]])
    rows.logprobs = [[float(torch.tensor(-x, dtype=torch.float32)) for x in (0.1, 0.7)], [-1 / 3],
                     [-2.5e-8, -13.0, -0.3], [-0.1]]
    back = carry_from_json(json.loads(json.dumps(carry_to_json(deal(rows, 2)))), 2)
    assert [c.group_id for c in back] == [[5, 5, 9], [6]]  # groups 5 and 9 to generator 0, 6 to 1
    merged = Rollout.concat(back)
    order = [merged.group_id.index(g) for g in (5, 6, 9)]
    assert [merged.logprobs[i] for i in order] == [rows.logprobs[0], rows.logprobs[2], rows.logprobs[3]]
    assert merged.token_versions[order[1]] == [1, 1, 2]
    assert [len(c) for c in carry_from_json(None, 3)] == [0, 0, 0]


def test_partial_tokens_needs_the_asynchronous_pipeline_and_a_budget_below_the_length_limit():
    with pytest.raises(ConfigError, match=r"rollout.partial_tokens: .*rollout.max_staleness >= 1"):
        load_config(None, ["rollout.partial_tokens=4"])
    with pytest.raises(ConfigError, match=r"rollout.partial_tokens: must be below rollout.max_new_tokens=12"):
        load_config(None, ["rollout.max_staleness=1", "rollout.partial_tokens=12"])
    assert load_config(None, ["rollout.max_staleness=1", "rollout.partial_tokens=4"]).rollout.partial_tokens == 4


def test_the_generators_lead_keeps_a_response_of_every_call_count_inside_the_window():
    assert generator_lead(3, 0, 12) == 3  # whole responses: k batches ahead
    assert generator_lead(3, 4, 12) == 1  # 3 calls: started at most 1 ahead, trained at most 3 behind
    assert generator_lead(6, 5, 12) == 4
    assert generator_lead(1, 4, 128) == 1  # k below the calls: still one ahead (long rows may be dropped)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_continued_response_records_each_tokens_version_and_behaviour_logprob(embedded_dir, backend):
    """Sample 3 tokens with version 0, load version 1 (scaled weights), continue: the first 3
    log-probs are version 0's and the rest version 1's, as a forward pass of each scores them."""
    from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
    from rayppo.data.prompts import PromptBatch
    from rayppo.models.loading import load_causal_lm
    from rayppo.models.sequences import pack, policy_forward
    from rayppo.models.weights import pack_weights

    limit, budget = 12, 3
    engine = GeneratorEngine(str(embedded_dir), SamplingSettings(max_new_tokens=limit, ignore_eos=True),
                             backend=backend, actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1)))
    texts = [f"{i}+{i}=" for i in range(4)]
    prompts = PromptBatch(texts=texts, ids=[engine.tokenizer(t)["input_ids"] for t in texts]).groups_of(1)
    first = engine.generate_partial(prompts, Rollout.concat([]), seed=1, budget=budget)
    assert first.finish_reason == ["partial"] * 4 and all(len(r) == budget for r in first.response_ids)
    old = load_causal_lm(str(embedded_dir), "float32").eval()
    new = load_causal_lm(str(embedded_dir), "float32").eval()
    with torch.no_grad():
        new.lm_head.weight.mul_(1.5)  # a different policy: every log-prob moves
    assert engine.load_weights(pack_weights(dict(new.state_dict()), version=1)) == 1
    out = engine.generate_partial(prompts.select([]), first, seed=2, budget=limit)
    assert out.finish_reason == ["length"] * 4 and all(len(r) == limit for r in out.response_ids)
    assert out.token_versions == [[0] * budget + [1] * (limit - budget)] * 4 and out.policy_version == [0] * 4
    assert [r[:budget] for r in out.response_ids] == first.response_ids  # continued, not restarted
    batch = pack(out.prompt_ids, out.response_ids, engine.tokenizer.pad_token_id)
    with torch.no_grad():
        under_old, under_new = policy_forward(old, batch)[0], policy_forward(new, batch)[0]
    logprobs = torch.tensor(out.logprobs)
    # fp32 log-softmax of O(10) logits over two layers, batched differently: a few 1e-6.
    tol = 2e-5 if backend == "hf" else 2e-4  # vLLM's CPU kernels are not the transformers ones
    assert torch.allclose(logprobs[:, :budget], under_old[:, :budget], atol=tol, rtol=0)
    assert torch.allclose(logprobs[:, budget:], under_new[:, budget:], atol=tol, rtol=0)
    assert not torch.allclose(under_old[:, budget:], under_new[:, budget:], atol=100 * tol, rtol=0)  # it can tell


PARTIAL = ["rollout.max_staleness=3", "rollout.partial_tokens=4", "rollout.batch_size=16", "learner.num_ranks=1",
           "generators.num=2", "generators.cpus_per_worker=0.25", "ppo.minibatches=2", "eval.every=0",
           "output.samples_every=0"]


def _drawn(cfg, n: int) -> list[str]:
    from rayppo.data.prompts import PromptSampler, load_prompt_set
    from rayppo.models.loading import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(str(resolve_model_path(cfg.model.policy, cfg.model.cache_dir)))
    prompts = load_prompt_set(cfg.data.prompts, cfg.data.prompt_column, tokenizer, 10_000, cfg.data.split)
    sampler = PromptSampler(prompts, cfg.rollout.batch_size, cfg.seed, cfg.data.shuffle)
    return [t for _ in range(n) for t in sampler.next_batch().texts]


@pytest.mark.slow
@pytest.mark.usefixtures("local_ray")
def test_a_generator_killed_mid_continuation_and_a_restored_checkpoint_lose_and_repeat_no_row(tmp_path):
    """Generator 1 is SIGKILLed while it holds unfinished rows; later a checkpoint is taken with
    rows in flight, two more iterations run, and the checkpoint is restored. Every row drawn is
    then trained exactly once, or is still in flight, or was dropped as stale and counted."""
    from rayppo.cluster.group import get
    from rayppo.machine.role_resources import Engine
    from rayppo.trainers.distributed import DistributedTrainer

    cfg = load_config(None, PARTIAL + [f"output.dir={tmp_path}"])
    trainer = DistributedTrainer(cfg)
    records: list[dict[str, float]] = []
    lags: list[int] = []  # versions between each trained row's oldest token and the learner

    def step() -> Rollout:
        records.append(trainer.iteration())
        learner = int(records[-1]["policy/version"]) - 1
        lags.extend(learner - v for v in oldest_versions(trainer.last_rollout))
        return trainer.last_rollout

    try:
        trained = [step()]
        for _ in range(5):
            if len(trainer.source._stages.carry[1]):  # generator 1 holds unfinished rows: kill it now
                break
            trained.append(step())
        assert len(trainer.source._stages.carry[1]), "generator 1 never held an unfinished row"
        pid, _ = get(trainer.generators.call_at(1, Engine.process_id, ()))
        os.kill(pid, signal.SIGKILL)
        trained += [step() for _ in range(2)]
        kept = len(records)
        state = json.loads(json.dumps(trainer.checkpoint(tmp_path / "ckpt")))  # as driver.json holds it
        at = trainer.iteration_count
        assert state["partial_rows"]["prompt_text"], "no row in flight at the checkpoint"
        undone = [step() for _ in range(2)]  # trained, then rolled back by the restore
        trainer.restore(tmp_path / "ckpt", state)
        assert trainer.iteration_count == at
        trained += [step() for _ in range(2)]
        in_flight = Rollout.concat(trainer.source._stages.carry_states[trainer.iteration_count])
        end = trainer.iteration_count
    finally:
        trainer.close()
    assert records[kept - 1]["faults/actor_restarts"] == 1
    assert undone and [r["policy/version"] for r in records[-2:]] == [at + 1, at + 2]
    # The account of every row drawn for batches 0..end-1.
    counted = records[:kept] + records[-2:]
    dropped = sum(int(r["async/dropped_rows"]) for r in counted)
    rows = Counter([t for r in trained for t in r.prompt_text] + in_flight.prompt_text)
    drawn = Counter(_drawn(cfg, end))
    assert rows <= drawn, f"rows trained twice or never drawn: {rows - drawn}"
    assert sum(drawn.values()) - sum(rows.values()) == dropped, "a row was lost"
    # Rows continued across weight updates hold several versions; none older than k was trained.
    mixed = [v for r in trained for v in r.token_versions if len(set(v)) > 1]
    assert mixed, "no response was continued with newer weights"
    # k = 3 and responses of up to 3 calls: a generator leads the learner by one batch
    # (pipeline.generator_lead), so no row ever left the window.
    assert dropped == 0 and max(lags) <= 3


def test_dropping_stale_groups_leaves_dense_group_ids_the_learner_can_train_on():
    """n = 2, 10 groups, the 6 oldest stale: the 8 rows left are groups 0..3 again. Their old ids
    (6..9) on 8 rows indexed past the learner's group tables (sized by its rows): IndexError on
    CPU, a device-side assert that kills the rank on GPU."""
    from rayppo.config.schema import PPOConfig
    from rayppo.learner.experience import make_experience
    from rayppo.learner.learn_settings import ExperienceSettings, LearnSettings, StepInputs
    from rayppo.learner.rollout_tensors import RolloutTensors
    from rayppo.learner.update_plan import UpdatePlan

    groups = [g for g in range(10) for _ in range(2)]
    rows = _rows(["stop"] * 20, groups, [[g // 2 + (0 if g >= 12 else -10)] * 2 for g in range(20)])
    rows.score = [float(i % 2) for i in range(20)]  # each group one right, one wrong
    kept, dropped = drop_stale(rows, version=5, max_staleness=2)
    assert dropped == 12 and kept.group_id == [0, 0, 1, 1, 2, 2, 3, 3]
    tensors = RolloutTensors.of(kept, 0)
    settings = LearnSettings(ExperienceSettings(PPOConfig(advantage="grpo")))
    plan = UpdatePlan.decide(settings, StepInputs(iteration=0, version=0, kl_coef=0.0), tensors)
    exp = make_experience(tensors, None, plan).experience
    assert exp.advantages[:, 0].tolist() == pytest.approx([-0.7071068, 0.7071068] * 4)
