"""Calls that survive a dead or hung actor: replace it, bring it up to date, redo its share.

The driver fans work out to generator, reference and reward actors with ``Supervisor.call``
instead of waiting on the futures directly. An actor whose process died (SIGKILL, OOM, node
loss: Ray raises ``RayActorError``) or that misses ``cluster.call_timeout_s`` is replaced by a
new actor with the same arguments and placement; ``refresh(i)`` brings it to the current state
(a generator: the current policy weights and version); then only that actor's share of the
call runs again, so no prompt is lost or scored twice. Replacements are counted
(``faults/actor_restarts``) and bounded as a crash-loop detector: at most
``cluster.max_actor_restarts`` within any ``cluster.restart_window`` completed iterations, so a
long run survives sporadic faults indefinitely while an actor that dies again and again (no
iterations completing in between) stops the run. A replacement generator that finds no place in
the cluster (its node gone) leaves the generator fleet instead of stopping the run (``fleet.py``).

A hung actor's threads are dumped to its own log first (``faulthandler`` on SIGUSR1, set up in
every role's process by ``rayppo.machine.role_resources``) when it runs on this node.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rayppo.cluster.fleet import Fleet
from rayppo.cluster.group import ActorGroup, get
from rayppo.cluster.startup import start_failure
from rayppo.console import console
from rayppo.errors import ActorFailedError, RayppoError, RunClosedError, SharesLostError, brief, restated
from rayppo.machine.role_resources import Engine

log = logging.getLogger(__name__)


@dataclass
class Fanout:
    """One typed fan-out: ``method`` on actor i of ``group`` with ``args[i]``."""

    group: ActorGroup
    role: str
    """For messages: ``generators``, ``reference``, ``reward``."""
    method: Callable[..., Any]
    args: Sequence[tuple]
    refresh: Callable[[int], None] | None = None
    """Brings a replacement actor i up to date before its share runs again."""
    actors: Sequence[int] | None = None
    """The actors that ``args`` go to, in order; None: actor i gets ``args[i]``."""

    def actor_at(self, pos: int) -> int:
        """The actor that ``args[pos]`` goes to."""
        return pos if self.actors is None else self.actors[pos]
    results: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    """When the last result arrived, from the start of ``Supervisor.run``."""


@dataclass(frozen=True)
class InFlight:
    """The calls of one ``Supervisor.run`` still out, and the shares lost with their generators."""

    fanouts: list[Fanout]
    """The run's fan-outs, in the caller's order."""
    pending: dict[Any, tuple[Fanout, int, float]] = field(default_factory=dict)
    """Each future still out -> its fan-out, position and deadline."""
    lost: dict[int, list[int]] = field(default_factory=dict)
    """A fan-out's index -> its positions whose generator left the fleet."""


