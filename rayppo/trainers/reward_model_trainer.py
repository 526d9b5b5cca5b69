"""``rayppo reward-model``: r_φ trained with the Bradley–Terry loss on preference pairs, by the
learner group that trains the policy (ranks, ZeRO stage, bf16, checkpoints, resume).

    pairs  -> checked, tokenised with r_φ's tokenizer, a held-out part set aside (seeded)
    step   -> the step's pairs dealt evenly to the ranks; each: −log σ(r_w − r_l), backward; one step
    eval   -> pairwise accuracy, margin and loss on the held-out pairs (each epoch, every eval_every)
    output -> output.dir/reward_model: a folder ``reward.model=`` takes as it is

Each step's metrics (``rm/loss``, ``rm/accuracy``, ``rm/margin``, ``rm/step_s``, ``rm/pairs_per_s``;
``rm/eval/*`` when evaluated) go to ``metrics.jsonl`` and the trackers, as a PPO run's do. docs/reward-models.md says the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from rayppo.cluster.learner_group import LearnerGroup
from rayppo.config.schema import Config, ConfigError, to_dict
from rayppo.console import console
from rayppo.data.pairs import PairTokens, PreferencePairs, epoch_order, held_out_split, read_pairs, tokenize_pairs
from rayppo.data.rollout import split_evenly
from rayppo.learner.bradley_terry import pair_means, pair_sums
from rayppo.learner.reward_model_engine import RewardModelLearner
from rayppo.models.loading import load_tokenizer, resolve_model_path
from rayppo.models.reward_model import backbone_name
from rayppo.models.reward_stats import RewardStats
from rayppo.run.checkpoint import read_driver_state, write_checkpoint
from rayppo.run.metrics import MetricsLogger
from rayppo.run.progress import Bar
from rayppo.run.tracking import make_trackers

OUTPUT = "reward_model"
"""The trained r_φ's folder under ``output.dir``."""


@dataclass
class RewardModelResult:
    """What a reward-model run did."""

    steps: int
    """Optimiser steps done in all (a resumed run's included)."""
    held_out: dict[str, float]
    """The final ``pair_means`` on the held-out pairs (empty without any)."""
    folder: Path
    """Where r_φ was written."""
    seconds: float
    """This process's wall time."""

    def summary(self) -> str:
        h = self.held_out
        held = (f"held-out pairwise accuracy {h['accuracy']:.3f}, margin {h['margin']:.3f}, loss {h['loss']:.3f}"
                if h else "no held-out pairs (preference.held_out=0)")
        return (f"reward model: {self.steps} steps in {self.seconds:.0f} s; {held}; written to {self.folder} "
                f"(use it with reward.model={self.folder})")


