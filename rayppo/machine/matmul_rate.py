"""The machine's measured arithmetic rate: the denominator of ``perf/mfu/*`` and the bench's MFU.

A vendor's peak is a number the machine never reaches on a 2-core VM or a shared GPU; a matmul
timed here and now, in the stage's dtype, on the threads (or the GPU) the stage runs on, is what
the stage could do if it were nothing but matmuls. ``peak_rate`` times the shape a decoder runs
most (a batch of tokens through the MLP's up projection). torch only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` -> the torch dtype the probe multiplies in."""


@dataclass(frozen=True)
class Probe:
    """How a matmul is timed: in the stage's dtype, on the threads and the device the stage runs on."""

    dtype: str
    """``model.dtype`` (a key of ``DTYPES``)."""
    threads: int
    """torch threads the matmul runs on; the process's count is restored after."""
    device: str | torch.device = "cpu"
    """``cpu``, or the GPU the stage runs on."""
    repeats: int = 15
    """Timed calls after the warm-up; the rate is the fastest's."""


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an ``[m, k] x [k, n]`` matmul: m n outputs of k multiply-adds, 2 FLOPs each."""
    return 2 * m * k * n


def matmul_flops_per_s(m: int, k: int, n: int, probe: Probe) -> float:
    """FLOP/s of an ``[m, k] x [k, n]`` matmul (``matmul_flops``) as ``probe`` says (its dtype,
    device and torch threads, the process's count restored after): the fastest of ``probe.repeats``
    timed calls after one warm-up call. The machine's best, not a typical moment: MFU divides by a
    peak, and a probe slowed by a neighbour for half its calls would put a stage above it. On CUDA
    the clock is read after a synchronize, so the time is the kernel's, not its launch's. A
    ``RuntimeError`` where torch keeps another thread count (vLLM's CPU worker turns
    ``torch.set_num_threads`` into a no-op once it has bound the process's threads): a rate of
    fewer threads than the stage runs on would put its MFU above 1."""
    threads = probe.threads
    device = torch.device(probe.device)
    cuda = device.type == "cuda"
    before = torch.get_num_threads()
    a = torch.randn(m, k).to(device=device, dtype=DTYPES[probe.dtype])
    b = torch.randn(k, n).to(device=device, dtype=a.dtype)
    torch.set_num_threads(threads)
    try:
        if torch.get_num_threads() != threads:
            raise RuntimeError(f"the matmul-rate probe asked torch for {threads} threads and has "
                               f"{torch.get_num_threads()}: its rate would not be of {threads} threads")
        torch.mm(a, b)
        seconds = []
        for _ in range(probe.repeats):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            if cuda:
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return matmul_flops(m, k, n) / max(min(seconds), 1e-12)


def peak_rate(dtype: str, threads: int, hidden: int, intermediate: int, tokens: int,
              device: str | torch.device = "cpu") -> float:
    """FLOP/s of the matmul a decoder of width ``hidden`` runs most: ``tokens`` tokens through its
    MLP's up projection (``[tokens, hidden] x [hidden, intermediate]``), in ``dtype`` on ``threads``
    torch threads of ``device`` (``Probe``)."""
    return matmul_flops_per_s(max(tokens, 1), hidden, intermediate, Probe(dtype, threads, device))
