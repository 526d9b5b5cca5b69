"""Weight fingerprints: an exact per-tensor checksum that survives fusion, padding and repacking.

After a weight sync, learner rank 0 fingerprints every tensor it sent and each generator
fingerprints what it actually holds; the correctness guard (``rayppo/learner/guard.py``) compares them.

A tensor is viewed as a matrix ``W [N, K]`` (the last dimension is K; a 1-D tensor of length N is a
column, K = 1) and read through two bilinear probes, each a row weight ``a_j [N]`` and a column
weight ``p_j [K]``:

    fingerprint_j(W) = a_j^T W p_j = sum_i a_ji r_ji,   r_ji = sum_k W_ik p_jk      j = 1, 2; float64

The weights are pseudo-random, of magnitude 0.5..1.5 and random sign, a function of the index alone
(``probe_weights``): a permutation of rows or of columns moves the fingerprint, a tensor held as
zeros or as another random init moves it by about its own size, and one changed element by
``|a_i p_k| |dW_ik| >= dW_ik / 4``.

Why this form: an inference engine may not keep a tensor as it was sent. vLLM fuses q/k/v and
gate/up into one matrix (rows stacked: the row sums ``r`` split back per tensor, each block's
rows weighed from its own first row), pads the vocabulary (extra rows, dropped), and on CPU repacks
linear weights into an opaque oneDNN / SGL kernel, leaving an empty parameter. Such a kernel is
read back exactly (``kernel_rows``): multiplied by the identity, each output is one product with
1.0 plus exact zeros, so the kernel returns every element as it holds it.

Exact, so compared bit for bit. Every product ``W_ik p_jk`` and ``a_ji r_ji`` is one float64
rounding of the same values on both sides (the conversion of a bf16, fp16 or fp32 element to
float64 is exact), and every sum is taken in one fixed order, ``pairwise_sum``: built from
elementwise IEEE additions (products and sums are separate kernels: no fused multiply-add), it
gives the same bits on CPU and GPU, for any thread count, block of rows, or aligned block of columns. Learner and generator run these same functions over the same
values on every path (a plain tensor, a fused block, a padded vocabulary, a kernel read back in
blocks of ``KERNEL_CHUNK`` columns, an expert probed before vLLM's CPU repack, a Conv1D weight read
in its sent layout, an adapter's A and B), so a faithful copy's fingerprint is the sent one to the
bit and no summation slack is allowed anywhere. (The earlier learner summed columns first and the
generator rows first; the gap allowed for that, Higham's 2 gamma_{N+K+2} sum |a||W||p|, let a
one-ulp change of an element of magnitude 1.5e-4 pass on a 32768 x 2048 bf16 tensor.)

What it resolves: rounding is monotone, so a changed element can be absorbed but never cancelled,
and it is absorbed only where ``|a_i p_k dW_ik|`` (at least a quarter of ``dW``) falls under half an
ulp, 2^-53, of a partial sum it passes through. A one-ulp change (at least 2^-8 of a bf16 element,
2^-24 of an fp32 one) is therefore seen while the element exceeds ~2^-43 (bf16) or ~2^-27 (fp32) of
the largest partial sum, about the fingerprint itself (sqrt(N K) typical elements for random
weights): every element of the suite's tiny models, not the smallest of a large fp32 tensor.

Only ``torch`` is imported: learner, generators and tests share this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod

import torch

PROBES = 2
"""Independent bilinear probes per tensor."""
_MASK32 = (1 << 32) - 1


@dataclass(frozen=True)
class SentPrint:
    """The fingerprint of a sent tensor: a faithful copy's is equal to the bit (module docstring)."""

    value: tuple[float, float]
    """``(a_1^T W p_1, a_2^T W p_2)`` in float64."""


