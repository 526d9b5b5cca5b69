"""Weight fingerprints: an exact per-tensor checksum that survives fusion, padding and repacking.

After a weight sync, learner rank 0 fingerprints every tensor it sent and each generator
fingerprints what it actually holds; the correctness guard (``rayppo/learner/guard.py``) compares them.

A tensor is viewed as a matrix ``W [N, K]`` (the last dimension is K; a 1-D tensor of length N is a
column, K = 1) and read through two bilinear probes, each a row weight ``a_j [N]`` and a column
weight ``p_j [K]``:

    fingerprint_j(W) = a_j^T W p_j = sum_i a_ji (W p_j)_i                     j = 1, 2; float64

The weights are pseudo-random, of magnitude 0.5..1.5 and random sign, a function of the index alone
(``probe_weights``): a permutation of rows or of columns moves the fingerprint, a tensor held as
zeros or as another random init moves it by about its own size, and one changed element by
``|a_i p_k| |dW_ik| >= dW_ik / 4``.

Why this form: an inference engine may not keep a tensor as it was sent. vLLM fuses q/k/v and
gate/up into one matrix (rows stacked: the row products ``W p`` split back per tensor, each block's
rows weighed from its own first row), pads the vocabulary (extra rows, dropped), and on CPU repacks
linear weights into an opaque oneDNN / SGL kernel, leaving an empty parameter. Such a kernel is
read back exactly (``kernel_rows``): multiplied by the identity, each output is one product with
1.0 plus exact zeros, so the kernel returns every element as it holds it.

Bound: both sides then evaluate the same bilinear form in float64 over the same values, in two
summation orders (the learner: weighted column sums first; the generator: row products first).
Each order errs by at most gamma_{N+K+2} sum_ik |a_i| |W_ik| |p_k| (Higham, *Accuracy and Stability
of Numerical Algorithms*, 2nd ed., eq. 3.5, for a sum of N K triple products), so the two differ
by at most twice that: ~1e-13 relative at N + K ~ 1e4. Nothing else is allowed: a generator one
optimiser step behind at lr 1e-6 flips bf16 roundings in ~1% of a tensor's elements, each a change
of ~1e-4 relative, 1e9 times the bound.

Only ``torch`` is imported: learner, generators and tests share this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod

import torch

PROBES = 2
"""Independent bilinear probes per tensor."""
U64 = torch.finfo(torch.float64).eps / 2
"""float64's unit roundoff."""
_MASK32 = (1 << 32) - 1


@dataclass(frozen=True)
class SentPrint:
    """The fingerprint of a sent tensor and how far a faithful copy's may deviate."""

    value: tuple[float, float]
    """``(a_1^T W p_1, a_2^T W p_2)`` in float64."""
    bound: tuple[float, float]
    """Largest |held - sent| that float64 summation order alone explains (the module docstring)."""


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


PROBE_CHUNK_ELEMENTS = 1 << 22
"""Elements of a tensor converted to float64 at a time by ``probe_rows`` (32 MiB): a whole
152k x 3584 embedding in float64 would be 4.4 GB inside vLLM's memory headroom."""


def probe_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[N, PROBES]`` float64: ``W p_j`` per row, over the held values converted to float64 (exact)
    one block of rows at a time (``PROBE_CHUNK_ELEMENTS``)."""
    w = as_matrix(tensor.detach())
    p = probes(w.shape[1], w.device)
    step = max(1, PROBE_CHUNK_ELEMENTS // max(w.shape[1], 1))
    return torch.cat([w[i:i + step].double() @ p for i in range(0, w.shape[0], step)]) if w.shape[0] else w.double() @ p


KERNEL_CHUNK = 256
"""Identity columns read through a kernel at a time by ``kernel_rows`` (a [256, N] output)."""


def kernel_rows(linear: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N, PROBES]`` float64: ``W p_j`` per row of a weight that only a kernel can read,
    ``linear(x) = x @ W^T`` (``x [c, K]`` in the weight's ``dtype``). Exact: the kernel is handed
    rows of the identity, so each output ``W_ik`` is one product with 1.0 (zeros add nothing) and
    comes back as the element it holds; the probe is then applied in float64. Costs a K x K x N
    product, ~1 s per billion weights x K / 1000 on a CPU core."""
    p = probes(k)
    rows = None
    for start, columns in read_back(linear, k, dtype):
        part = columns.double().T @ p[start:start + columns.shape[0]]
        rows = part if rows is None else rows + part
    if rows is None:
        raise ValueError("kernel_rows: a weight of no columns (k=0) has no rows to read back")
    return rows


def read_back(linear: Callable[[torch.Tensor], torch.Tensor], k: int,
              dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, W[:, start:stop]^T)`` blocks of ``KERNEL_CHUNK`` columns of the weight behind
    ``linear(x) = x @ W^T``, exactly (``kernel_rows``): the kernel is handed rows of the identity."""
    for start in range(0, k, KERNEL_CHUNK):
        stop = min(k, start + KERNEL_CHUNK)
        eye = torch.zeros(stop - start, k, dtype=dtype)
        eye[:, start:stop] = torch.eye(stop - start, dtype=dtype)
        yield start, linear(eye)


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u) in float64."""
    return n * U64 / (1 - n * U64)


def sent_print(tensor: torch.Tensor) -> SentPrint:
    """Fingerprint and summation bound of a tensor about to be sent.

    One pass over the tensor (it runs on learner rank 0 every sync): the row-weighted column sums
    ``a_j^T W`` in float64, then their dot product with ``p_j``; the bound from the same pass over
    ``|W|`` with ``|a_j|`` and ``|p_j|``.
    """
    w = as_matrix(tensor.detach())
    n, k = w.shape
    a, p = row_weights(n, w.device), probes(k, w.device)
    columns = torch.zeros(2, PROBES, k, dtype=torch.float64, device=w.device)  # a^T W and |a|^T |W|
    step = max(1, PROBE_CHUNK_ELEMENTS // max(k, 1))
    for i in range(0, n, step):  # float64 one block of rows at a time, as probe_rows
        block, weights = w[i:i + step].double(), a[i:i + step].T
        columns[0] += weights @ block
        columns[1] += weights.abs() @ block.abs()
    value, magnitude = (columns[0] * p.T).sum(dim=1), (columns[1] * p.abs().T).sum(dim=1)
    bound = 2 * gamma(n + k + 2) * magnitude  # either side's order errs by gamma_{N+K+2} at most
    return SentPrint(tuple(value.tolist()), tuple(bound.tolist()))


def sent_prints(named: dict[str, torch.Tensor]) -> dict[str, SentPrint]:
    """``sent_print`` of every tensor of a sync."""
    return {name: sent_print(tensor) for name, tensor in named.items()}


def split_rows(rows: torch.Tensor, names: list[str], shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """Held fingerprints from probe outputs ``[N_total, PROBES]`` of a matrix that stacks ``names``'
    rows in order (a fused q/k/v or gate/up projection; one name for a plain tensor): each block's
    rows weighed by ``a_j`` from its own first row. Rows past the sent ones (vocabulary padding)
    are ignored."""
    out, start = {}, 0
    for name in names:
        n = matrix_shape(shapes[name])[0]
        block = rows[start:start + n]
        out[name] = tuple((block * row_weights(n, block.device)).sum(dim=0).tolist())
        start += n
    return out


def held_prints(named: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Fingerprints of tensors held as plain tensors under the sent names (no fusion)."""
    return {name: split_rows(probe_rows(t), [name], {name: list(t.shape)})[name] for name, t in named.items()}
