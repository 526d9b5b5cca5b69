"""The learn step: one PPO update on a scored rollout, the same code in every trainer.

The in-process trainer calls ``learn`` on the whole batch; each rank of the distributed learner
calls it on the rows it owns (``LearnerEngine.train``), the collective making the statistics
global. One step is:

    minibatch plan (the same on every rank)  -> this rank's minibatches    (minibatches.py)
    the step's modes, decided once                                       (update_plan.py)
    values, shaped rewards, advantages, whitening, log pi_prox           (experience.py)
    M epochs x minibatches of clipped PPO + value loss, the mismatch guard on the first  (update.py)

log pi_prox comes from the update's own forward instead when that is the only one and nothing
before the update reads it (``proximal.fused_proximal``): the update is then
``update.one_forward_update``.

Its settings are read from the config once (``LearnSettings.of``, ``learn_settings.py``); what
changes per call comes in two records, this rank's rows (``BatchShard``) and the step's inputs (``StepInputs``: the
iteration, the policy's version, beta). It returns a ``LearnResult``: the policy's new version and
the KL to the reference, which the driver's control flow reads (weight sync, KL controller,
``stop.kl_budget``), and the metrics, which only the log reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from rayppo.data.rollout import Rollout
from rayppo.data.seeds import minibatch_seed
from rayppo.learner.experience import Experience, make_experience
from rayppo.learner.experience_passes import ProximalPolicy, proximal_logprobs
from rayppo.learner.learn_settings import LearnSettings, StepInputs
from rayppo.learner.minibatches import Minibatch, ShardPlan, first_rows_kept, local_minibatches, minibatch_plan
from rayppo.learner.proximal import any_stale, fused_proximal
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.learner.update import LearnerModels, one_forward_update, ppo_update
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.packing import cut_layout


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
    minibatch plan's first minibatch takes a row of each (``minibatches.every_source_first``)."""

    @staticmethod
    def whole(rollout: Rollout) -> BatchShard:
        """The whole batch, held by one process (the in-process trainer)."""
        return BatchShard(rollout=rollout, rows=list(range(len(rollout))), batch_size=len(rollout),
                          generators=list(rollout.generator_id))


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
    lr = models.steps.scale_lr(settings.lr_factor(step.iteration))  # read back from the optimiser
    order = minibatch_plan(shard.batch_size, p.epochs, p.minibatches,
                           seed=minibatch_seed(settings.seed, step.iteration), sources=shard.generators)
    local = ShardPlan(order, torch.tensor(shard.rows, dtype=torch.long), rollout.lengths(), rollout.trained_tokens(),
                      settings.experience.micro_batch_tokens, cut_layout(models.pack_mode))
    minibatches = local_minibatches(local, models.collective)
    # pi_prox: these weights, before this update's first step (asynchronous mode, rollout correction).
    proximal = ProximalPolicy(models.policy, settings.temperature, step.version)
    tensors = dataclasses.replace(RolloutTensors.of(rollout, models.pad_id, models.device, models.pack_mode),
                                  num_groups=shard.batch_size)
    if settings.reference_from_base and tensors.ref_logprobs is None:
        tensors = dataclasses.replace(tensors, ref_logprobs=base_logprobs(models, tensors, settings))
    plan = _decide(settings, step, tensors, minibatches, models)
    exp, stats, first_values = make_experience(tensors, models.critic, plan, models.collective, proximal)
    if plan.proximal == "update":
        exp, figures = one_forward_update(models, exp, minibatches, local, plan, first_values)
    else:
        if exp.row_keep is not None:  # rows the geometric-mean mask dropped count in no share (same rows and cuts)
            minibatches = local_minibatches(local, models.collective, exp.row_keep.tolist())
        figures = ppo_update(models, exp, minibatches, plan, first_values)
    metrics = stats | figures | {"policy/lr": lr}
    return LearnResult(version=step.version + 1, kl_ref=exp.kl_ref, metrics=metrics), exp


def _decide(settings: LearnSettings, step: StepInputs, tensors: RolloutTensors, minibatches: list[Minibatch],
            models: LearnerModels) -> UpdatePlan:
    """The step's ``UpdatePlan``, from the facts of this batch: a reference or not, beta, a critic,
    the first minibatch cut or whole, stale tokens. Collective (the staleness check, in asynchronous
    mode)."""
    e, has_reference = settings.experience, tensors.ref_logprobs is not None
    reward_kl = e.ppo.kl_mode == "reward" and step.kl_coef != 0 and has_reference
    # Every input is the same on every rank: all ranks agree, and call the staleness all-reduce
    # only when the rest allows the one forward (not at every asynchronous step).
    one_forward = (fused_proximal(e, reward_kl, models.critic is not None, False, len(minibatches[0]))
                   and not any_stale(tensors, step.version, e.max_staleness, models.collective))
    first_rows = first_rows_kept(minibatches) if models.critic is not None else None
    return UpdatePlan.decide(settings, step, tensors, first_rows, one_forward)


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

