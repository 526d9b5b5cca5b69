"""A real 3-node Ray cluster on this machine (head + 2 workers, separate `ray start` processes).

Jobs go through ``rayppo submit`` (the Ray Jobs API); the config pins generators and learner ranks
to the worker nodes by custom resources, and the job's placement.json shows where they ran.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from rayppo.cli import main

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).parent / "ray")
GCS_PORT, DASHBOARD_PORT = 6391, 8291
DASHBOARD = f"http://127.0.0.1:{DASHBOARD_PORT}"
FAST = ["generators.backend=hf", "rollout.batch_size=32", "reference.cpus=0.25", "reward.cpus=0.25",
        "generators.cpus_per_worker=0.5", "learner.cpus_per_rank=0.5"]


def ray_cli(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # As a user with the environment activated: job entrypoints' `python` is this interpreter.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"ray {' '.join(args)} failed:\n{result.stderr[-2000:]}"


def alive_nodes() -> list[dict]:
    ray.init(address=f"127.0.0.1:{GCS_PORT}", log_to_driver=False)
    try:
        return [n for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster(embedded_dir):
    """Head (1 CPU, runs the job drivers and scorers), a generator node and a learner node.

    conftest.py turns Ray's token authentication off for the session (loopback only).
    """
    ray_cli("start", "--head", f"--port={GCS_PORT}", f"--dashboard-port={DASHBOARD_PORT}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--num-cpus=1", "--disable-usage-stats")
    try:
        ray_cli("start", f"--address=127.0.0.1:{GCS_PORT}", "--num-cpus=1", '--resources={"generator_node": 1}')
        ray_cli("start", f"--address=127.0.0.1:{GCS_PORT}", "--num-cpus=1", '--resources={"learner_node": 2}')
        deadline = time.time() + 60
        while len(alive_nodes()) < 3 and time.time() < deadline:
            time.sleep(2)
        yield DASHBOARD
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def submitted_id(output: str) -> str:
    return re.search(r"submitted (\S+)", output).group(1)


def test_job_runs_on_the_requested_nodes_and_reward_rises(cluster, tmp_path, capsys, monkeypatch):
    """...with its outputs where the terminal says: a relative output.dir is the submitting
    directory's, not one in Ray's temporary copy of the working directory."""
    out = tmp_path / "job"
    monkeypatch.chdir(tmp_path)
    # The user's own reward module lives in their project folder only: --working-dir ships it.
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_reward.py").write_text("from rayppo.tasks.digits import reward as digits\n\n"
                                          "def score(prompt, response):\n    return digits(prompt, response)\n")
    overrides = FAST + ["generators.resources={generator_node: 1}", "learner.num_ranks=2",
                        "learner.resources={learner_node: 1}", "stop.iterations=12", "output.dir=job",
                        "reward.function=my_reward:score"]
    assert main(["submit", "--address", cluster, "--wait", "--working-dir", str(project), *overrides]) == 0
    said = capsys.readouterr().out
    job_id = submitted_id(said)
    assert "output.dir=job is relative" in said and f"it writes to {out} " in said, said
    assert said.rstrip().endswith(f"SUCCEEDED; its outputs: {out}/"), said
    assert (out / "policy" / "config.json").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in records]
    assert len(records) == 12 and sum(rewards[-3:]) / 3 > rewards[0] + 0.1, rewards
    placement = json.loads((out / "placement.json").read_text())
    nodes = placement["nodes"]
    assert all("generator_node" in nodes[n]["resources"] for n in placement["roles"]["generators"])
    assert len(placement["roles"]["learner"]) == 2
    assert all("learner_node" in nodes[n]["resources"] for n in placement["roles"]["learner"])
    assert main(["status", job_id, "--address", cluster]) == 0
    said = capsys.readouterr().out
    assert "SUCCEEDED" in said and "  iterations: 12 of 12" in said and "  generators: 1 of 1 sampling" in said, said
    assert main(["status", "--address", cluster]) == 0  # no job named: the cluster's jobs, one line each
    assert any(line.startswith(f"{job_id}  SUCCEEDED") and line.endswith("rayppo train")
               for line in capsys.readouterr().out.splitlines())
    assert main(["logs", job_id, "--address", cluster]) == 0
    logged = capsys.readouterr().out
    assert "completed: 12 iterations" in logged and f"Outputs in {out}/" in logged


def test_job_fails_clearly_when_the_cluster_lacks_resources(cluster, tmp_path, capsys):
    overrides = FAST + ["learner.resources={learner_node: 3}", f"output.dir={tmp_path / 'job'}"]
    assert main(["submit", "--address", cluster, "--wait", *overrides]) == 1
    output = capsys.readouterr().out
    assert "learner_node: need 6 (learner 2 x 3), cluster has 2" in output
    assert "FAILED" in output


def test_stop_ends_a_running_job_and_leaves_the_cluster_healthy(cluster, tmp_path, capsys):
    out = tmp_path / "job"
    assert main(["submit", "--address", cluster, *FAST, "learner.num_ranks=1",
                 "stop.iterations=100000", f"output.dir={out}"]) == 0
    job_id = submitted_id(capsys.readouterr().out)
    deadline = time.time() + 240
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        time.sleep(2)
    assert (out / "metrics.jsonl").read_text(), "the job never started iterating"
    from ray.job_submission import JobSubmissionClient

    env = JobSubmissionClient(cluster).get_job_info(job_id).runtime_env["env_vars"]
    assert env["RAY_JOB_STOP_WAIT_TIME_S"] == "35"  # stop.sigterm_grace_s=25 and the margin, for Ray's supervisor
    assert main(["stop", job_id, "--address", cluster]) == 0
    assert "STOPPED" in capsys.readouterr().out
    # A preemption, not a kill: the iteration in flight finished and its checkpoint holds every
    # completed iteration (periodic checkpoints come every 20; none was due).
    done = len((out / "metrics.jsonl").read_text().splitlines())
    assert (out / "checkpoints" / "latest").read_text().strip() == f"iter_{done:06d}"
    assert "Preempted (SIGTERM) after" in JobSubmissionClient(cluster).get_job_logs(job_id)
    # Healthy: three live nodes, and every CPU is free again once the job's actors are gone.
    deadline = time.time() + 60
    while time.time() < deadline:
        ray.init(address=f"127.0.0.1:{GCS_PORT}", log_to_driver=False)
        total, free, alive = ray.cluster_resources(), ray.available_resources(), len([n for n in ray.nodes() if n["Alive"]])
        ray.shutdown()
        if alive == 3 and free.get("CPU", 0) == total["CPU"]:
            break
        time.sleep(2)
    assert alive == 3 and free.get("CPU", 0) == total["CPU"], (free, total)
