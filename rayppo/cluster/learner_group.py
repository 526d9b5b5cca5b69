"""The learner group: N ``LearnerEngine`` ranks (or ``RewardModelLearner``'s, training r_φ) as Ray
actors forming one torch.distributed group.

A rank cannot be replaced mid-step (its ZeRO partitions and the collectives in flight die with
it), so every wait on the ranks has a deadline and a dead or hung rank surfaces as one
``LearnerFailedError``; the driver then ``rebuild``s the whole group and loads the latest
checkpoint (``DistributedTrainer.recover``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.exceptions import RayActorError

from rayppo.cluster.group import ActorGroup, get
from rayppo.cluster.placement import Placement
from rayppo.cluster.supervisor import dump_stacks
from rayppo.config.derived import actor_threads
from rayppo.config.schema import Config
from rayppo.console import console
from rayppo.data.micro_batches import balanced_shards
from rayppo.data.rollout import Rollout, split_evenly
from rayppo.data.seeds import minibatch_seed
from rayppo.errors import LearnerFailedError, brief
from rayppo.learner.broadcast_sender import SyncEndpoint, free_port
from rayppo.learner.learner_engine import LearnerEngine
from rayppo.learner.minibatches import minibatch_plan
from rayppo.learner.step import LearnResult
from rayppo.machine.role_resources import Engine


def _rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port (run where rank 0 will run)."""
    return ray.util.get_node_ip_address(), free_port()


