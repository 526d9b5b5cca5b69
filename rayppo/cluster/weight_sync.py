"""How learner rank 0's new policy reaches every generator (``learner.weight_sync``), checked.

- ``ObjectStoreSync``: rank 0 packs the (gathered, merged) weights into numpy arrays and puts them
  in Ray's object store once; every generator reads them (zero-copy on its node) and reloads them
  in place. Works everywhere; on GPUs the weights make a device -> host -> device round trip.
- ``IpcSync`` (colocated on GPUs): learner rank i hands the generator on its GPU CUDA-IPC handles.
- ``BroadcastSync``: rank 0 and every inference worker of every generator form one process group
  at start (``rayppo/learner/broadcast_sender.py``); each sync is one broadcast per tensor, received by
  vLLM's weight-transfer engine inside each worker (NCCL GPU to GPU, or gloo on CPUs), or under
  LoRA adapter sync the adapter's A and B, registered as the version's adapter.

Both check that every generator reports the version the learner just produced, and then
(``checks.verify_sync``) that it holds the weights that were sent: ``verify_sync``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from rayppo.actors.generator import GeneratorEngine
from rayppo.cluster.fleet import Fleet
from rayppo.cluster.group import ActorGroup, get, get_within
from rayppo.cluster.learner_group import LearnerGroup
from rayppo.cluster.supervisor import Supervisor
from rayppo.config.derived import tensor_parallel_size, weight_sync_backend
from rayppo.config.schema import Config
from rayppo.errors import ActorFailedError, LearnerFailedError, brief
from rayppo.learner.broadcast_sender import SyncEndpoint
from rayppo.learner.guard import check_sent, check_weights


def _check_versions(versions: list[int], expected: int) -> None:
    if any(v != expected for v in versions):
        raise RuntimeError(f"generators report policy versions {versions} after sync, expected {expected}")


def verify_sync(learner: LearnerGroup, generators: ActorGroup, version: int, supervisor: Supervisor,
                refresh: Callable[[int], None], actors: list[int]) -> float:
    """The guard's weight check: the fingerprints of what each of ``actors`` (generators) holds
    against rank 0's of what it sent. Raises ``NonFiniteWeightsError`` when what was sent holds a
    NaN or inf (before any comparison: also where no generator can be fingerprinted), ``WeightSyncError``
    naming generator, tensor and version; returns ``sync/verified``: 1.0, or NaN when some
    generator cannot be fingerprinted (warned once). The calls are supervised: a generator that
    dies or hangs here is replaced, ``refresh``ed to the current weights, and fingerprinted again."""
    held = supervisor.call(generators, "generators", GeneratorEngine.weight_fingerprints, [()] * len(actors),
                           refresh=refresh, actors=actors)
    sent = learner.sent_fingerprints()
    check_sent(sent, version)
    for i, prints in zip(actors, held):
        if prints is not None:
            check_weights(sent, prints, i, version)
    if any(prints is None for prints in held):
        warnings.warn("checks.verify_sync: tensor-parallel vLLM generators cannot be fingerprinted yet; their "
                      "weights are checked by logprob_mismatch only (sync/verified = NaN)", stacklevel=2)
        return float("nan")
    return 1.0


class ObjectStoreSync:
    """Weights through Ray's object store: put once by rank 0, read by every generator."""

    def __init__(self, learner: LearnerGroup, generators: ActorGroup, supervisor: Supervisor, fleet: Fleet):
        self.learner, self.generators, self.supervisor, self.fleet = learner, generators, supervisor, fleet
        self.payload_bytes: int | None = None

    def sync(self, version: int) -> int:
        """Move the weights of ``version`` to the fleet's generators; returns the bytes delivered. A
        generator that dies while loading is replaced and loads the same payload."""
        payload = self.learner.policy_weights()  # an ObjectRef: rank 0's WeightsPayload

        def load(active: list[int]) -> int:
            _check_versions(self.supervisor.call(self.generators, "generators", GeneratorEngine.load_weights,
                                                 [(payload,)] * len(active), actors=active), version)
            return len(active)

        loaded = self.fleet.on_active(load)
        if self.payload_bytes is None:
            self.payload_bytes = get(payload).nbytes
        return self.payload_bytes * loaded

    def refresh(self, i: int) -> None:
        """A replacement generator i takes the current weights (and version) from rank 0, within
        the call deadline (a replacement that cannot load them stops the run naming it)."""
        payload = self.learner.policy_weights()
        what, timeout = f"replacement generator {i} could not load the current weights", self.supervisor.timeout_s
        version = get_within(payload, timeout, what).version
        _check_versions([get_within(self.generators.call_at(i, GeneratorEngine.load_weights, (payload,)), timeout, what)],
                        version)


