"""A generator's node lost mid-run and a new node added, against an uninterrupted run of the same seed.

A Ray cluster of separate ``ray start`` processes on this machine: a head (learner, reference and
reward, pinned by a ``head_node`` resource) and two nodes with one ``generator_node`` each. For
each trainer (synchronous, and asynchronous with ``rollout.max_staleness=1``) two runs of the
embedded default with two transformers generators: one uninterrupted, one in which the raylet of
generator 1's node is SIGKILLed once ``--lose-after`` iterations are done (its workers die with it)
and, once the generator has left the fleet, a new generator node is started. Reported per trainer:
seconds from the loss to the next completed iteration, the iterations run on one generator, the
seconds from the new node's start (``ray start`` returned) to the first iteration on the whole
fleet and that iteration, iterations lost or done twice, and the largest
per-iteration reward gap to the uninterrupted run (0 for the synchronous trainer: a row's sampling
noise does not depend on the split; the asynchronous pipeline's staleness depends on timing).

    python benchmarks/node_loss.py --iterations 40 --lose-after 3 --out runs/node_loss

The cluster's GCS health check runs at 1 s x 3 (Ray's default: 3 s x 5, so a lost node is noticed
~15 s later than here). Writes ``OUT/node_loss.json`` and prints it. ``tests/test_fleet.py`` uses
the cluster helpers below.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# The cluster listens on loopback only: token authentication off for it and every process of the
# benchmark (as in the tests, tests/conftest.py).
os.environ["RAY_AUTH_MODE"] = "disabled"
RAY = str(Path(sys.executable).parent / "ray")
RAYPPO = str(Path(sys.executable).parent / "rayppo")
GCS_PORT = 6397
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "3"}
TWO_GENERATORS = [
    "generators.backend=hf", "rollout.batch_size=32", "generators.num=2", "generators.cpus_per_worker=0.5",
    "generators.resources={generator_node: 1}", "cluster.placement_timeout_s=3", "learner.num_ranks=1",
    "learner.cpus_per_rank=0.5", "reference.cpus=0.25", "reward.cpus=0.25", "eval.every=0",
    "output.checkpoint_every=0", "output.save_model=false", "output.tensorboard=false",
    # Only generators on the nodes that come and go: another role's replacement waits for a place.
    "learner.resources={head_node: 1}", "reference.resources={head_node: 1}", "reward.resources={head_node: 1}"]
"""The job on that cluster (``cluster.address`` and ``output.dir`` added per run)."""
TRAINERS = {"synchronous": [], "asynchronous": ["rollout.max_staleness=1"]}


def ray_start(*args: str) -> None:
    """``ray start`` (one at a time: two nodes starting at once on one machine can time out)."""
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **HEALTH_CHECK}
    result = subprocess.run([RAY, "start", *args], env=env, capture_output=True, text=True, timeout=180)
    if result.returncode:
        raise RuntimeError(f"ray start {' '.join(args)} failed:\n{result.stderr[-2000:]}")


GENERATOR_NODE = [f"--address=127.0.0.1:{GCS_PORT}", "--num-cpus=1", '--resources={"generator_node": 1}']


def start_cluster() -> str:
    """The head and two generator nodes; returns the address."""
    ray_start("--head", f"--port={GCS_PORT}", "--num-cpus=1", '--resources={"head_node": 3}',
              "--include-dashboard=false", "--disable-usage-stats")
    add_generator_node()
    add_generator_node()
    return f"127.0.0.1:{GCS_PORT}"


def add_generator_node() -> None:
    ray_start(*GENERATOR_NODE)


def stop_cluster() -> None:
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def stop_node_of(out: Path, generator: int) -> None:
    """SIGKILL the raylet of the node that holds ``generator`` (``placement.json``); its workers die with it."""
    node = json.loads((out / "placement.json").read_text())["roles"]["generators"][generator]
    raylets = [p for p in psutil.process_iter(["name", "cmdline"])
               if p.info["name"] == "raylet" and any(node in part for part in p.info["cmdline"] or [])]
    if len(raylets) != 1:
        raise RuntimeError(f"{len(raylets)} raylets hold node {node}")
    raylets[0].send_signal(signal.SIGKILL)


def start_run(address: str, out: Path, overrides: list[str]) -> tuple[subprocess.Popen, Path]:
    """``rayppo train`` on the cluster into a new ``out`` (an earlier run's files there would be read
    as this one's), its output in ``out/../NAME.log``."""
    shutil.rmtree(out, ignore_errors=True)
    log = out.parent / f"{out.name}.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("w") as sink:
        proc = subprocess.Popen([RAYPPO, "train", "--no-progress", *TWO_GENERATORS, f"cluster.address={address}",
                                 f"output.dir={out}", *overrides], stdout=sink, stderr=subprocess.STDOUT, env=env)
    return proc, log


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_for(what: str, ok, proc: subprocess.Popen, log: Path, timeout_s: float = 240.0, poll_s: float = 0.1):
    """``ok()``'s first true value; raises with the driver's output when the run ends or time runs out."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        value = ok()
        if value:
            return value
        time.sleep(poll_s)
    ended = "the run ended" if proc.poll() is not None else "timed out"
    raise RuntimeError(f"{ended} while waiting for {what}; the driver said:\n{log.read_text()[-4000:]}")


def left_fleet(out: Path) -> bool:
    from rayppo.cluster.fleet_file import fleet_line

    return "waiting for a place" in (fleet_line(out) or "")


def _lossy_run(address: str, out: Path, overrides: list[str], iterations: int, lose_after: int) -> dict:
    proc, log = start_run(address, out, [f"stop.iterations={iterations}", *overrides])
    wait_for(f"{lose_after} iterations", lambda: len(records(out)) >= lose_after, proc, log)
    lost_at = time.time()
    stop_node_of(out, 1)
    wait_for("the next iteration", lambda: len(records(out)) > lose_after, proc, log)
    seconds = time.time() - lost_at
    wait_for("generator 1 to leave the fleet", lambda: left_fleet(out), proc, log)
    add_generator_node()
    added_at = time.time()
    def whole_again() -> bool:
        fleet = [r["fleet/generators"] for r in records(out)]
        return 1 in fleet and 2 in fleet[fleet.index(1):]

    wait_for("the fleet whole again", whole_again, proc, log)
    regrown = time.time() - added_at
    if proc.wait(timeout=600):
        raise RuntimeError(f"the run failed:\n{log.read_text()[-4000:]}")
    done = records(out)
    fleet = [int(r["fleet/generators"]) for r in done]
    return {"seconds_to_next_iteration": round(seconds, 1), "iterations_on_one_generator": fleet.count(1),
            "seconds_from_new_node_to_whole_fleet": round(regrown, 1),
            "whole_again_at_iteration": next((i for i in range(fleet.index(1), len(fleet)) if fleet[i] == 2), None),
            "iterations_lost": iterations - len({r["iteration"] for r in done}),
            "iterations_done_twice": len(done) - len({r["iteration"] for r in done}),
            "rewards": [r["reward/mean"] for r in done]}


def measure(iterations: int, lose_after: int, out: Path) -> dict:
    address, results = start_cluster(), {}
    try:
        for trainer, overrides in TRAINERS.items():
            baseline, lossy = out / f"{trainer}-uninterrupted", out / f"{trainer}-node-lost"
            proc, log = start_run(address, baseline, [f"stop.iterations={iterations}", *overrides])
            if proc.wait(timeout=600):
                raise RuntimeError(f"the uninterrupted run failed:\n{log.read_text()[-4000:]}")
            expected = [r["reward/mean"] for r in records(baseline)]
            result = _lossy_run(address, lossy, overrides, iterations, lose_after)
            gaps = [abs(a - b) for a, b in zip(result["rewards"], expected)]
            result["max_reward_gap"] = max(gaps)
            result["first_iteration_with_another_reward"] = next((i for i, gap in enumerate(gaps) if gap), None)
            # The same tokens, log-probs computed in batches of another size: the update moves by ulps first.
            losses = zip(records(lossy), records(baseline))
            result["first_iteration_with_another_update"] = next(
                (i for i, (a, b) in enumerate(losses) if a["policy/loss"] != b["policy/loss"]), None)
            result["uninterrupted_rewards"] = expected
            results[trainer] = result
    finally:
        stop_cluster()
    return {"iterations": iterations, "lost_after": lose_after, "trainers": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--lose-after", type=int, default=3, help="iterations done when the node is stopped")
    parser.add_argument("--out", default="runs/node_loss")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args.iterations, args.lose_after, out)
    (out / "node_loss.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
