"""What drives a generator fleet besides its own bookkeeping (``cluster/fleet.py``): the parts the
run hands it once the rollout source that feeds from it exists (``Fleet.controlled_by``).

    keeper     brings a generator that joins to the learner's policy, and every one to a
               restored policy (the source's way: a sync to all, or each loading what was published)
    sampler    what samples from the generators in threads of its own (the pipelined source),
               paused while the fleet changes or a caller needs the generators to itself; none
               when nothing samples between the driver's calls
    spawner    where more generators come from (``rayppo scale``): room, placement, arguments
    on_join    told when generators joined (the trainer writes ``placement.json`` again)

With them the fleet pauses, brings up to date, restarts and grows its generators itself
(``Fleet.paused``, ``take_back``, ``restart``, ``grow``): a trainer asks the fleet, never the
source, and the run loop asks it to grow (``GrowingFleet``). This module imports no Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rayppo.cluster.placement import Placement


class PolicyKeeper(Protocol):
    """Keeps the fleet's generators on the learner's policy (the rollout source feeding from them)."""

    def bring_up_to_date(self, i: int) -> None:
        """Generator ``i`` (a replacement, or one joining the fleet) takes the published policy, checked."""
        ...

    def restart(self, version: int) -> None:
        """After a restore (inside ``Fleet.paused``): every generator takes the learner's ``version``."""
        ...


@runtime_checkable
class SamplesAhead(Protocol):
    """Samples from the fleet's generators in threads of its own, ahead of the learner (the
    pipelined source); its owner starts it once the roles are up and stops it when the run closes."""

    def start(self) -> None:
        """Start the threads (once; ``paused`` starts them again after)."""
        ...

    def paused(self, current: bool = False) -> AbstractContextManager[None]:
        """The threads stopped inside, started again after; with ``current`` every generator first
        holds the published policy."""
        ...

    def stop(self) -> None:
        """Tell the threads to stop, without waiting (the run is closing)."""
        ...

    def close(self) -> None:
        """Stop the threads and wait for them."""
        ...


class Spawner(Protocol):
    """Where more generators come from (``cluster/roles.py``'s ``GeneratorSpawner``)."""

    def room_for(self, count: int) -> bool:
        """Whether the cluster has ``count`` more generators' resources free now."""
        ...

    def reserve(self, count: int) -> list[tuple[Any, int]]:
        """Placement groups for ``count`` more, not waited for: each one's (placement group, bundle)."""
        ...

    def actor(self, i: int, placement: Placement) -> tuple[dict[str, Any], dict[str, Any]]:
        """Generator ``i``'s constructor arguments and its Ray actor options in ``placement``."""
        ...


@dataclass(frozen=True)
class FleetControl:
    """The parts that drive a fleet (module docstring)."""

    keeper: PolicyKeeper
    """Brings generators to the learner's policy: one that joins, or all of them after a restore."""
    spawner: Spawner
    """Reserves, places and builds more generators."""
    on_join: Callable[[], None]
    """Called after generators returned to the fleet (and tried to rejoin it)."""
    sampler: SamplesAhead | None = None
    """The threads that sample ahead, paused while the fleet changes; None: nothing samples between calls."""


class GrowingFleet(Protocol):
    """A generator fleet as the run loop sees it: one that grows while the run goes on (``rayppo
    scale generators.num=...``, ``Fleet``)."""

    def room_to_grow(self, generators: int) -> bool:
        """Whether ``generators`` in all can sample without a restart."""
        ...

    def grow(self, generators: int, minimum: int, iteration: int) -> list[int]:
        """``generators`` in all from now on, at least ``minimum`` sampling, the new ones joining at
        the boundary before ``iteration``; their indices."""
        ...