@dataclass(frozen=True)
class BroadcastGroup:
    """The process group a broadcast sync forms: its backend, its members per generator, its deadline."""

    backend: str
    """``gloo`` or ``nccl`` (``weight_sync_backend``)."""
    workers_per_generator: int
    """Members per generator: one inference worker per tensor-parallel rank of a vLLM generator."""
    timeout_s: float = 600.0
    """Seconds a collective of the group may take (``cluster.sync_timeout_s``)."""


class BroadcastSync:
    """Weights broadcast by rank 0 over a process group it shares with every inference worker of
    the fleet's generators."""

    def __init__(self, learner: LearnerGroup, generators: ActorGroup, group: BroadcastGroup, fleet: Fleet,
                 supervisor: Supervisor | None = None):
        self.learner, self.generators, self.supervisor, self.fleet = learner, generators, supervisor, fleet
        self.backend, self.workers, self.timeout_s = group.backend, group.workers_per_generator, group.timeout_s
        self.version = 0  # what every generator holds: the initial weights until the first sync
        self._open()

    def _open(self) -> None:
        """Form the group: rank 0 and the active generators' workers (again after a replacement or
        a change of the fleet: a process group cannot take a new member, so everyone joins a fresh
        one). A generator that dies or hangs while joining is replaced and the group formed again."""
        while True:
            host, port = self.learner.rank0_address()
            g, w, active = self.generators, self.workers, list(self.fleet.active)
            endpoint = SyncEndpoint(self.backend, host, port, 1 + len(active) * w, self.timeout_s)
            # Both sides block until the group is complete: start the generators' joins first.
            joins = [g.call_at(i, GeneratorEngine.join_weight_sync, (endpoint, 1 + pos * w))
                     for pos, i in enumerate(active)]
            opened = self.learner.open_weight_sync(endpoint)
            failed = self._failed_call(joins, "join_weight_sync") if self.supervisor is not None else None
            if failed is None:
                self.layout = self.learner.gather(opened, "open_weight_sync")[0]
                get(joins)
                return
            self._drain(opened, joins, failed[0])
            self._replace(active[failed[0]], *failed[1:])

    def refresh(self, i: int) -> None:
        """Generator i was replaced (or rejoins the fleet): a new group with it, and the current
        weights to everyone."""
        self._open()
        if self.version:
            self.sync(self.version)

    def sync(self, version: int) -> int:
        """Broadcast the weights of ``version``; returns the bytes delivered to the workers. A
        generator that dies or misses the call deadline while receiving is replaced; the broken
        group is left to time out (``cluster.sync_timeout_s``), a fresh one formed with the
        replacement (or without it, when it left the fleet), and the broadcast sent again."""
        while True:
            active = list(self.fleet.active)
            receives = [self.generators.call_at(i, GeneratorEngine.receive_weights, (self.layout, version))
                        for i in active]
            sends = self.learner.send_weights()
            failed = self._failed_call(receives, "receive_weights") if self.supervisor is not None else None
            if failed is None:
                sent = self.learner.gather(sends, "send_weights")
                _check_versions(get(receives), version)
                self.version = version
                return sent[0]
            self._drain(sends, receives, failed[0])
            self._replace(active[failed[0]], *failed[1:])
            self._open()

    def _replace(self, i: int, cause: str, hung: bool) -> None:
        """Replace generator ``i``; when it finds no place it has left the fleet, and the group is
        formed again without it."""
        assert self.supervisor is not None  # a call fails only where a supervisor looks for failures (_failed_call's callers)
        self.supervisor.replace(self.generators, "generators", i, cause, hung)

    def _failed_call(self, futures: list[Any], method: str) -> tuple[int, str, bool] | None:
        """The first call (one future per active generator) whose generator died or missed the call
        deadline: (position in ``futures``, cause, hung); None when every one answered."""
        assert self.supervisor is not None  # called only when self.supervisor is not None
        index = {ref: i for i, ref in enumerate(futures)}
        pending, deadline = list(futures), time.monotonic() + self.supervisor.timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return index[pending[0]], (f"did not answer {method} within cluster.call_timeout_s="
                                           f"{self.supervisor.timeout_s:g} s"), True
            try:
                get(ready[0])
            except RayActorError as exc:
                return index[ready[0]], f"died ({brief(exc)})", False
        return None

    def _drain(self, sends: list[Any], receives: list[Any], failed: int) -> None:
        """Let the calls on the broken group end (their collectives time out), the failed
        generator's aside (it is about to be killed); a learner rank that died meanwhile is the
        learner's failure."""
        assert self.supervisor is not None  # a call fails only where a supervisor looks for failures (_failed_call's callers)
        try:
            self.learner.gather(sends, "the broken weight broadcast")
        except LearnerFailedError:
            raise
        except Exception:  # noqa: BLE001 - the broken broadcast's own error: expected here
            pass
        others = [ref for i, ref in enumerate(receives) if i != failed]
        if others:
            ray.wait(others, num_returns=len(others), timeout=self.timeout_s + self.supervisor.timeout_s)


