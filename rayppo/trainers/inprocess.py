"""The in-process reference trainer: one whole PPO iteration, transformers only.

No Ray, no vLLM, no DeepSpeed: the golden path that the distributed system must reproduce on
the same seed. One iteration (docs/algorithm.md):

    prompts -> y ~ pi_old, log pi_old        (GeneratorEngine, hf backend)
            -> log pi_ref                    (ReferenceEngine; none at kl_coef = 0)
            -> r_phi(x, y)                   (RewardEngine)
            -> V, shaped rewards, advantages (GAE or a group estimator), whitening  (make_experience)
            -> M epochs x minibatches of clipped PPO + value loss (none without a critic)  (ppo_update)
            -> KL controller update

Prompts are drawn ``rollout.batch_size`` at a time, each repeated ``rollout.samples_per_prompt``
times as one group, as the distributed trainer's generators receive them.

The generator and the learner share one policy module, so the "weight sync" is free here: there
is nothing to publish, and no fleet to pause, restart or grow. The iteration is every trainer's
(``loop.py``) over a local rollout source (``LocalSource``): the driver state, the prompts and
the metrics line are the distributed trainer's too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rayppo.actors.generator import GeneratorActor, GeneratorEngine
from rayppo.actors.hf_backend import HFBackend
from rayppo.actors.reference import ReferenceEngine
from rayppo.actors.reward import RewardEngine
from rayppo.actors.settings import episode_settings, reference_args, reward_args, sampling_settings, teacher_args
from rayppo.actors.teacher import TeacherEngine
from rayppo.config.derived import has_critic, has_reward, policy_exports, reference_model
from rayppo.config.schema import Config
from rayppo.console import console
from rayppo.data.prompts import PromptSampler
from rayppo.data.rollout import Rollout
from rayppo.data.seeds import eval_seed, rollout_seed
from rayppo.errors import LearnerFailedError
from rayppo.learner.adapter_weights import (
    ADAPTER_FOLDER,
    adapter_config,
    adapter_tensors,
    policy_lora,
    save_adapter,
    wrap_lora,
)
from rayppo.learner.collective import LocalCollective
from rayppo.learner.experience import Experience
from rayppo.learner.full_weights import full_tensors
from rayppo.learner.lr_schedule import lr_scaler
from rayppo.learner.step import BatchShard, LearnerModels, LearnResult, LearnSettings, StepInputs, adamw, learn
from rayppo.learner.update import OptimiserSteps
from rayppo.machine.matmul_rate import peak_rate
from rayppo.machine.role_resources import Resources
from rayppo.models.checkpoint_names import checkpoint_tensors
from rayppo.models.export import write_policy
from rayppo.models.loading import Critic, prepare_for_training, resolve_model_path
from rayppo.models.teacher import checked_teacher
from rayppo.run.mfu import probe_tokens
from rayppo.run.stage_times import StageTimes
from rayppo.trainers.clock import Stage, StageClock
from rayppo.trainers.dynamic_sampling import fill_batch
from rayppo.trainers.evaluation import ScorePass, eval_plan, held_out_result
from rayppo.trainers.iteration import group_shares
from rayppo.trainers.loop import LoopTrainer, load_prompts
from rayppo.trainers.source import SamplerPosition, SourcedBatch


@dataclass(frozen=True)
class LocalScorers:
    """The in-process scorers: each None where the run has no such role."""

    reference: ReferenceEngine | None
    """log pi_ref (none at ppo.kl_coef = 0, or a LoRA policy's base)."""
    reward: RewardEngine | None
    """r_phi (none when an environment's turn rewards are the whole reward)."""
    teacher: TeacherEngine | None
    """log pi_T (none without ``distill.teacher``)."""


class LocalSource:
    """The in-process rollout source: generate (and dynamic sampling), reference, reward, teacher,
    each a stage; the generator samples from the module the learner trains, so there is nothing to publish."""

    def __init__(self, cfg: Config, generator: GeneratorEngine, scorers: LocalScorers, prompts: PromptSampler,
                 clock: StageClock) -> None:
        self.cfg, self.generator, self.reference, self.reward = cfg, generator, scorers.reference, scorers.reward
        self.teacher = scorers.teacher
        self.prompts, self.clock = prompts, clock
        self.position = SamplerPosition(prompts)

    def next(self, iteration: int) -> SourcedBatch:
        """Batch ``iteration``: sampled, its informative groups kept (dynamic sampling), scored."""
        self.position.drawing(iteration)
        with self.clock.stage(Stage.GENERATE):
            rollout, dynamic = self._sample(iteration)
        with self.clock.stage(Stage.REFERENCE):
            ref_logprobs = self.reference.ref_logprobs(rollout) if self.reference is not None else []
        with self.clock.stage(Stage.REWARD):
            # Dynamic sampling has rewarded it already.
            score = rollout.score if len(rollout.score) == len(rollout) else self.scores(rollout)
            gold = self.reward.gold_scores(rollout) if self.reward is not None and self.reward.gold else None
            rollout = rollout.scored(score, ref_logprobs, gold)
        if self.teacher is not None:
            with self.clock.stage(Stage.TEACHER):
                rollout = rollout.scored(rollout.score, teacher=self.teacher.teacher_logprobs(rollout))
        return SourcedBatch(rollout, dynamic)

    def _sample(self, it: int) -> tuple[Rollout, dict[str, float]]:
        """This iteration's batch: ``rollout.batch_size`` prompts, each a group of
        ``rollout.samples_per_prompt`` responses; with ``rollout.dynamic_sampling_rounds`` > 0 its
        informative groups and those of up to that many extra rewarded batches (``fill_batch``)."""
        cfg = self.cfg

        def draw(k: int) -> Rollout:
            (prompts,) = group_shares(self.prompts.next_batch(), 1, cfg.rollout.samples_per_prompt)
            return self.generator.generate(prompts, seed=rollout_seed(cfg.seed, it, k))

        if not cfg.rollout.dynamic_sampling_rounds:
            return draw(0), {}

        def draw_scored(k: int) -> Rollout:
            rollout = draw(k)
            return rollout.scored(self.scores(rollout))

        return fill_batch(draw_scored(0), draw_scored, cfg.rollout.batch_size, cfg.rollout.dynamic_sampling_rounds)

    def scores(self, rollout: Rollout) -> list[float]:
        """``[B]`` r_phi of the rows; 0 when an environment's turn rewards are the whole reward."""
        return self.reward.scores(rollout) if self.reward is not None else [0.0] * len(rollout)

    def state(self, iteration: int) -> dict[str, Any]:
        """The sampler's position before batch ``iteration``: stopped half-way through an iteration
        (a reward error, the guard before its update), its prompts are drawn again on resume."""
        return self.position.state(iteration)

    def load_state(self, state: dict[str, Any]) -> None:
        """The sampler goes on from the saved position."""
        self.position.load_state(state)

    def timings(self, seconds: dict[Stage, float]) -> StageTimes:
        """Each stage's seconds; the iteration's are their sum. The generator samples from the
        module the learner trains: no sync (0 s)."""
        return StageTimes(generate=seconds[Stage.GENERATE], reference=seconds[Stage.REFERENCE],
                          reward=seconds[Stage.REWARD], teacher=seconds.get(Stage.TEACHER), learn=seconds[Stage.LEARN],
                          sync=0.0,
                          iteration=sum(seconds.values()))


class InProcessTrainer(LoopTrainer):
    """Policy, reference, reward and critic in one process; ``iteration()`` runs one PPO step."""

    fleet = None
    """One generator in this process: no fleet that grows while the run goes on (``rayppo scale``
    goes through a checkpoint)."""

    def __init__(self, cfg: Config):
        torch.manual_seed(cfg.seed)
        m = cfg.model
        policy_path = str(resolve_model_path(m.policy, m.cache_dir))
        teacher_path = (checked_teacher(cfg.distill.teacher, policy_path, m.cache_dir, cfg.distill.topk)
                        if cfg.distill.teacher else None)
        # One process, one device: every engine on the learner's GPU when learner.gpus_per_rank > 0.
        gpus = cfg.learner.gpus_per_rank
        self.generator = GeneratorEngine(policy_path, sampling_settings(cfg), backend="hf", dtype=m.dtype,
                                         episodes=episode_settings(cfg), actor=GeneratorActor(resources=Resources(gpus=gpus)))
        self.device = self.generator.device
        self.tokenizer = self.generator.tokenizer
        backend = self.generator.backend
        if not isinstance(backend, HFBackend):  # asked for above: the in-process trainer trains what it samples
            raise TypeError(f"the in-process trainer samples with transformers, not {type(backend).__name__}")
        self.policy = backend.model  # pi_theta: sampled from and trained in place
        ref_path = str(resolve_model_path(m.reference or m.policy, m.cache_dir))
        self.reference = (ReferenceEngine(**reference_args(cfg, gpus, model_path=ref_path))
                          if reference_model(cfg) else None)
        reward_model = str(resolve_model_path(cfg.reward.model, m.cache_dir)) if cfg.reward.model else None
        self.reward = (RewardEngine(**reward_args(cfg, gpus, model=reward_model))
                       if has_reward(cfg) else None)  # an environment's turn rewards alone
        self.critic = (Critic.from_pretrained(str(resolve_model_path(m.critic or m.policy, m.cache_dir)), m.dtype,
                                              cfg.seed, normalize=cfg.reward.normalize).to(self.device)
                       if has_critic(cfg.ppo) else None)
        for model in (self.policy, self.critic) if self.critic is not None else (self.policy,):
            prepare_for_training(model, cfg.learner.gradient_checkpointing)
        if cfg.learner.lora_rank:  # the learner ranks' adapter; the generator samples from it unmerged
            backend.model = self.policy = wrap_lora(self.policy, policy_lora(cfg.learner.lora_rank, cfg.learner.lora_alpha),
                                                    cfg.seed)
        super().__init__(cfg, *load_prompts(cfg, self.tokenizer,
                                            self.policy.config.max_position_embeddings - cfg.rollout.max_new_tokens))
        self.clock = StageClock()
        self.teacher = (TeacherEngine(**teacher_args(cfg, gpus, model_path=str(teacher_path)))
                        if teacher_path is not None else None)
        if self.teacher is not None:
            console.phase(f"teacher: {self.teacher.describe()}")
        self.source: LocalSource = LocalSource(cfg, self.generator, LocalScorers(self.reference, self.reward,
                                                                                 self.teacher), self.prompts, self.clock)
        self.publisher = None  # the generator samples from the module the learner trains: nothing to send
        self.generator.warmup()  # its first call's start-up cost stays out of iteration 0
        if cfg.output.mfu:  # perf/mfu/*'s denominator: every stage runs here, on this device and these threads
            shape = self.stage_counter.policy
            self.stage_counter.rate = peak_rate(m.dtype, torch.get_num_threads(), shape.hidden, shape.intermediate,
                                                probe_tokens(cfg), self.device)
        self.policy_opt = adamw([p for p in self.policy.parameters() if p.requires_grad], cfg.ppo.lr, cfg.ppo.weight_decay)
        self.critic_opt = (adamw(list(self.critic.parameters()), cfg.ppo.critic_lr, cfg.ppo.weight_decay)
                           if self.critic is not None else None)
        steps = OptimiserSteps(torch.Tensor.backward, torch.Tensor.backward if self.critic is not None else None, self._step,
                               lr_scaler(self.policy_opt, cfg.ppo.lr, self.critic_opt, cfg.ppo.critic_lr))
        self.models = LearnerModels(self.policy, self.critic, steps, LocalCollective(), self.device,
                                    self.tokenizer.pad_token_id)
        self.settings = LearnSettings.of(cfg)
        self._experience: Experience | None = None  # the last update's, for its rollout file

    def _learn(self, rollout: Rollout, kl_coef: float, it: int) -> LearnResult:
        """One update in place; one process, one update per iteration: the policy's version is the
        iteration count."""
        update, self._experience = learn(self.models, BatchShard.whole(rollout),
                                         StepInputs(iteration=it, version=it, kl_coef=kl_coef), self.settings)
        return update

    def _trained_targets(self) -> tuple[list[list[float]], list[list[float]]]:
        """The last update's advantages (and returns, with a critic) per row."""
        assert self._experience is not None, "no update yet"
        return self._experience.trained_targets(self.critic is not None)

    def evaluate(self) -> dict[str, float]:
        """The current policy on the held-out prompts (``rayppo/trainers/evaluation.py``); {} without them."""
        prompts = self.eval_prompts
        if prompts is None:
            return {}

        def scored_by(sampler: GeneratorEngine | TeacherEngine) -> ScorePass:
            def score_pass(temperature: float, k: int) -> tuple[list[float], list[float]]:
                rollout = sampler.evaluate(prompts, temperature, k, eval_seed(self.cfg.seed))
                gold = self.reward.gold_scores(rollout) if self.reward is not None and self.reward.gold else []
                return rollout.scored(self.source.scores(rollout)).total_rewards(), gold
            return score_pass

        self.last_evaluation = held_out_result(eval_plan(self.cfg), len(prompts), scored_by(self.generator))
        if self.teacher is None:
            return self.last_evaluation.figures
        return self.last_evaluation.figures | self.beside_teacher(scored_by(self.teacher), len(prompts))

    def _trained(self) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """(model, optimiser) of the policy and, with one, the critic."""
        trained: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = [(self.policy, self.policy_opt)]
        if self.critic is not None and self.critic_opt is not None:  # built together
            trained.append((self.critic, self.critic_opt))
        return trained

    def _step(self) -> None:
        """One optimiser step of policy and critic (two models, two optimisers)."""
        for model, opt in self._trained():
            if self.cfg.ppo.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.ppo.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def save(self, out_dir: str | Path) -> None:
        """The final policy (Hugging Face format, with tokenizer) and critic (when there is one)."""
        out_dir = Path(out_dir)
        if "merged" in policy_exports(self.cfg):
            stream = checkpoint_tensors(self.policy, full_tensors(self.policy))  # the learner's export (models/export.py)
            write_policy(stream, resolve_model_path(self.cfg.model.policy, self.cfg.model.cache_dir), self.tokenizer,
                         out_dir / "policy")
        if "adapter" in policy_exports(self.cfg):
            save_adapter(dict(adapter_tensors(self.policy)), adapter_config(self.policy), self.cfg.model.policy,
                         out_dir / ADAPTER_FOLDER)
        if self.critic is not None:
            self.critic.save_pretrained(out_dir / "critic")

    def checkpoint(self, path: Path) -> dict[str, Any]:
        """Models and optimizers (tensors only, read back with ``weights_only``); returns the
        driver's state."""
        states = {"policy": self.policy.state_dict(), "policy_opt": self.policy_opt.state_dict()}
        if self.critic is not None and self.critic_opt is not None:
            states |= {"critic": self.critic.state_dict(), "critic_opt": self.critic_opt.state_dict()}
        torch.save(states, path / "trainer.pt")
        return self.driver_state()

    def restore(self, path: Path, state: dict[str, Any]) -> None:
        """The models and optimizers of checkpoint ``path``, the driver's ``state`` with them."""
        saved = torch.load(path / "trainer.pt", map_location=self.device, weights_only=True)
        for (model, opt), name in zip(self._trained(), ("policy", "critic")):
            model.load_state_dict(saved[name])
            opt.load_state_dict(saved[f"{name}_opt"])
        self._load_driver_state(state)

    def recover(self, failure: LearnerFailedError) -> int:
        """One process: no learner group to restart; the failure is the run's."""
        raise failure

    def close(self) -> None:
        """In-process, only the environment's processes of a multi-turn run to stop."""
        self.generator.close()
