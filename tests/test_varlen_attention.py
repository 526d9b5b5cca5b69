"""Attention per sequence on one packed row (``models/varlen_attention.py``): the buckets cover
every column once, and the attention equals SDPA run on each sequence alone."""

from __future__ import annotations

import math

import pytest
import torch

from rayppo.models.varlen_attention import (
    MATH_ATTENTION_MAX_LENGTH,
    causal_attention,
    math_attention,
    segments,
    varlen_sdpa_forward,
)

LENGTHS = [7, 1, 30, 12, 5, 29, 16, 2, 9]

# fp64 throughout: the per-sequence SDPA and the bucketed one sum the same <= 30 terms per dot
# product (head_dim 8, <= 30 keys) in possibly another order; each moves by <= K u max|a b| with
# K = 30, u = 1.1e-16 and |a b| <= ~20 for unit normals: 7e-14, through a softmax and a weighted
# sum of <= 30 values: 1e-12.
BOUND = 1e-12


class Attention(torch.nn.Module):
    """What transformers' attention functions read from the module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def test_buckets_cover_every_column_once_and_hold_sequences_of_like_length():
    layout = segments(LENGTHS)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    seen = []
    for columns in layout.buckets:
        widths = [int(row.unique().numel()) for row in columns]  # a row's filler repeats its last column
        assert min(widths) * math.sqrt(2) > columns.shape[1]  # within a factor sqrt(2) of the longest
        for row, n in zip(columns, widths):
            assert n in LENGTHS and int(row[0]) in starts
            assert torch.equal(row[:n], torch.arange(int(row[0]), int(row[0]) + n))  # one sequence, in order
            assert (row[n:] == row[n - 1]).all()
            seen += row[:n].tolist()
    assert sorted(seen) == list(range(sum(LENGTHS)))
    flat = torch.cat([columns.reshape(-1) for columns in layout.buckets])
    assert torch.equal(flat[layout.restore], torch.arange(sum(LENGTHS)))  # restore finds each column's output


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["multi-head", "grouped-query"])
def test_attention_per_sequence_equals_sdpa_on_each_sequence_alone(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    n, d = sum(LENGTHS), 8
    query = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, kv_heads, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.randn(1, kv_heads, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    module = Attention(heads, kv_heads)
    out, _ = varlen_sdpa_forward(module, query, key, value, None, scaling=0.3, rayppo_segments=segments(LENGTHS))
    assert out.shape == (1, n, heads, d)
    expected, start = [], 0
    for length in LENGTHS:
        part = slice(start, start + length)
        k, v = (t[:, :, part].repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        alone = torch.nn.functional.scaled_dot_product_attention(query[:, :, part], k, v, is_causal=True, scale=0.3)
        expected.append(alone.transpose(1, 2))
        start += length
    expected = torch.cat(expected, dim=1)
    assert (out - expected).abs().max().item() <= BOUND
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((o * weights).sum(), (query, key, value)) for o in (out, expected)]
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() <= BOUND * 10  # the backward adds one more such sum per input


def test_without_segments_it_is_transformers_sdpa_and_a_short_window_is_refused():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # a left-padded row
    module = Attention(4, 4)
    ours, _ = varlen_sdpa_forward(module, query, key, value, mask, scaling=0.5)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.5)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="no sliding window: a sequence is longer than the model's 16"):
        varlen_sdpa_forward(module, *(torch.randn(1, 4, sum(LENGTHS), 8) for _ in range(3)), None,
                            rayppo_segments=segments(LENGTHS), sliding_window=16)


@pytest.mark.parametrize("length", [1, 7, 43, MATH_ATTENTION_MAX_LENGTH])
def test_math_attention_equals_the_fused_kernel_in_bf16_values_and_gradients(length):
    """The short-bucket path (plain matmuls) against SDPA's fused kernel, bf16, 6 query / 2 key heads.

    Both form the scores and the softmax in fp32 from the same bf16 inputs (the products of two bf16
    numbers are exact in fp32); they differ where each rounds to bf16 (u = 2^-8): the probabilities
    before ``p v`` (|error| <= u p_j each, so <= u max|v| on a row's output) and the output itself
    (u |o|). Each side does both once: |o_math - o_fused| <= 2u (max|v| + |o|). The gradients pass
    three such roundings (P, dO V^T, the result) on each side: relative norm difference <= 6u."""
    u = 2.0**-8
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(5, h, length, 16, generator=gen).to(torch.bfloat16).requires_grad_() for h in (6, 2, 2))
    weights = torch.randn(5, 6, length, 16, generator=gen)
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    fused_grads = torch.autograd.grad((fused.float() * weights).sum(), (q, k, v))
    plain = math_attention(q, k, v, None)
    plain_grads = torch.autograd.grad((plain.float() * weights).sum(), (q, k, v))
    bound = 2 * u * (v.detach().float().abs().max() + fused.detach().float().abs())
    assert plain.dtype == torch.bfloat16
    assert ((plain.detach().float() - fused.detach().float()).abs() <= bound).all()
    for a, b in zip(plain_grads, fused_grads):
        assert (a.float() - b.float()).norm() <= 6 * u * b.float().norm()


def test_causal_attention_takes_the_plain_path_only_where_it_is_faster():
    """Short bf16 buckets with gradients go through ``math_attention`` (its result is bitwise its
    own); fp32, no-grad and long buckets stay on the fused kernel (bitwise SDPA's)."""
    def both(dtype: torch.dtype, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (torch.randn(2, 4, length, 8, generator=torch.Generator().manual_seed(1)).to(dtype) for _ in range(3))
        fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return causal_attention(q, k, v, 0.0, None), math_attention(q, k, v, None), fused

    out, plain, fused = both(torch.bfloat16, 16)
    assert torch.equal(out, plain) and not torch.equal(plain, fused)
    for dtype, length in ((torch.float32, 16), (torch.bfloat16, MATH_ATTENTION_MAX_LENGTH + 1)):
        out, _, fused = both(dtype, length)
        assert torch.equal(out, fused)
    with torch.no_grad():
        out, _, fused = both(torch.bfloat16, 16)
    assert torch.equal(out, fused)
