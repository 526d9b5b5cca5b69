"""The distributed system on a real local Ray: vLLM generators, scorers, DeepSpeed learner group."""

from __future__ import annotations

import json

import pytest
import ray
from transformers import AutoModelForCausalLM

from rayppo.actors.generator import EmptyResponseError
from rayppo.actors.reward import RewardError
from rayppo.cli import main
from rayppo.cluster.driver import DistributedTrainer
from rayppo.cluster.group import get
from rayppo.cluster.placement import PlacementError
from rayppo.config import load_config
from rayppo.learner.reference_trainer import ReferenceTrainer
from rayppo.models.weights import unpack_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray(embedded_dir):
    """One local Ray instance (2 logical CPUs, like this machine) for the whole module."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield
    ray.shutdown()


def run_iterations(overrides: list[str], n: int) -> tuple[list[dict[str, float]], DistributedTrainer]:
    trainer = DistributedTrainer(load_config(None, overrides))
    try:
        return [trainer.iteration() for _ in range(n)], trainer
    finally:
        trainer.close()


def test_end_to_end_two_generators_two_ranks_reward_rises_and_sync_is_exact(tmp_path):
    """vLLM generators x 2, DeepSpeed ZeRO-2 ranks x 2: reward rises; generators run the new weights."""
    out = tmp_path / "run"
    code = main(["train", "--no-progress", "generators.num=2", "generators.cpus_per_worker=0.25",
                 "learner.num_ranks=2", "stop.iterations=10",
                 "output.save_rollouts=true", f"output.dir={out}"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in records]
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.15, rewards
    # After every sync the generators' old log-probs equal the learner's recomputation (fp32).
    assert max(r["logprob_mismatch/max"] for r in records) < 1e-4
    assert records[-1]["sync/bytes"] > 2 * 1e6  # the full policy went to both generators
    for key in ("time/generate", "time/reference", "time/reward", "time/learn", "time/sync", "throughput/tokens_per_s"):
        assert records[-1][key] > 0, key
    table = __import__("pyarrow.parquet", fromlist=["read_table"]).read_table(out / "rollouts" / "iter_00009.parquet")
    assert set(table.column("generator_id").to_pylist()) == {0, 1}
    assert set(table.column("policy_version").to_pylist()) == {9}
    assert AutoModelForCausalLM.from_pretrained(out / "policy").config.model_type == "llama"


@pytest.mark.parametrize("sync", ["object_store", "broadcast"])
def test_sync_check_fails_when_weights_are_not_loaded(sync):
    records, _ = run_iterations(["learner.skip_weight_load=true", "rollout.batch_size=32", "learner.num_ranks=1",
                                 "ppo.lr=0.003", f"learner.weight_sync={sync}"], 3)
    assert records[0]["logprob_mismatch/max"] < 1e-4  # nothing trained yet
    assert records[2]["logprob_mismatch/max"] > 1e-2  # generators still sample from version 0 weights


def _policy_bytes(embedded_dir) -> int:
    return sum(t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(embedded_dir).state_dict().values())


def test_broadcast_sync_of_zero3_partitions_into_two_vllm_engines_is_exact(embedded_dir):
    """learner.weight_sync=broadcast: rank 0 gathers the ZeRO-3 partitions and broadcasts them over
    gloo to both generators' vLLM weight-transfer engines; the generators then run those weights."""
    records, _ = run_iterations(["learner.weight_sync=broadcast", "learner.zero_stage=3", "learner.num_ranks=2",
                                 "generators.num=2", "generators.cpus_per_worker=0.25", "rollout.batch_size=32",
                                 "ppo.lr=0.003"], 3)
    assert max(r["logprob_mismatch/max"] for r in records) < 1e-4
    assert records[2]["kl/ref_mean"] > 1e-4  # the policy did move away from the reference
    assert records[-1]["sync/bytes"] == 2 * _policy_bytes(embedded_dir)


def test_lora_policy_syncs_merged_weights(embedded_dir):
    records, _ = run_iterations(["learner.lora_rank=4", "learner.lora_alpha=32", "learner.num_ranks=1",
                                 "rollout.batch_size=32", "ppo.lr=0.01"], 3)
    assert max(r["logprob_mismatch/max"] for r in records) < 1e-4
    assert records[2]["kl/ref_mean"] > 1e-4  # the adapters changed the sampled policy
    assert records[-1]["sync/bytes"] == _policy_bytes(embedded_dir)  # full merged weights, no adapter names


