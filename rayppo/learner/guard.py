"""The correctness guard: a run that is silently wrong stops itself.

Two checks, both always on (``checks`` in the config):

- **Weight check after every sync.** Each generator's fingerprints of the weights it holds must
  equal learner rank 0's fingerprints of what it sent (``rayppo/models/fingerprint.py``) to the
  bit, for every tensor sent. Catches adapters never delivered, a tensor skipped, renamed or
  corrupted by the loader, a stale engine (one bf16 step of lr 1e-6 behind), rows permuted by a
  name mapping; and a NaN the learner itself sent, blamed on the learner.
- **Log-prob check.** Before the first optimiser step of an iteration, the generator's old
  log-probs and the learner's recomputation (same weights, so the gap is numerics only) must agree:
  per token within ``checks.max_logprob_mismatch`` (fp32), and in each generator's mean KL
  estimate per token within ``checks.max_logprob_kl`` (every dtype; ``MismatchGuard``,
  ``generator_kl``). Catches what fingerprints
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


class NonFiniteWeightsError(CorrectnessError):
    """The learner's own weights (what it sent) hold a NaN or inf."""


class LogprobMismatchError(CorrectnessError):
    """A generator's log-probs are not the learner's."""


HeldPrints = dict[str, tuple[float, float]] | list[dict[str, tuple[float, float]]]
"""What a generator reports it holds (``GeneratorEngine.weight_fingerprints``): fingerprints by
tensor name, or one such dict per inference worker of a tensor-parallel generator."""


def check_weights(sent: dict[str, SentPrint], held: HeldPrints, generator: int, version: int) -> int:
    """Raise unless every sent tensor is held, fingerprint equal to the bit (``models/fingerprint.py``:
    both sides sum the same float64 products in the same order); returns how many were compared,
    ``len(sent)`` per worker. ``NonFiniteWeightsError`` first when the learner's own fingerprints are
    not finite: a NaN or inf it sent is its fault, whatever the generators hold. Then
    ``WeightSyncError``: a held fingerprint that differs, or a sent tensor with none (a name the
    engine's loader renamed or dropped is not verified, so it is an error too) or a held one not
    sent. Per-worker prints are checked worker by worker, the error naming the worker."""
    check_sent(sent, version)
    if isinstance(held, list):
        return sum(_check_held(sent, prints, f"generator {generator} (worker {w})", version)
                   for w, prints in enumerate(held))
    return _check_held(sent, held, f"generator {generator}", version)


def _sync(version: int) -> str:
    return f"weight sync to policy version {version} (the update of iteration {version - 1})"


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if names[3:] else "")


def check_sent(sent: dict[str, SentPrint], version: int) -> None:
    """Raise ``NonFiniteWeightsError`` naming the tensors whose sent fingerprint is not finite.
    Finite weights give a finite one (|sum| <= 2.25 N K max|W| < 1e51), so it means a NaN or inf
    element in what the learner sent: the learner's fault, whatever any generator holds."""
    bad = [name for name, expected in sent.items() if not all(math.isfinite(v) for v in expected.value)]
    if bad:
        raise NonFiniteWeightsError(f"{_sync(version)}: the learner's own weights are non-finite (NaN or inf) in "
                                    f"{_some(bad)}: the learner's update diverged; the generators are not at fault")


