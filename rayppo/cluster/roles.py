"""Start-up of the distributed system's roles: each role's actors built from the config, with the
threads, environment and placement of each actor (the trainers only use what this returns).

    generators  GeneratorEngine x generators.num     (vLLM, or transformers with backend=hf)
    reference   ReferenceEngine x reference.num      (none at ppo.kl_coef = 0)
    rewards     RewardEngine    x reward.num         (none when an environment's turn rewards are the reward)
    teacher     TeacherEngine   x distill.num        (none without distill.teacher)
    learner     LearnerGroup    x learner.num_ranks  (DeepSpeed ZeRO ranks)

Model names travel unresolved: each node resolves (or builds) them itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayppo.actors.generator import GeneratorActor, GeneratorEngine, VLLMSettings
from rayppo.actors.reference import ReferenceEngine
from rayppo.actors.reward import RewardEngine
from rayppo.actors.settings import (
    episode_settings,
    generator_seed,
    reference_args,
    reward_args,
    sampling_settings,
    teacher_args,
)
from rayppo.actors.teacher import TeacherEngine
from rayppo.cluster.address import machine_cores
from rayppo.cluster.colocation import DeviceSchedule
from rayppo.cluster.group import ActorGroup
from rayppo.cluster.learner_group import LearnerGroup
from rayppo.cluster.placement import Placement, reserve_generators, role_specs, room_for_generators
from rayppo.cluster.session import ACTOR_ENV
from rayppo.config.derived import (
    ROLE_SECTIONS,
    lora_sync,
    reference_actors,
    reward_actors,
    role_gpus,
    role_threads,
    teacher_actors,
    tensor_parallel_size,
    vllm_memory_utilization,
    weight_sync_backend,
)
from rayppo.config.schema import Config
from rayppo.console import console
from rayppo.machine.role_resources import CORES_ENV, LOG_FILE_ENV, Engine, Resources
from rayppo.models.weights import SyncFault


@dataclass
class Roles:
    """The started actor groups of a run."""

    generators: ActorGroup
    reference: ActorGroup
    rewards: ActorGroup
    teacher: ActorGroup
    learner: LearnerGroup


def spawn_roles(cfg: Config, placements: dict[str, Placement], context: int | None,
                schedule: DeviceSchedule) -> Roles:
    """Every role's actors, in the order the GPUs need (``generators_start_first``);
    ``context`` is vLLM's max_model_len (``config.derived.generator_context``)."""
    g = cfg.generators
    cores = machine_cores(cfg.cluster.address)
    threads = {role: role_threads(cfg, role, cores) for role in ROLE_SECTIONS}
    gpus = {spec.name: spec.bundle.get("GPU", 0.0) for spec in role_specs(cfg)}

    def options(role: str, n: int) -> list[dict[str, Any]]:
        return [placements[role].actor_options(i, _actor_env(cfg, role, i, threads[role])) for i in range(n)]

    generators = ActorGroup(
        GeneratorEngine, [generator_args(cfg, context, i) for i in range(g.num)], options("generators", g.num),
        # Two vLLM engines profiling one GPU at once would each count the other's memory.
        one_by_one=Engine.ready if 0 < gpus["generators"] < 1 else None,
    )
    if generators_start_first(cfg):
        # vLLM charges every device-wide memory change during its profiling window to itself
        # (and asserts when others free memory): the roles sharing its GPUs start after it.
        schedule.record("spawn generators")
        generators.get(generators.call_all(Engine.ready))
        schedule.record("generators ready")
    reference = reference_args(cfg, gpus["reference"], threads["reference"])
    reward = reward_args(cfg, gpus["reward"], threads["reward"])
    teacher = teacher_args(cfg, gpus.get("teacher", 0.0), threads["teacher"])
    roles = Roles(
        generators,
        ActorGroup(ReferenceEngine, [reference] * reference_actors(cfg), options("reference", reference_actors(cfg))),
        ActorGroup(RewardEngine, [reward] * reward_actors(cfg), options("reward", reward_actors(cfg))),
        ActorGroup(TeacherEngine, [teacher] * teacher_actors(cfg), options("teacher", teacher_actors(cfg))),
        LearnerGroup(cfg, placements["learner"], options("learner", cfg.learner.num_ranks), threads["learner"]),
    )
    schedule.record("spawn reference, reward, " + ("teacher, " if teacher_actors(cfg) else "") + "learner")
    schedule.roles_spawned(roles.generators, [roles.reference, roles.rewards, roles.teacher], roles.learner)
    return roles


def spawn_learner(cfg: Config, placement: Placement, engine: type[Engine]) -> LearnerGroup:
    """The learner group alone, its ranks of class ``engine`` in ``placement`` (``rayppo
    reward-model``: ``RewardModelLearner``), with the environment every learner rank gets."""
    threads = role_threads(cfg, "learner", machine_cores(cfg.cluster.address))
    options = [placement.actor_options(i, _actor_env(cfg, "learner", i, threads)) for i in range(cfg.learner.num_ranks)]
    return LearnerGroup(cfg, placement, options, threads, engine=engine)