class Supervisor:
    """Restarts actors of any group it calls, within one crash-loop budget for all of them."""

    def __init__(self, max_restarts: int, timeout_s: float, window: int = 10):
        self.max_restarts, self.timeout_s, self.window = max_restarts, timeout_s, window
        self.restarts = 0
        """Restarts over the run (``faults/actor_restarts``)."""
        self.completed = 0
        """Iterations completed, redone ones included: the clock of the restart window."""
        self._recent: deque[int] = deque()  # ``completed`` at each restart still inside the window
        self._lock = threading.Lock()
        self._where: dict[tuple[ActorGroup, int], tuple[int, str]] = {}  # (group, actor) -> (pid, node address)
        self.closed = False
        """Set by ``close``: the run is ending and its actors are being killed."""
        self.fleet: Fleet | None = None
        """The generators' fleet (``add_fleet``)."""

    def add_fleet(self, fleet: Fleet) -> None:
        """A replacement in ``fleet.group`` that finds no place leaves the fleet (``Fleet.started``)."""
        self.fleet = fleet

    def close(self) -> None:
        """No replacements from now on: a call whose actor dies (killed by the run's own
        ``close``) raises ``RunClosedError`` instead of starting a new actor."""
        self.closed = True

    def watch(self, group: ActorGroup) -> None:
        """Note where each actor of ``group`` runs (waits until they are built)."""
        if not group.local:
            for i, where in enumerate(group.get(group.call_all(Engine.process_id))):
                self._where[group, i] = where

    def call(self, group: ActorGroup, role: str, method: Callable[..., Any], args: Sequence[tuple],
             refresh: Callable[[int], None] | None = None, actors: Sequence[int] | None = None) -> list[Any]:
        """``method`` on actor i with ``args[i]`` (on ``actors[i]`` when given); every result, in
        order; failed shares redone."""
        return self.run([Fanout(group, role, method, args, refresh, actors)])[0]

    def call_one(self, group: ActorGroup, role: str, i: int, method: Callable[..., Any], args: tuple,
                 refresh: Callable[[int], None] | None = None) -> Any:
        """``method`` on actor ``i`` alone (the asynchronous pipeline drives each generator on its
        own); replaced and redone like a share of ``call``."""
        return self.run([Fanout(group, role, method, [args], refresh, actors=[i])])[0][0]

    def run(self, fanouts: list[Fanout]) -> list[list[Any]]:
        """Several fan-outs at once (e.g. reference and reward scoring); each one's results, and
        ``Fanout.seconds`` set to when its last result arrived. Every call has its own deadline,
        ``cluster.call_timeout_s`` from when it was sent: a share redone on a replacement gets the
        whole deadline again, and only the calls past theirs count as hung.

        A share whose generator leaves the fleet (its replacement finds no place) is not sent again;
        the others run to their end, and then ``SharesLostError`` carries every result and the lost
        positions: the caller redoes only those, and no call of this fan-out is left running on an
        actor behind the retry (where it would hold the retry back, look hung, and do its work twice).
        """
        start = time.perf_counter()
        calls = InFlight(fanouts)
        for f in fanouts:
            f.results = [None] * len(f.args)
            for pos, a in enumerate(f.args):
                if f.group.local:
                    f.results[pos] = f.group.call_at(f.actor_at(pos), f.method, a)
                else:
                    self._send(calls, f, pos)
        while calls.pending:
            self._take_next(calls, start)
        if calls.lost:
            positions = [sorted(calls.lost.get(k, [])) for k in range(len(fanouts))]
            raise SharesLostError(f"{sum(map(len, positions))} shares lost with their generators",
                                  [f.results for f in fanouts], positions)
        return [f.results for f in fanouts]

    def _take_next(self, calls: InFlight, start: float) -> None:
        """Wait for the next result, until the first deadline: keep it (and when it is its fan-out's
        last, the fan-out's ``seconds`` since ``start``), or redo the share of an actor that died;
        at the deadline, replace the hung actors (``_replace_hung``)."""
        first = min(deadline for _, _, deadline in calls.pending.values())
        ready, _ = ray.wait(list(calls.pending), num_returns=1, timeout=max(0.0, first - time.monotonic()))
        if not ready:
            self._replace_hung(calls)
            return
        f, pos, _ = calls.pending.pop(ready[0])
        i = f.actor_at(pos)
        try:
            f.results[pos] = get(ready[0])
        except RayppoError as exc:  # the actor's own error about its input: one line, then its log
            raise restated(exc, console.details(f.role, i)) from None
        except RayActorError as exc:
            if exc.actor_id not in (None, f.group.actors[i]._actor_id.hex()):
                raise  # another actor's death reached this call (an argument it produced)
            self._redo(calls, f, pos, f"died ({brief(exc)})")
            return
        if not any(g is f for g, _, _ in calls.pending.values()):
            f.seconds = time.perf_counter() - start

    def _redo(self, calls: InFlight, f: Fanout, pos: int, cause: str, hung: bool = False) -> None:
        """Replace the actor of ``f``'s share ``pos`` and send the share again, with every other call
        still pending on the dead actor (a redo can give one generator two shares of a fan-out: the
        second's error would name the replaced actor, and a hung actor never answers either); when
        the actor left the fleet instead, note those shares as lost (``run`` raises once the others
        are done)."""
        i = f.actor_at(pos)
        on_actor = [future for future, (g, p, _) in calls.pending.items() if g.group is f.group and g.actor_at(p) == i]
        stranded = [calls.pending.pop(future)[:2] for future in on_actor]
        if not self.replace(f.group, f.role, i, cause, hung, f.refresh):
            for g, p in [(f, pos), *stranded]:
                calls.lost.setdefault(next(k for k, h in enumerate(calls.fanouts) if h is g), []).append(p)
            return
        for g, p in [(f, pos), *stranded]:
            self._send(calls, g, p)

    def _send(self, calls: InFlight, f: Fanout, pos: int) -> None:
        future = f.group.call_at(f.actor_at(pos), f.method, f.args[pos])
        calls.pending[future] = (f, pos, time.monotonic() + self.timeout_s)

    def _replace_hung(self, calls: InFlight) -> None:
        """The calls past their deadline count as hung: their actors are replaced, their shares sent
        again (with the other calls pending on those actors: ``_redo``)."""
        now = time.monotonic()
        for future, (f, pos, deadline) in list(calls.pending.items()):
            if deadline <= now and future in calls.pending:  # not resent already with an earlier call of its actor
                del calls.pending[future]
                self._redo(calls, f, pos, f"did not answer {f.method.__name__} within "
                                          f"cluster.call_timeout_s={self.timeout_s:g} s", hung=True)

    def progress(self) -> None:
        """One more iteration completed (the trainers call it at the end of each)."""
        with self._lock:
            self.completed += 1

    def count_restart(self, failure: str, error: type[ActorFailedError] = ActorFailedError, hint: str = "") -> None:
        """Count one restart for ``failure``; when ``max_restarts`` happened within the last
        ``window`` completed iterations already, a crash loop: raise ``error`` saying so."""
        with self._lock:  # the asynchronous pipeline's stages call from their own threads
            while self._recent and self._recent[0] <= self.completed - self.window:
                self._recent.popleft()
            if len(self._recent) >= self.max_restarts:
                raise error(f"{failure}; restarts are spent: cluster.max_actor_restarts={self.max_restarts} within "
                            f"cluster.restart_window={self.window} iterations (a crash loop, not a sporadic "
                            f"fault){hint}")
            self._recent.append(self.completed)
            self.restarts += 1

    def replace(self, group: ActorGroup, role: str, i: int, cause: str, hung: bool = False,
                refresh: Callable[[int], None] | None = None) -> bool:
        """Replace actor ``i`` of ``group`` (counted against the budget; a hung one's stacks
        dumped first), wait until it is built, bring it up to date with ``refresh``. False when
        it found no place and left the generator fleet instead (``Fleet.started``)."""
        if self.closed:
            raise RunClosedError(f"{role} actor {i} {cause} after the run was closed: not replaced")
        self.count_restart(f"{role} actor {i} {cause}", hint=console.details(role, i))
        if hung:
            dump_stacks(*self._where.get((group, i), (None, None)))
        start = time.perf_counter()
        group.restart(i)
        where = self._started(group, role, i)
        if where is None:
            return False
        self._where[group, i] = where
        if refresh is not None:
            refresh(i)
        log.warning("%s actor %d %s: replaced in %.1f s (%s); redoing its share", role, i, cause,
                    time.perf_counter() - start, self.budget_text())
        return True

    def _started(self, group: ActorGroup, role: str, i: int) -> tuple[int, str] | None:
        """Wait (within the call deadline) until replacement actor i is built; where it runs (None:
        a generator that left the fleet). A replacement that fails while starting, or does not
        start in time, stops the run naming it."""
        first_answer = group.call_at(i, Engine.process_id, ())
        try:
            if self.fleet is not None and group is self.fleet.group:  # no place in time: it leaves the fleet
                return self.fleet.started(i, first_answer, self.timeout_s)
            return get(first_answer, timeout=self.timeout_s)
        except GetTimeoutError:
            raise ActorFailedError(f"the replacement of {role} actor {i} did not start within cluster.call_timeout_s="
                                   f"{self.timeout_s:g} s{console.details(role, i)}") from None
        except RayActorError as exc:
            raise ActorFailedError(f"the replacement of {role} actor {i} failed while starting: "
                                   f"{start_failure(exc)}{console.details(role, i)}") from None

    def budget_text(self) -> str:
        """``restart 4 of the run, 1 of cluster.max_actor_restarts=3 within 10 iterations``."""
        return (f"restart {self.restarts} of the run, {len(self._recent)} of cluster.max_actor_restarts="
                f"{self.max_restarts} within {self.window} iterations")


def dump_stacks(pid: int | None, host: str | None) -> None:
    """SIGUSR1 to a hung actor's process when it runs on this node: its threads' stacks go to its log."""
    if pid is not None and host == ray.util.get_node_ip_address():
        try:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)  # let it write before the kill
        except ProcessLookupError:
            pass
