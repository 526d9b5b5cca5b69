"""Config tree: YAML + dotted overrides, types, and errors that name the field."""

from pathlib import Path

import pytest

from rayppo.config.derived import role_threads, truncation_mode, vllm_memory_utilization, weight_sync_backend
from rayppo.config.load import load_config
from rayppo.config.schema import Config, ConfigError, field_docs


def test_defaults_are_valid_and_every_field_is_documented():
    cfg = load_config()
    assert isinstance(cfg, Config)
    docs = field_docs()
    assert len(docs) > 30
    undocumented = [name for name, _, doc in docs if not doc]
    assert undocumented == []


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("ppo:\n  clip_eps: 0.3\n  epochs: 2\nrollout:\n  batch_size: 32\n")
    cfg = load_config(path, ["ppo.clip_eps=0.1", "ppo.value_clip=null", "ppo.adaptive_kl=true"])
    assert cfg.ppo.clip_eps == 0.1  # the override wins over the file
    assert cfg.ppo.epochs == 2 and cfg.rollout.batch_size == 32
    assert cfg.ppo.value_clip is None and cfg.ppo.adaptive_kl is True


@pytest.mark.parametrize(
    "override, field",
    [
        ("ppo.clip_eps=1.5", "ppo.clip_eps"),
        ("ppo.clipeps=0.1", "ppo.clipeps"),
        ("ppo.epochs=two", "ppo.epochs"),
        ("ppo.epochs=1.5", "ppo.epochs"),
        ("ppo.minibatches=3", "ppo.minibatches"),  # does not divide the batch of 64
        ("ppo.kl_estimator=k9", "ppo.kl_estimator"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("ppo.whiten_advantages=maybe", "ppo.whiten_advantages"),
        ("reward.url=ftp://host/score", "reward.url"),  # only http(s) scorers
        ("nosuch.field=1", "nosuch"),
        ("ppo=3", "ppo"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(field)


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["ppo.clip_eps"])


@pytest.mark.parametrize(
    "overrides, backend",
    [
        ([], None),  # CPUs: the object store by default
        (["learner.weight_sync=broadcast"], "gloo"),
        (["learner.gpus_per_rank=1", "generators.gpus_per_worker=1"], "nccl"),
        (["learner.gpus_per_rank=1", "generators.gpus_per_worker=2"], "nccl"),  # tensor parallel
        (["learner.gpus_per_rank=0.5", "learner.num_ranks=1", "generators.gpus_per_worker=0.5"], None),  # shared
        (["cluster.colocate_all=true", "learner.gpus_per_rank=1"], "ipc"),  # one GPU, two processes: CUDA-IPC
        (["cluster.colocate_all=true"], None),  # colocated on CPUs: the object store
        (["cluster.colocate_all=true", "learner.gpus_per_rank=1", "learner.weight_sync=object_store"], None),
        (["learner.gpus_per_rank=1", "generators.gpus_per_worker=1", "learner.weight_sync=object_store"], None),
        (["learner.gpus_per_rank=1", "generators.gpus_per_worker=1", "generators.backend=hf"], None),
    ],
)
def test_weight_sync_backend_follows_the_resources(overrides, backend):
    assert weight_sync_backend(load_config(None, overrides)) == backend


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.weight_sync=nccl"], "must be auto, broadcast, object_store or ipc"),
        (["learner.weight_sync=ipc", "learner.gpus_per_rank=1"], "ipc needs cluster.colocate_all=true"),
        (["learner.weight_sync=broadcast", "cluster.colocate_all=true", "learner.gpus_per_rank=1"],
         "NCCL cannot join two processes sharing one GPU"),
        (["learner.weight_sync=broadcast", "learner.gpus_per_rank=1"], "both on GPUs or both on CPUs"),
        (["learner.weight_sync=broadcast", "learner.gpus_per_rank=0.5", "learner.num_ranks=1",
          "generators.gpus_per_worker=0.5"],
         "NCCL cannot join two processes sharing one GPU"),
    ],
)
def test_impossible_weight_sync_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, overrides)
    assert str(info.value).startswith("learner.weight_sync")


