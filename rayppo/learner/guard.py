"""The correctness guard: a run that is silently wrong stops itself.

Two checks, both always on (``checks`` in the config):

- **Weight check after every sync.** Each generator's fingerprints of the weights it holds must
  match learner rank 0's fingerprints of what it sent (``rayppo/models/fingerprint.py``), within
  the rounding bound sent with them. Catches adapters never delivered, a tensor skipped or
  corrupted by the loader, a stale engine.
- **Log-prob check.** Before the first optimiser step of an iteration, the generator's old
  log-probs and the learner's recomputation (same weights, so the gap is numerics only) must agree:
  per token within ``checks.max_logprob_mismatch`` (fp32), and in the mean KL estimate per token
  within ``checks.max_logprob_kl`` (every dtype; ``MismatchGuard``). Catches what fingerprints
  cannot see: a sampling distribution that is not ``log_softmax(logits / T)``, a drift that grows.

Both raise a ``CorrectnessError`` that names the iteration and the generator (and the tensor);
the training loop writes a checkpoint of the state before the bad update and stops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from rayppo.config.derived import kl_limit, mismatch_limit
from rayppo.config.schema import Config
from rayppo.errors import RayppoError
from rayppo.models.fingerprint import SentPrint


class CorrectnessError(RayppoError, RuntimeError):
    """The run would go on silently wrong; the message says where and why."""


class WeightSyncError(CorrectnessError):
    """A generator does not hold the weights the learner sent."""


class LogprobMismatchError(CorrectnessError):
    """A generator's log-probs are not the learner's."""


def check_weights(sent: dict[str, SentPrint], held: dict[str, tuple[float, float]], generator: int,
                  version: int) -> int:
    """Raise ``WeightSyncError`` unless every held tensor matches what was sent; returns how many
    tensors were compared. A sent tensor the engine does not hold under any name (e.g. a tied
    ``lm_head``) is not compared; a generator that holds none of them is an error."""
    compared, bad = 0, []
    for name, expected in sent.items():
        if name not in held:
            continue
        compared += 1
        gaps = [abs(h - v) for h, v in zip(held[name], expected.value)]
        if any(gap > bound for gap, bound in zip(gaps, expected.bound)):
            bad.append(f"{name} (|held - sent| = {max(gaps):.3g}, rounding allows {max(expected.bound):.3g})")
    if bad:
        raise WeightSyncError(f"weight sync to policy version {version}: generator {generator} does not hold the "
                              f"weights the learner sent: {bad[0]}" + (f" and {len(bad) - 1} more tensors" if bad[1:] else ""))
    if compared == 0:
        raise WeightSyncError(f"weight sync to policy version {version}: generator {generator} holds none of the "
                              f"{len(sent)} sent tensors under their names; the weights cannot be verified")
    return compared


class Reductions(Protocol):
    """Maxima over the learner ranks (``experience.Collective``)."""

    def max(self, x: torch.Tensor) -> torch.Tensor: ...

    def sum(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class MismatchGuard:
    """The log-prob check of one iteration's update (``checks.max_logprob_mismatch``,
    ``checks.max_logprob_kl``), before its first optimiser step.

    Two statistics of ``d_t = log pi(y_t) - log mu(y_t)`` (learner minus generator, same weights):

    - the largest |d_t| on a token: exact in fp32, where a healthy sync measures ~1e-5;
    - the mean over tokens of ``k3 = exp(d) - 1 - d``, the unbiased estimate of KL(mu || pi) per
      token (Schulman's k3): stable under bf16 noise, whose |d_t| has a heavy tail (the max over a
      batch grows with the batch and reached 0.54 nats on SmolLM2-135M) while its k3 mean stays
      near 1.2e-3; a sampling distribution that is not ``log_softmax(logits / T)`` moves it (T = 0.9
      where the learner uses 1.0: 1.7e-2), and so does any drift as it grows.
      ``docs/real-model.md`` has the measured table behind the bounds.
    """

    limit: float
    """Largest allowed |log pi_old - log pi| on a token, in nats (inf: not checked)."""
    iteration: int
    """The iteration being trained (named in the error)."""
    kl_limit: float = math.inf
    """Largest allowed mean k3 per token, in nats (inf: not checked)."""
    weights_verified: bool = True
    """The weight check ran after the sync (``checks.verify_sync``): the message then blames the
    sampling, not the weights."""

    @classmethod
    def of(cls, cfg: Config, iteration: int) -> "MismatchGuard":
        """The check of ``iteration`` as the config sets it (bounds by ``model.dtype``)."""
        dtype = cfg.model.dtype
        return cls(mismatch_limit(cfg.checks, dtype), iteration, kl_limit(cfg.checks, dtype), cfg.checks.verify_sync)

    def check(self, drift: torch.Tensor, generator_ids: torch.Tensor, collective: Reductions,
              mask: torch.Tensor | None = None) -> None:
        """Raise ``LogprobMismatchError`` on every rank when either statistic exceeds its bound.

        ``drift`` is ``[B, T]`` log pi - log mu per token (0 on padding; only its magnitude
        matters for the max), ``mask`` ``[B, T]`` its valid tokens (None: every entry),
        ``generator_ids`` ``[B]``: this rank's part of the first minibatch (at least one row: a
        rank with none runs a placeholder row). Collective: all ranks reach the same verdict, so
        none waits in a later all-reduce.
        """
        drift = drift.detach().double()
        mask = torch.ones_like(drift) if mask is None else mask.detach().to(drift)
        row_max = (drift.abs() * mask).amax(dim=1).cpu()
        k3 = (torch.expm1(drift) - drift) * mask
        worst, (k3_sum, tokens) = collective.max(row_max.max()), collective.sum(torch.stack([k3.sum(), mask.sum()]))
        kl = float(k3_sum / tokens.clamp(min=1))
        if float(worst) <= self.limit and kl <= self.kl_limit:
            return
        # Which generator sampled the worst row: only the rank holding it proposes its id.
        local = float(generator_ids.cpu()[row_max.argmax()]) if row_max.max() == worst else -1.0
        generator = int(collective.max(torch.tensor(local, dtype=torch.float64)))
        what = (f"logprob_mismatch/max = {float(worst):.3g} nats exceeds checks.max_logprob_mismatch = {self.limit:g}"
                if float(worst) > self.limit else
                f"logprob_mismatch/kl = {kl:.3g} nats per token exceeds checks.max_logprob_kl = {self.kl_limit:g}")
        cause = ("its weights matched the learner's (sync/verified), so its sampling distribution is not the "
                 "learner's log_softmax(logits / T): a temperature, top-p/top-k or logits processor the learner does "
                 "not apply, or kernels far off the learner's" if self.weights_verified else
                 "it is not sampling from the learner's weights (checks.verify_sync is off: they were not checked), "
                 "or its sampling distribution is not log_softmax(logits / T)")
        raise LogprobMismatchError(f"iteration {self.iteration}: {what} on generator {generator}: {cause}. "
                                   "Stopped before training on this rollout.")
