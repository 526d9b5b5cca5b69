"""Held-out evaluation: the current policy on prompts it never trains on.

Every ``eval.every`` iterations (and after the last) each eval prompt gets ``eval.samples``
responses sampled at the rollout temperature (as in training, so the held-out reward compares
with the training reward) and, with ``eval.greedy``, one greedy response; the reward role scores
them as it scores rollouts. Nothing here is trained on. The figures:

    eval/reward/mean           mean reward of the sampled responses
    eval/pass_rate             share of them with reward >= eval.pass_threshold
    eval/pass@k                share of prompts with at least one of their k samples passing
    eval/greedy/reward/mean    the same for the greedy responses (eval/greedy/pass_rate);
                               with eval.samples = 0 they are also the headline eval/reward/mean
    eval/teacher/*             on-policy distillation: the teacher's own figures on the same
                               prompts and seeds (measured once: it is frozen)
    distill/reached            the student's figure over the teacher's (``REACHED_FIGURES``)

Pass rates are reported for verifier rewards only (a reward model's scale has no threshold).
An evaluation's result (``HeldOutResult``) carries its figures and, typed, the two means the gold
stop rule compares (``run/gold.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayppo.data.prompts import EMBEDDED_PROMPTS

if TYPE_CHECKING:
    from rayppo.config.schema import Config

GREEDY = 0.0
"""Temperature of the greedy responses (the generators decode greedily at 0)."""


@dataclass(frozen=True)
class EvalPlan:
    """What one evaluation asks of the generators (from the ``eval`` config section)."""

    greedy: bool
    samples: int
    temperature: float
    pass_threshold: float
    verifier: bool
    """Whether the reward is a verifier function (pass rates are reported)."""

    def passes(self) -> list[tuple[float, int]]:
        """``(temperature, responses per prompt)`` of each generation pass."""
        out = [(GREEDY, 1)] if self.greedy else []
        return out + ([(self.temperature, self.samples)] if self.samples else [])


@dataclass(frozen=True)
class HeldOutResult:
    """One evaluation: the figures of its metrics line, and the means the gold stop rule reads."""

    figures: dict[str, float]
    """``eval/*`` (module docstring), ``eval/gold/mean`` with a gold scorer, and ``time/eval``."""
    reward_mean: float | None
    """The headline mean reward (``eval/reward/mean``: the sampled responses', else the greedy
    ones'); None when no pass ran."""
    gold_mean: float | None
    """The gold scorer's mean on the same responses (``eval/gold/mean``); None without one."""


def headline_mean(greedy: list[float] | None, sampled: list[list[float]] | None) -> float | None:
    """``eval/reward/mean``: the mean reward of the sampled responses, else of the greedy ones."""
    if sampled:
        flat = [r for row in sampled for r in row]
        return sum(flat) / len(flat)
    return sum(greedy) / len(greedy) if greedy else None


def eval_metrics(plan: EvalPlan, greedy: list[float] | None, sampled: list[list[float]] | None) -> dict[str, float]:
    """The figures of one evaluation. ``greedy``: ``[P]`` rewards of the greedy responses;
    ``sampled``: ``[P][k]`` rewards of the sampled ones (None when that pass was not run)."""
    out: dict[str, float] = {}
    if greedy:
        out["eval/greedy/reward/mean"] = sum(greedy) / len(greedy)
        if plan.verifier:
            out["eval/greedy/pass_rate"] = sum(r >= plan.pass_threshold for r in greedy) / len(greedy)
    headline = headline_mean(greedy, sampled)
    if headline is not None:
        out["eval/reward/mean"] = headline
    if sampled and plan.verifier:
        flat = [r for row in sampled for r in row]
        out["eval/pass_rate"] = sum(r >= plan.pass_threshold for r in flat) / len(flat)
        out[f"eval/pass@{plan.samples}"] = sum(any(r >= plan.pass_threshold for r in row)
                                               for row in sampled) / len(sampled)
    elif not sampled and greedy and plan.verifier:  # greedy only: its figures are the headline ones
        out["eval/pass_rate"] = out["eval/greedy/pass_rate"]
    return out


def due(every: int, iteration: int, last: int) -> bool:
    """Whether to evaluate after ``iteration`` (0-based) of a run of ``last`` iterations."""
    return every > 0 and ((iteration + 1) % every == 0 or iteration + 1 == last)


def eval_source(cfg: Config) -> tuple[str, str] | None:
    """``(prompts, split)`` of the held-out set, or None when nothing is evaluated: the
    configured ``eval.prompts``, else the embedded task's held-out split when training on it."""
    if cfg.eval.every == 0:
        return None
    if cfg.eval.prompts:
        return cfg.eval.prompts, cfg.eval.split
    return (cfg.data.prompts, "test") if cfg.data.prompts in EMBEDDED_PROMPTS else None


def eval_plan(cfg: Config) -> EvalPlan:
    e = cfg.eval
    return EvalPlan(e.greedy, e.samples, cfg.rollout.temperature, e.pass_threshold, cfg.reward.function is not None)


ScorePass = Callable[[float, int], tuple[list[float], list[float]]]
"""``score_pass(temperature, k)``: k responses per prompt generated and scored; their ``[P * k]``
rewards, prompt-major, and their gold scores (``[]`` without a gold scorer)."""


def held_out_result(plan: EvalPlan, num_prompts: int, score_pass: ScorePass) -> HeldOutResult:
    """Every pass of ``plan`` (``score_pass``). Its figures, with ``eval/gold/mean`` (the gold mean of
    the pass that gives ``eval/reward/mean``, the sampled one when there is one) and ``time/eval``."""
    start = time.perf_counter()
    greedy: list[float] | None = None
    sampled: list[list[float]] | None = None
    gold: list[float] = []
    for temperature, k in plan.passes():
        scores, pass_gold = score_pass(temperature, k)
        gold = pass_gold or gold  # the last pass's: sampled after greedy, as eval/reward/mean
        if len(scores) != num_prompts * k:
            raise RuntimeError(f"evaluation got {len(scores)} rewards for {num_prompts} prompts x {k}")
        if temperature == GREEDY:
            greedy = scores
        else:
            sampled = [scores[i * k:(i + 1) * k] for i in range(num_prompts)]
    figures = eval_metrics(plan, greedy, sampled)
    gold_mean = sum(gold) / len(gold) if gold else None
    if gold_mean is not None:
        figures["eval/gold/mean"] = gold_mean
    return HeldOutResult(figures | {"time/eval": time.perf_counter() - start}, headline_mean(greedy, sampled),
                         gold_mean)


REACHED_FIGURES = ("eval/greedy/pass_rate", "eval/pass_rate", "eval/reward/mean")
"""``distill/reached`` compares the first of these both evaluations have: the greedy pass rate,
else the sampled one, else the headline mean reward."""


def teacher_figures(student: HeldOutResult, teacher: HeldOutResult) -> dict[str, float]:
    """The teacher's held-out figures as ``eval/teacher/*`` and the share of its score the student
    has reached (``distill/reached``; absent while the teacher scores 0)."""
    out = {f"eval/teacher/{name.removeprefix('eval/')}": value for name, value in teacher.figures.items()
           if name.startswith("eval/")}
    shared = next((name for name in REACHED_FIGURES if name in student.figures and name in teacher.figures), None)
    if shared is not None and teacher.figures[shared] > 0:
        out["distill/reached"] = student.figures[shared] / teacher.figures[shared]
    return out
