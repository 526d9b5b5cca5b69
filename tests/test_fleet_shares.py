"""A generator that leaves the fleet mid-call (its node removed from a real multi-node Ray
cluster, ``ray.cluster_utils.Cluster``): the other generators' shares are kept, not abandoned and
redone, so an environment steps once per turn of every episode; only the lost share is played
again, split over the generators left, and the batch comes back in order.

Before, the call was made again over the generators left while their first calls still ran: each
retry queued behind its own abandoned call with a fresh deadline, and every episode of a surviving
generator was played twice. Then a second fault during that recovery (a survivor killed, or hung,
while it redid a lost share) crashed the call: a lost share was cut into a piece per survivor, so a
survivor held two calls of the fan-out, and the second one's error named the actor already replaced.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group

from rayppo.cluster.fleet import Fleet
from rayppo.cluster.group import ActorGroup
from rayppo.cluster.placement import Placement
from rayppo.cluster.shares import ShareCall, sampled_shares
from rayppo.cluster.supervisor import Supervisor
from rayppo.machine.role_resources import Engine

pytestmark = pytest.mark.slow

STEP_S = 0.05
"""One environment step; a share of 8 episodes x 4 turns takes ~1.6 s."""


class Episodes(Engine):
    """A generator stand-in whose every call plays episodes against an environment that logs each
    step it takes to a file (one line per step, from whichever process plays it). While the file
    ``hang`` names exists, the first call to play a row from ``hang_from`` on removes it and hangs."""

    def __init__(self, log: str, hang: str = "", hang_from: int = 0):
        self.log, self.hang, self.hang_from = log, hang, hang_from

    def play(self, rows: list[int], turns: int) -> list[int]:
        if self.hang and rows and rows[0] >= self.hang_from and self._claim_hang():
            time.sleep(3600)
        for row in rows:
            for turn in range(turns):
                with open(self.log, "a") as f:
                    f.write(f"{row} {turn} {os.getpid()}\n")
                time.sleep(STEP_S)
        return rows

    def _claim_hang(self) -> bool:
        """Whether this call removed the ``hang`` file: two survivors can redo lost rows at once,
        and only the one whose remove succeeds (an atomic claim) hangs."""
        try:
            os.remove(self.hang)
        except FileNotFoundError:
            return False
        return True


def steps(log: Path) -> list[tuple[int, int, int]]:
    """(row, turn, pid) of each whole line the episodes logged so far."""
    lines = log.read_text().split("\n")[:-1] if log.exists() else []
    return [(int(r), int(t), int(p)) for r, t, p in (line.split() for line in lines)]


def first_pid(log: Path, rows: range, exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """The process of the first step logged of a row in ``rows`` by a process not in ``exclude``."""
    while True:
        found = [pid for row, _, pid in steps(log) if row in rows and pid not in exclude]
        if found:
            return found[0]
        time.sleep(0.01)


def lose_node_after_first_step(c: Cluster, node, log: Path, first_row: int) -> None:
    """Once the generator whose share starts at ``first_row`` has logged a step, its node goes the
    way a machine does: its worker SIGKILLed and its raylet with it. Removing the node alone leaves
    the worker running until it notices its raylet is gone, and on a loaded machine (CI) such a
    worker played its whole share before dying, which is not a loss mid-call."""
    while True:
        lines = log.read_text().split("\n")[:-1] if log.exists() else []  # whole lines only
        pids = [int(line.split()[2]) for line in lines if int(line.split()[0]) >= first_row]
        if pids:
            break
        time.sleep(0.01)
    os.kill(pids[0], signal.SIGKILL)
    c.remove_node(node, allow_graceful=False)


@contextlib.contextmanager
def node_cluster(node_resources: list[dict[str, float]]):
    """A head and a node of one CPU per entry of ``node_resources`` (its custom resources), Ray
    connected to it; yields (cluster, nodes)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path
    # A lost node noticed in ~3 s (health checks at 1 s x 3; Ray's default is 3 s x 5), as in test_fleet.py.
    checks = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": checks})
    nodes = [c.add_node(num_cpus=1, resources=resources) for resources in node_resources]
    ray.init(address=c.address)
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def cluster():
    """A head and two generator nodes (custom resources ``gen0``, ``gen1`` pin one generator each)."""
    with node_cluster([{f"gen{i}": 1} for i in range(2)]) as made:
        yield made


