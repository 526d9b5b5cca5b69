"""rayppo bench: the figures it derives, and a short real run of the tiny workload."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rayppo.cli import main
from rayppo.config import load_config

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("rayppo_benchmarks_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def record(iteration, generate, learn, sync):
    return {"time/iteration": iteration, "time/generate": generate, "time/reference": 0.1, "time/reward": 0.05,
            "time/learn": learn, "time/sync": sync, "time/sync_verify": sync / 4, "sync/bytes": 2e6}


def test_summary_ratios(bench):
    cfg = load_config(None, ["rollout.batch_size=64", "rollout.max_new_tokens=32"])
    records = [record(1.0, 0.5, 0.3, 0.05), record(2.0, 1.0, 0.6, 0.1), record(1.5, 0.7, 0.5, 0.15)]
    alone = {"generate": 0.6, "reference": 0.1, "reward": 0.2, "learn": 0.4}
    trl = [{"wall_s": 2.048, "gc_s": 1.024}] * 3
    s = bench.summarize("tiny", cfg, records, {"learner": 1}, alone, trl)
    assert s["end_to_end_tokens_per_s"] == pytest.approx(2048 / 1.5)
    assert s["overhead_ratio"] == pytest.approx(1.5 / (0.6 + 0.2 + 0.4))  # reference and reward overlap
    assert s["sync_share"] == pytest.approx(0.05)
    assert s["sync_verify_share"] == pytest.approx(0.25)
    assert s["sync_gb_per_s"] == pytest.approx(2e6 / 0.1 / 1e9)
    assert s["trl_end_to_end_tokens_per_s"] == pytest.approx(1000.0)
    assert s["ratio_vs_trl"] == pytest.approx(2048 / 1.5 / 1000)
    assert s["ratio_vs_trl_without_gc"] == pytest.approx(2048 / 1.5 / 2000)
    assert s["idle_s"]["generators"]["max"] == pytest.approx(1.0)


def test_sweep_points(bench):
    points = bench.sweep_points(["generators.num=1,2", "learner.num_ranks=1,2"])
    assert points == [{"generators.num": "1", "learner.num_ranks": "1"}, {"generators.num": "1", "learner.num_ranks": "2"},
                      {"generators.num": "2", "learner.num_ranks": "1"}, {"generators.num": "2", "learner.num_ranks": "2"}]
    with pytest.raises(ValueError, match="expected key=v1,v2"):
        bench.sweep_points(["generators.num"])


def test_workloads_file_defines_the_required_presets(bench):
    workloads = bench.load_workloads()
    assert {"tiny", "small", "gpu-0.5b", "gpu-1.5b"} <= set(workloads)
    assert workloads["tiny"].config["rollout.batch_size"] == 64 and workloads["tiny"].config["rollout.max_new_tokens"] == 32
    assert workloads["small"].config["rollout.batch_size"] == 256 and workloads["small"].config["rollout.max_new_tokens"] == 128
    for w in workloads.values():  # every preset's overrides are valid config
        load_config(None, [f"{k}={v}" for k, v in w.config.items()])


@pytest.mark.slow
def test_bench_tiny_writes_json_and_plot(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "--workload", "tiny", "--warmup", "1", "--iters", "2", "--output", str(out),
                 "generators.enforce_eager=true"]) == 0
    summary = json.loads((out / "bench.json").read_text())
    for key in ("workload", "end_to_end_tokens_per_s", "overhead_ratio", "sync_share", "stage_s", "peak_memory_bytes"):
        assert key in summary, key
    assert summary["workload"] == "tiny" and len(summary["per_iteration"]) == 2
    assert summary["end_to_end_tokens_per_s"] > 0 and summary["overhead_ratio"] > 0.5
    # rayppo plan's peak-memory estimate is within 25% of the measured peak RSS of every role
    assert set(summary["plan_ratio"]) == {"generators", "reference", "reward", "learner"}
    assert all(0.75 <= ratio <= 1.25 for ratio in summary["plan_ratio"].values()), summary["plan_ratio"]
    assert (out / "stages.png").stat().st_size > 1000