@pytest.mark.parametrize(
    "overrides, field, message",
    [
        # Two ranks of one NCCL group on one GPU: NCCL refuses; the error names both fields.
        (["learner.gpus_per_rank=0.5", "learner.num_ranks=2"], "learner.gpus_per_rank", "learner.num_ranks=2"),
        # vLLM sizes itself against the whole device: a 0.4 share cannot take 0.85 of it.
        (["generators.gpus_per_worker=0.4", "generators.gpu_memory_utilization=0.85"],
         "generators.gpu_memory_utilization", "at most 0.4"),
        (["generators.gpus_per_worker=2", "generators.tensor_parallel_size=4"], "generators.tensor_parallel_size",
         "must equal generators.gpus_per_worker=2"),
        (["generators.tensor_parallel_size=2", "generators.backend=hf"], "generators.tensor_parallel_size",
         "needs generators.backend=vllm"),
        (["generators.tensor_parallel_layout=across_nodes", "generators.tensor_parallel_size=2"],
         "generators.tensor_parallel_layout", "ray executor"),
        (["cluster.colocate_all=true", "generators.num=3"], "generators.num", "at most learner.num_ranks=2"),
        (["generators.num=2", "generators.min_num=3"], "generators.min_num", r"must be in \[1, generators.num=2\]"),
        (["generators.min_num=0"], "generators.min_num", r"must be in \[1, generators.num=1\]"),
        (["cluster.colocate_all=true", "reference.gpus=0.5"], "reference.gpus", "set by cluster.colocate_all"),
        (["reward.gpus=2"], "reward.gpus", "must be in"),
        (["cluster.colocate_all=true", "learner.gpus_per_rank=1", "checks.sync_fault=skip_all"], "checks.sync_fault",
         "not implemented for the CUDA-IPC"),
        (["cluster.colocate_all=true", "learner.gpus_per_rank=1", "learner.num_ranks=1",
          "generators.tensor_parallel_size=2"], "generators.tensor_parallel_size", "must be 1 with"),
    ],
)
def test_gpu_layouts_nccl_or_vllm_would_refuse_are_refused_at_load(overrides, field, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(field + ":")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], 0.85),  # CPU, or whole GPUs
        (["generators.gpus_per_worker=2"], 0.85),
        (["generators.gpus_per_worker=0.4"], 0.34),  # 0.85 of the share
        (["generators.gpus_per_worker=0.4", "generators.gpu_memory_utilization=0.3"], 0.3),
        (["cluster.colocate_all=true", "learner.gpus_per_rank=1"], 0.4),
    ],
)
def test_vllm_memory_share_follows_the_gpu_share(overrides, expected):
    assert vllm_memory_utilization(load_config(None, overrides)) == pytest.approx(expected)


@pytest.mark.parametrize("overrides, cores, expected", [
    # stages take turns on a 4-core machine: each stage's actors share every core
    # the scorers that run a model share the cores; a verifier function beside them takes none
    ([], 4, {"generators": 4, "reference": 4, "reward": 4, "learner": 2}),
    (["reward.model=tiny-reward", "reward.function=null"], 4, {"reference": 2, "reward": 2}),
    (["reward.model=tiny-reward", "reward.function=null", "ppo.kl_coef=0"], 4, {"reward": 4}),  # no reference runs
    (["distill.teacher=runs/x"], 4, {"reference": 2, "teacher": 2}),
    (["distill.teacher=runs/x", "ppo.kl_coef=0"], 2, {"teacher": 2, "reward": 2}),  # the teacher beside a verifier
    (["generators.num=3", "learner.num_ranks=1"], 4, {"generators": 1, "learner": 4}),
    (["reward.threads=3"], 4, {"reward": 3}),  # the user's number wins
    # overlapping stages, a joined cluster (cores unknown), a GPU: the actor's CPU share
    (["rollout.max_staleness=1", "learner.cpus_per_rank=2"], 4, {"generators": 1, "reward": 1, "learner": 2}),
    ([], None, {"generators": 1, "reward": 1, "learner": 1}),
    (["reward.gpus=1", "reward.cpus=2"], 4, {"reward": 2, "reference": 4}),
])
def test_role_threads_give_a_stage_alone_every_core(overrides, cores, expected):
    cfg = load_config(None, overrides)
    assert {role: role_threads(cfg, role, cores) for role in expected} == expected


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_loads_and_passes_the_cross_field_checks(example):
    """A recipe the docs send users to must load as it is (a renamed field or a broken pairing of
    settings would otherwise be found by a user's first command)."""
    assert load_config(example).output.dir


def test_the_reward_model_recipe_pays_a_cut_response_its_score_and_uses_unbiased_advantages():
    """The PPO-on-r_φ settings docs/reward-models.md argues for: with the critic the recipe builds,
    ``auto`` would bootstrap a cut response from V(S_T); the recipe makes the cut final, and λ = 1."""
    cfg = load_config(next(p for p in EXAMPLES if p.name == "reward-model.yaml"))
    assert truncation_mode(cfg) == "terminal" and cfg.ppo.lam == 1.0
    assert truncation_mode(load_config(None, ["ppo.advantage=gae"])) == "bootstrap"  # what auto would pick
