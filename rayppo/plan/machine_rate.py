"""The machine's measured arithmetic rate: the denominator of ``perf/mfu/*`` and the bench's MFU.

A vendor's peak is a number the machine never reaches on a 2-core VM or a shared GPU; a matmul
timed here and now, in the stage's dtype, on the threads (or the GPU) the stage runs on, is what
the stage could do if it were nothing but matmuls. ``peak_rate`` times the shape a decoder runs
most (a batch of tokens through the MLP's up projection). torch only.
"""

from __future__ import annotations

import statistics
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` -> the torch dtype the probe multiplies in."""


def matmul_flops_per_s(m: int, k: int, n: int, dtype: str, threads: int, device: str | torch.device = "cpu",
                       repeats: int = 15) -> float:
    """FLOP/s of an ``[m, k] x [k, n]`` matmul (``2 m k n`` FLOPs) in ``dtype`` on ``device``,
    with ``threads`` torch threads (restored after): the median of ``repeats`` timed calls after
    one warm-up call (a minimum would catch the machine's best moment). On CUDA the clock is read
    after a synchronize, so the time is the kernel's, not its launch's."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    before = torch.get_num_threads()
    a = torch.randn(m, k).to(device=device, dtype=DTYPES[dtype])
    b = torch.randn(k, n).to(device=device, dtype=a.dtype)
    torch.set_num_threads(threads)
    try:
        torch.mm(a, b)
        seconds = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            if cuda:
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * m * k * n / max(statistics.median(seconds), 1e-12)


def peak_rate(dtype: str, threads: int, hidden: int, intermediate: int, tokens: int,
              device: str | torch.device = "cpu", repeats: int = 15) -> float:
    """FLOP/s of the matmul a decoder of width ``hidden`` runs most: ``tokens`` tokens through its
    MLP's up projection (``[tokens, hidden] x [hidden, intermediate]``)."""
    return matmul_flops_per_s(max(tokens, 1), hidden, intermediate, dtype, threads, device, repeats)
