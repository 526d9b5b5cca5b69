"""Per-token tensor helpers every layer uses: masked reductions, log-probs and entropy from logits.

Pure functions over tensors (``torch`` only), at the bottom of the package: the models' forward
passes (``models/sequences.py``, ``models/sft.py``) and the PPO math (``learner/ppo.py``) both
call them, so neither imports the other for them.
"""

from __future__ import annotations

import torch


# --------------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1 (0 when there are none). Any shape."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_sum_per_row(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B]``: the sum of each row over its valid tokens (e.g. KL nats per response)."""
    return (x * mask.to(x.dtype)).sum(dim=-1)


# --------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# --------------------------------------------------------------------------------------------
def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[tokens]``: ``[B, T, V], [B, T] -> [B, T]``.

    The caller divides ``logits`` by the sampling temperature first, so that the result is the
    log-prob under the distribution the sampler actually drew from.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical policy at each position: ``[..., V] -> [...]``.

    H = logsumexp(z) - sum_v softmax(z)_v z_v, which avoids log(0) for vanishing probabilities.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
