"""The terminal of `rayppo train` on the distributed system: a few lines of its own, the libraries'
output in the run's log files, everything again with --verbose; of `rayppo pairs` (vLLM in its own
process); and of a driver whose cluster loses a node. Real runs (vLLM, DeepSpeed, Ray)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

RUN = ["rollout.batch_size=16", "stop.iterations=2", "eval.every=2", "eval.samples=2", "output.samples_every=1",
       "output.samples_shown=2", "output.save_model=false"]
VLLM_LINE = "Initializing a V1 LLM engine"  # vLLM's own log line at engine start


def train(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayppo.cli", "train", "--no-progress", *RUN, *extra],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_quiet_terminal_keeps_library_output_in_per_role_logs(tmp_path):
    out = tmp_path / "run"
    result = train(tmp_path, f"output.dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    terminal = (result.stdout + result.stderr).splitlines()
    # Headline, Ray, actors, 4 ready lines, warm-up, 2 x (header + 2 x 2 sample lines), summary.
    assert len(terminal) <= 20, "\n".join(terminal)
    for role in ("generator ", "reference ", "reward ", "learner x2"):
        assert any(role in line and "ready in" in line for line in terminal), (role, terminal)
    assert not any(VLLM_LINE in line or "DeepSpeed deepspeed.ops" in line or "INFO" in line for line in terminal)
    assert result.stdout.startswith("completed: 2 iterations in")
    logs = out / "logs"
    assert VLLM_LINE in (logs / "generator-0.log").read_text()
    assert {p.name for p in logs.iterdir()} >= {"driver.log", "generator-0.log", "reference-0.log", "reward-0.log",
                                                 "learner-0.log", "learner-1.log"}
    # The held-out evaluation ran after the last iteration (4 samples of the 8 embedded held-out prompts).
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/reward/mean" not in records[0] and 0.0 <= records[1]["eval/reward/mean"] <= 1.0
    assert {"eval/pass_rate", "eval/pass@2", "reward/std", "reward/min", "reward/max"} <= set(records[1])


def test_verbose_shows_the_actors_output(tmp_path):
    out = tmp_path / "run"  # the transformers generator and one learner rank: a quicker start than vLLM's
    result = train(tmp_path, "--verbose", f"output.dir={out}", "eval.every=0", "output.samples_every=0",
                   "generators.backend=hf", "learner.num_ranks=1", "stop.iterations=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(LearnerEngine pid=" in result.stdout + result.stderr  # Ray forwards each actor's lines, prefixed
    assert not (out / "logs" / "learner-0.log").exists()  # not to a log file


def test_a_log_gets_a_line_per_phase_and_per_tenth_of_the_run(tmp_path):
    """Output that is not a terminal (make train > log, CI, nohup): no progress bar redraws (the
    first-use SFT warm-up's bar alone was ~200 of them), one plain line per tenth of the run."""
    result = subprocess.run([sys.executable, "-m", "rayppo.cli", "train", "trainer=reference", "rollout.batch_size=8",
                             "ppo.minibatches=1", "stop.iterations=20", "eval.every=0", "output.samples_every=0",
                             "output.save_model=false", f"model.cache_dir={tmp_path / 'cache'}",
                             f"output.dir={tmp_path / 'run'}"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)  # pipes: not a terminal
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "\r" not in log and "SFT warm-up" not in log and "building the embedded model" in log
    # Saving the built model: transformers' shard bar, and DeepSpeed (imported by accelerate) on stdout.
    assert "Writing model shards" not in log and "Setting accelerator to CPU" not in log, log[:3000]
    progress = [line for line in log.splitlines() if line.startswith("PPO ")]
    assert [line.split(":")[0] for line in progress] == [f"PPO {i}/20" for i in range(2, 21, 2)], progress
    assert "reward " in progress[-1] and "tok/s " in progress[-1]


def test_rayppo_pairs_keeps_vllm_in_its_log_and_shows_pairs_per_minute(tmp_path, embedded_dir):
    """vLLM's engine runs in the pairs command's own process: its INFO and WARNING lines, loading
    bars and C++ warnings go to logs/pairs.log beside the pair file; the terminal gets the headline,
    a progress line with the pairs per minute (here the last one: preference.max_pairs stops it
    before a tenth of the batches) and the summary."""
    pairs = tmp_path / "out" / "pairs.jsonl"
    result = subprocess.run([sys.executable, "-m", "rayppo.cli", "pairs", f"preference.pairs={pairs}",
                             "preference.samples_per_prompt=4", "rollout.batch_size=16", "preference.max_pairs=20"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)  # pipes: not a terminal
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stderr.splitlines()
    assert len(said) == 2 and said[0].endswith("the libraries' output to out/logs/pairs.log"), said
    assert re.fullmatch(r"pairs 1/\d+: pairs 20, pairs/min \d+", said[1]), said
    assert result.stdout.startswith("pairs: 20 pairs from 16 prompts") and len(result.stdout.splitlines()) == 1
    log = (tmp_path / "out" / "logs" / "pairs.log").read_text()
    assert VLLM_LINE in log and "INFO" in log and "WARNING" in log


NODE_LOSS = """
import sys, time
import ray
from ray.cluster_utils import Cluster
from rayppo.cluster.session import RaySession
from rayppo.console import console
from rayppo.machine.role_resources import LOG_FILE_ENV

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
node = cluster.add_node(num_cpus=1, resources={"generator_node": 1})
console.setup(sys.argv[1], verbose=False)
try:
    with RaySession(cluster.address, None, verbose=False):
        @ray.remote(num_cpus=0, resources={"generator_node": 1})
        class Generator:
            def say(self):
                import rayppo.machine.role_resources  # what an engine's actor imports first: its output to its log file
                print("stray stdout", flush=True)
                print("stray stderr", file=sys.stderr, flush=True)

        log = console.actor_log("generators", 0)
        ray.get(Generator.options(runtime_env={"env_vars": {LOG_FILE_ENV: str(log)}}).remote().say.remote())
        node.kill_raylet()  # the node is lost: its agents report the raylet's death to the driver
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "Raylet is terminated" not in console.log_file.read_text():
            time.sleep(0.2)
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_what_ray_reports_of_a_lost_node_goes_to_the_log_not_the_terminal(tmp_path):
    """A node of the cluster dies (its raylet SIGKILLed, as tests/test_fleet.py loses a generator's
    node): each of its two agents reports it to the driver with the raylet's last 20 lines (an
    object-store state dump), which Ray prints in colour on the driver's stdout whatever
    log_to_driver says. They go to logs/driver.log; the actor's own stray output to its log file."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", NODE_LOSS, str(out)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    terminal = result.stdout + result.stderr
    assert "Raylet is terminated" not in terminal and "state-dump" not in terminal, terminal[-3000:]
    assert "\x1b[" not in terminal and "stray" not in terminal, terminal[-3000:]
    driver = (out / "logs" / "driver.log").read_text()
    assert driver.count("(raylet) Raylet is terminated. Termination is unexpected.") >= 1, driver[-3000:]
    assert "stray stdout\nstray stderr\n" in (out / "logs" / "generator-0.log").read_text()
