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

The generator and the learner share one policy module, so the "weight sync" is free here.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rayppo.actors.generator import GeneratorEngine
from rayppo.actors.reference import ReferenceEngine
from rayppo.actors.reward import RewardEngine, endpoint_from
from rayppo.actors.settings import episode_settings, sampling_settings
from rayppo.config.derived import has_critic, has_reward, uses_reference
from rayppo.config.schema import Config
from rayppo.data.prompts import PromptSampler, load_prompt_set
from rayppo.data.rollout import Rollout
from rayppo.learner.collective import LocalCollective
from rayppo.learner.step import BatchShard, LearnerModels, LearnResult, LearnSettings, StepInputs, learn
from rayppo.learner.update import Steps
from rayppo.learner.full_weights import full_tensors
from rayppo.models.checkpoint_names import checkpoint_tensors
from rayppo.models.export import write_pretrained
from rayppo.models.loading import Critic, prepare_for_training, resolve_model_path
from rayppo.trainers.dynamic_sampling import fill_batch
from rayppo.trainers.evaluation import eval_plan, eval_source, run_evaluation
from rayppo.data.seeds import eval_seed, rollout_seed
from rayppo.trainers.iteration import group_shares, make_kl_controller, rollout_stats


class InProcessTrainer:
    """Policy, reference, reward and critic in one process; ``iteration()`` runs one PPO step."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        m = cfg.model
        policy_path = str(resolve_model_path(m.policy, m.cache_dir))
        # One process, one device: every engine on the learner's GPU when learner.gpus_per_rank > 0.
        gpus = cfg.learner.gpus_per_rank
        self.generator = GeneratorEngine(policy_path, sampling_settings(cfg), backend="hf", dtype=m.dtype, gpus=gpus,
                                         episodes=episode_settings(cfg))
        self.device = self.generator.device
        self.tokenizer = self.generator.tokenizer
        self.policy = self.generator.backend.model  # pi_theta: sampled from and trained in place
        ref_path = str(resolve_model_path(m.reference or m.policy, m.cache_dir))
        self.reference = (ReferenceEngine(ref_path, cfg.rollout.temperature, dtype=m.dtype, gpus=gpus,
                                          micro_batch_tokens=cfg.reference.micro_batch_tokens)
                          if uses_reference(cfg.ppo) else None)
        reward_model = str(resolve_model_path(cfg.reward.model, m.cache_dir)) if cfg.reward.model else None
        endpoint = endpoint_from(cfg.reward.url, cfg.reward.timeout_s, cfg.reward.retries)
        self.reward = (RewardEngine(cfg.reward.function, reward_model, cfg.reward.batch_size, m.dtype, http=endpoint,
                                    gpus=gpus, timeout_s=cfg.reward.timeout_s, timeout_score=cfg.reward.timeout_score,
                                    micro_batch_tokens=cfg.reward.micro_batch_tokens)
                       if has_reward(cfg) else None)  # an environment's turn rewards alone
        self.critic = (Critic.from_pretrained(str(resolve_model_path(m.critic or m.policy, m.cache_dir)), m.dtype,
                                              cfg.seed).to(self.device) if has_critic(cfg.ppo) else None)
        for model in (self.policy, self.critic) if self.critic is not None else (self.policy,):
            prepare_for_training(model, cfg.learner.gradient_checkpointing)
        max_prompt = self.policy.config.max_position_embeddings - cfg.rollout.max_new_tokens
        prompt_set = load_prompt_set(cfg.data.prompts, cfg.data.prompt_column, self.tokenizer, max_prompt,
                                     cfg.data.split)
        self.prompts = PromptSampler(prompt_set, cfg.rollout.batch_size, cfg.seed, cfg.data.shuffle)
        held_out = eval_source(cfg)
        self.eval_prompts = (load_prompt_set(held_out[0], cfg.data.prompt_column, self.tokenizer, max_prompt, held_out[1])
                             if held_out else None)
        self.generator.warmup()  # its first call's start-up cost stays out of iteration 0
        self.policy_opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.ppo.lr, weight_decay=cfg.ppo.weight_decay)
        self.critic_opt = (torch.optim.AdamW(self.critic.parameters(), lr=cfg.ppo.critic_lr,
                                             weight_decay=cfg.ppo.weight_decay) if self.critic is not None else None)
        steps = Steps(torch.Tensor.backward, torch.Tensor.backward if self.critic is not None else None, self._step)
        self.models = LearnerModels(self.policy, self.critic, steps, LocalCollective(), self.device,
                                    self.tokenizer.pad_token_id)
        self.settings = LearnSettings.of(cfg)
        p = cfg.ppo
        self.kl_ctl = make_kl_controller(p.kl_coef, p.adaptive_kl, p.kl_target, p.kl_horizon)
        self.iteration_count = 0
        self.last_rollout: Rollout | None = None
        self.last_update: LearnResult | None = None
        self._prompts_at_start: dict[str, int] | None = None  # set while an iteration runs

    def iteration(self) -> dict[str, float]:
        """One PPO iteration; returns its metrics (docs/algorithm.md, "Metrics")."""
        cfg, it, clock = self.cfg, self.iteration_count, time.perf_counter
        t0 = clock()
        self._prompts_at_start = self.prompts.state_dict()
        rollout, dynamic = self._sample(it)
        t1 = clock()
        ref_logprobs = self.reference.ref_logprobs(rollout) if self.reference is not None else []
        t2 = clock()
        # Dynamic sampling has rewarded it already.
        score = rollout.score if len(rollout.score) == len(rollout) else self._scores(rollout)
        rollout = rollout.scored(score, ref_logprobs)
        t3 = clock()
        kl_coef = self.kl_ctl.value
        # One process, one update per iteration: the policy's version is the iteration count.
        step = StepInputs(iteration=it, version=it, kl_coef=kl_coef)
        update, exp = learn(self.models, BatchShard.whole(rollout), step, self.settings)
        self.kl_ctl.update(0.0 if update.kl_ref is None else update.kl_ref, len(rollout))  # None: beta = 0
        if cfg.output.save_rollouts:  # each row's advantages (and returns) into its rollout file
            rollout = rollout.trained(*exp.trained_targets(self.critic is not None))
        t4 = clock()
        self.iteration_count += 1
        self._prompts_at_start = None
        self.last_rollout = rollout
        self.last_update = update
        timings = {"time/generate": t1 - t0, "time/reference": t2 - t1, "time/reward": t3 - t2,
                   "time/learn": t4 - t3, "time/sync": 0.0, "time/iteration": t4 - t0}
        return {**update.metrics, **rollout_stats(rollout, t4 - t0, cfg.rollout.max_turns), **timings, **dynamic,
                "kl_coef": kl_coef}

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
            return rollout.scored(self._scores(rollout))

        return fill_batch(draw_scored(0), draw_scored, cfg.rollout.batch_size, cfg.rollout.dynamic_sampling_rounds)

    def evaluate(self) -> dict[str, float]:
        """The current policy on the held-out prompts (``rayppo/trainers/evaluation.py``); {} without them."""
        if self.eval_prompts is None:
            return {}

        def score_pass(temperature: float, k: int) -> list[float]:
            rollout = self.generator.evaluate(self.eval_prompts, temperature, k, eval_seed(self.cfg.seed))
            return rollout.scored(self._scores(rollout)).total_rewards()

        return run_evaluation(eval_plan(self.cfg), len(self.eval_prompts), score_pass)

    def _scores(self, rollout: Rollout) -> list[float]:
        """``[B]`` r_phi of the rows; 0 when an environment's turn rewards are the whole reward."""
        return self.reward.scores(rollout) if self.reward is not None else [0.0] * len(rollout)

    def _trained(self) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """(model, optimiser) of the policy and, with one, the critic."""
        return [(self.policy, self.policy_opt)] + ([(self.critic, self.critic_opt)] if self.critic is not None else [])

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
        stream = checkpoint_tensors(self.policy, full_tensors(self.policy))  # the learner's export (models/export.py)
        write_pretrained(((name, t.to("cpu", copy=True)) for name, t in stream),
                         resolve_model_path(self.cfg.model.policy, self.cfg.model.cache_dir), out_dir / "policy")
        self.tokenizer.save_pretrained(str(out_dir / "policy"))
        if self.critic is not None:
            self.critic.save_pretrained(out_dir / "critic")

    def checkpoint(self, path: Path) -> dict:
        """Models and optimizers (tensors only, read back with ``weights_only``); returns the
        driver's state."""
        states = {"policy": self.policy.state_dict(), "policy_opt": self.policy_opt.state_dict()}
        if self.critic is not None:
            states |= {"critic": self.critic.state_dict(), "critic_opt": self.critic_opt.state_dict()}
        torch.save(states, path / "trainer.pt")
        # Stopped half-way through an iteration (a reward error, the guard before its update): its
        # prompts are drawn again on resume, since the update never happened.
        prompts = self._prompts_at_start or self.prompts.state_dict()
        return {"iteration": self.iteration_count, "kl_coef": self.kl_ctl.value, "prompts": prompts}

    def restore(self, path: Path, state: dict) -> None:
        saved = torch.load(path / "trainer.pt", map_location=self.device, weights_only=True)
        for (model, opt), name in zip(self._trained(), ("policy", "critic")):
            model.load_state_dict(saved[name])
            opt.load_state_dict(saved[f"{name}_opt"])
        self.iteration_count = state["iteration"]
        self.kl_ctl.value = float(state["kl_coef"])
        self.prompts.load_state_dict(state["prompts"])

    def close(self) -> None:
        """In-process, only the environment's processes of a multi-turn run to stop."""
        self.generator.close()
