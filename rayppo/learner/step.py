"""The learn step: one PPO update on a scored rollout, the same code in every trainer.

The in-process trainer calls ``learn`` on the whole batch; each rank of the distributed learner
calls it on the rows it owns (``LearnerEngine.train``), the collective making the statistics
global. One step is:

    minibatch plan (the same on every rank)  -> this rank's minibatches    (update.py)
    values, shaped rewards, advantages, whitening, log pi_prox           (experience.py)
    M epochs x minibatches of clipped PPO + value loss, the mismatch guard on the first  (update.py)

log pi_prox comes from the update's own forward instead when that is the only one and nothing
before the update reads it (``proximal.fused_proximal``).

Its settings are read from the config once (``LearnSettings.of``); what changes per call comes
in two records, this rank's rows (``BatchShard``) and the step's inputs (``StepInputs``: the
iteration, the policy's version, beta). It returns a ``LearnResult``: the policy's new version and
the KL to the reference, which the driver's control flow reads (weight sync, KL controller,
``stop.kl_budget``), and the metrics, which only the log reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rayppo.config.derived import reference_in_learner
from rayppo.config.schema import Config, PPOConfig
from rayppo.data.rollout import Rollout
from rayppo.data.seeds import minibatch_seed
from rayppo.learner.collective import Collective
from rayppo.learner.experience import (
    Experience,
    ExperienceSettings,
    ProximalPolicy,
    make_experience,
    proximal_logprobs,
)
from rayppo.learner.guard import MismatchGuard
from rayppo.learner.proximal import any_stale, fused_proximal
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.learner.update import (
    InUpdateProximal,
    Minibatch,
    Steps,
    first_rows_kept,
    local_minibatches,
    minibatch_plan,
    ppo_update,
)
from rayppo.models.packing import cut_layout


@dataclass(frozen=True)
class LearnSettings:
    """What the learn step reads from the config, gathered once."""

    experience: ExperienceSettings
    """The experience pass's: estimator, truncation rule, staleness, micro-batches, rollout correction."""
    seed: int
    """The run's seed; the minibatch plan of iteration i uses ``minibatch_seed(seed, i)``."""
    temperature: float
    """T of log_softmax(logits / T), the sampling distribution the generators used."""
    max_new_tokens: int
    """L_max (``rollout.max_new_tokens``): the loss aggregations that normalise by a fixed length."""
    config: Config
    """The whole config, for the mismatch guard's per-dtype bounds (``MismatchGuard.of``)."""

    @property
    def ppo(self) -> PPOConfig:
        """The update's section (epochs, minibatches, estimator, clipping, learning rates)."""
        return self.experience.ppo

    @property
    def reference_from_base(self) -> bool:
        """log pi_ref is the policy's own with its LoRA adapter off (``config.derived.reference_in_learner``)."""
        return reference_in_learner(self.config)

    @staticmethod
    def of(cfg: Config) -> LearnSettings:
        return LearnSettings(experience=ExperienceSettings.of(cfg), seed=cfg.seed, temperature=cfg.rollout.temperature,
                             max_new_tokens=cfg.rollout.max_new_tokens, config=cfg)


@dataclass
class LearnerModels:
    """The trained models of one process and how to step them."""

    policy: torch.nn.Module
    """pi_theta (a DeepSpeed engine on a learner rank, the plain module in-process)."""
    critic: torch.nn.Module | None
    """V_w, or None under a critic-free estimator."""
    steps: Steps
    """Backward of each model, then the optimiser step of both."""
    collective: Collective
    """All-reduces across the learner ranks (``LocalCollective`` in one process)."""
    device: torch.device | str
    pad_id: int
    """The tokenizer's padding id."""
    pack_mode: str = ""
    """Sequence packing of the learner's forward passes (``models/packing.py``; "": padded rows)."""


@dataclass(frozen=True)
class BatchShard:
    """This rank's rows of a scored batch."""

    rollout: Rollout
    """The rows, in ascending global order."""
    rows: list[int]
    """Their global indices in the batch."""
    batch_size: int
    """Rows in the whole batch, every rank's (the minibatch plan's rows, the group ids' bound)."""
    generators: list[int] = dataclasses.field(default_factory=list)
    """[batch_size] the generator that drew each row of the whole batch ([]: not known): the
    minibatch plan's first minibatch takes a row of each (``update.every_source_first``)."""

    @staticmethod
    def whole(rollout: Rollout) -> BatchShard:
        """The whole batch, held by one process (the in-process trainer)."""
        return BatchShard(rollout=rollout, rows=list(range(len(rollout))), batch_size=len(rollout),
                          generators=list(rollout.generator_id))


@dataclass(frozen=True)
class StepInputs:
    """What changes from one learn step to the next."""

    iteration: int
    """Seeds the minibatch plan (``minibatch_seed``); the guard names it in its reports."""
    version: int
    """The policy's version before the update: rows of that version were sampled by pi_prox
    itself (asynchronous mode)."""
    kl_coef: float
    """beta, the KL controller's current value."""


