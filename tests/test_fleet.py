"""An elastic generator fleet on a real multi-node Ray cluster on this machine (`ray start`
processes, ``benchmarks/node_loss.py``'s): the node that holds a generator is stopped (its raylet
SIGKILLed, which takes the node's workers with it), the run goes on with the generator left, and
when a new node joins the lost generator is placed there, brought to the current weights, checked,
and samples again. ``rayppo status DIR`` shows the fleet meanwhile.

The cluster's GCS health check runs at 1 s x 3 (Ray's default is 3 s x 5), so a lost node is
noticed in ~3 s instead of ~15 s; nothing else differs from a production cluster.
"""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

from rayppo.cli import main

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location("node_loss", Path(__file__).parents[1] / "benchmarks" / "node_loss.py")
node_loss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(node_loss)


@pytest.fixture(scope="module")
def cluster(embedded_dir):
    """A head (the learner and the scorers) and two generator nodes."""
    try:
        yield node_loss.start_cluster()
    finally:
        node_loss.stop_cluster()


@pytest.mark.parametrize("trainer,sync", [("synchronous", "broadcast"), ("asynchronous", "object_store")])
def test_a_lost_generator_node_shrinks_the_fleet_and_a_new_node_regrows_it(cluster, tmp_path, trainer, sync, capsys):
    """The synchronous trainer broadcasts the weights (gloo here, NCCL on GPUs): the process group is
    formed again without the lost generator, and again with it when it rejoins. The asynchronous
    pipeline's generators load them from the object store, each between its own batches."""
    out = tmp_path / "run"
    # A broadcast broken by the loss ends when its collective times out (cluster.sync_timeout_s).
    overrides = ["stop.iterations=1000", f"learner.weight_sync={sync}", "cluster.sync_timeout_s=12"]
    proc, log = node_loss.start_run(cluster, out, overrides + node_loss.TRAINERS[trainer])
    records = node_loss.records
    try:
        node_loss.wait_for("an iteration", lambda: len(records(out)) >= 1, proc, log)
        node_loss.stop_node_of(out, 1)
        node_loss.wait_for("generator 1 to leave the fleet", lambda: node_loss.left_fleet(out), proc, log)
        assert main(["status", str(out)]) == 0
        said = capsys.readouterr().out
        assert "generators: 1 of 2 sampling (1 waiting for a place: 1), at least 1; lost 1 time" in said, said
        node_loss.add_generator_node()  # room again: the lost generator's bundle is placed on the new node
        shrunk = node_loss.wait_for("an iteration on one generator",
                                    lambda: [r for r in records(out) if r["fleet/generators"] == 1], proc, log)
        node_loss.wait_for("the fleet regrown", lambda: [r for r in records(out) if r["fleet/generators"] == 2
                                                         and r["iteration"] > shrunk[0]["iteration"]], proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)  # a preemption: the iteration in flight completes, then a checkpoint
        code = proc.wait(timeout=180)
    driver = log.read_text()
    assert code == 143, driver[-3000:]
    done = records(out)
    assert [r["iteration"] for r in done] == list(range(len(done)))  # no iteration lost nor done twice
    fleet = [int(r["fleet/generators"]) for r in done]
    first_one = fleet.index(1)
    assert set(fleet[:first_one]) == {2} and 2 in fleet[first_one:] and done[-1]["faults/generators_lost"] == 1
    assert "generator 1 left the fleet at iteration" in driver and "going on with 1 of 2" in driver
    assert "generator 1 rejoined the fleet at iteration" in driver
    assert (out / "checkpoints" / "latest").read_text().strip() == f"iter_{len(done):06d}"


def test_a_fleet_below_its_minimum_stops_the_run_with_a_checkpoint_and_the_resume_command(cluster, tmp_path):
    """generators.min_num=2 of 2: losing one stops the run after the last completed iteration,
    with a checkpoint and the command to go on with the generator left."""
    out = tmp_path / "run"
    proc, log = node_loss.start_run(cluster, out, ["stop.iterations=1000", "generators.min_num=2"])
    try:
        node_loss.wait_for("an iteration", lambda: len(node_loss.records(out)) >= 1, proc, log)
        node_loss.stop_node_of(out, 1)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    driver = log.read_text()
    done = len(node_loss.records(out))
    assert code == 2, driver[-3000:]
    # The last completed iteration; or the one whose update the learner took before the loss stopped
    # its weight sync (a checkpoint pairs the updated learner with the state after it).
    assert (out / "checkpoints" / "latest").read_text().strip() in (f"iter_{done:06d}", f"iter_{done + 1:06d}")
    error = next(line for line in driver.splitlines() if line.startswith("rayppo: error:"))
    assert "generator 1 was lost at iteration" in error and "1 of 2 generators left, fewer than generators.min_num=2" in error
    assert f"rayppo train --resume {out} generators.num=1" in error, error