def generator_args(cfg: Config, context: int | None, index: int) -> dict[str, Any]:
    """The constructor arguments of generator ``index``."""
    g, m = cfg.generators, cfg.model
    gpus = next(spec.bundle.get("GPU", 0.0) for spec in role_specs(cfg) if spec.name == "generators")
    threads = role_threads(cfg, "generators", machine_cores(cfg.cluster.address))
    actor = GeneratorActor(index, generator_seed(cfg.seed, index), vllm_settings(cfg, context), Resources(threads, gpus),
                           SyncFault(cfg.checks.sync_fault, cfg.checks.sync_fault_tensor))  # the fault: testing only
    return dict(model_path=m.policy, sampling=sampling_settings(cfg), backend=g.backend, dtype=m.dtype,
                episodes=episode_settings(cfg), actor=actor)


class GeneratorSpawner:
    """Where more generators of a run come from (``Fleet.grow``, ``rayppo scale``): the room the
    cluster has for them, their placement groups, and each one's constructor arguments and actor
    options, as the first ones got theirs; ``context`` is vLLM's max_model_len."""

    def __init__(self, cfg: Config, context: int | None) -> None:
        self.cfg, self.context = cfg, context

    def room_for(self, count: int) -> bool:
        """Whether the cluster has ``count`` more generators' resources free now."""
        return room_for_generators(self.cfg, count)

    def reserve(self, count: int) -> list[tuple[Any, int]]:
        """Placement groups for ``count`` more generators, not waited for: each new one's (group, bundle)."""
        return reserve_generators(self.cfg, count)

    def actor(self, i: int, placement: Placement) -> tuple[dict[str, Any], dict[str, Any]]:
        """Generator ``i``'s constructor arguments and its Ray actor options in ``placement``."""
        cfg = self.cfg
        env = _actor_env(cfg, "generators", i, role_threads(cfg, "generators", machine_cores(cfg.cluster.address)))
        return generator_args(cfg, self.context, i), placement.actor_options(i, env)


def _actor_env(cfg: Config, role: str, index: int, threads: int) -> dict[str, str]:
    """The environment of actor ``index`` of ``role``: its OpenMP threads (vLLM's CPU kernels and
    DeepSpeed follow them), its cores, its log file, and ``cluster.actor_env``."""
    g = cfg.generators
    env = {**ACTOR_ENV, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(g.kv_cache_gib))),
           **({"RAYPPO_CACHE": cfg.model.cache_dir} if cfg.model.cache_dir else {}), **cfg.cluster.actor_env}
    section = getattr(cfg, ROLE_SECTIONS[role])  # cfg.generators, .reference, .reward, .distill, .learner
    if section.cores:
        env[CORES_ENV] = ",".join(map(str, section.cores))
    if role == "generators" and g.tensor_parallel_layout == "across_nodes":
        # vLLM's ray executor: worker r in bundle r of the generator's own group.
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, range(tensor_parallel_size(g))))
    log_file = console.actor_log(role, index)  # none with --verbose: the output goes to the terminal
    return {**env, **({LOG_FILE_ENV: str(log_file)} if log_file else {})}


def actor_count(cfg: Config) -> str:
    """``5 actors: 1 generator, 1 reference, 1 reward, 2 learner ranks``."""
    counts = {("generator", "generators"): cfg.generators.num, ("reference", "reference"): reference_actors(cfg),
              ("reward", "reward"): reward_actors(cfg), ("teacher", "teachers"): teacher_actors(cfg),
              ("learner rank", "learner ranks"): cfg.learner.num_ranks}
    parts = [f"{n} {one if n == 1 else many}" for (one, many), n in counts.items() if n]
    return f"{sum(counts.values())} actors: {', '.join(parts)}"


def vllm_settings(cfg: Config, max_model_len: int | None = None) -> VLLMSettings:
    """The vLLM engine arguments of a generator, executor and memory share made explicit;
    ``max_model_len`` (default ``generators.max_model_len``) is the trainer's ``context``."""
    g = cfg.generators
    tp = tensor_parallel_size(g)
    # across_nodes: the actor holds no GPU, so even one worker must be a Ray actor in the bundle.
    executor = "ray" if g.tensor_parallel_layout == "across_nodes" else ("uni" if tp == 1 else "mp")
    on_gpu = role_gpus(cfg, "generators") > 0 or g.tensor_parallel_layout == "across_nodes"
    return VLLMSettings(tp, executor, vllm_memory_utilization(cfg), max_model_len or g.max_model_len, g.kv_cache_gib,
                        g.enforce_eager, collective_sync=weight_sync_backend(cfg) in ("gloo", "nccl"),
                        ipc_sync=weight_sync_backend(cfg) == "ipc", sleep_mode=cfg.cluster.colocate_all and on_gpu,
                        lora_rank=cfg.learner.lora_rank if lora_sync(cfg)[0] == "adapter" else 0)


def generators_start_first(cfg: Config) -> bool:
    """Whether the generators must be ready before the other roles start: when a GPU is shared
    (colocated mode, or a fraction of a GPU for any role), so that nothing else allocates or
    frees GPU memory during vLLM's memory profiling. Colocated mode on CPUs keeps the same order."""
    shared = any(0 < role_gpus(cfg, role) < 1 for role in ROLE_SECTIONS)
    return cfg.cluster.colocate_all or shared
