"""The learning rate over a run (``ppo.lr_schedule``, ``ppo.lr_warmup``, ``ppo.lr_end``): a factor
of the configured rate per iteration, a pure function of the iteration's index.

Being a function of the index, not an object stepped along, it needs no state in a checkpoint: a
resumed run, a replaced learner rank and the in-process trainer all compute the same rate.

With w warm-up iterations and N = ``stop.iterations``, iteration i (from 0) trains at

    i < w:   (i + 1) / (w + 1)                              linear warm-up (Goyal et al. 2017,
                                                            arXiv 1706.02677, section 2.2)
    i >= w:  p = (i - w) / (N - w)   in [0, 1)
             constant  1
             linear    1 - (1 - e) p
             cosine    e + (1 - e) (1 + cos(pi p)) / 2      SGDR without restarts (Loshchilov &
                                                            Hutter, ICLR 2017, eq. 5)

times ``ppo.lr`` (and ``ppo.critic_lr``), e = ``lr_end``. The last iteration, i = N - 1, still
trains (linear: at e + (1 - e) / (N - w)); iterations past N (a run resumed with a larger
``stop.iterations`` computes the schedule on its new N) hold e. After the warm-up, with e = 0, the
same factors as transformers' ``get_linear_schedule_with_warmup`` and
``get_cosine_schedule_with_warmup`` (transformers 5.25, ``optimization.py``), counted in iterations
instead of optimiser steps (every optimiser step of an iteration takes its rate); their warm-up
starts at 0 (i / w), this one at 1 / (w + 1), so no iteration trains at a rate of 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def lr_factor(iteration: int, iterations: int, schedule: str, warmup: int = 0, end: float = 0.0) -> float:
    """The factor of the configured learning rate at ``iteration`` (0-based) of a run of
    ``iterations``; formulas in the module's docstring."""
    if iteration < warmup:
        return (iteration + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    p = min(1.0, (iteration - warmup) / max(1, iterations - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - end) * p
    if schedule == "cosine":
        return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def set_lr(optimizer: Any, lr: float) -> float:
    """Every parameter group of ``optimizer`` at ``lr``; returns its first group's rate read back
    (what its next step uses). A torch optimiser, or one of DeepSpeed's wrappers, whose
    ``param_groups`` are the client optimiser's (deepspeed 0.19.8: ``runtime/zero/stage_1_and_2.py``
    and ``stage3.py``, ``param_groups = property(...)``; ``runtime/fp16/fused_optimizer.py`` and
    ``runtime/bf16_optimizer.py`` the same)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return float(optimizer.param_groups[0]["lr"])


def lr_scaler(policy: Any, lr: float, critic: Any | None = None, critic_lr: float = 0.0) -> Callable[[float], float]:
    """``OptimiserSteps.scale_lr`` of these optimisers: given a factor, each trains at that factor of
    its configured rate (``lr``, ``critic_lr``; no critic: a critic-free estimator); returns the
    policy's rate read back (``set_lr``)."""
    def scale(factor: float) -> float:
        if critic is not None:
            set_lr(critic, critic_lr * factor)
        return set_lr(policy, lr * factor)

    return scale