class LearnerGroup:
    """Ranks 0..N-1; ``train`` shards a rollout across them, ``policy_weights`` gathers on rank 0."""

    def __init__(self, cfg: Config, placement: Placement | None, options: list[dict[str, Any]] | None = None,
                 threads: int | None = None, engine: type[Engine] = LearnerEngine):
        """``threads``: each rank's torch threads (``config.derived.role_threads``; default its CPU share).
        ``engine``: the rank's class, ``LearnerEngine`` (PPO) or ``RewardModelLearner`` (r_φ), both
        built from ``(cfg, rank, world_size, master_addr, master_port, threads)``."""
        self._spec = (cfg, placement, options)
        self._engine = engine
        self._threads = threads or actor_threads(cfg.learner.threads, cfg.learner.cpus_per_rank)
        self.timeout_s = cfg.cluster.call_timeout_s
        self._start()

    def _start(self) -> None:
        cfg, placement, options = self._spec
        n = cfg.learner.num_ranks
        threads = self._threads
        if placement is None:  # in-process, one rank (tests)
            addr, port = "127.0.0.1", _rendezvous_address()[1]
            self.ranks = ActorGroup(self._engine, [(cfg, 0, 1, addr, port, None)], local=True)
        else:
            # Probed in rank 0's bundle before rank 0 takes it (afterwards a task would not fit).
            addr, port = get(ray.remote(_rendezvous_address).options(**placement.actor_options(0)).remote())
            args = [(cfg, rank, n, addr, port, threads) for rank in range(n)]
            self.ranks = ActorGroup(self._engine, args, options or [placement.actor_options(i) for i in range(n)])
        self.num_ranks = len(self.ranks)
        self.owned: list[list[int]] = []  # the global rows of each rank in the last ``train``
        self.rank0_host = addr
        self.where: list[tuple[int, str]] = []  # (pid, node address) per rank, once ``locate`` has run

    def locate(self) -> None:
        """Ask every rank for its process and node, right after they have started (the driver
        asks once the roles are ready; asked of a hung rank it would never answer)."""
        self.where = [] if self.ranks.local else self.ranks.get(self.ranks.call_all(Engine.process_id))

    def rebuild(self) -> None:
        """Kill every rank and start the group again from the initial models (same placement)."""
        self.ranks.kill()
        self._start()
        self.locate()

    def gather(self, futures: list[Any], what: str) -> list[Any]:
        """Every rank's result of ``futures`` (a call the caller started, e.g. ``send_weights``),
        with the learner's deadline and failure rules."""
        return self._gather(futures, what)

    def _gather(self, futures: list[Any], what: str) -> list[Any]:
        """Every rank's result; ``LearnerFailedError`` as soon as a rank dies, or when some rank
        has not answered within ``cluster.call_timeout_s`` (its stack dumped to its log first)."""
        if self.ranks.local:
            return futures
        rank_of = {ref: r for r, ref in enumerate(futures)}
        pending, deadline = list(futures), time.monotonic() + self.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(rank_of[ref] for ref in pending)
                for r in late:
                    if r < len(self.where):
                        dump_stacks(*self.where[r])
                raise LearnerFailedError(f"learner rank {late[0]} did not finish {what} within "
                                         f"cluster.call_timeout_s={self.timeout_s:g} s{console.details('learner', late[0])}")
            try:
                get(ready[0])
            except RayActorError as exc:
                raise LearnerFailedError(f"learner rank {rank_of[ready[0]]} died during {what} "
                                         f"({brief(exc)}){console.details('learner', rank_of[ready[0]])}") from None
            except Exception:
                # A collective failing in a live rank is often the first sign of a dead peer.
                dead = _dead(pending, rank_of, grace_s=10.0)
                if dead is None:
                    raise
                raise LearnerFailedError(f"learner rank {dead} died during {what}{console.details('learner', dead)}") from None
        return get(futures)

    @contextmanager
    def failures(self) -> Iterator[None]:
        """Report a rank's death as ``LearnerFailedError`` also where it surfaces in another
        actor's call (a generator reading rank 0's weights from the object store)."""
        try:
            yield
        except RayActorError as exc:
            ids = [actor._actor_id.hex() for actor in ([] if self.ranks.local else self.ranks.actors)]
            if getattr(exc, "actor_id", None) not in ids:
                raise
            raise LearnerFailedError(f"learner rank {ids.index(exc.actor_id)} died ({brief(exc)})") from None

    def rank0_address(self) -> tuple[str, int]:
        """Address of rank 0's node and a port free there now (for another rendezvous store)."""
        return self.rank0_host, self._gather(self.ranks.call_all(LearnerEngine.free_port), "free_port")[0]

    def matmul_rate(self, tokens: int) -> float:
        """The learner's arithmetic rate (FLOP/s): every rank's probe (``LearnerEngine.matmul_rate``)
        at the same time, summed, so ranks that share cores share them here too."""
        return sum(self._gather(self.ranks.call_all(LearnerEngine.matmul_rate, tokens), "matmul_rate"))

    def train(self, rollout: Rollout, kl_coef: float, iteration: int) -> LearnResult:
        """One PPO iteration over ``rollout``, its rows dealt to the ranks by tokens (``shards``);
        rank 0's result (its figures are global). A rollout without rows (the pipeline dropped every
        row as too stale) trains nothing and still advances the version (``LearnerEngine.skip_update``)."""
        if len(rollout) == 0:
            self.owned = [[] for _ in range(self.num_ranks)]
            return self._gather(self.ranks.call_all(LearnerEngine.skip_update), "skip_update")[0]
        self.owned = self.shards(rollout, iteration)
        drew = list(rollout.generator_id) or [0] * len(rollout)
        args = [(rollout.select(rows), rows, drew, kl_coef, iteration) for rows in self.owned]
        return self._gather(self.ranks.call(LearnerEngine.train, args), "train")[0]

    def shards(self, rollout: Rollout, iteration: int) -> list[list[int]]:
        """The global rows each rank trains on: the first epoch's minibatches (the plan every rank
        computes, ``minibatches.minibatch_plan``) dealt by tokens, so no rank waits on another's long
        rows at every step; by rows when that would leave a rank without any."""
        p = self._spec[0].ppo
        plan = minibatch_plan(len(rollout), p.epochs, p.minibatches, seed=minibatch_seed(self._spec[0].seed, iteration),
                              sources=rollout.generator_id)[0]
        prompt, response = rollout.lengths()
        owned = balanced_shards([a + b for a, b in zip(prompt, response)], [m.tolist() for m in plan], self.num_ranks)
        return owned if all(owned) else [list(rows) for rows in split_evenly(len(rollout), self.num_ranks)]

    def trained_targets(self) -> tuple[list[list[float]], list[list[float]]]:
        """``(advantages, returns)`` of every row of the last ``train``, in the rollout's row order."""
        parts = self._gather(self.ranks.call_all(LearnerEngine.trained_targets), "trained_targets")
        rows = [i for owned in self.owned for i in owned]
        order = sorted(range(len(rows)), key=rows.__getitem__)
        advantages = [a for part, _ in parts for a in part]
        returns = [r for _, part in parts for r in part]
        return [advantages[i] for i in order], [returns[i] for i in order] if returns else []

    def policy_weights(self) -> Any:
        """A future of rank 0's ``WeightsPayload`` (the value itself when in-process), once every
        rank has done its part within ``cluster.call_timeout_s``: a rank that hangs here is the
        learner's failure (``LearnerFailedError``), not that of the generators that would wait on
        the payload as an argument of their loads and miss their own deadline."""
        futures = self.ranks.call_all(LearnerEngine.policy_weights)
        if not self.ranks.local:
            self._gather(futures[1:], "policy_weights")  # the other ranks' part of the gathers (None)
            ready, _ = ray.wait(futures[:1], timeout=self.timeout_s)  # rank 0's payload stays in the object store
            if not ready:
                if self.where:
                    dump_stacks(*self.where[0])
                raise LearnerFailedError(f"learner rank 0 did not finish policy_weights within cluster.call_timeout_s="
                                         f"{self.timeout_s:g} s{console.details('learner', 0)}")
        return futures[0]

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
        return self._gather(self.ranks.call_all(LearnerEngine.sent_fingerprints), "sent_fingerprints")[0]

    def save(self, out_dir: str) -> None:
        """The final policy and critic in Hugging Face format."""
        self._gather(self.ranks.call_all(LearnerEngine.save, out_dir), "save")

    def save_checkpoint(self, path: str) -> None:
        """Every rank's DeepSpeed states under ``path``."""
        self._gather(self.ranks.call_all(LearnerEngine.save_checkpoint, path), "save_checkpoint")

    def load_checkpoint(self, path: str) -> int:
        """Every rank loads its states; returns the policy version."""
        versions = set(self._gather(self.ranks.call_all(LearnerEngine.load_checkpoint, path), "load_checkpoint"))
        if len(versions) != 1:
            raise RuntimeError(f"learner ranks restored different policy versions {sorted(versions)} from {path}")
        return versions.pop()

    def kill(self) -> None:
        self.ranks.kill()


def _dead(pending: list[Any], rank_of: dict[Any, int], grace_s: float) -> int | None:
    """The rank among ``pending`` calls whose actor died, waiting up to ``grace_s`` to see it."""
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
    for ref in ready:
        try:
            get(ref)
        except RayActorError:
            return rank_of[ref]
        except Exception:  # noqa: BLE001 - another casualty of the same failure
            continue
    return None
