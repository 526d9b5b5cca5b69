"""The terminal of `rayppo train` on the distributed system: a few lines of its own, the libraries'
output in the run's log files, everything again with --verbose. Real runs (vLLM, DeepSpeed, Ray)."""

from __future__ import annotations

import json
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
    progress = [line for line in log.splitlines() if line.startswith("PPO ")]
    assert [line.split(":")[0] for line in progress] == [f"PPO {i}/20" for i in range(2, 21, 2)], progress
    assert "reward " in progress[-1] and "tok/s " in progress[-1]
