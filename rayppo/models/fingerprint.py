"""Weight fingerprints: a cheap per-tensor checksum that survives fusion, padding and repacking.

After a weight sync, learner rank 0 fingerprints every tensor it sent and each generator
fingerprints what it actually holds; the correctness guard (``rayppo/learner/guard.py``) compares them.

A tensor is viewed as a matrix ``W [N, K]`` (the last dimension is K; a 1-D tensor of length N is a
column, K = 1) and multiplied by two fixed probe vectors, ``1`` and a seeded ±1 vector ``s``:

    fingerprint(W) = ( sum_i (W 1)_i ,  sum_i (W s)_i )                      [2], float64

Why this form: an inference engine may not keep a tensor as it was sent. vLLM fuses q/k/v and
gate/up into one matrix (rows stacked, so row blocks split back per tensor), pads the vocabulary
(extra rows, dropped by taking the first N), and on CPU repacks linear weights into an opaque
oneDNN / SGL kernel, leaving an empty parameter. A product with a probe vector can still be
evaluated through that kernel, so every weight is checked as the engine will use it.

Bound: evaluated exactly (float64 over the held values) the two sides differ only by float64
summation order. Through a kernel in the weight's dtype, each output y_i = sum_k W_ik x_k carries
at most ``K u_acc + u_out`` times ``sum_k |W_ik||x_k|`` of rounding (Higham's gamma_K for the
accumulation, plus rounding the result to the dtype); the probes (±1) are exact in every dtype.
``u_acc`` is float32's unit roundoff for float32/bfloat16/float16 kernels (they accumulate in
float32), ``u_out`` the dtype's. A stale or perturbed tensor moves a fingerprint by far more:
one AdamW step changes each weight by ~lr (1e-4..1e-3), ~1e3..1e4 times the float32 bound's share.

Only ``torch`` is imported: learner, generators and tests share this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

PROBE_SEED = 0x5EED
"""Seed of the ±1 probe vector; both sides must use the same."""
F64_EPS = torch.finfo(torch.float64).eps / 2


@dataclass(frozen=True)
class SentPrint:
    """The fingerprint of a sent tensor and how far a faithful copy's may deviate."""

    value: tuple[float, float]
    """``(sum W 1, sum W s)`` in float64."""
    bound: tuple[float, float]
    """Largest |held - sent| that rounding alone explains (see the module docstring)."""


def matrix_shape(shape: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """``(N, K)`` of the matrix view: ``[..., K] -> [prod(...), K]``; ``[N] -> [N, 1]``; ``[] -> [1, 1]``."""
    if len(shape) >= 2:
        return prod(shape[:-1]), shape[-1]
    return (shape[0] if shape else 1), 1


def probes(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[K, 2]`` float64: the ones vector and the seeded ±1 vector (exact in every dtype)."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    signs = torch.randint(0, 2, (k,), generator=generator, dtype=torch.float64) * 2 - 1
    return torch.stack([torch.ones(k, dtype=torch.float64), signs], dim=1).to(device)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(matrix_shape(tuple(tensor.shape)))


PROBE_CHUNK_ELEMENTS = 1 << 22
"""Elements of a tensor converted to float64 at a time by ``probe_rows`` (32 MiB): a whole
152k x 3584 embedding in float64 would be 4.4 GB inside vLLM's memory headroom."""


def probe_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[N, 2]`` float64: W @ probes, exactly (float64), one row per matrix row; converted to
    float64 one block of rows at a time (``PROBE_CHUNK_ELEMENTS``)."""
    w = as_matrix(tensor.detach())
    p = probes(w.shape[1], w.device)
    step = max(1, PROBE_CHUNK_ELEMENTS // max(w.shape[1], 1))
    return torch.cat([w[i:i + step].double() @ p for i in range(0, w.shape[0], step)]) if w.shape[0] else w.double() @ p


def unit_roundoffs(dtype: torch.dtype) -> tuple[float, float]:
    """``(u_acc, u_out)`` of a kernel computing in ``dtype`` (see the module docstring)."""
    u_out = torch.finfo(dtype).eps / 2
    if dtype == torch.float64:
        return u_out, u_out
    return torch.finfo(torch.float32).eps / 2, u_out  # 16-bit kernels accumulate in float32


def sent_print(tensor: torch.Tensor) -> SentPrint:
    """Fingerprint and rounding bound of a tensor about to be sent.

    One pass over the tensor (it runs on learner rank 0 every sync): the probes are 1 and ±1, so
    sum_i (W x)_i = sum_k x_k c_k with the column sums c (accumulated in float64), and
    sum_ik |W_ik||x_k| = sum |W| for both probes.
    """
    w = as_matrix(tensor.detach())
    n, k = w.shape
    columns = w.sum(dim=0, dtype=torch.float64)
    value = columns @ probes(k, columns.device)
    u_acc, u_out = unit_roundoffs(tensor.dtype)
    # Kernel rounding, plus float64 summation over the N x K terms on either side.
    bound = float(w.abs().sum(dtype=torch.float64)) * (k * u_acc + u_out + 2 * (n + k) * F64_EPS)
    return SentPrint(tuple(value.tolist()), (bound, bound))


def sent_prints(named: dict[str, torch.Tensor]) -> dict[str, SentPrint]:
    """``sent_print`` of every tensor of a sync."""
    return {name: sent_print(tensor) for name, tensor in named.items()}


def split_rows(rows: torch.Tensor, names: list[str], shapes: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """Held fingerprints from probe outputs ``[N_total, 2]`` of a matrix that stacks ``names``'
    rows in order (a fused q/k/v or gate/up projection; one name for a plain tensor). Rows past
    the sent ones (vocabulary padding) are ignored."""
    out, start = {}, 0
    for name in names:
        n = matrix_shape(shapes[name])[0]
        out[name] = tuple(rows[start:start + n].sum(dim=0).tolist())
        start += n
    return out


def held_prints(named: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Fingerprints of tensors held as plain tensors under the sent names (no fusion)."""
    return {name: tuple(probe_rows(t).sum(dim=0).tolist()) for name, t in named.items()}
