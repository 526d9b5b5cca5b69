"""The training driver: iterations, metrics, early stop, a rescale between iterations, final save.

The iteration itself belongs to a trainer object (``iteration() -> metrics``, ``save(dir)``,
``last_rollout``, ``last_update``); this module only runs it and records what happened. Its
stop rules read typed results (``last_update.kl_ref``; ``last_evaluation``'s means, fed to the
gold rule as each evaluation is made), not metrics by their names.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from rayppo.cluster.fleet_control import GrowingFleet
from rayppo.config.derived import fleet_minimum
from rayppo.config.schema import Config, to_dict
from rayppo.console import console
from rayppo.data.rollout import Rollout
from rayppo.errors import ActorFailedError, LearnerFailedError, RayppoError, brief
from rayppo.learner.guard import CorrectnessError
from rayppo.learner.step import LearnResult
from rayppo.plan.fit import preflight
from rayppo.run.checkpoint import (
    CheckpointError,
    continued_config,
    latest_checkpoint,
    read_driver_state,
    split_change,
    write_checkpoint,
)
from rayppo.run.folder import release_output_dir
from rayppo.run.gold import GoldWatch
from rayppo.run.metrics import MetricsLogger, plot_metrics, read_metrics
from rayppo.run.progress import Bar
from rayppo.run.samples import format_samples, pick_samples, shown_prompt
from rayppo.run.scale import changes, grows_fleet_only, take_request
from rayppo.run.stop import StopRequest
from rayppo.run.tracking import make_trackers
from rayppo.trainers.evaluation import HeldOutResult, due


class Trainer(Protocol):
    """What the run loop asks of a trainer (``rayppo/trainers/``)."""

    last_rollout: Rollout | None
    last_update: LearnResult | None
    """The last iteration's update: the policy's version, its KL to the reference (the stop rule's)."""
    last_evaluation: HeldOutResult | None
    """The last held-out evaluation (``evaluate``): its proxy and gold means (the gold rule's)."""
    iteration_count: int
    """Iterations whose update the trainer holds (a checkpoint is named after them)."""

    @property
    def fleet(self) -> GrowingFleet | None:
        """The generator fleet, which grows without a restart; None in one process."""
        ...

    def iteration(self) -> dict[str, float]: ...

    def evaluate(self) -> dict[str, float]: ...

    def save(self, out_dir: str | Path) -> None: ...

    def checkpoint(self, path: Path) -> dict[str, Any]: ...

    def restore(self, path: Path, state: dict[str, Any]) -> None: ...

    def recover(self, failure: LearnerFailedError) -> int: ...

    def close(self) -> None: ...


@dataclass
class TrainResult:
    """What a run did."""

    iterations: int
    """Iterations completed."""
    stop_reason: str
    """``completed``, ``kl_budget``, ``gold_plateau``, ``interrupted`` (Ctrl-C) or ``preempted`` (SIGTERM); a guard
    or failure stop raises."""
    reward_start: float
    """Mean reward of the first iteration (the initial policy)."""
    reward_end: float
    """Mean reward of the last (up to) five iterations."""
    out_dir: Path
    eval_reward: float | None = None
    """The last ``eval/reward/mean`` (None without evaluation)."""
    seconds: float = 0.0
    """Wall-clock seconds of this invocation's iterations (start-up excluded)."""
    resumed_at: int = 0
    """Iterations the checkpoint it resumed from held (0: a new run)."""
    rescaled: Config | None = None
    """The config to go on with, on another split (``rayppo scale``; stop reason ``rescaled``)."""

    def summary(self) -> str:
        """The closing line: what was done, how reward moved, where everything is."""
        n = self.iterations
        evaluated = f", held-out {self.eval_reward:.3f}" if self.eval_reward is not None else ""
        here = f" ({n - self.resumed_at} after resuming at {self.resumed_at})" if self.resumed_at else ""
        return (f"{self.stop_reason}: {n} iteration{'s' if n != 1 else ''}{here} in {self.seconds:.0f} s; mean reward "
                f"{self.reward_start:.3f} (first iteration) -> {self.reward_end:.3f} "
                f"({'last' if n == 1 else f'mean of the last {min(n, 5)}'}){evaluated}. Outputs in {self.out_dir}/ "
                f"({', '.join(self.outputs())})")

    def outputs(self) -> list[str]:
        """What the run folder holds of what a run writes (no critic/ without a critic)."""
        names = ("metrics.jsonl", "plot.png", "tb/", "policy/", "policy-adapter/", "critic/", "logs/")
        return [name for name in names if (self.out_dir / name.rstrip("/")).exists()]


def _mean_reward(records: list[dict[str, float]]) -> float:
    return sum(r["reward/mean"] for r in records) / max(len(records), 1)


def train(cfg: Config, progress: bool = True, resume: Path | None = None) -> TrainResult:
    """``run`` with the trainer ``cfg`` chooses; when ``rayppo scale`` asks for another split, the
    run resumes on it, in this process, from the checkpoint written at the boundary (``run/scale.py``)."""
    from rayppo.trainers.choice import make_trainer

    while True:
        result = run(cfg, make_trainer(cfg), progress, resume)
        if result.rescaled is None:
            return result
        cfg, resume = result.rescaled, latest_checkpoint(result.out_dir)


def run(cfg: Config, trainer: Trainer, progress: bool = True, resume: Path | None = None) -> TrainResult:
    """Run ``cfg.stop.iterations`` iterations of ``trainer`` (from checkpoint ``resume`` on, if
    given); write every output of a run, and a checkpoint every ``output.checkpoint_every``.
    When a learner rank dies the trainer goes back to its latest checkpoint (``recover``) and
    the iterations since are redone, their first records replaced."""
    out = Path(cfg.output.dir)
    try:
        first = _start(cfg, trainer, out, resume)
        trackers = make_trackers(cfg, to_dict(cfg), resume=resume is not None)
    except BaseException:
        trainer.close()
        raise
    logger = MetricsLogger(out, trackers, resume_at=first if resume is not None else None)
    # A resumed run's evaluations so far are in the records it goes on from (read once).
    gold = GoldWatch.of_records(cfg.stop.gold_patience, read_metrics(logger.path) if resume and cfg.stop.gold_patience
                                else [])
    loop = _Loop(cfg, trainer, out, logger, Bar(cfg.stop.iterations, first, progress),
                 StopRequest(cfg.stop.sigterm_grace_s), first, gold)
    failure: Exception | None = None
    stop_reason, at_once, started = "completed", False, time.monotonic()
    try:
        with loop.stop.installed():
            stop_reason = loop.run()
    except KeyboardInterrupt:  # a second Ctrl-C, or a preemption without the time to finish
        stop_reason, at_once = loop.stop.requested or "interrupted", True
    except LearnerFailedError as exc:  # no learner left to checkpoint: the message says how to go on
        stop_reason, failure = "learner_failure", exc
    except RayppoError as exc:  # keep what is done, then say why
        stop_reason, failure = _stop_reason(exc), exc
    except Exception as exc:  # a bug, not an input: still keep what is done and close, then raise it
        stop_reason, failure = "error", exc
    finally:
        loop.bar.close()
        logger.close()
    # Nothing trained yet (a stop during iteration 0 after its update, e.g. by the sync guard, has
    # something to keep): no checkpoint, and the folder is free again.
    if resume is None and trainer.iteration_count == 0 and stop_reason != "completed":
        _nothing_done(trainer, out, stop_reason)
    else:
        _finish(cfg, trainer, out, stop_reason, loop.it, at_once)
    if failure is not None:
        raise failure
    result = _result(cfg, out, loop.it, stop_reason, time.monotonic() - started, first)  # first: 0 for a new run
    result.rescaled = loop.rescale if stop_reason == "rescaled" and _checkpointed_at(out, loop.it) else None
    return result


@dataclass
class _Loop:
    """The iterations of one run, and what each leaves behind (metrics, samples, checkpoints)."""

    cfg: Config
    trainer: Trainer
    out: Path
    logger: MetricsLogger
    bar: Bar
    stop: StopRequest
    it: int
    """Iterations completed so far."""
    gold: GoldWatch = field(default_factory=lambda: GoldWatch(0))
    """The gold stop rule over the run's evaluations (``stop.gold_patience``; 0: off)."""
    rescale: Config | None = None
    """The split ``rayppo scale`` asked for, once taken (the loop then stops: ``rescaled``)."""

    def run(self) -> str:
        """Iterate until done; returns why it stopped (``completed``, ``kl_budget``, ``gold_plateau``, ``rescaled``, or
        the signal's ``interrupted`` / ``preempted``)."""
        cfg = self.cfg
        while self.it < cfg.stop.iterations:
            try:
                self.one()
            except LearnerFailedError as exc:  # raises again once the restart budget is spent
                self.it = self.trainer.recover(exc)
                self.logger.rewind(self.it)
                self.gold.rewind(self.it)
                self.bar.rewind(self.it)
                continue
            assert self.trainer.last_update is not None  # one() ran an iteration, whose update set it
            kl = self.trainer.last_update.kl_ref  # None without a reference (kl_coef = 0)
            if kl is not None and kl > cfg.stop.kl_budget:
                console.write(f"Stopping early at iteration {self.it - 1}: KL(pi || pi_ref) = {kl:.2f} nats per "
                              f"response exceeds stop.kl_budget = {cfg.stop.kl_budget}")
                return "kl_budget"
            if why := self.gold.verdict():
                console.write(f"Stopping early at iteration {self.it - 1}: {why}")
                return "gold_plateau"
            if self.stop.requested:
                return self.stop.requested
            if self.it < cfg.stop.iterations and self._take_rescale():
                return "rescaled"
        return "completed"

    def _take_rescale(self) -> bool:
        """Whether a waiting ``rayppo scale`` request is to be carried out now; one that cannot be
        (a field or value ``--resume`` refuses, a split this machine cannot hold) is refused on
        one line, and the run goes on as it is."""
        overrides = take_request(self.out)
        if overrides is None:
            return False
        try:
            cfg = continued_config(self.out, overrides)
            missing = preflight(cfg)
            if missing:
                raise RayppoError("it does not fit: " + "; ".join(missing))
        except RayppoError as exc:
            console.write(f"rayppo scale {' '.join(overrides)}: refused ({exc}); the run goes on as it is")
            return False
        said = changes(self.cfg, cfg)
        if not said:
            return False
        # No restart when only generators are added and the cluster has room for them now: they join the
        # running fleet. Else (a local Ray instance sized to the job has none) through a checkpoint.
        if grows_fleet_only(self.cfg, cfg) and self._grow_fleet(cfg):
            self.cfg = cfg  # the loop goes on under the grown split; config.yaml says it for a resume
            _save_config(self.out, cfg)
            console.write(f"rayppo scale: {said} after iteration {self.it - 1}: the new generators join the fleet "
                          "once placed and up to date (no restart)")
            return False
        console.write(f"rayppo scale: {said} after iteration {self.it - 1}: checkpoint, then resume on the new split")
        self.rescale = cfg
        return True

    def _grow_fleet(self, cfg: Config) -> bool:
        """Whether the fleet grew to ``cfg``'s generators: not in one process (no fleet), nor
        without room for them in the cluster now."""
        fleet = self.trainer.fleet
        if fleet is None or not fleet.room_to_grow(cfg.generators.num):
            return False
        fleet.grow(cfg.generators.num, fleet_minimum(cfg), self.it)
        return True

    def one(self) -> dict[str, float]:
        """One iteration, its evaluation when due, its records and its periodic checkpoint."""
        cfg, it, start = self.cfg, self.it, time.monotonic()
        self.stop.iteration_begins()
        initial = {}
        if it == 0 and cfg.eval.at_start and cfg.eval.every:  # the policy before its first update
            initial = {f"initial/{k}": v for k, v in self.trainer.evaluate().items()}
        metrics = self.trainer.iteration() | initial
        if due(cfg.eval.every, it, cfg.stop.iterations):
            metrics |= self.trainer.evaluate()
            evaluation = self.trainer.last_evaluation  # None without held-out prompts
            if evaluation is not None:
                self.gold.evaluated(it, evaluation.reward_mean, evaluation.gold_mean)
        self.logger.log(it, metrics)
        _after_iteration(cfg, self.trainer, self.out, it, metrics, self.logger)
        self.bar.update(metrics)
        self.it = it + 1
        # The iteration's own seconds: a checkpoint's are counted apart (the SIGTERM estimate adds them).
        self.stop.iteration_done(time.monotonic() - start)
        every = cfg.output.checkpoint_every
        if every and self.it % every == 0:
            begin = time.monotonic()
            write_checkpoint(self.out, self.trainer, cfg.output.keep_checkpoints)
            self.stop.last_checkpoint_s = time.monotonic() - begin
        return metrics


def _result(cfg: Config, out: Path, done: int, stop_reason: str, seconds: float, resumed_at: int) -> TrainResult:
    """The run's summary (and its plot) from metrics.jsonl."""
    records = read_metrics(out / "metrics.jsonl")
    if records:
        plot_metrics(records, out / "plot.png", cfg.stop.kl_budget)
    evals = [r["eval/reward/mean"] for r in records if "eval/reward/mean" in r]
    return TrainResult(done, stop_reason, _mean_reward(records[:1]), _mean_reward(records[-5:]), out,
                       evals[-1] if evals else None, seconds, resumed_at)


def _save_config(out: Path, cfg: Config) -> None:
    """``config.yaml``: what ``--resume`` and ``rayppo scale`` read the run's config from."""
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _start(cfg: Config, trainer: Trainer, out: Path, resume: Path | None) -> int:
    """The run folder and its config; the checkpoint ``resume`` loaded. Returns the first iteration."""
    out.mkdir(parents=True, exist_ok=True)
    _save_config(out, cfg)
    if resume is None:
        return 0
    state = read_driver_state(resume)
    trainer.restore(resume, state)
    console.phase(f"resumed from {resume} after {state['iteration']} iterations{split_change(resume, cfg)}")
    return state["iteration"]


STOPS = {"interrupted": "Interrupted", "preempted": "Preempted (SIGTERM)", "rescaled": "Rescaling",
         "correctness_guard": "Stopped by the correctness guard", "actor_failure": "Stopped by an actor failure",
         "error": "Stopped by an error"}
"""Stops after which a checkpoint is written (of the last completed iteration), and how they read."""


def _stop_reason(exc: RayppoError) -> str:
    if isinstance(exc, CorrectnessError):  # raised before the bad update, or after a bad sync
        return "correctness_guard"
    return "actor_failure" if isinstance(exc, ActorFailedError) else "error"


def _after_iteration(cfg: Config, trainer: Trainer, out: Path, it: int, metrics: dict[str, float],
                     logger: MetricsLogger) -> None:
    """Rollouts to disk (when asked) and, every ``output.samples_every``, a few responses."""
    rollout = trainer.last_rollout
    if cfg.output.save_rollouts and rollout is not None:
        rollout.write_parquet(out / "rollouts" / f"iter_{it:05d}.parquet")
    every = cfg.output.samples_every
    if every and (it + 1) % every == 0 and rollout is not None:
        n = cfg.output.samples_shown
        logger.log_samples(it, pick_samples(rollout.prompt_text, rollout.response_text, rollout.total_rewards(), n))
        # The same picks (they depend on the rewards only), each chat prompt shown by its question.
        questions = [shown_prompt(text, messages) for text, messages in zip(rollout.prompt_text,
                                                                            rollout.conversations())]
        console.write(f"samples of iteration {it} (highest to lowest reward):")
        for line in format_samples(pick_samples(questions, rollout.response_text, rollout.total_rewards(), n),
                                   shutil.get_terminal_size().columns):
            console.write(line)


def _finish(cfg: Config, trainer: Trainer, out: Path, stop_reason: str, done: int, at_once: bool) -> None:
    """A last checkpoint (always after Ctrl-C, SIGTERM or a guard stop; with periodic checkpoints on,
    also at the end, so ``--resume DIR stop.iterations=...`` can extend a finished run), the final
    models, then close. A stop at once (mid-iteration) and a dead learner write nothing: the
    latest checkpoint stands, and the message names it."""
    every = cfg.output.checkpoint_every
    try:
        if stop_reason == "learner_failure":  # the learner's state died with it
            return
        if at_once:
            console.write(f"{STOPS[stop_reason]} mid-iteration: {_standing(out)}")
            return
        if stop_reason in STOPS:
            try:
                path = write_checkpoint(out, trainer, cfg.output.keep_checkpoints)  # named after what it holds
            except Exception as exc:  # noqa: BLE001 - the stop's own cause is what gets raised
                console.write(f"{STOPS[stop_reason]}; the checkpoint could not be written ({brief(exc)}): "
                              f"{_standing(out)}")
                return
            if stop_reason == "rescaled":  # train() resumes from it at once
                return
            console.write(f"{STOPS[stop_reason]} after {int(path.name.removeprefix('iter_'))} iterations; saved a "
                          f"checkpoint to {path} (continue with: rayppo train --resume {out})")
        elif (every or cfg.output.save_model) and not _checkpointed_at(out, done):
            # Before the export, so that a failed export loses nothing: the run goes on from here.
            write_checkpoint(out, trainer, cfg.output.keep_checkpoints)
        if cfg.output.save_model and stop_reason != "preempted":  # a preempted run saves when it completes
            _export(trainer, out)
    finally:
        trainer.close()


def _checkpointed_at(out: Path, done: int) -> bool:
    """The latest checkpoint holds the state after ``done`` iterations."""
    try:
        return latest_checkpoint(out).name == f"iter_{done:06d}"
    except CheckpointError:
        return False


def _export(trainer: Trainer, out: Path) -> None:
    """The final models; a failure is one line that says where the trained state is and how to
    export it again (``--resume`` of a completed run trains nothing and exports)."""
    try:
        trainer.save(out)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the checkpoint written before stands
        try:
            kept = f"the trained state is in the checkpoint {latest_checkpoint(out)}"
        except CheckpointError:
            kept = "no checkpoint holds the trained state"
        raise RayppoError(f"the final export to {out}/policy failed ({brief(exc)}); {kept}: export it again with "
                          f"rayppo train --resume {out} (the log is in {out}/logs/)") from None


def _nothing_done(trainer: Trainer, out: Path, stop_reason: str) -> None:
    """A new run stopped before its first iteration completed: there is nothing to resume, so no
    checkpoint is written and the folder is not claimed (the same command can run again into it);
    its logs stay, for the error that stopped it."""
    try:
        release_output_dir(out)
        said = STOPS.get(stop_reason, "Stopped")
        console.write(f"{said} before the first iteration completed: nothing to resume, so no checkpoint was "
                      f"written; the same command can run again into {out} (its logs/ are kept)")
    finally:
        trainer.close()


def _standing(out: Path) -> str:
    """Which checkpoint a run stopped at once goes on from, and how."""
    try:
        path = latest_checkpoint(out)
    except CheckpointError:
        return "no checkpoint was written yet; rayppo train starts it again from the beginning"
    return f"the checkpoint {path} stands (continue with: rayppo train --resume {out})"
