"""The training driver: iterations, progress bar, metrics, early stop, final save.

The iteration itself belongs to a trainer object (``iteration() -> metrics``, ``save(dir)``,
``last_rollout``); this module only runs it and records what happened.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import yaml
from tqdm import tqdm

from rayppo.config.schema import Config, to_dict
from rayppo.console import console
from rayppo.data.rollout import Rollout
from rayppo.errors import ActorFailedError, LearnerFailedError, RayppoError
from rayppo.learner.guard import CorrectnessError
from rayppo.run.checkpoint import checkpoint_root, read_driver_state, write_checkpoint
from rayppo.run.metrics import MetricsLogger, plot_metrics, read_metrics
from rayppo.run.samples import format_samples, pick_samples
from rayppo.run.tracking import make_trackers
from rayppo.trainers.evaluation import due


class Trainer(Protocol):
    last_rollout: Rollout | None

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
    """``completed``, ``kl_budget`` or ``interrupted`` (a guard or failure stop raises)."""
    reward_start: float
    """Mean reward of the first iteration (the initial policy)."""
    reward_end: float
    """Mean reward of the last (up to) five iterations."""
    out_dir: Path
    eval_reward: float | None = None
    """The last ``eval/reward/mean`` (None without evaluation)."""
    seconds: float = 0.0
    """Wall-clock seconds of the iterations (start-up excluded)."""

    def summary(self) -> str:
        """The closing line: what was done, how reward moved, where everything is."""
        n = self.iterations
        evaluated = f", held-out {self.eval_reward:.3f}" if self.eval_reward is not None else ""
        return (f"{self.stop_reason}: {n} iteration{'s' if n != 1 else ''} in {self.seconds:.0f} s; mean reward "
                f"{self.reward_start:.3f} (first iteration) -> {self.reward_end:.3f} "
                f"({'last' if n == 1 else f'mean of the last {min(n, 5)}'}){evaluated}. Outputs in {self.out_dir}/ "
                "(metrics.jsonl, plot.png, tb/, policy/, critic/, logs/)")


def _mean_reward(records: list[dict[str, float]]) -> float:
    return sum(r["reward/mean"] for r in records) / max(len(records), 1)


class _StopRequest:
    """The first Ctrl-C asks the loop to stop after the current iteration; a second one aborts it.

    Stopping at an iteration boundary keeps the interrupt out of Ray and DeepSpeed calls in
    flight, so the checkpoint that follows starts from a consistent state.
    """

    def __init__(self) -> None:
        self.requested = False

    def _handler(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        console.write("Ctrl-C: stopping after this iteration, then saving a checkpoint (Ctrl-C again to stop now)")

    @contextmanager
    def installed(self) -> Iterator["_StopRequest"]:
        if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


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
    stop_reason, it, every = "completed", first, cfg.output.checkpoint_every
    guard_error: RayppoError | None = None
    bar = Bar(cfg.stop.iterations, first, progress)
    stop, started = _StopRequest(), time.monotonic()
    try:
        with stop.installed():
            while it < cfg.stop.iterations:
                try:
                    metrics = trainer.iteration()
                    if due(cfg.eval.every, it, cfg.stop.iterations):
                        metrics |= trainer.evaluate()
                    logger.log(it, metrics)
                    _after_iteration(cfg, trainer, out, it, metrics, logger)
                    bar.update(metrics)
                    if every and (it + 1) % every == 0:
                        write_checkpoint(out, it + 1, trainer, cfg.output.keep_checkpoints)
                except LearnerFailedError as exc:  # raises again once the restart budget is spent
                    it = trainer.recover(exc)
                    logger.rewind(it)
                    bar.rewind(it)
                    continue
                it += 1
                if metrics["kl/ref_mean"] > cfg.stop.kl_budget:
                    stop_reason = "kl_budget"
                    console.write(f"Stopping early at iteration {it - 1}: KL(pi || pi_ref) = "
                                  f"{metrics['kl/ref_mean']:.2f} nats per response exceeds stop.kl_budget = "
                                  f"{cfg.stop.kl_budget}")
                    break
                if stop.requested:
                    stop_reason = "interrupted"
                    break
    except KeyboardInterrupt:  # a second Ctrl-C, mid-iteration
        stop_reason = "interrupted"
    except LearnerFailedError as exc:  # no learner left to checkpoint: the message says how to go on
        stop_reason, guard_error = "learner_failure", exc
    except RayppoError as exc:  # keep what is done (the state before this iteration), then say why
        stop_reason, guard_error = _stop_reason(exc), exc
    finally:
        bar.close()
        logger.close()
    _finish(cfg, trainer, out, stop_reason, it)
    if guard_error is not None:
        raise guard_error
    return _result(cfg, out, it, stop_reason, time.monotonic() - started)


def _result(cfg: Config, out: Path, done: int, stop_reason: str, seconds: float) -> TrainResult:
    """The run's summary (and its plot) from metrics.jsonl."""
    records = read_metrics(out / "metrics.jsonl")
    if records:
        plot_metrics(records, out / "plot.png", cfg.stop.kl_budget)
    evals = [r["eval/reward/mean"] for r in records if "eval/reward/mean" in r]
    return TrainResult(done, stop_reason, _mean_reward(records[:1]), _mean_reward(records[-5:]), out,
                       evals[-1] if evals else None, seconds)