def _check_held(sent: dict[str, SentPrint], held: dict[str, tuple[float, float]], who: str, version: int) -> int:
    common = [name for name in sent if name in held]
    if not common:
        raise WeightSyncError(f"{_sync(version)}: {who} holds none of the {len(sent)} sent tensors under their "
                              "names; the weights cannot be verified")
    # != so that NaN fails: vLLM's layerwise reload leaves a tensor it was not handed as fresh,
    # uninitialised memory, whose fingerprint can be NaN (seen on Qwen2-MoE experts).
    bad = [(name, max(abs(h - v) for h, v in zip(held[name], sent[name].value)))
           for name in common if any(h != v for h, v in zip(held[name], sent[name].value))]
    if bad:
        name, gap = bad[0]
        raise WeightSyncError(f"{_sync(version)}: {who} does not hold the weights the learner sent: {name} "
                              f"(|held - sent| = {gap:.3g}, exactly 0 for a faithful copy)"
                              + (f" and {len(bad) - 1} more tensors" if bad[1:] else ""))
    missing, extra = [name for name in sent if name not in held], [name for name in held if name not in sent]
    if missing or extra:
        raise WeightSyncError(
            f"{_sync(version)}: {who} reports fingerprints of {len(common)} of the {len(sent)} sent tensors"
            + (f", not of {_some(missing)}" if missing else "")
            + (f"; and of tensors not sent: {_some(extra)}" if extra else "")
            + " (a tensor the engine's loader renamed or dropped cannot be verified)")
    return len(common)


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

    def check(self, drift: torch.Tensor, generator_ids: torch.Tensor, collective: Reductions,
              mask: torch.Tensor | None = None) -> None:
        """Raise ``LogprobMismatchError`` on every rank when either statistic exceeds its bound.

        ``drift`` is ``[B, T]`` log pi - log mu per token (0 on padding; only its magnitude
        matters for the max), ``mask`` ``[B, T]`` its valid tokens (None: every entry),
        ``generator_ids`` ``[B]``: this rank's part of the first minibatch (at least one row: a
        rank with none runs a placeholder row). Collective: all ranks reach the same verdict, so
        none waits in a later all-reduce.

        The k3 mean is taken per generator over its own rows (``generator_kl``): pooled, one
        generator sampling at the wrong temperature beside a healthy one averaged under the limit.
        """
        drift = drift.detach().double()
        mask = torch.ones_like(drift) if mask is None else mask.detach().to(drift)
        row_max = (drift.abs() * mask).amax(dim=1).cpu()
        worst = collective.max(row_max.max())
        kl = generator_kl(drift, mask, generator_ids, collective, self.kl_limit)
        if float(worst) <= self.limit and float(kl.max()) <= self.kl_limit:
            return
        if float(worst) > self.limit:  # which generator sampled the worst row: only the rank holding it proposes
            local = float(generator_ids.cpu()[row_max.argmax()]) if row_max.max() == worst else -1.0
            generator = int(collective.max(torch.tensor(local, dtype=torch.float64)))
            what = (f"logprob_mismatch/max = {float(worst):.3g} nats exceeds checks.max_logprob_mismatch = "
                    f"{self.limit:g}")
        else:
            generator = int(kl.argmax())
            what = (f"logprob_mismatch/kl = {float(kl[generator]):.3g} nats per token on its own rows exceeds "
                    f"checks.max_logprob_kl = {self.kl_limit:g}")
        cause = ("its weights matched the learner's (sync/verified), so its sampling distribution is not the "
                 "learner's log_softmax(logits / T): a temperature, top-p/top-k or logits processor the learner does "
                 "not apply, or kernels far off the learner's" if self.weights_verified else
                 "it is not sampling from the learner's weights (checks.verify_sync is off: they were not checked), "
                 "or its sampling distribution is not log_softmax(logits / T)")
        raise LogprobMismatchError(f"iteration {self.iteration}: {what} on generator {generator}: {cause}. "
                                   "Stopped before training on this rollout.")


@dataclass(frozen=True)
class GuardBounds:
    """The log-prob check's bounds as the config sets them (``of``: by ``model.dtype``), read once;
    ``at`` makes the check of one iteration. The default checks nothing."""

    max_mismatch: float = math.inf
    """``MismatchGuard.limit``: the largest |log pi - log mu| on a token (``checks.max_logprob_mismatch``)."""
    max_kl: float = math.inf
    """``MismatchGuard.kl_limit``: the largest mean k3 per token (``checks.max_logprob_kl``)."""
    weights_verified: bool = True
    """``MismatchGuard.weights_verified`` (``checks.verify_sync``)."""

    @staticmethod
    def of(cfg: Config) -> GuardBounds:
        dtype = cfg.model.dtype
        return GuardBounds(mismatch_limit(cfg.checks, dtype), kl_limit(cfg.checks, dtype), cfg.checks.verify_sync)

    def at(self, iteration: int) -> MismatchGuard:
        """The check of ``iteration``'s update."""
        return MismatchGuard(self.max_mismatch, iteration, self.max_kl, self.weights_verified)


TOKEN_SHARE = 0.5
"""The most one token may add to a generator's k3 mean, as a share of ``checks.max_logprob_kl``."""


def generator_kl(drift: torch.Tensor, mask: torch.Tensor, generator_ids: torch.Tensor, collective: Reductions,
                 limit: float) -> torch.Tensor:
    """``[G]`` float64: each generator's mean k3 = exp(d) - 1 - d over its own valid tokens (0 for
    a generator with no rows here), each token's term capped at ``TOKEN_SHARE * limit * T_g``
    (``T_g``: that generator's token count over all ranks).

    Why the cap: k3 has no upper bound for d > 0, so one token with pi/mu ~ 90 (d ~ 4.5, k3 ~ 86)
    in 10k healthy bf16 tokens (mean 1.1e-3) would lift the mean past 1e-2 alone. Capped, one token
    adds at most half the limit; what the check is for moves every token (a temperature gap: mean
    1.85e-2, largest single k3 ~1.6 on SmolLM2-135M, far under the cap of ~15 nats at 3k tokens), and
    is untouched (docs/real-model.md has the measurement). ``drift``, ``mask``: ``[B, T]``;
    ``generator_ids``: ``[B]``. Collective: two sums over the ranks, the same answer everywhere.
    """
    ids = generator_ids.detach().to(drift.device).long().clamp(min=0)
    count = int(collective.max(ids.max().double().reshape(())).item()) + 1 if ids.numel() else 1
    per_row = torch.zeros(count, dtype=torch.float64, device=drift.device)
    tokens = collective.sum(per_row.index_add(0, ids, mask.sum(dim=1)))
    cap = (TOKEN_SHARE * limit * tokens)[ids].unsqueeze(1) if math.isfinite(limit) else torch.tensor(math.inf)
    k3 = torch.minimum(torch.expm1(drift) - drift, cap.to(drift)) * mask
    sums = collective.sum(per_row.index_add(0, ids, k3.sum(dim=1)))
    return (sums / tokens.clamp(min=1)).cpu()
