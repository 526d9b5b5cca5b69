"""One iteration for every trainer: the batch from a rollout source, the update, the publish.

    batch  = source.next(it)               generate, filter, score   (sync)  or wait (pipeline)
    update = learn(batch.rollout, beta)    the trainer's learner: a DeepSpeed group, or in-process
    publisher.publish(update.version)      sync and check            (sync)  or hand to the pipeline;
                                           nothing in one process (one module samples and learns)
    times  = source.timings(...)           the iteration's StageTimes: time/* and perf/*

The trainers differ in their learner and their source, not in their iteration: what the driver
keeps between iterations (beta, the iteration count, the prompt position: ``driver_state``), the
prompts, the metrics line and the commit of an update are written here once.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from rayppo.config.schema import Config
from rayppo.data.prompts import PromptSampler, PromptSet, load_prompt_set
from rayppo.data.rollout import Rollout
from rayppo.learner.step import LearnResult
from rayppo.run.mfu import StageCounter
from rayppo.trainers.clock import Stage, StageClock
from rayppo.trainers.evaluation import (
    HeldOutResult,
    ScorePass,
    eval_plan,
    eval_source,
    held_out_result,
    teacher_figures,
)
from rayppo.trainers.iteration import make_kl_controller, rollout_stats
from rayppo.trainers.source import BatchSource, Publisher


def load_prompts(cfg: Config, tokenizer: Any, max_prompt: int | None) -> tuple[PromptSet, PromptSet | None]:
    """The training prompts and the held-out ones (None without), each at most ``max_prompt``
    tokens (None: no limit)."""
    limit = sys.maxsize if max_prompt is None else max_prompt
    prompt_set = load_prompt_set(cfg.data.prompts, cfg.data.prompt_column, tokenizer, limit, cfg.data.split)
    held_out = eval_source(cfg)
    eval_prompts = (load_prompt_set(held_out[0], cfg.data.prompt_column, tokenizer, limit, held_out[1])
                    if held_out else None)
    return prompt_set, eval_prompts


class LoopTrainer:
    """The iteration and the driver's state every trainer shares; a trainer gives its learner
    (``_learn``, ``_trained_targets``), its rollout source (``source``) and where its updates go
    (``publisher``)."""

    source: BatchSource
    publisher: Publisher | None
    """Where each update's policy goes; None when the generator samples from the module the learner trains."""
    clock: StageClock

    def __init__(self, cfg: Config, prompt_set: PromptSet, eval_prompts: PromptSet | None) -> None:
        self.cfg = cfg
        p = cfg.ppo
        self.prompts = PromptSampler(prompt_set, cfg.rollout.batch_size, cfg.seed, cfg.data.shuffle)
        self.eval_prompts = eval_prompts
        self.kl_ctl = make_kl_controller(p.kl_coef, p.adaptive_kl, p.kl_target, p.kl_horizon)
        self.iteration_count = 0
        self.last_rollout: Rollout | None = None
        self.last_update: LearnResult | None = None
        self.last_evaluation: HeldOutResult | None = None
        """The last held-out evaluation (``evaluate``): the gold stop rule reads its means."""
        self.teacher_evaluation: HeldOutResult | None = None
        """The distillation teacher's held-out evaluation (``beside_teacher``), made once."""
        self.stage_counter = StageCounter.of(cfg)
        """Each stage's FLOPs and the measured rate (``rate``: the trainer's probe) for ``perf/*``."""

    @property
    def phase(self) -> str:
        """What the driver waits on now (one of ``source.PHASES``), for whoever watches the run
        from another thread: the fault matrix (``benchmarks/fault_matrix.py``) times its signals by it."""
        return self.clock.phase

    def iteration(self) -> dict[str, float]:
        """One PPO iteration; returns its metrics (docs/algorithm.md, "Metrics")."""
        it = self.iteration_count
        self.clock.begin()
        self._before_iteration()
        batch = self.source.next(it)
        kl_coef = self.kl_ctl.value
        with self._learner_failures():  # a dead or hung rank: LearnerFailedError, then recover()
            with self.clock.stage(Stage.LEARN):
                update = self._learn(batch.rollout, kl_coef, it)
                self._commit_update(update, batch.rollout)  # from here a checkpoint holds this iteration
            published = self.publisher.publish(update.version) if self.publisher is not None else {}
        self._iteration_done()
        times = self.source.timings(self.clock.seconds)
        reported = batch.reported if batch.reported is not None else batch.rollout
        return {**update.metrics, **rollout_stats(reported, times.iteration, self.cfg.rollout.max_turns),
                **self.stage_counter.metrics(batch.rollout, times), **times.metrics(), **self._run_figures(),
                **batch.source_metrics, **published, "kl_coef": kl_coef}

    def _learn(self, rollout: Rollout, kl_coef: float, it: int) -> LearnResult:
        """The learner's update on a scored batch."""
        raise NotImplementedError

    def _trained_targets(self) -> tuple[list[list[float]], list[list[float]]]:
        """Each row's advantages (and returns) of the last update, for its rollout file."""
        raise NotImplementedError

    def _before_iteration(self) -> None:
        """What happens at an iteration boundary before the batch is drawn (none here)."""

    def _iteration_done(self) -> None:
        """What follows an iteration's publish (none here)."""

    def _learner_failures(self) -> AbstractContextManager[Any]:
        """Where a learner failure is told apart from others (one process: nowhere)."""
        return nullcontext()

    def _run_figures(self) -> dict[str, float]:
        """Figures of the run as a whole for the metrics line (faults, the fleet; none here)."""
        return {}

    def beside_teacher(self, teacher_pass: ScorePass, prompts: int) -> dict[str, float]:
        """The teacher's held-out figures beside the last evaluation's (``teacher_figures``): the
        teacher is frozen and the held-out seed fixed, so its passes (``teacher_pass``) run once."""
        if self.last_evaluation is None:
            return {}
        if self.teacher_evaluation is None:
            self.teacher_evaluation = held_out_result(eval_plan(self.cfg), prompts, teacher_pass)
        return teacher_figures(self.last_evaluation, self.teacher_evaluation)

    def _commit_update(self, update: LearnResult, rollout: Rollout) -> None:
        """The learner has taken this iteration's update: the driver's state moves with it (beta,
        the iteration count), so that a checkpoint written after a later failure of this iteration
        (the sync, its check) pairs the updated learner with the state after the iteration, never
        with the state before it (which would train the batch twice on resume)."""
        # kl_ref None: no reference (beta = 0), or no row trained; the controller sees 0.
        self.kl_ctl.update(0.0 if update.kl_ref is None else update.kl_ref, len(rollout))
        if self.cfg.output.save_rollouts:  # each row's advantages (and returns) into its rollout file
            rollout = rollout.trained(*self._trained_targets())
        self.iteration_count += 1
        self.last_rollout = rollout
        self.last_update = update

    def driver_state(self) -> dict[str, Any]:
        """What the next iteration needs besides the models (JSON): beta, the iteration count and
        the source's position before the next batch to train, even when an iteration failed
        half-way (its prompts are drawn again on resume)."""
        return {"iteration": self.iteration_count, "kl_coef": self.kl_ctl.value,
                **self.source.state(self.iteration_count)}

    def _load_driver_state(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (as ``driver_state`` wrote it)."""
        self.iteration_count = state["iteration"]
        self.kl_ctl.value = float(state["kl_coef"])
        self.source.load_state(state)
