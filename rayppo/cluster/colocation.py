"""Who holds the GPUs when: the schedule of colocated mode (``cluster.colocate_all``).

When every role shares the learner's GPUs, memory is shared in time. Per iteration:

    generate          generators awake (weights + KV cache), learner resident but idle
    sleep             vLLM frees its KV cache and moves its weights to host memory (level 1)
    score, learn      reference, reward and the learner's PPO update have the GPU
    release           they hand their allocators' cached blocks back to the device
    wake weights      vLLM's weights come back (the sync writes into them)
    sync              learner rank i -> the generator on its GPU (CUDA-IPC, or the object store)
    release           the sync's gathered and IPC-shared blocks go back to the device
    wake kv_cache     the KV cache is re-allocated for the next generation

The synchronous rollout source (the only one colocated mode runs: generation and learning take
turns) calls each step where it belongs (``trainers/sync_source.py``): ``sleep_generators`` once
it has generated, ``wake_weights`` as its sync begins, ``wake_kv_cache`` once the sync is checked;
``record`` keeps the order of what happened (``events``).

Level 1 keeps a host copy of the weights, so a failed sync cannot leave an engine with none; the
KV cache holds no state between iterations. vLLM refuses sleep mode on CPU (``vllm/platforms/
cpu.py``, 0.32): there the same schedule runs and each sleep/wake is recorded as skipped, so
the order of the stages is tested on CPU and the memory it frees only on GPUs.

Disaggregated runs (roles on their own devices) use ``DeviceSchedule(False)``: nothing to do.
"""

from __future__ import annotations

import logging

from rayppo.actors.generator import GeneratorEngine
from rayppo.cluster.group import ActorGroup, get_within
from rayppo.cluster.learner_group import LearnerGroup
from rayppo.machine.role_resources import Engine

log = logging.getLogger(__name__)


class DeviceSchedule:
    """Sleeps and wakes the generators around the stages that need their memory; ``events``
    records what happened, in order (``"generators: sleep"`` or ``"generators: sleep skipped"``,
    and the driver's stage names)."""

    def __init__(self, colocated: bool, timeout_s: float | None = None):
        self.colocated, self.timeout_s = colocated, timeout_s
        self.generators: ActorGroup | None = None
        """The generators it sleeps and wakes; None until they are spawned (``roles_spawned``)."""
        self.scorers: list[ActorGroup] = []
        """The roles besides the learner that use the GPU while vLLM sleeps."""
        self.learner: LearnerGroup | None = None
        """The learner group, whose ranks (new ones after a learner restart) use the GPU too."""
        self.events: list[str] = []
        self.asleep: set[str] = set()
        """What the generators have given back and not taken again: ``weights``, ``kv_cache``."""
        self._warned = False

    def _spawned(self) -> ActorGroup:
        """The generators, which colocated mode sleeps and wakes only once they are spawned."""
        if self.generators is None:
            raise RuntimeError("colocation: the generators are slept or woken before they are spawned")
        return self.generators

    def roles_spawned(self, generators: ActorGroup, scorers: list[ActorGroup], learner: LearnerGroup) -> None:
        """The roles that share the GPUs are up: the generators to sleep and wake, and the others
        to release their cached memory before each wake-up."""
        self.generators, self.scorers, self.learner = generators, scorers, learner

    def record(self, event: str) -> None:
        """Record a step of start-up or of the iteration (only in colocated mode, where order matters)."""
        if self.colocated:
            self.events.append(str(event))  # a trainer's stage by its name

    def sleep_generators(self) -> None:
        """Before scoring and learning: the generators give their GPU memory back."""
        if self.colocated:
            generators = self._spawned()
            self._record("sleep", self._get(generators, generators.call_all(GeneratorEngine.sleep), "sleep"))
            self.asleep = {"weights", "kv_cache"}

    def wake_weights(self) -> None:
        """Before the sync: the other roles release their cached memory (PyTorch's allocator would
        keep its peak reserved), then the generators' weights come back to be overwritten."""
        if self.colocated:
            self._release_others()
            generators = self._spawned()
            self._record("wake weights",
                         self._get(generators, generators.call_all(GeneratorEngine.wake_up, ["weights"]),
                                   "wake weights"))
            self.asleep.discard("weights")

    def wake_kv_cache(self) -> None:
        """After the sync: the KV cache is re-allocated for the next generation, into the memory the
        sync's gathers and IPC-shared tensors held."""
        if self.colocated:
            self._release_others()
            generators = self._spawned()
            self._record("wake kv_cache",
                         self._get(generators, generators.call_all(GeneratorEngine.wake_up, ["kv_cache"]),
                                   "wake kv_cache"))
            self.asleep.discard("kv_cache")

    def wake_for_restore(self) -> None:
        """A learner failure can land between the sleep and the wake-ups: before a restore's sync
        the weights must be back (vLLM 0.32's sleep unmaps their memory: writing into it is an
        illegal access on a GPU; ``vllm/device_allocator/cumem.py``)."""
        if "weights" in self.asleep:
            self.wake_weights()

    def wake_after_restore(self) -> None:
        """After a restore's sync: the KV cache back for the next generation."""
        if "kv_cache" in self.asleep:
            self.wake_kv_cache()

    def _get(self, group: ActorGroup, futures: list, step: str) -> list:
        """The answers within ``cluster.call_timeout_s``: a hung engine stops the run naming the step."""
        if group.local or self.timeout_s is None:
            return group.get(futures)
        return get_within(futures, self.timeout_s, f"colocated mode: {step} did not complete")

    def _release_others(self) -> None:
        for group in [*self.scorers, *([self.learner.ranks] if self.learner is not None else [])]:
            self._get(group, group.call_all(Engine.release_cached_memory), "release cached memory")
        self.events.append("others: release cached memory")

    def _record(self, what: str, done: list[bool]) -> None:
        skipped = not all(done)
        self.events.append(f"generators: {what}{' skipped' if skipped else ''}")
        if skipped and not self._warned:
            self._warned = True
            log.warning("colocated mode: vLLM sleep/wake skipped (sleep mode needs vLLM on GPUs; this run's "
                        "generators cannot free their memory, the schedule runs unchanged)")