def _equivalence_overrides(ranks: int, zero: int) -> list[str]:
    return ["generators.backend=hf", "generators.num=1", f"learner.num_ranks={ranks}", f"learner.zero_stage={zero}",
            "rollout.batch_size=16", "ppo.epochs=2", "ppo.minibatches=2", "rollout.max_new_tokens=6"]


def _distributed_first_update(ranks: int, zero: int):
    trainer = DistributedTrainer(load_config(None, _equivalence_overrides(ranks, zero)))
    try:
        stats = trainer.iteration()
        weights = unpack_weights(get(trainer.learner.policy_weights()))
        return stats, weights, trainer.last_rollout
    finally:
        trainer.close()


def test_distributed_first_update_equals_reference_trainer_for_1_and_2_ranks(embedded_dir):
    reference = ReferenceTrainer(load_config(None, _equivalence_overrides(1, 0) + ["trainer=reference"]))
    ref_stats = reference.iteration()
    ref_weights = reference.policy.state_dict()
    initial = AutoModelForCausalLM.from_pretrained(embedded_dir).state_dict()
    update = max((ref_weights[k] - initial[k]).abs().max().item() for k in ref_weights)
    assert update > 1e-4  # the update is far larger than the tolerance below
    for ranks, zero in ((2, 2), (1, 3)):
        stats, weights, rollout = _distributed_first_update(ranks, zero)
        assert rollout.response_ids == reference.last_rollout.response_ids  # same seed, same samples
        assert rollout.finish_reason == reference.last_rollout.finish_reason
        for key in ("policy/loss", "value/loss", "policy/clipfrac", "kl/ref_mean"):
            assert stats[key] == pytest.approx(ref_stats[key], abs=1e-5, rel=1e-4), (ranks, key)
        gap = max((ref_weights[k] - weights[k]).abs().max().item() for k in ref_weights)
        print(f"ranks={ranks} zero={zero}: max |w_ref - w_dist| = {gap:.2e}, update size {update:.2e}")
        assert gap < 1e-5, (ranks, zero, gap)


def test_placement_failure_is_a_clear_error_not_a_hang():
    with pytest.raises(PlacementError, match=r"CPU: need 9 \(generators 1 x 0.5, reference 1 x 0.25, reward 1 x 0.25, learner 2 x 4\), cluster has 2"):
        DistributedTrainer(load_config(None, ["learner.cpus_per_rank=4"]))
    with pytest.raises(PlacementError, match=r"GPU: need 1 \(generators 1 x 1\), cluster has 0"):
        DistributedTrainer(load_config(None, ["generators.gpus_per_worker=1"]))


def test_reward_function_error_names_the_prompt(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["say 1 :", "give 2 :", "hello there", "say 3 :"]))
    overrides = ["generators.backend=hf", "learner.num_ranks=1", "rollout.batch_size=4", "ppo.minibatches=1",
                 f"data.prompts={prompts}", "data.shuffle=false"]
    with pytest.raises(RewardError, match=r"failed on prompt 'hello there'"):
        run_iterations(overrides, 1)


def test_empty_response_error_names_the_prompt(tmp_path, embedded_dir):
    """A policy that only ever writes padding produces empty responses: a clear error, no hang."""
    model = AutoModelForCausalLM.from_pretrained(embedded_dir)
    pad = model.config.pad_token_id
    # Its generation config forbids every token but <pad>.
    model.generation_config.suppress_tokens = [i for i in range(model.config.vocab_size) if i != pad]
    model.save_pretrained(tmp_path / "degenerate")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (embedded_dir / name).exists():
            (tmp_path / "degenerate" / name).write_bytes((embedded_dir / name).read_bytes())
    overrides = ["generators.backend=hf", "learner.num_ranks=1", "rollout.batch_size=4", "ppo.minibatches=1",
                 f"model.policy={tmp_path / 'degenerate'}", f"model.reference={embedded_dir}"]
    with pytest.raises(EmptyResponseError, match=r"empty response for prompt '\w+ \d :'"):
        run_iterations(overrides, 1)