@dataclass(frozen=True)
class LearnResult:
    """What a learn step reports: typed fields for the driver's decisions, a dict for the log (as
    torchtune's ``PPOStats``)."""

    version: int
    """The policy's version after the update (one more per update): what the weight sync publishes."""
    kl_ref: float | None
    """Mean KL(pi || pi_ref) per response over the batch (``Experience.kl_ref``): what the KL
    controller and ``stop.kl_budget`` read; None without a reference or without an update."""
    metrics: dict[str, float]
    """The update's figures (``kl/ref_mean``, ``policy/loss``, ...): for logging only."""


def learn(models: LearnerModels, shard: BatchShard, step: StepInputs,
          settings: LearnSettings) -> tuple[LearnResult, Experience]:
    """One PPO update on this rank's ``shard`` of the batch; returns its result and the experience
    it trained on. Collective: every rank calls it in the same iteration."""
    p, rollout = settings.ppo, shard.rollout
    plan = minibatch_plan(shard.batch_size, p.epochs, p.minibatches, seed=minibatch_seed(settings.seed, step.iteration),
                          sources=shard.generators)

    def planned(keep: list[float] | None = None) -> list[Minibatch]:
        return local_minibatches(plan, torch.tensor(shard.rows, dtype=torch.long), rollout.lengths(),
                                 models.collective, settings.experience.micro_batch_tokens,
                                 cut_layout(models.pack_mode), trained=rollout.trained_tokens(), keep=keep)

    minibatches = planned()
    # pi_prox: these weights, before this update's first step (asynchronous mode, rollout correction).
    proximal = ProximalPolicy(models.policy, settings.temperature, step.version)
    tensors = dataclasses.replace(RolloutTensors.of(rollout, models.pad_id, models.device, models.pack_mode),
                                  num_groups=shard.batch_size, first_rows=first_rows_kept(minibatches))
    if settings.reference_from_base and tensors.ref_logprobs is None:
        tensors = dataclasses.replace(tensors, ref_logprobs=base_logprobs(models, tensors, settings))
    fused = _in_update_proximal(settings, step, tensors, models, len(minibatches[0]), planned)
    exp, stats = make_experience(tensors, models.critic, step.kl_coef, settings.experience, models.collective,
                                 proximal, fused=fused is not None)
    if exp.row_keep is not None:  # rows the geometric-mean mask dropped count in no share (same rows and cuts)
        minibatches = planned(exp.row_keep.tolist())
    guard = MismatchGuard.of(settings.config, step.iteration)
    stats |= ppo_update(models.policy, models.critic, exp, minibatches, p, settings.temperature, models.steps,
                        models.collective, guard, settings.max_new_tokens, fused)
    return LearnResult(version=step.version + 1, kl_ref=exp.kl_ref, metrics=stats), exp


def base_logprobs(models: LearnerModels, tensors: RolloutTensors, settings: LearnSettings) -> torch.Tensor:
    """``[B, T]`` log pi_ref(y_t) of a LoRA policy's base: the policy's forward with its adapter
    switched off (peft's ``disable_adapter``), no gradient, in the passes pi_prox takes."""
    peft_model: Any = getattr(models.policy, "module", models.policy)  # a DeepSpeed engine wraps it
    with peft_model.disable_adapter():
        return proximal_logprobs(ProximalPolicy(models.policy, settings.temperature, -1), tensors.batch,
                                 settings.ppo.minibatches, settings.experience.micro_batch_tokens, models.collective)


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW with its fused kernel: one pass over each tensor instead of a dozen
    element-wise ops. On SmolLM2-135M's 134M fp32 master weights on 2 cores, 0.04 s per 67M
    instead of 0.26 s (``docs/benchmarks.md``, "Kernels"). No compiled DeepSpeed ops are needed,
    and the in-process trainer makes the same update. The learner engine hands it to DeepSpeed,
    which takes a client optimiser and swaps its parameters for its fp32 partitions (deepspeed 0.19.8,
    ``runtime/engine.py`` ``_configure_optimizer``: "Using client Optimizer as basic optimizer")."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, fused=True)


def _in_update_proximal(settings: LearnSettings, step: StepInputs, tensors: RolloutTensors, models: LearnerModels,
                        micro_batches: int, planned: Callable[[list[float]], list[Minibatch]]) -> InUpdateProximal | None:
    """What the update needs to take log pi_prox from its own forward, or None where the separate
    pass runs (``proximal.fused_proximal``). Collective (the staleness check, in asynchronous mode)."""
    e, has_reference = settings.experience, tensors.ref_logprobs is not None
    reward_kl = e.ppo.kl_mode == "reward" and step.kl_coef != 0 and has_reference
    # Every input is the same on every rank: all ranks agree, and call the staleness all-reduce
    # only when the rest allows the fusion (not at every asynchronous step).
    if not fused_proximal(e, reward_kl, models.critic is not None, False, micro_batches):
        return None
    if any_stale(tensors, step.version, e.max_staleness, models.collective):
        return None
    return InUpdateProximal(e.correction.geo_mask, has_reference, planned)
