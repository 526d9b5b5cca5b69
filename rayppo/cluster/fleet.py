"""The generator fleet: which generators sample now, and which wait for a place in the cluster.

A generator whose process dies is replaced (``Supervisor``). When its node is gone and no other
node has room for it, the replacement waits for a place that may never come: after
``cluster.placement_timeout_s`` without one, the generator *leaves the fleet*. The call it was
part of is made again over the generators left (``Fleet.on_active``); their shares of the next
batches grow, and since a row's sampling noise does not depend on the split (``sample_seeds``),
they draw the same rows. Ray keeps the replacement's request open: when a node with room joins,
its placement-group bundle is placed again and the replacement starts. At the next iteration
boundary the trainer takes it back (``returned``): it loads the current weights, its fingerprints
are checked, and it samples from then on (``rejoin``). Below ``generators.min_num`` generators
the run stops with a checkpoint and the command to resume.

Once the rollout source that feeds from it exists, the fleet is driven by it (``controlled_by``,
``cluster/fleet_control.py``): the fleet pauses what samples on its own (``paused``), brings a
generator that returns up to date (``take_back``), every one to a restored policy (``restart``),
and grows by more generators without a restart (``grow``, ``rayppo scale``).

The fleet is written to ``fleet.json`` in the run folder on every change (``rayppo status DIR``
shows it) and goes into each iteration's metrics (``fleet/generators``, ``faults/generators_lost``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError

from rayppo.cluster.fleet_control import FleetControl
from rayppo.cluster.fleet_file import FLEET_FILE
from rayppo.cluster.group import ActorGroup, get
from rayppo.cluster.placement import Placement, bundle_placed
from rayppo.cluster.startup import start_failure
from rayppo.console import console
from rayppo.errors import ActorFailedError, FleetTooSmallError, GeneratorLostError
from rayppo.machine.role_resources import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_S = 1.0
"""Pause before starting again a replacement that died before it ran (its node was lost)."""


class Fleet:
    """Generators ``active`` (sampling) and ``waiting`` (replacements with no place yet)."""

    def __init__(self, group: ActorGroup, placement: Placement | None, minimum: int, place_timeout_s: float,
                 run_dir: Path | None = None):
        self.group, self.placement, self.minimum = group, placement, minimum
        self.place_timeout_s, self.run_dir = place_timeout_s, run_dir
        self.active: list[int] = list(range(len(group)))
        self.waiting: dict[int, Any] = {}
        """Generator -> the future of its replacement's first answer (ready once it is placed and built)."""
        self.lost = 0
        """Times a generator left the fleet (``faults/generators_lost``)."""
        self._left: set[int] = set()  # generators that left it at some time
        self.iteration = 0
        """The iteration the trainer is in (for the messages and ``fleet.json``; set by ``returned``)."""
        self.control: FleetControl | None = None
        """What drives it once the rollout source exists (``controlled_by``)."""
        self._save()

    def controlled_by(self, control: FleetControl) -> None:
        """From now on the fleet pauses, brings up to date, restarts and grows its generators with
        ``control``'s parts (``cluster/fleet_control.py``)."""
        self.control = control

    def _controlled(self) -> FleetControl:
        if self.control is None:
            raise RuntimeError("the fleet is driven by no rollout source yet (Fleet.controlled_by)")
        return self.control

    @contextmanager
    def paused(self, current: bool = False) -> Iterator[None]:
        """The generators to the caller alone inside (evaluation, a generator rejoining, a restore):
        what samples from them on its own stops first and starts again after (the pipeline's
        batches in flight are drawn again); with ``current`` every generator first holds the
        published policy. Nothing samples between calls otherwise: then there is nothing to stop."""
        sampler = self._controlled().sampler
        if sampler is None:
            yield
            return
        with sampler.paused(current):
            yield

    def restart(self, version: int) -> None:
        """After a restore (inside ``paused``): every generator takes the learner's ``version``."""
        self._controlled().keeper.restart(version)

    @property
    def placed_by_ray(self) -> bool:
        """Whether its generators are Ray actors in placement groups (not in-process ones)."""
        return not self.group.local and self.placement is not None

    def on_active(self, call: Callable[[list[int]], T]) -> T:
        """``call(active generators)``, made again over the generators left each time one leaves
        the fleet during it (the supervisor's fan-out cannot return every result then, and says
        so with ``GeneratorLostError``)."""
        while True:
            try:
                return call(list(self.active))
            except GeneratorLostError as exc:
                log.warning("%s: making the call again on generators %s", exc, self.active)

    def started(self, i: int, first_answer: Any, timeout_s: float) -> Any | None:
        """Wait for replacement generator ``i``'s ``first_answer`` (a future) and return its value;
        ``GetTimeoutError`` past ``timeout_s``. A Ray-placed replacement whose bundle has no
        node after ``cluster.placement_timeout_s`` leaves the fleet instead: None (and
        ``FleetTooSmallError`` below ``generators.min_num``). One that dies before it runs its
        constructor (placed on the lost node before Ray noticed it is gone) is started again."""
        if not self.placed_by_ray:
            return get(first_answer, timeout=timeout_s)
        deadline = time.monotonic() + self.place_timeout_s
        while True:
            ready, _ = ray.wait([first_answer], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                return get(first_answer)
            except RayActorError as exc:
                if exc.actor_init_failed or time.monotonic() > deadline:  # its own error: no place fixes that
                    raise
            time.sleep(RETRY_S)
            self.group.restart(i)
            first_answer = self.group.call_at(i, Engine.process_id, ())
        assert self.placement is not None  # placed_by_ray, checked above
        if not bundle_placed(self.placement, i):
            self._leave(i, first_answer)
            return None
        return get(first_answer, timeout=max(0.0, timeout_s - self.place_timeout_s))

    def _leave(self, i: int, first_answer: Any) -> None:
        """Generator ``i`` waits for a place (its replacement's ``first_answer``) out of the fleet;
        below ``minimum`` the run stops (``FleetTooSmallError``)."""
        if i in self.active:
            self.active.remove(i)
        self.waiting[i] = first_answer
        self.lost += 1
        self._left.add(i)
        self._save()
        where = (f"no node has room for it within cluster.placement_timeout_s={self.place_timeout_s:g} s "
                 f"(its node is gone)")
        if len(self.active) < self.minimum:
            raise FleetTooSmallError(
                f"generator {i} was lost at iteration {self.iteration}: {where}; {len(self.active)} of "
                f"{len(self.group)} generators left, fewer than generators.min_num={self.minimum}. Add capacity and "
                f"resume, or resume on fewer: rayppo train --resume {self.run_dir or 'DIR'} "
                f"generators.num={max(1, len(self.active))}")
        console.write(f"generator {i} left the fleet at iteration {self.iteration}: {where}; going on with "
                      f"{len(self.active)} of {len(self.group)} (it rejoins when the cluster has room)")

    def returned(self, iteration: int) -> list[int]:
        """At the boundary before ``iteration`` (which the fleet's messages and ``fleet.json`` name
        from now on): the waiting generators whose replacement is placed and built now (no
        waiting). One that died meanwhile (its new node lost too) is replaced again and keeps
        waiting; one whose constructor failed stops the run (``ActorFailedError``)."""
        self.iteration = iteration
        back = []
        for i, answer in list(self.waiting.items()):
            ready, _ = ray.wait([answer], timeout=0)
            if not ready:
                continue
            try:
                ray.get(answer)
                back.append(i)
            except RayActorError as exc:
                if exc.actor_init_failed:  # its own error (a node without the model, no memory): said, not retried
                    raise ActorFailedError(f"generator {i} failed while starting: {start_failure(exc)}"
                                           f"{console.details('generators', i)}") from None
                self.group.restart(i)
                self.waiting[i] = self.group.call_at(i, Engine.process_id, ())
        return back

    def take_back(self, iteration: int) -> list[int]:
        """At the boundary before ``iteration``: the generators that ``returned`` take the current
        weights, are checked and rejoin (``rejoin``), with what samples on its own paused
        meanwhile; ``on_join`` is told. Returns them."""
        back = self.returned(iteration)
        if back:
            control = self._controlled()
            with self.paused():
                self.rejoin_all(back, control.keeper.bring_up_to_date)
            control.on_join()
        return back

    def room_to_grow(self, generators: int) -> bool:
        """Whether the cluster has room now for ``generators`` in all (more than now)."""
        more = generators - len(self.group)
        return more > 0 and self._controlled().spawner.room_for(more)

    def grow(self, generators: int, minimum: int, iteration: int) -> list[int]:
        """``generators`` generators in all from now on (more than now), at least ``minimum`` of
        them sampling (``generators.min_num`` may come with them), without a restart
        (``rayppo scale``). The new ones start in placement groups of their own and wait like lost
        ones; those placed and built within ``cluster.placement_timeout_s`` join at once, at the
        boundary before ``iteration`` (``take_back``), the others at a later boundary. Returns
        their indices."""
        spawner, placement = self._controlled().spawner, self.placement
        if placement is None:
            raise RuntimeError("a fleet outside placement groups does not grow")
        added = []
        for group, bundle in spawner.reserve(generators - len(self.group)):
            i = placement.add(group, bundle)
            added.append(self.group.add(*spawner.actor(i, placement)))
            assert added[-1] == i, f"generator {added[-1]} placed as {i}"  # one list of places per actor
        self.minimum = minimum
        for i in added:
            self.waiting[i] = self.group.call_at(i, Engine.process_id, ())
        self._save()
        answers = [self.waiting[i] for i in added]
        ray.wait(answers, num_returns=len(answers), timeout=self.place_timeout_s)
        self.take_back(iteration)
        return added

    def rejoin_all(self, generators: list[int], bring_up_to_date: Callable[[int], None]) -> None:
        """``rejoin`` each of ``generators``; one lost again while catching up waits for a place again."""
        for i in generators:
            try:
                self.rejoin(i, bring_up_to_date)
            except GeneratorLostError:
                continue

    def rejoin(self, i: int, bring_up_to_date: Callable[[int], None]) -> None:
        """Returned generator ``i`` joins the active ones, ``bring_up_to_date(i)`` gives it the
        current weights and checks them (a broadcast sync forms its group with the active
        generators, so it is one of them first); it samples from the next call on. When that
        fails it is not in the fleet and the error is raised."""
        del self.waiting[i]
        self.active = sorted(self.active + [i])
        try:
            bring_up_to_date(i)
        except BaseException:
            if i in self.active:  # not when it left again meanwhile (``_leave``)
                self.active.remove(i)
            raise
        self._save()
        again = "rejoined" if i in self._left else "joined"
        console.write(f"generator {i} {again} the fleet at iteration {self.iteration}: {len(self.active)} of "
                      f"{len(self.group)} generators")

    def metrics(self) -> dict[str, float]:
        """The fleet's figures of the metrics line."""
        return {"fleet/generators": float(len(self.active)), "faults/generators_lost": float(self.lost)}

    def state(self) -> dict[str, Any]:
        """What ``fleet.json`` holds."""
        return {"generators": len(self.group), "active": self.active, "waiting": sorted(self.waiting),
                "min_num": self.minimum, "lost": self.lost, "iteration": self.iteration, "time": time.time()}

    def _save(self) -> None:
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f"{FLEET_FILE}.tmp"
        tmp.write_text(json.dumps(self.state()))
        tmp.replace(self.run_dir / FLEET_FILE)

