"""The correctness guard's two checks at the edges where they used to fail.

The weight check (``models/fingerprint.py``) is exact: a tensor one optimiser step behind, held as
zeros, as another random init, or with its rows or columns permuted is caught in every dtype, and
a weight read back through a repacking kernel still verifies. The log-prob check
(``learner/guard.py``) judges each generator on its own rows and cannot be tripped by one token.
Pure tensor math in this process: a few seconds.
"""

from __future__ import annotations

import math

import pytest
import torch

from rayppo.learner.collective import LocalCollective
from rayppo.learner.guard import LogprobMismatchError, MismatchGuard, WeightSyncError, check_weights, generator_kl
from rayppo.models.fingerprint import held_prints, kernel_rows, probe_weights, sent_prints, split_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _init(shape: tuple[int, int], seed: int, std: float = 0.02) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def _passes(sent: torch.Tensor, held: torch.Tensor) -> bool:
    try:
        check_weights(sent_prints({"w": sent}), held_prints({"w": held}), generator=0, version=1)
        return True
    except WeightSyncError:
        return False


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_exact_copy_verifies_also_read_back_through_a_kernel(dtype):
    """A faithful copy verifies, held as a tensor or behind a kernel that only computes x @ W^T
    (vLLM's repacked CPU linear layers): the identity read-back returns every element as held."""
    w = _init((300, 700), 0).to(dtype)  # K = 700: three identity chunks, the last one short
    assert _passes(w, w.clone())
    rows = kernel_rows(lambda x: torch.nn.functional.linear(x, w), 700, dtype)
    assert check_weights(sent_prints({"w": w}), split_rows(rows, ["w"], {"w": [300, 700]}), 0, 1) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_optimiser_step_behind_is_caught_at_lr_1e_6(dtype):
    """The generator kept the weights before an AdamW step of lr 1e-6 (each master weight moved by
    ~lr): in 16-bit most elements round back to the same value, yet the ones that flip (about
    lr / ulp of them) are caught; the old kernel-rounding bound let even lr 1e-4 in fp32 through."""
    master = _init((576, 576), 1)
    stepped = master - 1e-6 * torch.sign(_init((576, 576), 2))
    before, after = master.to(dtype), stepped.to(dtype)
    assert (before != after).any()  # the update reached the sent tensor
    assert not _passes(after, before)
    assert _passes(after, after.clone())


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_another_init_and_permutations_are_caught(dtype):
    w = _init((576, 576), 3).to(dtype)
    assert not _passes(w, torch.zeros_like(w))
    assert not _passes(w, w[torch.randperm(576, generator=torch.Generator().manual_seed(0))])  # rows
    assert not _passes(w, w[:, torch.randperm(576, generator=torch.Generator().manual_seed(0))])  # columns
    assert not _passes(w, w.flip(0))
    assert all(not _passes(w, _init((576, 576), 100 + seed).to(dtype)) for seed in range(40))


def test_a_bf16_tensor_held_as_zeros_is_caught_at_2048():
    w = _init((2048, 2048), 4).to(torch.bfloat16)
    assert not _passes(w, torch.zeros_like(w))


def test_fused_blocks_weigh_their_rows_from_their_own_first_row():
    """q and k stacked in one engine matrix, the vocabulary padded: each block checks against its
    own sent tensor, and swapping the two blocks' order is caught."""
    q, k = _init((8, 16), 5), _init((8, 16), 6)
    shapes = {"q": [8, 16], "k": [8, 16]}
    sent = sent_prints({"q": q, "k": k})
    from rayppo.models.fingerprint import probe_rows
    fused = probe_rows(torch.cat([q, k, torch.zeros(4, 16)]))
    assert check_weights(sent, split_rows(fused, ["q", "k"], shapes), 0, 1) == 2
    with pytest.raises(WeightSyncError, match="generator 0 does not hold"):
        check_weights(sent, split_rows(probe_rows(torch.cat([k, q])), ["q", "k"], shapes), 0, 1)


def test_probe_weights_of_a_block_are_those_of_the_whole():
    whole = probe_weights(5000, salt=7)
    assert torch.equal(probe_weights(100, salt=7, start=4000), whole[4000:4100])
    assert torch.equal(probe_weights(10, salt=7), whole[:10])
    assert bool((whole.abs() >= 0.5).all() and (whole.abs() < 1.5).all())
    assert 0.45 < float((whole > 0).double().mean()) < 0.55  # both signs


# ------------------------------------------------------------------------------------------
# The log-prob check
# ------------------------------------------------------------------------------------------
def _k3_drift(k3: float, shape: tuple[int, int]) -> torch.Tensor:
    """Drift d of alternating sign whose k3 = exp(d) - 1 - d averages ~``k3``."""
    d = math.sqrt(2 * k3)  # k3 ~ d^2 / 2 for small d
    return d * (torch.arange(shape[0] * shape[1]).reshape(shape) % 2 * 2 - 1).double()


def test_one_odd_generator_among_healthy_ones_is_named_on_its_own_rows():
    """Generator 0 samples at T = 0.9 (k3 ~ 1.7e-2), generator 1 is healthy bf16 (~1.1e-3): pooled,
    their mean (~9e-3) sat under the 1e-2 limit; on its own rows generator 0 is over it."""
    drift = torch.cat([_k3_drift(1.7e-2, (8, 50)), _k3_drift(1.1e-3, (8, 50))])
    ids = torch.tensor([0] * 8 + [1] * 8)
    pooled = float((torch.expm1(drift) - drift).mean())
    assert pooled < 1e-2  # what the pooled check saw
    kl = generator_kl(drift, torch.ones_like(drift), ids, LocalCollective(), 1e-2)
    assert kl[0] > 1e-2 > kl[1]
    with pytest.raises(LogprobMismatchError, match=r"iteration 3: logprob_mismatch/kl = 0.01\d+ nats per token on its "
                                                   r"own rows exceeds checks.max_logprob_kl = 0.01 on generator 0"):
        MismatchGuard(math.inf, 3, kl_limit=1e-2).check(drift, ids, LocalCollective())


def test_one_outlier_token_cannot_stop_a_healthy_run_but_a_temperature_gap_does():
    """10k healthy bf16 tokens (k3 mean 1.1e-3) and one token at pi/mu ~ 100 (d = 4.6, k3 ~ 94): the
    plain mean rises to ~1.05e-2, over the limit; capped at half the limit per token it stays
    near 6e-3. A gap every token shares is not capped at all."""
    guard = MismatchGuard(math.inf, 0, kl_limit=1e-2)
    drift = _k3_drift(1.1e-3, (100, 100))
    drift[37, 12] = 4.6
    ids = torch.zeros(100, dtype=torch.long)
    assert float((torch.expm1(drift) - drift).mean()) > 1e-2  # the plain mean would have stopped it
    guard.check(drift, ids, LocalCollective())
    kl = float(generator_kl(drift, torch.ones_like(drift), ids, LocalCollective(), 1e-2)[0])
    assert kl == pytest.approx(1.1e-3 + 0.5 * 1e-2, rel=0.02)
    shifted = _k3_drift(1.2e-2, (100, 100))
    with pytest.raises(LogprobMismatchError, match="on generator 0"):
        guard.check(shifted, ids, LocalCollective())


def test_a_tensor_held_as_nan_fails():
    """vLLM's layerwise reload leaves a tensor it was not handed as uninitialised memory; when that
    reads as NaN the fingerprint is NaN, and NaN > bound is False: the check must still fail."""
    w = _init((64, 64), 7)
    assert not _passes(w, torch.full_like(w, math.nan))
