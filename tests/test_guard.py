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
from rayppo.learner.guard import (
    LogprobMismatchError,
    MismatchGuard,
    NonFiniteWeightsError,
    WeightSyncError,
    check_weights,
    generator_kl,
)
from rayppo.models.fingerprint import (
    held_prints,
    kernel_rows,
    probe_weights,
    probes,
    row_weights,
    sent_prints,
    split_rows,
)

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


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_faithful_copy_is_bitwise_equal_in_every_layout_the_engine_holds(dtype, monkeypatch):
    """Learner and generator sum the same float64 products in the same order (``pairwise_sum``):
    the held fingerprint is the sent one to the bit, whether the tensor is held as sent, as a
    transposed view (a Conv1D weight read in its sent layout), stacked under another (fused q/k/v)
    with padded rows, read back through a kernel 256 columns at a time (K = 700: the last block
    short), or probed in blocks of rows."""
    import rayppo.models.fingerprint as fingerprint

    w, other = _init((300, 700), 8).to(dtype), _init((40, 700), 9).to(dtype)
    sent = sent_prints({"w": w})["w"].value
    shapes = {"other": [40, 700], "w": [300, 700]}
    stacked = torch.cat([other, w, torch.zeros(24, 700, dtype=dtype)])
    kernel = kernel_rows(lambda x: torch.nn.functional.linear(x, w), 700, dtype)
    assert held_prints({"w": w.t().contiguous().t()})["w"] == sent
    assert split_rows(fingerprint.probe_rows(stacked), ["other", "w"], shapes)["w"] == sent
    assert split_rows(kernel, ["w"], {"w": [300, 700]})["w"] == sent
    monkeypatch.setattr(fingerprint, "PROBE_CHUNK_ELEMENTS", 700 * 7)  # blocks of 7 rows
    assert held_prints({"w": w})["w"] == sent


def one_ulp(w: torch.Tensor) -> torch.Tensor:
    """``w`` with its smallest-magnitude nonzero element moved one ulp away from zero (also used by
    ``test_model_families.py``)."""
    flat = w.clone().reshape(-1)
    i = int(flat.abs().float().masked_fill(flat == 0, math.inf).argmin())
    flat[i] = torch.nextafter(flat[i], torch.tensor(math.copysign(math.inf, float(flat[i])), dtype=w.dtype))
    return flat.reshape(w.shape)


def test_one_ulp_of_the_smallest_element_is_caught_where_the_summation_bound_let_it_pass():
    """The issue's case at 2048 x 2048 in bf16: the smallest element (1.9e-9 at std 0.02) moved by
    one ulp (2^-8 of it) moves the fingerprint by ~1e-11 (a thousand ulps of its ~40), far under the
    bound the check allowed before, 2 gamma_{N+K+2} sum |a||W||p| = 6e-8 (both computed below).
    Compared bit for bit, it is caught, held as sent and read back through a kernel alike."""
    w = _init((2048, 2048), 10).to(torch.bfloat16)
    nudged = one_ulp(w)
    assert int((nudged != w).sum()) == 1
    sent = sent_prints({"w": w})
    change = max(abs(a - b) for a, b in zip(held_prints({"w": nudged})["w"], sent["w"].value))
    n, k = w.shape
    magnitude = float(row_weights(n).abs()[:, 0] @ w.double().abs() @ probes(k).abs()[:, 0])
    old_bound = 2 * (n + k + 2) * torch.finfo(torch.float64).eps / 2 * magnitude
    assert 0 < change < old_bound / 100
    assert not _passes(w, nudged)
    kernel = kernel_rows(lambda x: torch.nn.functional.linear(x, nudged), k, torch.bfloat16)
    with pytest.raises(WeightSyncError, match=r"does not hold the weights the learner sent: w \(\|held - sent\|"):
        check_weights(sent, split_rows(kernel, ["w"], {"w": [n, k]}), 0, 1)


def test_a_nan_the_learner_sent_is_the_learners_not_a_generators():
    """A NaN (or inf) in what the learner sent makes its own fingerprint non-finite: the error says
    the learner's weights are non-finite and names the tensor, whatever the generator holds (the
    same NaN, the last finite weights, nothing), and never blames a generator."""
    good, bad = _init((64, 64), 11), _init((64, 64), 12)
    bad[3, 5] = math.nan
    inf = good.clone()
    inf[0, 0] = math.inf
    sent = sent_prints({"good": good, "layers.1.bad": bad, "inf": inf})
    for held in (held_prints({"good": good, "layers.1.bad": bad, "inf": inf}), held_prints({"good": good}), {},
                 [held_prints({"good": good})] * 2):
        with pytest.raises(NonFiniteWeightsError, match=r"policy version 3 \(the update of iteration 2\): the "
                                                        r"learner's own weights are non-finite \(NaN or inf\) in "
                                                        r"layers.1.bad, inf: .* the generators are not at fault"):
            check_weights(sent, held, generator=1, version=3)
    assert not issubclass(NonFiniteWeightsError, WeightSyncError)
    # A NaN the generator holds where the learner sent finite weights is the generator's.
    with pytest.raises(WeightSyncError, match="generator 1 does not hold the weights the learner sent: layers.1.bad"):
        check_weights(sent_prints({"layers.1.bad": good}), held_prints({"layers.1.bad": bad}), 1, 3)