def test_a_generator_lost_mid_call_costs_only_its_own_share(cluster, tmp_path):
    c, nodes = cluster
    log = tmp_path / "steps.log"
    groups = [placement_group([{"CPU": 0.5, f"gen{i}": 1}]) for i in range(2)]
    ray.get([g.ready() for g in groups])
    placement = Placement(groups, [0, 0], {"CPU": 0.5})
    actors = ActorGroup(Episodes, [{"log": str(log)}] * 2, [placement.actor_options(i) for i in range(2)])
    # The replacement's wait for a place outlasts the loss's detection (health checks 1 s x 3, and the
    # GCS's handling on a loaded machine): at 3.0 s, equal to it, a replacement sent to the dead node
    # before Ray marked it dead could still be failing when the wait ended (a failed test, 1 run in 5).
    fleet = Fleet(actors, placement, minimum=1, place_timeout_s=8.0)
    supervisor = Supervisor(max_restarts=3, timeout_s=60.0)
    supervisor.add_fleet(fleet)
    supervisor.watch(actors)

    shares = [list(range(0, 8)), list(range(8, 16))]
    turns = 4
    def pieces(share: list[int], parts: int) -> list[list[int]]:
        return [share[len(share) * k // parts: len(share) * (k + 1) // parts] for k in range(parts)]

    # The node of generator 1 goes once it is into its share.
    threading.Thread(target=lose_node_after_first_step, args=(c, nodes[1], log, 8), daemon=True).start()
    results = sampled_shares(supervisor, fleet, ShareCall(Episodes.play, (turns,)), shares, pieces)

    assert [row for part in results for row in part] == list(range(16))  # every row, in order
    assert fleet.active == [0] and fleet.lost == 1
    steps = [tuple(map(int, line.split()[:2])) for line in Path(log).read_text().splitlines()]
    kept = [s for s in steps if s[0] < 8]
    assert sorted(kept) == [(r, t) for r in range(8) for t in range(turns)]  # generator 0's share: played once
    lost = [s for s in steps if s[0] >= 8]  # generator 1's: what it played before its node went, then once more
    assert sorted(set(lost)) == [(r, t) for r in range(8, 16) for t in range(turns)]
    assert len(lost) < 2 * 8 * turns


@pytest.fixture
def two_by_two():
    """A head and two nodes of two generators each (resources ``nodeA``, ``nodeB``): generators 0, 1
    on node A, 2, 3 on node B."""
    with node_cluster([{"nodeA": 2}, {"nodeB": 2}]) as made:
        yield made


def four_generators(log: Path, hang: Path | None = None) -> tuple[Fleet, Supervisor]:
    """Generators 0, 1 on node A and 2, 3 on node B, each with a share of 8 rows; a call that misses
    its 10 s deadline counts as hung (a share plays in ~1.6 s). With ``hang``, the first redo of a
    lost row (16 on) on node A hangs."""
    groups = [placement_group([{"CPU": 0.25, "nodeA" if i < 2 else "nodeB": 1}]) for i in range(4)]
    ray.get([g.ready() for g in groups])
    placement = Placement(groups, [0] * 4, {"CPU": 0.25})
    args = [{"log": str(log), "hang": str(hang or "") if i < 2 else "", "hang_from": 16} for i in range(4)]
    actors = ActorGroup(Episodes, args, [placement.actor_options(i) for i in range(4)])
    fleet = Fleet(actors, placement, minimum=1, place_timeout_s=8.0)
    supervisor = Supervisor(max_restarts=5, timeout_s=10.0)
    supervisor.add_fleet(fleet)
    supervisor.watch(actors)
    return fleet, supervisor


def lose_node_b_then(c: Cluster, node, log: Path, second_fault=None) -> None:
    """Node B goes once both its generators are into their shares (their workers SIGKILLed, its
    raylet removed); then ``second_fault()``, if any."""
    doomed = {first_pid(log, range(16, 24)), first_pid(log, range(24, 32))}
    for pid in doomed:
        os.kill(pid, signal.SIGKILL)
    c.remove_node(node, allow_graceful=False)
    if second_fault is not None:
        second_fault(doomed)


def pieces_of(share: list[int], parts: int) -> list[list[int]]:
    return [p for p in (share[len(share) * k // parts: len(share) * (k + 1) // parts] for k in range(parts)) if p]


def test_a_survivor_killed_while_it_redoes_a_lost_share_is_replaced_and_every_row_played_once(two_by_two, tmp_path):
    """A node with two generators goes; the two survivors take one lost share each (one call per
    generator); then a survivor's process is SIGKILLed in the middle of its redo: it is replaced on
    its node and its redo played again, and every row comes back once, in order."""
    c, nodes = two_by_two
    log = tmp_path / "steps.log"
    fleet, supervisor = four_generators(log)
    survivors: set[int] = set()

    def kill_a_survivor(doomed: set[int]) -> None:
        survivors.add(first_pid(log, range(16, 32), exclude=doomed))
        os.kill(next(iter(survivors)), signal.SIGKILL)

    threading.Thread(target=lose_node_b_then, args=(c, nodes[1], log, kill_a_survivor), daemon=True).start()
    results = sampled_shares(supervisor, fleet, ShareCall(Episodes.play, (4,)),
                             [list(range(8 * k, 8 * k + 8)) for k in range(4)], pieces_of)

    assert [row for part in results for row in part] == list(range(32))
    assert fleet.active == [0, 1] and fleet.lost == 2
    assert survivors and supervisor.restarts == 3  # generators 2 and 3 (no place), the killed survivor
    played = steps(log)
    assert sorted((r, t) for r, t, _ in played if r < 16) == [(r, t) for r in range(16) for t in range(4)]
    assert {(r, t) for r, t, _ in played if r >= 16} == {(r, t) for r in range(16, 32) for t in range(4)}


def test_a_survivor_that_hangs_while_it_redoes_a_lost_share_is_replaced_and_every_row_played_once(two_by_two,
                                                                                                   tmp_path):
    """As above, but the survivor that first plays a lost row hangs (past cluster.call_timeout_s)."""
    c, nodes = two_by_two
    log, hang = tmp_path / "steps.log", tmp_path / "hang"
    hang.touch()
    fleet, supervisor = four_generators(log, hang)
    threading.Thread(target=lose_node_b_then, args=(c, nodes[1], log), daemon=True).start()
    results = sampled_shares(supervisor, fleet, ShareCall(Episodes.play, (4,)),
                             [list(range(8 * k, 8 * k + 8)) for k in range(4)], pieces_of)

    assert [row for part in results for row in part] == list(range(32))
    assert not hang.exists() and fleet.active == [0, 1] and supervisor.restarts == 3  # 2, 3 and the hung one
    played = steps(log)
    assert sorted((r, t) for r, t, _ in played if r < 16) == [(r, t) for r in range(16) for t in range(4)]
    assert {(r, t) for r, t, _ in played if r >= 16} == {(r, t) for r in range(16, 32) for t in range(4)}


@pytest.mark.parametrize("sizes,generators", [([8, 8], 2), ([8, 8], 6), ([16, 8], 5), ([8, 8, 8], 2), ([5], 3)])
def test_lost_pieces_go_one_call_per_generator_in_proportion_to_their_rows(sizes, generators):
    """``spread``: while the lost pieces are no more than the generators, no generator gets two calls
    and the rows per call differ by at most one piece's rounding; more pieces than generators give
    each piece one call, dealt in turn."""
    from rayppo.cluster.shares import spread

    firsts = [sum(sizes[:k]) for k in range(len(sizes))]
    pieces = {(k,): list(range(first, first + n)) for k, (first, n) in enumerate(zip(firsts, sizes))}
    work = spread(pieces, list(range(10, 10 + generators)), pieces_of)
    assert [row for _, part, _ in sorted(work) for row in part] == list(range(sum(sizes)))  # every row once, in order
    calls = [g for _, _, g in work]
    if len(sizes) <= generators:
        assert len(calls) == len(set(calls)) == min(generators, sum(sizes))
        rows = [len(part) for _, part, _ in work]
        assert max(rows) - min(rows) <= max(sizes) / generators + 1
    else:
        assert len(work) == len(sizes) and set(calls) == set(range(10, 10 + generators))