def matrix_shape(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """``(N, K)`` of the matrix view: ``[..., K] -> [prod(...), K]``; ``[N] -> [N, 1]``; ``[] -> [1, 1]``."""
    if len(shape) >= 2:
        return prod(shape[:-1]), shape[-1]
    return (shape[0] if shape else 1), 1


def probe_weights(n: int, salt: int, start: int = 0) -> torch.Tensor:
    """``[n, PROBES]`` float64 weights of indices ``start .. start + n - 1``: sign and magnitude
    (0.5..1.5) from an integer hash of (index, probe, salt), so any prefix or block of rows gets the
    same weights whatever length is asked for (a random generator gives no such promise)."""
    index = torch.arange(start, start + n, dtype=torch.int64).unsqueeze(1)
    h = (index * 2654435761 + torch.arange(PROBES, dtype=torch.int64) * 40503 + salt) & _MASK32
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & _MASK32  # a 32-bit integer mix (each step stays in int64)
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & _MASK32
    h = h ^ (h >> 16)
    magnitude = 0.5 + (h & 0x7FFFFFFF).double() / 2**31
    return torch.where((h >> 31) == 1, -magnitude, magnitude)


def probes(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[K, PROBES]`` float64: the column weights ``p_j``."""
    return probe_weights(k, salt=0x5EED).to(device)


def row_weights(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N, PROBES]`` float64: the row weights ``a_j``."""
    return probe_weights(n, salt=0xA11CE).to(device)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(matrix_shape(tuple(tensor.shape)))


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` summed over its last dimension in one fixed order: neighbours first,
    ``((x0 + x1) + (x2 + x3)) + ...``, a level's odd last element carried up unchanged; 0 for
    n = 0. Each level is one elementwise IEEE addition, so the same values give the same bits on
    any device, thread count or memory layout (a BLAS product or ``torch.sum`` promises neither).
    A node of level l is the sum of the aligned block of 2^l elements under it: a row reduced in
    aligned blocks of 2^l and then over the blocks' sums gets the bits of the row reduced whole."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    while x.shape[-1] > 1:
        n = x.shape[-1]
        pairs = x[..., 0:n - 1:2] + x[..., 1:n:2]
        x = torch.cat([pairs, x[..., n - 1:]], dim=-1) if n % 2 else pairs
    return x[..., 0]


PROBE_CHUNK_ELEMENTS = 1 << 18
"""Elements of a tensor probed at a time by ``row_sums``: their float64 products (4 MiB) stay in
cache, which makes the pairwise sums as fast as a BLAS product (measured on one CPU core), and a
whole 152k x 3584 embedding is never converted at once (4.4 GB inside vLLM's memory headroom)."""


def row_sums(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``[N, PROBES]`` float64: ``r_ji = sum_k W_ik p_jk`` of a matrix ``w [N, K]`` (any float dtype,
    any layout) and column weights ``p [K, PROBES]``, in ``pairwise_sum``'s order, one block of
    rows at a time (``PROBE_CHUNK_ELEMENTS``; the rows are independent, so the blocks change nothing)."""
    n, k = w.shape
    weights = p.T.unsqueeze(1)  # [PROBES, 1, K]
    step = max(1, PROBE_CHUNK_ELEMENTS // max(k, 1))
    parts = [pairwise_sum(w[i:i + step].unsqueeze(0) * weights).T for i in range(0, n, step)]
    return torch.cat(parts) if parts else torch.zeros(0, PROBES, dtype=torch.float64, device=w.device)


def probe_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[N, PROBES]`` float64: the row sums ``W p_j`` of a tensor held as it was sent."""
    w = as_matrix(tensor.detach())
    return row_sums(w, probes(w.shape[1], w.device))


KERNEL_CHUNK = 256
"""Identity columns read through a kernel at a time by ``kernel_rows`` (a [256, N] output). A power
of two: each block is a subtree of ``pairwise_sum``'s order, so the rows come out to the bit."""


def kernel_rows(linear: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, PROBES]`` float64: ``W p_j`` per row of a weight that only a kernel can read,
    ``linear(x) = x @ W^T`` (``x [c, K]`` in the weight's ``dtype``), bitwise ``probe_rows(W)``. The
    kernel is handed rows of the identity, so each output ``W_ik`` is one product with 1.0 (zeros
    add nothing) and comes back as the element it holds; each block of ``KERNEL_CHUNK`` columns is
    summed on its own, then the blocks' sums (``pairwise_sum``: the same order as a whole row).
    Costs a K x K x N product, ~1 s per billion weights x K / 1000 on a CPU core."""
    p = probes(k)
    blocks = [row_sums(columns.T, p[start:start + columns.shape[0]]) for start, columns in read_back(linear, k, dtype)]
    if not blocks:
        raise ValueError("kernel_rows: a weight of no columns (k=0) has no rows to read back")
    return pairwise_sum(torch.stack(blocks, dim=-1))


def read_back(linear: Callable[[torch.Tensor], torch.Tensor], k: int,
              dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, W[:, start:stop]^T)`` blocks of ``KERNEL_CHUNK`` columns of the weight behind
    ``linear(x) = x @ W^T``, exactly (``kernel_rows``): the kernel is handed rows of the identity."""
    for start in range(0, k, KERNEL_CHUNK):
        stop = min(k, start + KERNEL_CHUNK)
        eye = torch.zeros(stop - start, k, dtype=dtype)
        eye[:, start:stop] = torch.eye(stop - start, dtype=dtype)
        yield start, linear(eye)


def weigh_rows(rows: torch.Tensor) -> tuple[float, float]:
    """The fingerprint from a tensor's row sums ``[N, PROBES]``: ``sum_i a_ji r_ji`` in
    ``pairwise_sum``'s order, the rows weighed from the tensor's first row."""
    return tuple(pairwise_sum((rows * row_weights(rows.shape[0], rows.device)).T).tolist())


def sent_print(tensor: torch.Tensor) -> SentPrint:
    """Fingerprint of a tensor about to be sent (learner rank 0, every sync): the functions a
    generator holding it as sent runs (``held_prints``), over the same values."""
    return SentPrint(weigh_rows(probe_rows(tensor)))


def sent_prints(named: dict[str, torch.Tensor]) -> dict[str, SentPrint]:
    """``sent_print`` of every tensor of a sync."""
    return {name: sent_print(tensor) for name, tensor in named.items()}


def split_rows(rows: torch.Tensor, names: list[str], shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """Held fingerprints from probe outputs ``[N_total, PROBES]`` of a matrix that stacks ``names``'
    rows in order (a fused q/k/v or gate/up projection; one name for a plain tensor): each block's
    rows weighed by ``a_j`` from its own first row (``weigh_rows``). Rows past the sent ones
    (vocabulary padding) are ignored."""
    out, start = {}, 0
    for name in names:
        n = matrix_shape(shapes[name])[0]
        out[name] = weigh_rows(rows[start:start + n])
        start += n
    return out


def held_prints(named: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Fingerprints of tensors held as plain tensors under the sent names (no fusion)."""
    return {name: split_rows(probe_rows(t), [name], {name: list(t.shape)})[name] for name, t in named.items()}