def test_a_sent_tensor_the_generator_reports_no_fingerprint_for_is_named():
    """Every sent tensor must be compared: one the generator has no fingerprint for (dropped by its
    loader, or held under the name its HF-to-vLLM mapping gave it, e.g. vLLM's transformers
    fallback for GPT-NeoX keeps ``gpt_neox.*`` as ``model.*``) is named, not skipped; so is a
    worker of a tensor-parallel generator that lacks one."""
    names = ["gpt_neox.embed_in.weight", "gpt_neox.layers.0.mlp.dense_h_to_4h.weight", "gpt_neox.final_layer_norm.weight"]
    state = {name: _init((16, 8), i) for i, name in enumerate(names)}
    sent, held = sent_prints(state), held_prints(state)
    assert check_weights(sent, held, 2, 5) == 3
    dropped = {name: held[name] for name in names if "mlp" not in name}
    with pytest.raises(WeightSyncError, match=r"generator 2 reports fingerprints of 2 of the 3 sent tensors, not of "
                                              r"gpt_neox.layers.0.mlp.dense_h_to_4h.weight \(a tensor the engine's "
                                              r"loader renamed or dropped cannot be verified\)"):
        check_weights(sent, dropped, 2, 5)
    renamed = dict(dropped) | {"model.layers.0.mlp.dense_h_to_4h.weight": held[names[1]]}
    with pytest.raises(WeightSyncError, match=r"2 of the 3 sent tensors, not of gpt_neox.layers.0.mlp.dense_h_to_4h"
                                              r".weight; and of tensors not sent: model.layers.0.mlp.dense_h_to_4h"):
        check_weights(sent, renamed, 2, 5)
    with pytest.raises(WeightSyncError, match=r"generator 2 \(worker 1\) reports fingerprints of 2 of the 3"):
        check_weights(sent, [held, dropped], 2, 5)


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
    """Generator 1 samples at T = 0.9 (k3 ~ 1.7e-2), generators 0 and 2 are healthy bf16 (~1.1e-3):
    pooled, their mean (~6.4e-3) sat under the 1e-2 limit; on its own rows generator 1 is over it,
    and the message names it (not the first generator, nor the last)."""
    drift = torch.cat([_k3_drift(1.1e-3, (8, 50)), _k3_drift(1.7e-2, (8, 50)), _k3_drift(1.1e-3, (8, 50))])
    ids = torch.tensor([0] * 8 + [1] * 8 + [2] * 8)
    pooled = float((torch.expm1(drift) - drift).mean())
    assert pooled < 1e-2  # what the pooled check saw
    kl = generator_kl(drift, torch.ones_like(drift), ids, LocalCollective(), 1e-2)
    assert kl[1] > 1e-2 > max(kl[0], kl[2])
    with pytest.raises(LogprobMismatchError, match=r"iteration 3: logprob_mismatch/kl = 0.01\d+ nats per token on its "
                                                   r"own rows exceeds checks.max_logprob_kl = 0.01 on generator 1:"):
        MismatchGuard(math.inf, 3, kl_limit=1e-2).check(drift, ids, LocalCollective())


def test_one_outlier_token_cannot_stop_a_healthy_run_but_a_temperature_gap_does():
    """10k healthy bf16 tokens (k3 mean 1.1e-3) and one token at pi/mu ~ 100 (d = 4.6, k3 ~ 94): the
    plain mean rises to ~1.05e-2, over the limit; capped at half the limit per token it stays
    near 6e-3. A gap every token shares is not capped at all."""
    guard = MismatchGuard(math.inf, 0, kl_limit=1e-2)
    drift = _k3_drift(1.1e-3, (100, 100))
    replaced = float(torch.expm1(drift[37, 12]) - drift[37, 12])
    healthy_sum = float((torch.expm1(drift) - drift).sum())
    drift[37, 12] = 4.6
    ids = torch.zeros(100, dtype=torch.long)
    assert float((torch.expm1(drift) - drift).mean()) > 1e-2  # the plain mean would have stopped it
    guard.check(drift, ids, LocalCollective())
    kl = float(generator_kl(drift, torch.ones_like(drift), ids, LocalCollective(), 1e-2)[0])
    # The healthy tokens' k3 less the one replaced, plus the outlier at its cap 0.5 * limit * 10^4
    # tokens, over 10^4: both sides sum the same 10^4 float64 terms of one sign, in other orders, so
    # they agree to n u = 10^4 * 1.1e-16 ~ 1.1e-12 relative (Higham eq. 3.5); 1e-11 leaves 9x room.
    expected = (healthy_sum - replaced + 0.5 * 1e-2 * 1e4) / 1e4
    assert kl == pytest.approx(expected, rel=1e-11)
    # The docstring's figures: k3 of +-d averages d^2/2 + d^4/24, the second term 2e-7 (3e-5 relative).
    assert kl == pytest.approx(1.1e-3 + 0.5 * 1e-2, rel=1e-4)
    shifted = _k3_drift(1.2e-2, (100, 100))
    with pytest.raises(LogprobMismatchError, match="on generator 0"):
        guard.check(shifted, ids, LocalCollective())


def test_a_tensor_held_as_nan_fails():
    """vLLM's layerwise reload leaves a tensor it was not handed as uninitialised memory; when that
    reads as NaN the fingerprint is NaN, and NaN > bound is False: the check must still fail."""
    w = _init((64, 64), 7)
    assert not _passes(w, torch.full_like(w, math.nan))
