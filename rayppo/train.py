"""The training driver: iterations, progress bar, metrics, early stop, final save.

The iteration itself belongs to a trainer object (``iteration() -> metrics``, ``save(dir)``,
``last_rollout``); this module only runs it and records what happened.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import yaml
from tqdm import tqdm

from rayppo.checkpoint import checkpoint_root, read_driver_state, write_checkpoint
from rayppo.config import Config, to_dict
from rayppo.data.rollout import Rollout
from rayppo.errors import ActorFailedError, LearnerFailedError, RayppoError
from rayppo.guard import CorrectnessError
from rayppo.metrics import MetricsLogger, plot_metrics, read_metrics


class Trainer(Protocol):
    last_rollout: Rollout | None

    def iteration(self) -> dict[str, float]: ...

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
        tqdm.write("Ctrl-C: stopping after this iteration, then saving a checkpoint (Ctrl-C again to stop now)",
                   file=sys.stderr)

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
    first = _start(cfg, trainer, out, resume)
    logger = MetricsLogger(out, cfg.output.tensorboard, resume_at=first if resume is not None else None)
    stop_reason, it, every = "completed", first, cfg.output.checkpoint_every
    guard_error: RayppoError | None = None
    bar = tqdm(total=cfg.stop.iterations, initial=first, desc="PPO", unit="it", disable=not progress, file=sys.stderr)
    stop = _StopRequest()
    try:
        with stop.installed():
            while it < cfg.stop.iterations:
                try:
                    metrics = trainer.iteration()
                    logger.log(it, metrics)
                    _after_iteration(cfg, trainer, out, it, metrics, bar)
                    if every and (it + 1) % every == 0:
                        write_checkpoint(out, it + 1, trainer, cfg.output.keep_checkpoints)
                except LearnerFailedError as exc:  # raises again once the restart budget is spent
                    it = trainer.recover(exc)
                    logger.rewind(it)
                    bar.n = it
                    bar.refresh()
                    continue
                it += 1
                if metrics["kl/ref_mean"] > cfg.stop.kl_budget:
                    stop_reason = "kl_budget"
                    tqdm.write(f"Stopping early at iteration {it - 1}: KL(pi || pi_ref) = {metrics['kl/ref_mean']:.2f} "
                               f"nats per response exceeds stop.kl_budget = {cfg.stop.kl_budget}", file=sys.stderr)
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
    records = read_metrics(out / "metrics.jsonl")
    if records:
        plot_metrics(records, out / "plot.png", cfg.stop.kl_budget)
    return TrainResult(it, stop_reason, _mean_reward(records[:1]), _mean_reward(records[-5:]), out)


def _start(cfg: Config, trainer: Trainer, out: Path, resume: Path | None) -> int:
    """The run folder and its config; the checkpoint ``resume`` loaded. Returns the first iteration."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if resume is None:
        return 0
    state = read_driver_state(resume)
    trainer.restore(resume, state)
    tqdm.write(f"Resumed from {resume} after {state['iteration']} iterations", file=sys.stderr)
    return state["iteration"]


STOPS = {"interrupted": "Interrupted", "correctness_guard": "Stopped by the correctness guard",
         "actor_failure": "Stopped by an actor failure", "error": "Stopped by an error"}
"""Stops after which a checkpoint is written (of the last completed iteration), and how they read."""


def _stop_reason(exc: RayppoError) -> str:
    if isinstance(exc, CorrectnessError):  # raised before the bad update, or after a bad sync
        return "correctness_guard"
    return "actor_failure" if isinstance(exc, ActorFailedError) else "error"


def _after_iteration(cfg: Config, trainer: Trainer, out: Path, it: int, metrics: dict[str, float], bar: tqdm) -> None:
    """Rollouts to disk (when asked) and the progress bar."""
    if cfg.output.save_rollouts and trainer.last_rollout is not None:
        trainer.last_rollout.write_parquet(out / "rollouts" / f"iter_{it:05d}.parquet")
    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl/ref_mean']:.2f}",
                    tok_s=f"{metrics['throughput/tokens_per_s']:.0f}")
    bar.update()


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
            tqdm.write(f"{why} after {done} iterations; saving a checkpoint to {checkpoint_root(out)} "
                       f"(continue with: rayppo train --resume {out})", file=sys.stderr)
            write_checkpoint(out, done, trainer, cfg.output.keep_checkpoints)
        elif every and done % every:
            write_checkpoint(out, done, trainer, cfg.output.keep_checkpoints)
        if cfg.output.save_model:
            trainer.save(out)
    finally:
        trainer.close()