def _start(cfg: Config, trainer: Trainer, out: Path, resume: Path | None) -> int:
    """The run folder and its config; the checkpoint ``resume`` loaded. Returns the first iteration."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if resume is None:
        return 0
    state = read_driver_state(resume)
    trainer.restore(resume, state)
    console.phase(f"resumed from {resume} after {state['iteration']} iterations")
    return state["iteration"]


STOPS = {"interrupted": "Interrupted", "correctness_guard": "Stopped by the correctness guard",
         "actor_failure": "Stopped by an actor failure", "error": "Stopped by an error"}
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
        samples = pick_samples(rollout.prompt_text, rollout.response_text, rollout.score, cfg.output.samples_shown)
        logger.log_samples(it, samples)
        console.write(f"samples of iteration {it} (highest to lowest reward):")
        for line in format_samples(samples, shutil.get_terminal_size().columns):
            console.write(line)


class Bar:
    """The progress bar: iterations, ETA, and the figures a user watches (reward, held-out
    reward, KL, tokens/s). The last evaluation's reward stays on it until the next one."""

    def __init__(self, total: int, first: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, initial=first, desc="PPO", unit="it", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True)
        self.eval: str | None = None

    def update(self, metrics: dict[str, float]) -> None:
        if "eval/reward/mean" in metrics:
            self.eval = f"{metrics['eval/reward/mean']:.3f}"
        shown = {"reward": f"{metrics['reward/mean']:.3f}", **({"eval": self.eval} if self.eval else {}),
                 "kl": f"{metrics['kl/ref_mean']:.2f}", "tok/s": f"{metrics['throughput/tokens_per_s']:.0f}"}
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update()

    def rewind(self, iteration: int) -> None:
        self.bar.n = iteration
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _finish(cfg: Config, trainer: Trainer, out: Path, stop_reason: str, done: int) -> None:
    """A last checkpoint (always after Ctrl-C or a guard stop; with periodic checkpoints on, also at
    the end, so ``--resume DIR stop.iterations=...`` can extend a finished run), the final
    models, then close."""
    every = cfg.output.checkpoint_every
    if stop_reason == "learner_failure":  # the learner's state died with it
        trainer.close()
        return
    try:
        if stop_reason in STOPS:
            why = STOPS[stop_reason]
            console.write(f"{why} after {done} iterations; saving a checkpoint to {checkpoint_root(out)} "
                          f"(continue with: rayppo train --resume {out})")
            write_checkpoint(out, done, trainer, cfg.output.keep_checkpoints)
        elif every and done % every:
            write_checkpoint(out, done, trainer, cfg.output.keep_checkpoints)
        if cfg.output.save_model:
            trainer.save(out)
    finally:
        trainer.close()
