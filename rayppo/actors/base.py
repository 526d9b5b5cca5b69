"""What every role's engine shares: threads from its CPU share, and its peak memory."""

from __future__ import annotations

import resource

import torch


class Engine:
    """Base of the role engines (generator, reference, reward, learner rank)."""

    @staticmethod
    def set_threads(num_threads: int | None) -> None:
        """torch intra-op threads = the actor's CPU share (2 cores shared by 5 actors must not
        run 5 x 2 threads)."""
        if num_threads:
            torch.set_num_threads(num_threads)

    def peak_memory_bytes(self) -> dict[str, int]:
        """Peak resident memory of this process, and peak CUDA memory when on a GPU."""
        out = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = int(torch.cuda.max_memory_allocated())
        return out
