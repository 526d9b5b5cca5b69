"""The learner group: N ``LearnerEngine`` ranks as Ray actors forming one torch.distributed group."""

from __future__ import annotations

from typing import Any

import ray

from rayppo.cluster.group import ActorGroup, get, split_evenly
from rayppo.cluster.placement import Placement
from rayppo.config import Config, actor_threads
from rayppo.data.rollout import Rollout
from rayppo.learner.engine import LearnerEngine
from rayppo.learner.weight_sync import SyncEndpoint, free_port


def _rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port (run where rank 0 will run)."""
    return ray.util.get_node_ip_address(), free_port()


class LearnerGroup:
    """Ranks 0..N-1; ``train`` shards a rollout across them, ``policy_weights`` gathers on rank 0."""

    def __init__(self, cfg: Config, placement: Placement | None, options: list[dict[str, Any]] | None = None):
        n = cfg.learner.num_ranks
        threads = actor_threads(cfg.learner.threads, cfg.learner.cpus_per_rank)
        if placement is None:  # in-process, one rank (tests)
            addr, port = "127.0.0.1", _rendezvous_address()[1]
            self.ranks = ActorGroup(LearnerEngine, [(cfg, 0, 1, addr, port, None)], local=True)
        else:
            # Probed in rank 0's bundle before rank 0 takes it (afterwards a task would not fit).
            addr, port = get(ray.remote(_rendezvous_address).options(**placement.actor_options(0)).remote())
            args = [(cfg, rank, n, addr, port, threads) for rank in range(n)]
            self.ranks = ActorGroup(LearnerEngine, args, options or [placement.actor_options(i) for i in range(n)])
        self.num_ranks = len(self.ranks)
        self.rank0_host = addr

    def rank0_address(self) -> tuple[str, int]:
        """Address of rank 0's node and a port free there now (for another rendezvous store)."""
        return self.rank0_host, self.ranks.get(self.ranks.call_all(LearnerEngine.free_port))[0]

    def train(self, rollout: Rollout, kl_coef: float, iteration: int) -> dict[str, float]:
        """One PPO iteration over ``rollout``, its rows split contiguously across the ranks."""
        shards = split_evenly(len(rollout), self.num_ranks)
        args = [(rollout.select(rows), rows.start, len(rollout), kl_coef, iteration) for rows in shards]
        return self.ranks.get(self.ranks.call(LearnerEngine.train, args))[0]

    def policy_weights(self) -> Any:
        """A future of rank 0's ``WeightsPayload`` (the value itself when in-process)."""
        return self.ranks.call_all(LearnerEngine.policy_weights)[0]

    def open_weight_sync(self, endpoint: SyncEndpoint) -> list[Any]:
        """Futures: rank 0 joins the sync group as root (returns the stream layout); all ranks call."""
        return self.ranks.call_all(LearnerEngine.open_weight_sync, endpoint)

    def send_weights(self) -> list[Any]:
        """Futures: broadcast the policy to the sync group (rank 0's result: bytes delivered)."""
        return self.ranks.call_all(LearnerEngine.send_weights)

    def ipc_next(self) -> list[Any]:
        """Futures: every rank's next run of CUDA-IPC handles (``LearnerEngine.ipc_next``)."""
        return self.ranks.call_all(LearnerEngine.ipc_next)

    def sent_fingerprints(self) -> dict[str, Any]:
        """Rank 0's fingerprints of the weights of the last sync (``SentPrint`` per tensor)."""
        return self.ranks.get(self.ranks.call_all(LearnerEngine.sent_fingerprints))[0]

    def save(self, out_dir: str) -> None:
        """The final policy and critic in Hugging Face format."""
        self.ranks.get(self.ranks.call_all(LearnerEngine.save, out_dir))

    def save_checkpoint(self, path: str) -> None:
        """Every rank's DeepSpeed states under ``path``."""
        self.ranks.get(self.ranks.call_all(LearnerEngine.save_checkpoint, path))

    def load_checkpoint(self, path: str) -> int:
        """Every rank loads its states; returns the policy version."""
        versions = set(self.ranks.get(self.ranks.call_all(LearnerEngine.load_checkpoint, path)))
        if len(versions) != 1:
            raise RuntimeError(f"learner ranks restored different policy versions {sorted(versions)} from {path}")
        return versions.pop()

    def kill(self) -> None:
        self.ranks.kill()
