"""The reward model's math: the Bradley–Terry preference loss and what is reported beside it.

Pure functions over tensors (only ``torch``), as ``ppo.py``: the reward-model learner and the
tests call them. docs/reward-models.md states each equation.

Bradley–Terry (Bradley and Terry 1952; as a reward-model loss: Christiano et al. 2017,
arXiv:1706.03741, eq. 1; Ouyang et al. 2022, arXiv:2203.02155, eq. 1): the probability that a
rater prefers the chosen response y_w over the rejected y_l for prompt x is
σ(r_φ(x, y_w) − r_φ(x, y_l)), and r_φ is fitted by maximum likelihood on the pairs.

Shapes: ``chosen[P]`` and ``rejected[P]`` are r_φ of the P pairs' two responses (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``[]`` mean over the pairs of −log σ(r_w − r_l).

    ``logsigmoid`` rather than ``log(sigmoid(.))``: for a badly ranked pair with a large margin
    (r_w − r_l = −40) σ underflows to 0 in float32 and the log to −inf; logsigmoid stays finite
    (≈ −40) and so does its gradient."""
    return -F.logsigmoid(chosen - rejected).mean()


def pair_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``[4]`` sums over the pairs of (loss, correct, margin, 1), to add up across micro-batches
    and ranks before dividing (``pair_means``): a pair is correct when r_w > r_l (a tie is not),
    its margin is r_w − r_l."""
    margin = (chosen - rejected).float()
    return torch.stack([-F.logsigmoid(margin).sum(), (margin > 0).float().sum(), margin.sum(),
                        margin.new_tensor(float(margin.numel()))])


def pair_means(sums: torch.Tensor) -> dict[str, float]:
    """``{"loss", "accuracy", "margin"}``: the means of what ``pair_sums`` added up."""
    loss, correct, margin, count = sums.tolist()
    count = max(count, 1.0)
    return {"loss": loss / count, "accuracy": correct / count, "margin": margin / count}