class PreferenceLearner:
    """The learner group's ranks as r_φ's (``RewardModelLearner``): typed fan-out calls."""

    def __init__(self, group: LearnerGroup, tokens: PairTokens, micro_pairs: int):
        self.group, self.tokens, self.micro = group, tokens, micro_pairs

    def train_step(self, rows: list[int]) -> dict[str, float]:
        """One optimiser step on ``rows`` (a multiple of the rank count), dealt evenly."""
        shards = [self.tokens.select([rows[i] for i in part]) for part in split_evenly(len(rows), self.group.num_ranks)]
        futures = self.group.ranks.call(RewardModelLearner.train_step, [(s.chosen, s.rejected) for s in shards])
        return pair_means(self.group.gather(futures, "train_step")[0])

    def evaluate(self, rows: list[int]) -> dict[str, float]:
        """``pair_means`` of r_φ on the pairs ``rows`` (``scores``)."""
        return pair_means(held_sums(self.scores(rows)))

    def scores(self, rows: list[int]) -> list[float]:
        """r_φ of both responses of each pair of ``rows`` (chosen ones first), dealt to the ranks."""
        texts = [self.tokens.chosen[i] for i in rows] + [self.tokens.rejected[i] for i in rows]
        parts = split_evenly(len(texts), self.group.num_ranks)
        passes = max(-(-len(part) // (2 * self.micro)) for part in parts)
        futures = self.group.ranks.call(RewardModelLearner.score_rows, [([texts[i] for i in part], passes)
                                                                        for part in parts])
        return [x for part in self.group.gather(futures, "score_rows") for x in part]

    def checkpoint(self, path: Path) -> dict[str, Any]:
        """``run/checkpoint.Checkpointable``: every rank's states; the driver's state is the step count."""
        self.group.gather(self.group.ranks.call_all(RewardModelLearner.save_checkpoint, str(path)), "save_checkpoint")
        return {"iteration": self.steps()}

    def restore(self, path: Path, state: dict[str, Any]) -> None:
        steps = set(self.group.gather(self.group.ranks.call_all(RewardModelLearner.load_checkpoint, str(path)),
                                      "load_checkpoint"))
        if steps != {state["iteration"]}:
            raise RuntimeError(f"{path}: the ranks restored steps {sorted(steps)}, the checkpoint says {state['iteration']}")

    def steps(self) -> int:
        return self.group.gather(self.group.ranks.call_all(RewardModelLearner.steps_done), "steps_done")[0]

    def save(self, folder: Path) -> None:
        self.group.gather(self.group.ranks.call_all(RewardModelLearner.save, str(folder)), "save")

    def describe(self) -> str:
        return self.group.gather(self.group.ranks.call_all(RewardModelLearner.describe), "describe")[0]


def held_sums(scores: list[float]) -> torch.Tensor:
    """``pair_sums`` of ``PreferenceLearner.scores``' layout: P chosen scores, then P rejected."""
    chosen, rejected = torch.tensor(scores).chunk(2)
    return pair_sums(chosen, rejected)


def steps_per_epoch(cfg: Config, train_pairs: int) -> int:
    """Whole steps of ``preference.batch_pairs`` in one pass over the training pairs."""
    steps = train_pairs // cfg.preference.batch_pairs
    if steps == 0:
        raise ConfigError(f"preference.batch_pairs: {cfg.preference.batch_pairs} is more than the {train_pairs} "
                          f"training pairs of {cfg.preference.pairs} (after preference.held_out={cfg.preference.held_out:g})")
    return steps


def prepared_pairs(cfg: Config) -> tuple[PreferencePairs, PairTokens]:
    """``preference.pairs`` read and checked, in r_φ's tokens; ``PromptDataError`` naming the row."""
    tokenizer = load_tokenizer(resolve_model_path(backbone_name(cfg), cfg.model.cache_dir))
    pairs = read_pairs(cfg.preference.pairs)
    return pairs, tokenize_pairs(pairs, tokenizer, cfg.preference.max_tokens)


def train_reward_model(cfg: Config, progress: bool = True, resume: Path | None = None) -> RewardModelResult:
    """Train r_φ as the config says (``resume``: continue from that checkpoint); write it to
    ``output.dir/reward_model``."""
    start_time, out, f = time.monotonic(), Path(cfg.output.dir), cfg.preference
    pairs, tokens = prepared_pairs(cfg)
    train_rows, held_rows = held_out_split(len(pairs), f.held_out, cfg.seed)
    per_epoch = steps_per_epoch(cfg, len(train_rows))
    total = f.epochs * per_epoch
    console.phase(f"{len(train_rows)} training pairs, {len(held_rows)} held out, from {pairs.source}; "
                  f"{f.epochs} epoch{'s' * (f.epochs > 1)} of {per_epoch} steps of {f.batch_pairs} pairs")
    with _learner_group(cfg) as group:
        learner = PreferenceLearner(group, tokens, f.micro_pairs)
        console.phase(f"reward model learner: {learner.describe()}")
        first = 0
        if resume is not None:
            first = read_driver_state(resume)["iteration"]
            learner.restore(resume, {"iteration": first})
            console.phase(f"resumed from {resume} after step {first}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        logger = MetricsLogger(out, make_trackers(cfg, to_dict(cfg), resume is not None),
                               resume_at=first if resume is not None else None)
        bar = Bar(total, first, progress, desc="reward model", unit="step", figures=_figures)
        try:
            for step in range(first, total):
                epoch, k = divmod(step, per_epoch)
                rows = epoch_order(train_rows, epoch, cfg.seed)[k * f.batch_pairs:(k + 1) * f.batch_pairs]
                began = time.perf_counter()
                metrics = {f"rm/{key}": value for key, value in learner.train_step(rows).items()}
                seconds = time.perf_counter() - began
                metrics |= {"rm/epoch": step / per_epoch, "rm/step_s": seconds, "rm/pairs_per_s": len(rows) / seconds}
                done = step + 1
                if held_rows and (done % per_epoch == 0 or (f.eval_every and done % f.eval_every == 0)):
                    metrics |= {f"rm/eval/{key}": value for key, value in learner.evaluate(held_rows).items()}
                logger.log(step, metrics)  # 0-based, as a PPO run's iterations: a resume at k drops records >= k
                bar.update(metrics)
                if cfg.output.checkpoint_every and done % cfg.output.checkpoint_every == 0 and done < total:
                    write_checkpoint(out, learner, cfg.output.keep_checkpoints)
        finally:
            bar.close()
            logger.close()
        scores = learner.scores(held_rows) if held_rows else []  # one pass for the figures and the statistics
        held_out = pair_means(held_sums(scores)) if scores else {}
        learner.save(out / OUTPUT)
        if scores:  # r_φ's own offset and unit, on responses it was not trained on
            RewardStats.of(scores).write(out / OUTPUT)
    return RewardModelResult(total, held_out, out / OUTPUT, time.monotonic() - start_time)


def _figures(metrics: dict[str, float]) -> dict[str, str]:
    """What the progress bar shows of a step."""
    shown = {"loss": f"{metrics['rm/loss']:.3f}", "acc": f"{metrics['rm/accuracy']:.2f}"}
    if "rm/eval/accuracy" in metrics:
        shown["held-out acc"] = f"{metrics['rm/eval/accuracy']:.3f}"
    return shown


@contextmanager
def _learner_group(cfg: Config) -> Iterator[LearnerGroup]:
    """The learner group of r_φ: one rank in this process (``trainer=reference``), or its ranks
    as Ray actors in a placement group of their own (``trainer=distributed``); released on exit."""
    if cfg.trainer == "reference":
        group = LearnerGroup(cfg, None, engine=RewardModelLearner)
        try:
            yield group
        finally:
            group.ranks.actors[0].close()  # the process group, left before another is joined
        return
    from rayppo.cluster.placement import release, reserve_learner
    from rayppo.cluster.roles import spawn_learner
    from rayppo.cluster.session import RaySession
    from rayppo.cluster.startup import wait_ready

    cpus = cfg.learner.num_ranks * cfg.learner.cpus_per_rank
    with RaySession(cfg.cluster.address, cfg.cluster.num_cpus, cpus, verbose=console.actor_log("driver", 0) is None):
        placement = reserve_learner(cfg)
        try:
            group = spawn_learner(cfg, placement, RewardModelLearner)
            try:
                wait_ready({"learner": group.ranks}, cfg.cluster.call_timeout_s)
                group.locate()
                yield group
            finally:
                group.kill()
        finally:
            release({"learner": placement})
