"""The correctness guard: a run that is silently wrong stops itself.

Two checks, both always on (``checks`` in the config):

- **Weight check after every sync.** Each generator's fingerprints of the weights it holds must
  match learner rank 0's fingerprints of what it sent (``rayppo/models/fingerprint.py``), within
  the rounding bound sent with them. Catches adapters never delivered, a tensor skipped or
  corrupted by the loader, a stale engine.
- **Mismatch limit.** Before the first optimiser step of an iteration, the largest gap between the
  generator's old log-probs and the learner's recomputation (same weights, so it is rounding
  only) must stay under ``checks.max_logprob_mismatch``. Catches what fingerprints cannot see:
  a sampling distribution that is not ``log_softmax(logits / T)``, a drift that grows.

Both raise a ``CorrectnessError`` that names the iteration and the generator (and the tensor);
the training loop writes a checkpoint of the state before the bad update and stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

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


@dataclass(frozen=True)
class MismatchGuard:
    """``checks.max_logprob_mismatch`` for one iteration's update."""

    limit: float
    """Largest allowed |log pi_old - log pi| on a token, in nats."""
    iteration: int
    """The iteration being trained (named in the error)."""

    def check(self, gap: torch.Tensor, generator_ids: torch.Tensor, collective: Reductions) -> None:
        """Raise ``LogprobMismatchError`` on every rank when a token's gap exceeds the limit.

        ``gap`` is ``[B, T]`` |old - new| (0 on padding), ``generator_ids`` ``[B]``: this rank's
        part of the first minibatch (at least one row: a rank with none runs a placeholder row).
        Collective: all ranks reach the same verdict, so none waits in a later all-reduce.
        """
        row_max = gap.detach().amax(dim=1).double().cpu()
        worst = collective.max(row_max.max())
        if float(worst) <= self.limit:
            return
        # Which generator sampled the worst row: only the rank holding it proposes its id.
        local = float(generator_ids.cpu()[row_max.argmax()]) if row_max.max() == worst else -1.0
        generator = int(collective.max(torch.tensor(local, dtype=torch.float64)))
        raise LogprobMismatchError(
            f"iteration {self.iteration}: logprob_mismatch/max = {float(worst):.3g} nats exceeds "
            f"checks.max_logprob_mismatch = {self.limit:g} on generator {generator}: it is not sampling from the "
            "learner's weights (see sync/verified), or its sampling distribution is not log_softmax(logits / T). "
            "Stopped before training on this rollout.")