class IpcSync:
    """Colocated on GPUs: learner rank i shares its GPU's policy tensors with generator i by
    CUDA-IPC handles; nothing is copied between processes. Under ZeRO-3 or merged LoRA the tensors
    are gathered or merged one at a time and each run is loaded before the next is made; an
    adapter is one run."""

    def __init__(self, learner: LearnerGroup, generators: ActorGroup):
        self.learner, self.generators = learner, generators

    @staticmethod
    def refresh(i: int) -> None:
        raise ActorFailedError(f"generator {i} was replaced; the CUDA-IPC sync cannot bring it up to date yet: use "
                               "learner.weight_sync=object_store for runs that must survive generator failures")

    def sync(self, version: int) -> int:
        """Hand over the weights of ``version``; returns the bytes the generators loaded."""
        g = self.generators
        g.get(g.call_all(GeneratorEngine.start_ipc_update))
        delivered = 0
        while True:
            runs = self.learner.ipc_next()  # collective: every rank, every run
            first = get(runs[0])
            if first is None:
                get(runs)
                break
            # Rank i's handles go to generator i, on the same GPU (futures: Ray resolves them there).
            g.get(g.call(GeneratorEngine.load_ipc, [(runs[i],) for i in range(len(g))]))
            delivered += first.nbytes * len(g)
        _check_versions(g.get(g.call_all(GeneratorEngine.finish_ipc_update, version)), version)
        return delivered


def make_weight_sync(cfg: Config, learner: LearnerGroup, generators: ActorGroup, supervisor: Supervisor,
                     fleet: Fleet) -> ObjectStoreSync | BroadcastSync | IpcSync:
    """The strategy ``learner.weight_sync`` selects (see ``weight_sync_backend``), to ``fleet``'s
    generators (colocated mode's CUDA-IPC sync: every generator, its fleet never shrinks)."""
    backend = weight_sync_backend(cfg)
    if backend is None:
        return ObjectStoreSync(learner, generators, supervisor, fleet)
    if backend == "ipc":
        return IpcSync(learner, generators)
    # A vLLM generator has one inference worker per tensor-parallel rank; the hf backend has one.
    tp = tensor_parallel_size(cfg.generators)
    return BroadcastSync(learner, generators, BroadcastGroup(backend, tp, cfg.cluster.sync_timeout_s), fleet, supervisor)
