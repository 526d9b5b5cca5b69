"""What the config implies: GPUs per actor, vLLM workers and memory share, the weight-sync path,
thread counts, the log-prob mismatch limit and the rollout correction in force. Pure functions of
the dataclass tree."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayppo.choices import Truncation
from rayppo.config.schema import ChecksConfig, Config, GeneratorConfig, PPOConfig


def mismatch_limit(checks: ChecksConfig, dtype: str) -> float:
    """``checks.max_logprob_mismatch``, or the default of ``model.dtype`` (inf: not checked)."""
    if checks.max_logprob_mismatch is not None:
        return checks.max_logprob_mismatch
    return 1e-3 if dtype == "float32" else math.inf


def kl_limit(checks: ChecksConfig, dtype: str) -> float:
    """``checks.max_logprob_kl``, or the default of ``model.dtype``."""
    if checks.max_logprob_kl is not None:
        return checks.max_logprob_kl
    return 1e-6 if dtype == "float32" else 1e-2


@dataclass(frozen=True)
class Correction:
    """The rollout correction in force: what the update does about mu (the generator's log-probs,
    the behaviour policy) differing from pi_prox (the learner's at the start of the update)."""

    truncated_is: bool = False
    """The decoupled policy loss with truncated importance weights min(pi_prox / mu, is_clip);
    False: the plain clipped loss against mu = pi_old."""
    geo_mask: bool = False
    """Rows whose geometric-mean ratio exp(mean_t log(pi_prox / mu)) leaves exp(+-geo_mask_bound)
    are dropped from the update (``ppo.geometric_mean_mask``)."""

    @staticmethod
    def named(name: str) -> Correction:
        """The correction a resolved ``ppo.rollout_correction`` choice names: ``none``, ``tis`` or
        ``tis+geo_mask`` (the mask only ever comes with the weights)."""
        return {"none": NO_CORRECTION, "tis": Correction(truncated_is=True),
                "tis+geo_mask": Correction(truncated_is=True, geo_mask=True)}[name]


NO_CORRECTION = Correction()
"""mu is taken for pi_old: the plain clipped loss, no row masked."""


def rollout_correction(ppo: PPOConfig, dtype: str, max_staleness: int) -> Correction:
    """``ppo.rollout_correction`` with ``auto`` resolved: ``none`` in float32 (mu = pi_prox to 1e-5),
    ``tis+geo_mask`` in bfloat16, ``tis`` in asynchronous mode (staleness would leave the band)."""
    if ppo.rollout_correction != "auto":
        return Correction.named(ppo.rollout_correction)
    if max_staleness > 0:
        return Correction.named("tis")
    return Correction.named("none" if dtype == "float32" else "tis+geo_mask")


def actor_threads(threads: int | None, cpus: float) -> int:
    """torch threads of an actor: the configured number, else its CPU share (at least 1)."""
    return threads or max(1, int(cpus))


ROLE_SECTIONS = {"generators": "generators", "reference": "reference", "reward": "reward", "teacher": "distill",
                 "learner": "learner"}
"""The config section of each role's actors (the teacher's is ``distill``)."""


def role_threads(cfg: Config, role: str, machine_cores: int | None) -> int:
    """torch threads of one actor of ``role`` (``generators``, ``reference``, ``reward``, ``teacher``, ``learner``).

    ``<role>.threads`` when set. Otherwise, where the stages take turns on one machine's CPUs (the
    synchronous iteration, ``rollout.max_staleness`` 0; a local instance on ``machine_cores`` cores,
    None when joining a cluster; no GPUs for the role), the machine's cores shared among the actors
    that run at the same moment: the role's own, and for the scorers the models that score at once
    (``scoring_models``). A stage alone then uses every core: the SmolLM2 reward pass took 7.2 s on
    its 1-thread share and 4.6 s on 2 threads (``docs/benchmarks.md``, "Kernels"). Else (overlapping
    stages, GPUs, a cluster) the actor's CPU share rounded down."""
    threads, cpus, gpus = {
        "generators": (cfg.generators.threads, cfg.generators.cpus_per_worker, cfg.generators.gpus_per_worker),
        "reference": (cfg.reference.threads, cfg.reference.cpus, cfg.reference.gpus),
        "reward": (cfg.reward.threads, cfg.reward.cpus, cfg.reward.gpus),
        "teacher": (cfg.distill.threads, cfg.distill.cpus, cfg.distill.gpus),
        "learner": (cfg.learner.threads, cfg.learner.cpus_per_rank, cfg.learner.gpus_per_rank)}[role]
    if threads or not machine_cores or gpus or cfg.rollout.max_staleness > 0:
        return actor_threads(threads, cpus)
    at_once = {"generators": cfg.generators.num, "learner": cfg.learner.num_ranks,
               "reference": scoring_models(cfg)}
    return max(1, machine_cores // max(1, at_once.get(role, at_once["reference"])))


COLOCATED_SHARES = {"learner": 0.4, "generators": 0.4, "reference": 0.1, "reward": 0.1}
"""Ray's accounting of one GPU in colocated mode (``cluster.colocate_all``): the roles share it
in time (vLLM sleeps while the learner trains), so the fractions only let Ray place four actors
on one GPU; they sum to 1."""


def tensor_parallel_size(g: GeneratorConfig) -> int:
    """vLLM workers per generator: ``generators.tensor_parallel_size``, else its whole GPUs."""
    return g.tensor_parallel_size or max(1, int(g.gpus_per_worker))


def role_gpus(cfg: Config, role: str) -> float:
    """GPUs (or a share of one) that Ray gives each actor of ``role``
    (generators, reference, reward, learner)."""
    if cfg.cluster.colocate_all:
        if role == "reward" and cfg.reward.model is None:
            return 0.0  # a verifier function or an endpoint needs no GPU (nor a CUDA context)
        if role == "teacher":
            return 0.0  # no teacher runs colocated (checks.py refuses distill.teacher there)
        return COLOCATED_SHARES[role] if cfg.learner.gpus_per_rank else 0.0
    return {"generators": cfg.generators.gpus_per_worker, "reference": cfg.reference.gpus,
            "reward": cfg.reward.gpus, "teacher": cfg.distill.gpus, "learner": cfg.learner.gpus_per_rank}[role]


def vllm_memory_utilization(cfg: Config) -> float:
    """vLLM's ``gpu_memory_utilization``: the configured value, else 0.85 of the generator's share
    of each GPU (vLLM sizes itself against the whole device, so a 0.4 share must not take 0.85),
    or 0.4 in colocated mode (the learner's weights and optimizer states stay resident)."""
    g = cfg.generators
    if g.gpu_memory_utilization is not None:
        return g.gpu_memory_utilization
    if cfg.cluster.colocate_all:
        return 0.4
    return round(0.85 * min(1.0, g.gpus_per_worker or 1.0), 4)


def fleet_minimum(cfg: Config) -> int:
    """The fewest generators a run goes on with (``generators.min_num``); all of them in colocated
    mode, where a generator shares its node and GPU with a learner rank."""
    return cfg.generators.num if cfg.cluster.colocate_all else cfg.generators.min_num


def weight_sync_backend(cfg: Config) -> str | None:
    """``ipc``, ``nccl`` or ``gloo`` when weights go straight to the generators' workers, None when
    they go through the object store (``learner.weight_sync``)."""
    g, mode = cfg.generators, cfg.learner.weight_sync
    if mode == "auto" and lora_sync(cfg)[0] == "adapter":
        return None  # an adapter is a few MB: the object store, which every layout has
    gen_gpus, learner_gpus = role_gpus(cfg, "generators"), cfg.learner.gpus_per_rank
    if cfg.cluster.colocate_all and learner_gpus and g.backend == "vllm" and mode in ("auto", "ipc"):
        return "ipc"  # learner rank and generator on one GPU: hand over CUDA-IPC handles
    on_gpus = learner_gpus > 0 and gen_gpus > 0
    # NCCL cannot put two ranks of one group on one GPU: auto broadcasts only between whole GPUs.
    whole_gpus = learner_gpus >= 1 and gen_gpus >= 1 and not cfg.cluster.colocate_all
    # The asynchronous pipeline updates one generator at a time, between its batches.
    broadcast_fits = on_gpus and whole_gpus and g.backend == "vllm" and cfg.rollout.max_staleness == 0
    if mode == "object_store" or (mode == "auto" and not broadcast_fits):
        return None
    return "nccl" if on_gpus else "gloo"



def lora_sync(cfg: Config) -> tuple[str, str]:
    """``(mode, why)`` of a LoRA policy's sync (``learner.lora_sync``): ``adapter`` or ``merged``,
    and the reason in words; ``("none", "")`` without LoRA. ``adapter`` needs a rank the
    generators serve (``adapter_blockers``: vLLM 0.32 at most 512; any on the hf backend, peft);
    every transport carries it. ``learner.lora_sync=adapter`` where it cannot work is refused at
    load; an adapter with features vLLM cannot serve is refused at its first sync
    (``adapter_weights.unsupported``)."""
    lr = cfg.learner
    if lr.lora_rank == 0:
        return "none", ""
    if lr.lora_sync == "merged":
        return "merged", "learner.lora_sync=merged"
    missing = adapter_blockers(cfg)
    if missing:
        return "merged", f"merged weights travel: adapter sync does not serve {missing[0]} yet"
    return "adapter", f"only the LoRA adapter travels (r={lr.lora_rank}); the generators load the base once"


def policy_exports(cfg: Config) -> set[str]:
    """What the final export writes of the policy: ``merged`` (``DIR/policy``) and, for a LoRA
    policy, ``adapter`` (``DIR/policy-adapter``), as ``output.lora_export`` picks."""
    if cfg.learner.lora_rank == 0:
        return {"merged"}
    return {"merged", "adapter"} if cfg.output.lora_export == "both" else {cfg.output.lora_export}


def adapter_blockers(cfg: Config) -> list[str]:
    """What keeps this job from adapter sync, in words (empty: nothing)."""
    g = cfg.generators
    out = []
    if g.backend == "vllm" and cfg.learner.lora_rank > 512:
        out.append(f"rank {cfg.learner.lora_rank} (vLLM 0.32 serves ranks up to 512)")
    return out


def generator_context(configured: int | None, model_positions: int | None, longest_prompt: int,
                      max_new_tokens: int) -> int:
    """vLLM's ``max_model_len``: ``generators.max_model_len`` when set; else what the job needs,
    its longest prompt + ``rollout.max_new_tokens``, within the model's context. Not the model's
    whole context: vLLM 0.32 refuses to start when one sequence of ``max_model_len`` tokens does
    not fit its KV cache (``check_enough_kv_cache_memory``, vllm/v1/core/kv_cache_utils.py), and
    Llama 3.1's 128k tokens need ~16 GiB of KV for an 8B model, where 2k tokens need 0.25 GiB."""
    if configured:
        return configured
    needed = longest_prompt + max_new_tokens
    return min(needed, model_positions) if model_positions else needed




def has_critic(ppo: PPOConfig) -> bool:
    """Whether the run trains a critic V_w at all (only ``gae`` uses one)."""
    return ppo.advantage == "gae"


def uses_reference(cfg: Config) -> bool:
    """Whether any pass needs log pi_ref: when beta > 0, and when a gold scorer is set
    (``reward.gold_function``), whose proxy-and-gold figure is drawn against KL(pi || pi_ref), so
    that a run without the penalty still measures how far it went. Otherwise (beta = 0: the adaptive
    controller scales beta multiplicatively, so 0 stays 0) no reference model is loaded anywhere."""
    return cfg.ppo.kl_coef > 0 or cfg.reward.gold_function is not None


def truncation_mode(cfg: Config) -> Truncation:
    """``rollout.truncation`` resolved: ``auto`` bootstraps with a critic and is ``terminal`` without."""
    if cfg.rollout.truncation != "auto":
        return cfg.rollout.truncation
    return "bootstrap" if has_critic(cfg.ppo) else "terminal"


def batch_rows(cfg: Config) -> int:
    """Responses per iteration: rollout.batch_size prompts x rollout.samples_per_prompt."""
    return cfg.rollout.batch_size * cfg.rollout.samples_per_prompt


def has_reward(cfg: Config) -> bool:
    """Whether a reward function, model or endpoint scores the responses: not when an environment's
    turn rewards are the whole reward (``rollout.environment`` with no ``reward.*`` chosen)."""
    return any(x is not None for x in (cfg.reward.function, cfg.reward.model, cfg.reward.url))


def reward_actors(cfg: Config) -> int:
    """Reward actors the run starts: ``reward.num``, or none when nothing scores the responses."""
    return cfg.reward.num if has_reward(cfg) else 0


def scoring_models(cfg: Config) -> int:
    """Scorer actors that run a model at once in ``DistributedRoles.score``: the reference, teacher
    and reward actors, the reward only when it is a model (``reward.model``). A verifier function or an
    endpoint spends next to no CPU here, so counting it would halve a teacher's threads for nothing:
    the SmolLM2 teacher's top-64 pass took 4.1 s on the 1 thread it got beside a verifier."""
    models = reward_actors(cfg) if cfg.reward.model is not None else 0
    return reference_actors(cfg) + teacher_actors(cfg) + models


def reference_actors(cfg: Config) -> int:
    """Reference actors the run starts: ``reference.num``, or none when no pass needs log pi_ref
    (``uses_reference``) or the learner computes it itself (``reference_in_learner``)."""
    return cfg.reference.num if reference_model(cfg) else 0


def teacher_actors(cfg: Config) -> int:
    """Teacher actors the run starts: ``distill.num`` with a ``distill.teacher``, else none."""
    return cfg.distill.num if cfg.distill.teacher is not None else 0


def reference_model(cfg: Config) -> bool:
    """Whether a model of its own scores log pi_ref (a reference actor, or the in-process
    trainer's reference engine): when log pi_ref is needed (``uses_reference``) and the learner does
    not compute it itself (``reference_in_learner``)."""
    return uses_reference(cfg) and not reference_in_learner(cfg)


def reference_in_learner(cfg: Config) -> bool:
    """A LoRA policy's reference is its base model, the policy with the adapter switched off
    (the adapter starts at B = 0, so the initial policy is the base): the learner computes
    log pi_ref from its own weights and no reference actor holds a second copy (docs/lora.md).
    Not when ``model.reference`` names another model."""
    return uses_reference(cfg) and cfg.learner.lora_rank > 0 and cfg.model.reference is None
